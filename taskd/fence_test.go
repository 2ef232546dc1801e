package taskd

import (
	"context"
	"fmt"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/taskd/lease"
)

// gatedTrainer records its calls; Pause blocks until release is closed.
type gatedTrainer struct {
	mu      sync.Mutex
	calls   []string
	release chan struct{}
}

func (g *gatedTrainer) record(s string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.calls = append(g.calls, s)
}

func (g *gatedTrainer) Calls() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.calls)
}

func (g *gatedTrainer) Pause(ctx context.Context) (int64, error) {
	g.record("pause")
	<-g.release
	return 1, nil
}

func (g *gatedTrainer) Resume(ctx context.Context, r ResumeRequest) error {
	g.record("resume")
	return nil
}

func (g *gatedTrainer) Stop(ctx context.Context, reason string) error {
	g.record("stop " + reason)
	return nil
}

// fencedMsg is an orchestration message of the term whose token is fence.
func fencedMsg(id, fence uint64, kind, payload string) *pb.Envelope {
	return &pb.Envelope{Id: id, Fence: fence, Body: &pb.Envelope_Message{Message: &pb.UserMessage{Kind: kind, Payload: []byte(payload)}}}
}

// TestFenceAtExecution: a command admitted under one term but still
// queued behind a slow trainer call when the worker admits a newer term is
// not carried out: a deposed leader's stop must not end training that its
// successor has taken over.
func TestFenceAtExecution(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{Term: newFakeTerm(5)})
	tr := &gatedTrainer{release: make(chan struct{})}
	w, err := NewWorker(WorkerConfig{Job: c.job, Node: 0, Rank: 3, Upstream: c.m.Addr().String(), Security: c.sec, AckTimeout: c.ack, Trainer: tr})
	if err != nil {
		t.Fatal(err)
	}
	c.run(w, w.Run)
	testkit.WaitFor(t, "the trainer started", func() bool { return slices.Contains(tr.Calls(), "resume") })
	w.handle(fencedMsg(101, 5, kindPause, `{}`), "old") // blocks in the trainer
	testkit.WaitFor(t, "the pause runs", func() bool { return slices.Contains(tr.Calls(), "pause") })
	w.handle(fencedMsg(102, 5, kindStop, `{"reason":"deposed-exit"}`), "old") // queued
	w.handle(fencedMsg(201, 6, kindPause, `{}`), "new")                       // term 6 admitted
	if w.fence.newest() != 6 {
		t.Fatalf("newest token %d, want 6", w.fence.newest())
	}
	close(tr.release)
	testkit.WaitFor(t, "term 6's pause ran", func() bool { return len(tr.Calls()) >= 3 && tr.Calls()[len(tr.Calls())-1] == "pause" })
	if want := []string{"resume", "pause", "pause"}; !slices.Equal(tr.Calls(), want) {
		t.Fatalf("trainer calls %q, want %q", tr.Calls(), want)
	}
	// The queued stop, at least: the manager, whose term is still 5, may
	// send more meanwhile, and those are fenced too.
	if counterValue(w.met.fenced) < 1 {
		t.Errorf("fenced %v, want at least the queued stop", counterValue(w.met.fenced))
	}
}

// TestProxyFenceAtSend: a message a proxy queued for a worker under one
// term is not forwarded once the proxy has admitted a newer term.
func TestProxyFenceAtSend(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{Term: newFakeTerm(5)})
	p := c.addProxy(0)
	testkit.WaitFor(t, "the proxy", func() bool { return len(c.m.Members()) == 1 })
	r := newRawMember(t, p.Addr().String(), c.job, insecureSec(), RoleWorker, Position{Node: 0, Rank: 0})
	testkit.WaitFor(t, "a worker behind the proxy", func() bool { return r.register() == nil })
	// Queued while the worker's stream is not open.
	p.route(&pb.Envelope{Id: 1, Fence: 5, Ranks: []int32{0}, Body: &pb.Envelope_Message{Message: &pb.UserMessage{Kind: "old"}}})
	p.route(&pb.Envelope{Id: 2, Fence: 6, Ranks: []int32{0}, Body: &pb.Envelope_Message{Message: &pb.UserMessage{Kind: "new"}}})
	stream, err := r.client.Stream(r.ctx(), &pb.StreamRequest{Job: c.job, Member: r.self})
	if err != nil {
		t.Fatal(err)
	}
	env, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if env.GetId() != 2 {
		t.Fatalf("the worker got message %d (term %d) first, want 2 (term 6)", env.GetId(), env.GetFence())
	}
	// The queued message of term 5, at least: the manager, whose term is
	// still 5, may send the worker more meanwhile, and those are fenced too.
	if counterValue(p.met.fenced) < 1 {
		t.Errorf("fenced %v, want at least the queued message of term 5", counterValue(p.met.fenced))
	}
}

// storeTerm is a lease term whose Check asks a store that knows the
// newest token: a term older than that ends when checked.
type storeTerm struct {
	*fakeTerm
	newest *atomic.Uint64
}

func (t storeTerm) Check(ctx context.Context) error {
	if n := t.newest.Load(); n > t.token {
		t.end(fmt.Errorf("%w: token %d is the lease's now", lease.ErrLost, n))
	}
	return context.Cause(t.ctx)
}

// TestMemberTellsManagerDeposed: a member tells the manager the newest
// term it has seen, registering or in its heartbeats, through a proxy or
// not; a manager of an older term refuses it, finds its term ended when
// it checks the lease, and stops.
func TestMemberTellsManagerDeposed(t *testing.T) {
	stopped := func(t *testing.T, c *cluster) {
		t.Helper()
		addr := c.m.Addr().String()
		testkit.WaitFor(t, "the deposed manager stopped listening", func() bool {
			conn, err := net.DialTimeout("tcp", addr, time.Second)
			if err == nil {
				conn.Close()
			}
			return err != nil
		})
		if counterValue(c.m.met.deposed) == 0 {
			t.Error("no member counted as having seen a newer term")
		}
	}
	newCluster4 := func(t *testing.T) (*cluster, *atomic.Uint64) {
		newest := new(atomic.Uint64)
		newest.Store(5) // another manager took the lease; this one has not checked
		return newCluster(t, insecureSec(), ManagerConfig{Term: storeTerm{newFakeTerm(4), newest}}), newest
	}

	t.Run("registering through a proxy", func(t *testing.T) {
		c, _ := newCluster4(t)
		p := c.addProxy(0)
		testkit.WaitFor(t, "the proxy registered", func() bool { return len(c.m.Members()) == 1 })
		w, err := NewWorker(WorkerConfig{Job: c.job, Node: 0, Rank: 0, Upstream: p.Addr().String(), Security: c.sec, AckTimeout: c.ack, ReconnectMax: 500e6})
		if err != nil {
			t.Fatal(err)
		}
		if err := w.fence.admit(5); err != nil { // it served under term 5 before
			t.Fatal(err)
		}
		c.run(w, w.Run)
		stopped(t, c)
		if w.Connected() {
			t.Error("the worker registered with the deposed manager")
		}
	})

	t.Run("in a heartbeat", func(t *testing.T) {
		c, _ := newCluster4(t)
		w := c.addWorker(0, 0)
		testkit.WaitFor(t, "the worker registered", w.Connected)
		if err := w.fence.admit(5); err != nil { // a newer manager reached it
			t.Fatal(err)
		}
		stopped(t, c)
	})
}
