package taskd

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/taskd/lease"
)

// TestStandby runs a job of real processes with two managers that share
// a lease file and a StateDir: a proxy and its workers, and workers
// attached directly, are given both managers' addresses. Only the leader
// listens. The leader is killed with SIGKILL: the standby leads with the
// next token, every member registers with it, and the faults reported
// before and while no manager led are in its log. A manager started
// again stands by; the leader, stopped with SIGTERM, resigns, and the
// other leads at once.
func TestStandby(t *testing.T) {
	const nodes, ppn = 2, 2
	dir := t.TempDir()
	base := childArgs{Job: "job-s", Interval: 200 * time.Millisecond, Deadline: 2 * time.Second, Ack: time.Second, Nodes: nodes, PPN: ppn}
	addrs := []string{freeAddr(t), freeAddr(t)}
	startManager := func(i int) *child {
		a := base
		a.Listen, a.StateDir, a.LeaseFile, a.Name = addrs[i], filepath.Join(dir, "state"), filepath.Join(dir, "manager.lease"), fmt.Sprintf("mgr-%d", i)
		c := startChild(t, "manager", a)
		c.expect(0, "standby", 60*time.Second)
		return c
	}
	leads := func(c *child, from int) (addr string, token uint64) {
		t.Helper()
		line, _ := c.expect(from, "ready", 60*time.Second)
		if _, err := fmt.Sscanf(line, "ready %s %d", &addr, &token); err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		return addr, token
	}
	first := startManager(0)
	if _, token := leads(first, 0); token != 1 {
		t.Fatalf("first term's token %d", token)
	}
	second := startManager(1)
	if c, err := net.DialTimeout("tcp", addrs[1], time.Second); err == nil {
		c.Close()
		t.Fatal("the standby listens")
	}

	upstream := strings.Join(addrs, ",")
	a := base
	a.Node, a.Listen, a.Upstream = 0, freeAddr(t), upstream
	proxy := startChild(t, "proxy", a)
	proxy.expect(0, "ready", 60*time.Second)
	workers := make([]*child, nodes*ppn)
	for r := range workers {
		a := base
		a.Node, a.Rank, a.Upstream = r/ppn, r, upstream
		if a.Node == 0 {
			a.Upstream = proxy.args.Listen
		}
		workers[r] = startChild(t, "worker", a)
	}
	for _, w := range workers {
		w.expect(0, "connected", 60*time.Second)
	}
	members := func(addr string) int { return len(newAdminClient(t, addr, base.Job).members()) }
	faultIDs := func(addr string) []string {
		var ids []string
		for _, f := range newAdminClient(t, addr, base.Job).faults() {
			ids = append(ids, f.GetId())
		}
		return ids
	}
	testkit.WaitFor(t, "every member registered with the leader", func() bool { return members(addrs[0]) == len(workers)+1 })
	for r, w := range workers {
		w.send(fmt.Sprintf("fault before-%d op_error", r))
	}
	testkit.WaitFor(t, "the faults logged", func() bool { return len(filterPrefix(faultIDs(addrs[0]), "before-")) == len(workers) })

	from := second.nlines()
	first.kill()
	killed := time.Now()
	for r, w := range workers {
		w.send(fmt.Sprintf("fault away-%d process_exit", r))
	}
	if _, token := leads(second, from); token != 2 {
		t.Fatalf("second term's token %d", token)
	}
	testkit.WaitFor(t, "every member registered with the standby", func() bool { return members(addrs[1]) == len(workers)+1 })
	t.Logf("leader killed -> standby leading and every member registered: %v", time.Since(killed))
	testkit.WaitFor(t, "the faults of before and while away", func() bool {
		ids := faultIDs(addrs[1])
		return len(filterPrefix(ids, "before-")) == len(workers) && len(filterPrefix(ids, "away-")) == len(workers)
	})

	third := startManager(0)
	from = third.nlines()
	stopped := time.Now()
	second.signal(syscall.SIGTERM)
	if _, token := leads(third, from); token != 3 {
		t.Fatalf("third term's token %d", token)
	}
	if d := time.Since(stopped); d > 10*time.Second {
		t.Errorf("a resigned lease took %v to change hands", d)
	}
	select {
	case <-second.done:
	case <-time.After(30 * time.Second):
		t.Fatal("the manager stopped with SIGTERM did not exit")
	}
	if code := second.cmd.ProcessState.ExitCode(); code != 0 {
		t.Errorf("the manager stopped with SIGTERM exited %d", code)
	}
	testkit.WaitFor(t, "every member registered with the new leader", func() bool { return members(addrs[0]) == len(workers)+1 })
	ids := faultIDs(addrs[0])
	slices.Sort(ids)
	if len(slices.Compact(ids)) != len(faultIDs(addrs[0])) {
		t.Errorf("duplicate fault ids in %v", ids)
	}
}

