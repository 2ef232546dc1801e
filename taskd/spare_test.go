package taskd

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// TestSpareNodes: a job of two nodes of one rank with a spare node and
// orchestration on. The spare's worker registers as rank 2 on node 2;
// one beyond it, or one of another node's ranks, is refused. AllWorkers reaches the job's ranks alone,
// NodeWorkers the spare too. A spare that falls silent is no fault and
// starts no recovery, one that leaves is none of the job's departures,
// and the job completes without its spares. The handlers learn that a
// spare left or was lost (an EventLeft), so that the job stops counting
// on it.
func TestSpareNodes(t *testing.T) {
	var mu sync.Mutex
	var left []Departure // of the spare
	rec := Handler{Name: "rec", Handle: func(_ context.Context, _ *Manager, ev Event) error {
		if ev.Kind == EventLeft && ev.Position.Node == 2 {
			mu.Lock()
			left = append(left, ev.Departure)
			mu.Unlock()
		}
		return nil
	}}
	c := newCluster(t, insecureSec(), ManagerConfig{Nodes: 2, ProcsPerNode: 1, SpareNodes: 1, Orchestration: &OrchestrationConfig{}, Handlers: []Handler{rec}})
	got := map[int][]string{}
	c.onMsg = func(rank int, m Message) error {
		mu.Lock()
		got[rank] = append(got[rank], m.Kind)
		mu.Unlock()
		return nil
	}
	ws := []*Worker{c.addWorker(0, 0), c.addWorker(1, 1), c.addWorker(2, 2)}
	testkit.WaitFor(t, "3 workers", func() bool {
		return c.liveWorkers() == 3 && !slices.ContainsFunc(ws, func(w *Worker) bool { return !w.Connected() })
	})
	err := newRawMember(t, c.m.Addr().String(), c.job, insecureSec(), RoleWorker, Position{Node: 3, Rank: 3}).register()
	if err == nil || !strings.Contains(err.Error(), "out of range [0,3)") {
		t.Fatalf("node 3 registered: %v", err)
	}
	// A node started with another shape than the job's claims ranks that
	// are not its own.
	err = newRawMember(t, c.m.Addr().String(), c.job, insecureSec(), RoleWorker, Position{Node: 2, Rank: 1}).register()
	if err == nil || !strings.Contains(err.Error(), "rank 1 is not of node 2, whose ranks are 2 to 2 with 1 a node") {
		t.Fatalf("node 2 registered rank 1: %v", err)
	}

	ctx := ctxT(t)
	ds, err := c.m.Broadcast(ctx, AllWorkers(), "all", nil)
	if err != nil || len(ds) != 2 || ds[0].Rank != 0 || ds[1].Rank != 1 {
		t.Fatalf("AllWorkers: %v %v", ds, err)
	}
	ds, err = c.m.Broadcast(ctx, NodeWorkers(2), "spare", nil)
	if err != nil || len(ds) != 1 || ds[0].Rank != 2 {
		t.Fatalf("NodeWorkers(2): %v %v", ds, err)
	}
	mu.Lock()
	if !slices.Equal(got[2], []string{"spare"}) || !slices.Equal(got[0], []string{"all"}) {
		t.Errorf("messages: %v", got)
	}
	mu.Unlock()

	// The spare leaves; another registers in its place and falls silent.
	c.stop(ws[2], ws[2])
	silent := newRawMember(t, c.m.Addr().String(), c.job, insecureSec(), RoleWorker, Position{Node: 2, Rank: 2})
	testkit.WaitFor(t, "the spare's place free", func() bool { return silent.register() == nil })
	testkit.WaitFor(t, "the silent spare gone", func() bool { return c.liveWorkers() == 2 })
	// Its handlers learn that it is gone, left or lost, as no fault.
	testkit.WaitFor(t, "the spare's departures told", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(left) == 2
	})
	mu.Lock()
	if !left[0].Left || left[1].Left || left[1].Position != (Position{Node: 2, Rank: 2}) {
		t.Errorf("the spare's departures: %+v, want it left, then lost", left)
	}
	mu.Unlock()
	time.Sleep(2 * testTimings.interval) // a fault would be logged in the same step
	if fs := c.m.Faults(0); len(fs) != 0 {
		t.Fatalf("a spare's loss is a fault: %+v", fs)
	}
	if st := c.m.Orchestrations(0); st.Current != nil || len(st.History) != 0 {
		t.Fatalf("a spare's loss started an orchestration: %+v", st)
	}
	if st := c.m.JobStatus(); len(st.Departed) != 0 {
		t.Fatalf("departures %+v: a spare is none of the job's ranks", st.Departed)
	}
	for _, w := range ws[:2] {
		w.Finish()
		c.stop(w, w)
	}
	testkit.WaitFor(t, "the job complete", func() bool { return c.m.JobStatus().Complete })

	// A rank of the job that falls silent is a fault.
	lost := newRawMember(t, c.m.Addr().String(), c.job, insecureSec(), RoleWorker, Position{Node: 1, Rank: 1})
	if err := lost.register(); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, "rank 1 lost", func() bool {
		fs := c.m.Faults(0)
		return len(fs) == 1 && fs[0].Kind == FaultLost && fs[0].Position.Rank == 1
	})
}

// TestSpareNodesNeedTheShape: spares are the nodes beyond the shape.
func TestSpareNodesNeedTheShape(t *testing.T) {
	for _, c := range []ManagerConfig{{SpareNodes: 1}, {Nodes: 2, SpareNodes: -1}} {
		c.Job, c.Security = "j", insecureSec()
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "SpareNodes") {
			t.Errorf("%+v: %v", c, err)
		}
	}
}
