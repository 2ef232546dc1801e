package taskd

import (
	"context"
	"fmt"
	"os"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
	"github.com/faultline-ml/faultline/internal/testkit"
)

// heavy reports whether the heavier variants run (TASKD_HEAVY=1).
func heavy() bool { return os.Getenv("TASKD_HEAVY") != "" }

// adminClient talks to a manager process through its public services.
type adminClient struct {
	t     testing.TB
	job   string
	conn  *grpc.ClientConn
	admin pb.AdminClient
	trace pb.TrainingDataTraceClient
}

func newAdminClient(t testing.TB, addr, job string) *adminClient {
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &adminClient{t: t, job: job, conn: conn, admin: pb.NewAdminClient(conn), trace: pb.NewTrainingDataTraceClient(conn)}
}

func (a *adminClient) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	a.t.Cleanup(cancel)
	return ctx
}

// members returns the live members by key, empty while the manager is down.
func (a *adminClient) members() map[memberKey]*pb.MemberStatus {
	out := map[memberKey]*pb.MemberStatus{}
	for offset := int32(0); ; {
		res, err := a.admin.ListMembers(a.ctx(), &pb.ListMembersReq{JobNsName: a.job, Offset: offset})
		if err != nil {
			return map[memberKey]*pb.MemberStatus{}
		}
		for _, m := range res.GetMembers() {
			out[keyOf(m.GetMember())] = m
		}
		offset += int32(len(res.GetMembers()))
		if len(res.GetMembers()) == 0 || offset >= res.GetTotal() {
			return out
		}
	}
}

func (a *adminClient) faults() []*pb.Fault {
	res, err := a.admin.ListFaults(a.ctx(), &pb.ListFaultsReq{JobNsName: a.job})
	if err != nil {
		return nil
	}
	return res.GetFaults()
}

func (a *adminClient) switchStatus() map[int]map[string]string {
	res, err := a.admin.GetSwitchStatus(a.ctx(), &pb.DataStatusReq{JobNsName: a.job})
	out := map[int]map[string]string{}
	if err != nil {
		return out
	}
	for _, w := range res.GetWorkers() {
		d := map[string]string{}
		for _, ds := range w.GetDomains() {
			d[ds.GetDomain()] = ds.GetStatus()
		}
		out[int(w.GetPosition().GetRank())] = d
	}
	return out
}