// fakeTerm is a lease term held for as long as the test says.
type fakeTerm struct {
	token uint64
	ctx   context.Context
	end   context.CancelCauseFunc
}

func newFakeTerm(token uint64) *fakeTerm {
	ctx, end := context.WithCancelCause(context.Background())
	return &fakeTerm{token: token, ctx: ctx, end: end}
}

func (t *fakeTerm) Token() uint64                   { return t.token }
func (t *fakeTerm) Context() context.Context        { return t.ctx }
func (t *fakeTerm) Check(ctx context.Context) error { return context.Cause(t.ctx) }
func (t *fakeTerm) Resign() error {
	t.end(fmt.Errorf("%w: resigned", lease.ErrLost))
	return nil
}

// TestFencing: a deposed manager that does not know it yet (its term goes
// on, by its own lights) can do no harm. A member that has seen a newer
// term refuses to register with it, and a message it sends through a
// member that has not is refused by those that have. A manager whose term
// ends stops serving at once, and Run says why.
func TestFencing(t *testing.T) {
	newer := newFakeTerm(5)
	c := newCluster(t, insecureSec(), ManagerConfig{Term: newer})
	p := c.addProxy(0)
	w := c.addWorker(0, 0)
	direct := c.addWorker(1, 1)
	testkit.WaitFor(t, "the members registered", func() bool { return w.Connected() && direct.Connected() })
	if p.fence.newest() != 5 || w.fence.newest() != 5 || direct.fence.newest() != 5 {
		t.Fatalf("tokens seen: proxy %d, worker %d, direct worker %d", p.fence.newest(), w.fence.newest(), direct.fence.newest())
	}

	// The deposed manager, term 4, on its own address.
	deposed, err := NewManager(ManagerConfig{Job: c.job, Listen: "127.0.0.1:0", Security: c.sec, Term: newFakeTerm(4)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- deposed.Run(ctx) }()
	defer func() { cancel(); <-done; deposed.Close() }()
	raw := newRawMember(t, deposed.Addr().String(), c.job, c.sec, RoleWorker, Position{Node: 1, Rank: 1})
	resp, err := raw.client.Register(ctxT(t), &pb.RegisterRequest{Job: c.job, Member: raw.self})
	if err != nil || resp.GetFence() != 4 {
		t.Fatalf("register with the deposed manager: %v %v", resp, err)
	}
	if err := direct.fence.admit(resp.GetFence()); !errors.Is(err, lease.ErrStale) {
		t.Fatalf("a worker that saw term 5 admits term 4: %v", err)
	}

	// A message of term 4 reaching a worker that saw term 5.
	var applied []string
	c.onMsg = func(rank int, m Message) error { applied = append(applied, m.Kind); return nil }
	w.handle(&pb.Envelope{Id: 1, Fence: 4, Body: &pb.Envelope_Message{Message: &pb.UserMessage{Kind: "stale"}}}, "x")
	w.handle(&pb.Envelope{Id: 2, Fence: 5, Body: &pb.Envelope_Message{Message: &pb.UserMessage{Kind: "current"}}}, "x")
	p.route(&pb.Envelope{Id: 3, Fence: 4, Ranks: []int32{0}, Body: &pb.Envelope_Message{Message: &pb.UserMessage{Kind: "stale-via-proxy"}}})
	if !slices.Equal(applied, []string{"current"}) {
		t.Fatalf("applied %v, want only the current term's", applied)
	}
	if counterValue(w.met.fenced) != 1 || counterValue(p.met.fenced) != 1 {
		t.Fatalf("fenced: worker %v, proxy %v", counterValue(w.met.fenced), counterValue(p.met.fenced))
	}

	// The leader's term ends: it stops at once.
	addr := c.m.Addr().String()
	newer.Resign()
	testkit.WaitFor(t, "the manager whose term ended stopped listening", func() bool {
		conn, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			conn.Close()
		}
		return err != nil
	})
}
