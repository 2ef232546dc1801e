package taskd

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
	"github.com/faultline-ml/faultline/internal/testkit"
)

// TestCleanExitIsNotAFault: a worker process that closes and exits 0 is
// not a fault, while one killed without a word is lost. A real manager
// keeps its fault log in a state folder; two real workers attach to it.
// Worker 1 is killed after worker 0 left, so that once its loss is
// logged, worker 0's deadline has passed too.
func TestCleanExitIsNotAFault(t *testing.T) {
	base := childArgs{Job: "job-leave", Interval: 200 * time.Millisecond, Deadline: 2 * time.Second, Ack: time.Second}
	state := t.TempDir()
	a := base
	a.Listen, a.StateDir = freeAddr(t), state
	mgr := startChild(t, "manager", a)
	mgr.expect(0, "ready", 60*time.Second)
	api := newAdminClient(t, a.Listen, base.Job)
	var workers []*child
	for r := range 2 {
		w := base
		w.Rank, w.Upstream = r, a.Listen
		workers = append(workers, startChild(t, "worker", w))
	}
	for _, w := range workers {
		w.expect(0, "connected", 60*time.Second)
	}
	testkit.WaitFor(t, "both workers live", func() bool { return len(api.members()) == 2 })

	workers[0].send("close")
	<-workers[0].done
	if code := workers[0].cmd.ProcessState.ExitCode(); code != 0 {
		t.Fatalf("worker 0 exited %d", code)
	}
	testkit.WaitFor(t, "worker 0's leave recorded", func() bool {
		res, err := api.admin.GetJob(api.ctx(), &pb.GetJobReq{JobNsName: base.Job})
		if err != nil || len(res.GetDeparted()) != 1 {
			return false
		}
		d := res.GetDeparted()[0]
		return d.GetPosition().GetRank() == 0 && d.GetLeft() && !d.GetFinished() && !res.GetComplete() && res.GetLiveWorkers() == 1
	})
	workers[1].kill()
	testkit.WaitFor(t, "worker 1 lost", func() bool {
		for _, f := range api.faults() {
			if f.GetKind() == string(FaultLost) && f.GetRank() == 1 {
				return true
			}
		}
		return false
	})
	if ms := api.members(); len(ms) != 0 {
		t.Fatalf("members left: %v", ms)
	}
	mgr.signal(syscall.SIGTERM)
	<-mgr.done
	data, err := os.ReadFile(filepath.Join(state, "faults.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	faults, _, err := parseFaultLog(data)
	if err != nil {
		t.Fatal(err)
	}
	if len(faults) != 1 || faults[0].Kind != FaultLost || faults[0].Position.Rank != 1 {
		t.Fatalf("faults.jsonl holds %+v, want worker 1 lost alone", faults)
	}
}

// TestJobComplete: workers behind a proxy and attached directly leave;
// the job is complete only once every rank of its shape left finished,
// which is an event, a metric and an Admin answer of its own. A proxy
// that closes leaves too, and nothing is a fault.
func TestJobComplete(t *testing.T) {
	var mu sync.Mutex
	var evs []Event
	reg := prometheus.NewRegistry()
	c := newCluster(t, insecureSec(), ManagerConfig{Nodes: 2, ProcsPerNode: 2, Registerer: reg, Handlers: []Handler{{Name: "rec", Handle: func(_ context.Context, _ *Manager, ev Event) error {
		if ev.Kind == EventLeft || ev.Kind == EventJobComplete {
			mu.Lock()
			evs = append(evs, ev)
			mu.Unlock()
		}
		return nil
	}}}})
	events := func() []string {
		mu.Lock()
		defer mu.Unlock()
		var out []string
		for _, ev := range evs {
			s := ev.Kind.String()
			if ev.Kind == EventLeft {
				s += fmt.Sprintf(" %s %v", ev.Role, ev.Departure.Finished)
			}
			out = append(out, s)
		}
		return out
	}
	p := c.addProxy(0)
	ws := []*Worker{c.addWorker(0, 0), c.addWorker(0, 1), c.addWorker(1, 2), c.addWorker(1, 3)}
	testkit.WaitFor(t, "4 workers", func() bool {
		return c.liveWorkers() == 4 && ws[0].Connected() && ws[1].Connected() && ws[2].Connected() && ws[3].Connected()
	})
	leave := func(w *Worker, finished bool, want int) {
		t.Helper()
		if finished {
			w.Finish()
		}
		c.stop(w, w)
		testkit.WaitFor(t, fmt.Sprintf("%d events", want), func() bool { return len(events()) == want })
	}
	for i, w := range ws[:3] {
		leave(w, true, i+1)
	}
	leave(ws[3], false, 4) // every rank left, one not finished
	if st := c.m.JobStatus(); st.Complete || len(st.Departed) != 4 || len(st.Live) != 0 {
		t.Fatalf("after a leave that did not finish: %+v", st)
	}
	again := c.addWorker(1, 3)
	testkit.WaitFor(t, "rank 3 back", func() bool { return c.liveWorkers() == 1 && again.Connected() })
	if st := c.m.JobStatus(); len(st.Departed) != 3 || !slices.Equal(st.Live, []int{3}) {
		t.Fatalf("rank 3 back: %+v", st)
	}
	leave(again, true, 6)
	c.stop(p, p)
	testkit.WaitFor(t, "the proxy's leave", func() bool { return len(events()) == 7 })
	want := []string{"left worker true", "left worker true", "left worker true", "left worker false", "left worker true", "job-complete", "left proxy false"}
	if d := cmp.Diff(want, events()); d != "" {
		t.Fatalf("events (-want +got):\n%s", d)
	}
	st := c.m.JobStatus()
	if !st.Complete || st.CompletedAt.IsZero() || len(st.Departed) != 4 || len(c.m.Members()) != 0 || len(c.m.Faults(0)) != 0 {
		t.Fatalf("job status %+v, members %v, faults %v", st, c.m.Members(), c.m.Faults(0))
	}
	got := gathered(t, reg)
	if got["faultline_taskd_job_complete"] != 1 || got[`faultline_taskd_left_total{role="worker"}`] != 5 || got[`faultline_taskd_left_total{role="proxy"}`] != 1 {
		t.Fatalf("metrics %v", got)
	}
	api := newAdminClient(t, c.m.Addr().String(), c.job)
	res, err := api.admin.GetJob(api.ctx(), &pb.GetJobReq{JobNsName: c.job, FromRank: 2})
	if err != nil || !res.GetComplete() || res.GetDepartedWorkers() != 4 || len(res.GetDeparted()) != 2 || res.GetDeparted()[0].GetPosition().GetRank() != 2 {
		t.Fatalf("GetJob: %v %v", res, err)
	}
}

func TestDepartures(t *testing.T) {
	left := func(rank int, finished bool) Departure {
		return Departure{Position: Position{Rank: rank}, Left: true, Finished: finished}
	}
	lost := Departure{Position: Position{Rank: 1}}
	for _, tc := range []struct {
		name     string
		expected int
		live     int
		deps     []Departure
		back     []int
		want     bool
	}{
		{name: "nobody", want: false},
		{name: "all finished, shape unknown", deps: []Departure{left(0, true), left(1, true)}, want: true},
		{name: "one lost", deps: []Departure{left(0, true), lost}, want: false},
		{name: "lost, then left finished", deps: []Departure{left(0, true), lost, left(1, true)}, want: true},
		{name: "a live worker", live: 1, deps: []Departure{left(0, true)}, want: false},
		{name: "a rank of the shape never came", expected: 3, deps: []Departure{left(0, true), left(1, true)}, want: false},
		{name: "the shape's every rank", expected: 2, deps: []Departure{left(0, true), left(1, true)}, want: true},
		{name: "finished, then back", live: 1, deps: []Departure{left(0, true), left(1, true)}, back: []int{1}, want: false},
		{name: "finished twice", expected: 2, deps: []Departure{left(0, true), left(0, true)}, want: false},
	} {
		g := newDepartures(tc.expected)
		for _, d := range tc.deps {
			g.add(d)
		}
		for _, r := range tc.back {
			g.back(r)
		}
		if got := g.complete(tc.live); got != tc.want {
			t.Errorf("%s: complete = %v, want %v", tc.name, got, tc.want)
		}
	}
}