// TestProcesses runs a job of real processes on loopback: a manager, 4
// proxies and 32 workers (64 with TASKD_HEAVY=1), and breaks it.
func TestProcesses(t *testing.T) {
	nodes, ppn := 4, 8
	if heavy() {
		ppn = 16
	}
	world := nodes * ppn
	base := childArgs{Job: "job-p", Interval: 200 * time.Millisecond, Deadline: 3 * time.Second, Ack: time.Second}
	state := t.TempDir()
	mAddr := freeAddr(t)
	startManager := func() *child {
		a := base
		a.Listen, a.StateDir = mAddr, state
		c := startChild(t, "manager", a)
		c.expect(0, "ready", 60*time.Second)
		return c
	}
	mgr := startManager()
	api := newAdminClient(t, mAddr, base.Job)

	proxies := make([]*child, nodes)
	startProxy := func(n int, listen string) *child {
		a := base
		a.Node, a.Listen, a.Upstream = n, listen, mAddr
		c := startChild(t, "proxy", a)
		c.expect(0, "ready", 60*time.Second)
		return c
	}
	for n := range nodes {
		proxies[n] = startProxy(n, freeAddr(t))
	}
	workers := make([]*child, world)
	for r := range world {
		a := base
		a.Node, a.Rank, a.Upstream = r/ppn, r, proxies[r/ppn].args.Listen
		workers[r] = startChild(t, "worker", a)
	}
	for _, w := range workers {
		w.expect(0, "connected", 90*time.Second)
	}
	testkit.WaitFor(t, "every member live at the manager", func() bool { return len(api.members()) == world+nodes })

	t.Run("switch reaches all but a stopped worker, which gets it when it returns", func(t *testing.T) {
		const stoppedRank = 5
		stopped := workers[stoppedRank]
		stopped.signal(syscall.SIGSTOP)
		defer stopped.signal(syscall.SIGCONT) // a failure here leaves the others their peer
		from := stopped.nlines()
		on := &pb.ProfilingSwitch{CommunicationOperator: "on", Step: "on", SaveCheckpoint: "on", FP: "on", DataLoader: "on"}
		res, err := api.trace.ModifyTrainingDataTraceSwitch(api.ctx(), &pb.DataTypeReq{JobNsName: base.Job, ProfilingSwitch: on})
		if err != nil || res.GetCode() != pb.Code_CODE_OK {
			t.Fatalf("modify: %v %v", res, err)
		}
		allBut := func(want string) func() bool {
			return func() bool {
				st := api.switchStatus()
				for r := range world {
					w := want
					if r == stoppedRank {
						w = string(DomainWaiting)
					}
					if st[r]["default"] != w || st[r]["communication"] != w {
						return false
					}
				}
				return true
			}
		}
		// Asked at one moment: past the deadline the stopped worker is lost,
		// which on a loaded machine can follow the others' opening closely.
		testkit.WaitFor(t, "every worker but the stopped one opened, the stopped one waiting", allBut(string(DomainOpened)))
		stopped.signal(syscall.SIGCONT)
		stopped.expect(from, "switch ", 30*time.Second)
		testkit.WaitFor(t, "the returned worker opened", func() bool {
			return api.switchStatus()[stoppedRank]["default"] == string(DomainOpened)
		})
		got, err := api.trace.GetTrainingDataTraceSwitch(api.ctx(), &pb.DataStatusReq{JobNsName: base.Job})
		if err != nil || got.GetProfilingSwitch().GetCommunicationOperator() != "on" {
			t.Fatalf("get: %v %v", got, err)
		}
		bad, _ := api.trace.ModifyTrainingDataTraceSwitch(api.ctx(), &pb.DataTypeReq{JobNsName: base.Job, ProfilingSwitch: &pb.ProfilingSwitch{Step: "yes"}})
		unknown, _ := api.trace.ModifyTrainingDataTraceSwitch(api.ctx(), &pb.DataTypeReq{JobNsName: "other", ProfilingSwitch: on})
		if bad.GetCode() != pb.Code_CODE_BAD_PARAMETER || unknown.GetCode() != pb.Code_CODE_UNKNOWN_JOB {
			t.Fatalf("codes: bad parameter %v, unknown job %v", bad, unknown)
		}
	})

	t.Run("killed proxy: its workers are lost within the deadline and come back with it", func(t *testing.T) {
		const node = 1
		before := len(api.faults())
		killed := time.Now()
		proxies[node].kill()
		lostRanks := func() map[int]*pb.Fault {
			out := map[int]*pb.Fault{}
			for _, f := range api.faults()[before:] {
				if f.GetKind() == string(FaultLost) && f.GetNode() == node {
					out[int(f.GetRank())] = f
				}
			}
			return out
		}
		testkit.WaitFor(t, "the node's proxy and workers declared lost", func() bool { return len(lostRanks()) == ppn+1 })
		for rank, f := range lostRanks() {
			// Lost once silent for the deadline, noticed by a check every
			// interval/4; the rest is slack for a loaded machine.
			if late := time.Unix(0, f.GetReceivedUnixNano()).Sub(killed); late > base.Deadline+3*time.Second {
				t.Errorf("rank %d declared lost %v after the kill, deadline %v", rank, late, base.Deadline)
			}
		}
		from := make([]int, world)
		for r := node * ppn; r < (node+1)*ppn; r++ {
			from[r] = workers[r].nlines()
		}
		proxies[node] = startProxy(node, proxies[node].args.Listen)
		for r := node * ppn; r < (node+1)*ppn; r++ {
			workers[r].expect(from[r], "connected", 60*time.Second)
		}
		testkit.WaitFor(t, "every member live again", func() bool { return len(api.members()) == world+nodes })
		testkit.WaitFor(t, "the switch still opened everywhere", func() bool {
			st := api.switchStatus()
			for r := range world {
				if st[r]["default"] != string(DomainOpened) {
					return false
				}
			}
			return true
		})
	})

	t.Run("an impersonator of a live rank is refused", func(t *testing.T) {
		holder := api.members()[workerKey(0)]
		reg := prometheus.NewRegistry()
		w, err := NewWorker(WorkerConfig{Job: base.Job, Node: 0, Rank: 0, Upstream: proxies[0].args.Listen, Security: Security{Insecure: true}, AckTimeout: time.Second, ReconnectMax: 200 * time.Millisecond, Registerer: reg})
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() { defer close(done); w.Run(context.Background()) }()
		testkit.WaitFor(t, "a refusal", func() bool { return counterValue(w.met.refused) >= 2 })
		connected := w.Connected()
		w.Close()
		<-done
		if connected {
			t.Fatal("the impersonator got connected")
		}
		if now := api.members()[workerKey(0)]; now.GetMember().GetInstance() != holder.GetMember().GetInstance() {
			t.Fatalf("rank 0 changed hands: %v, was %v", now, holder)
		}
	})

	t.Run("manager restart loses no fault report", func(t *testing.T) {
		for r, w := range workers {
			w.send(fmt.Sprintf("fault before-%d op_error", r))
		}
		ids := func() []string {
			var out []string
			for _, f := range api.faults() {
				out = append(out, f.GetId())
			}
			return out
		}
		testkit.WaitFor(t, "faults logged", func() bool { return len(filterPrefix(ids(), "before-")) == world })
		mgr.kill()
		for r, w := range workers {
			from := w.nlines()
			w.send(fmt.Sprintf("fault during-%d process_exit", r))
			w.expect(from, "queued during-", 10*time.Second)
		}
		mgr = startManager()
		testkit.WaitFor(t, "faults reported while the manager was down", func() bool { return len(filterPrefix(ids(), "during-")) == world })
		all := ids()
		if n := len(filterPrefix(all, "before-")); n != world {
			t.Errorf("%d faults from before the restart, want %d", n, world)
		}
		slices.Sort(all)
		if len(slices.Compact(all)) != len(ids()) {
			t.Errorf("duplicate fault ids in %v", all)
		}
		testkit.WaitFor(t, "every member registered with the new manager", func() bool { return len(api.members()) == world+nodes })
	})
}

func filterPrefix(ss []string, prefix string) []string {
	var out []string
	for _, s := range ss {
		if len(s) >= len(prefix) && s[:len(prefix)] == prefix {
			out = append(out, s)
		}
	}
	return out
}

func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		return 0
	}
	return m.GetCounter().GetValue()
}
