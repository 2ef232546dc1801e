package taskd

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/faultline-ml/faultline/rescheduling"
)

// coreWorld drives a machine over a small job (ranks 0..3 on nodes 0 and
// 1) with a fake clock.
type coreWorld struct {
	t       testing.TB
	m       *machine
	now     time.Time
	actions []action // every action asked for, in order
	trans   []transitionEvent
	ids     map[uint64]bool
	faultN  int
}

const coreRanks = 4

func testCoreConfig() coreConfig {
	return newCoreConfig(OrchestrationConfig{
		Executor:    nopExecutor{},
		Checkpoints: nopCheckpoints{},
		Timeouts:    Timeouts{Pause: time.Second, Notify: time.Second, Decide: time.Second, Retry: time.Second, Restart: 2 * time.Second, Replace: 3 * time.Second, Load: time.Second, Resume: time.Second, Dump: time.Second, Exit: time.Second, Switch: time.Second, Stress: time.Second},
	})
}

func newCoreWorld(t testing.TB, cfg coreConfig) *coreWorld {
	return &coreWorld{t: t, m: newMachine(cfg), now: time.Unix(1_000_000, 0), ids: map[uint64]bool{}}
}

// drain collects what the machine asked for and checks the invariants.
func (w *coreWorld) drain() {
	w.t.Helper()
	as, ts := w.m.ready()
	for _, a := range as {
		if w.ids[a.id] {
			w.t.Fatalf("action id %d used twice", a.id)
		}
		w.ids[a.id] = true
		if a.kind == actRepair && len(a.faults) == 0 {
			w.t.Fatalf("action %d: a repair of no fault:\n%s", a.id, w.reasons())
		}
	}
	w.actions = append(w.actions, as...)
	w.trans = append(w.trans, ts...)
	checkCoreInvariants(w.t, w.m)
}

func checkCoreInvariants(t testing.TB, m *machine) {
	t.Helper()
	var last Orchestration
	for i, o := range m.history {
		switch {
		case !o.Done || !o.State.Terminal():
			t.Fatalf("history[%d] #%d is %s, done %v", i, o.ID, o.State, o.Done)
		case i > 0 && (o.ID <= last.ID || o.Start.Before(last.End)):
			t.Fatalf("history[%d] #%d (from %v) overlaps #%d (to %v)", i, o.ID, o.Start, last.ID, last.End)
		case len(o.Transitions) == 0 || o.Transitions[len(o.Transitions)-1].To != o.State:
			t.Fatalf("#%d: transitions %v do not end in %s", o.ID, o.Transitions, o.State)
		}
		last = o
	}
	r := m.run
	if r == nil {
		if m.holding(0) {
			t.Fatal("idle but holding the job")
		}
		return
	}
	switch {
	case r.o.State == StateIdle || r.o.State.Terminal():
		t.Fatalf("#%d in progress in state %s", r.o.ID, r.o.State)
	case r.settling:
		// Taken over, it waits for the members and for settled.
	case r.deadline.IsZero():
		t.Fatalf("#%d: state %s has no timeout", r.o.ID, r.o.State)
	case len(m.history) > 0 && r.o.Start.Before(last.End):
		t.Fatalf("#%d started at %v, before #%d ended at %v", r.o.ID, r.o.Start, last.ID, last.End)
	case r.action == 0 && !r.settling:
		t.Fatalf("#%d: state %s waits for no action", r.o.ID, r.o.State)
	}
}

func (w *coreWorld) step() { w.now = w.now.Add(time.Millisecond) }

func (w *coreWorld) fault(rank int, kind FaultKind) Fault {
	w.step()
	w.faultN++
	f := Fault{ID: fmt.Sprintf("f%d", w.faultN), Kind: kind, Position: Position{Node: rank / 2, Rank: rank}, Time: w.now.Add(-time.Millisecond), Received: w.now}
	w.m.fault(w.now, f)
	w.drain()
	return f
}

// last returns the last action, which the state in progress waits for.
func (w *coreWorld) last() action {
	w.t.Helper()
	if len(w.actions) == 0 {
		w.t.Fatal("no action")
	}
	return w.actions[len(w.actions)-1]
}

// targets returns the ranks a broadcast reaches in the small job.
func targets(a action) []int {
	var out []int
	for r := range coreRanks {
		if (a.to.All || slices.Contains(a.to.Nodes, r/2) || slices.Contains(a.to.Ranks, r)) && !slices.Contains(a.except, r) {
			out = append(out, r)
		}
	}
	return out
}

// deliver answers the last broadcast: every target acknowledges, but the
// ranks in fail, which refuse.
func (w *coreWorld) deliver(reply orchReply, fail ...int) {
	w.t.Helper()
	a := w.last()
	if a.kind != actBroadcast {
		w.t.Fatalf("last action is %v, not a broadcast", a.kind)
	}
	w.step()
	var res []rankResult
	for _, r := range targets(a) {
		rr := rankResult{rank: r, node: r / 2, reply: reply}
		if slices.Contains(fail, r) {
			rr.err, rr.reply = &DeliveryError{Rank: r, Msg: "no"}, orchReply{}
		}
		res = append(res, rr)
	}
	w.m.delivered(w.now, a.id, res)
	w.drain()
}

func (w *coreWorld) tick() {
	w.now = w.m.deadline()
	w.m.tick(w.now)
	w.drain()
}

func (w *coreWorld) states() []State {
	var out []State
	for _, t := range w.trans {
		out = append(out, t.t.To)
	}
	return out
}

func (w *coreWorld) wantStates(want ...State) {
	w.t.Helper()
	if diff := cmp.Diff(want, w.states()); diff != "" {
		w.t.Fatalf("states (-want +got):\n%s\nreasons:\n%s", diff, w.reasons())
	}
}

func (w *coreWorld) reasons() string {
	var b strings.Builder
	for _, t := range w.trans {
		fmt.Fprintf(&b, "  #%d %s -> %s: %s\n", t.o.ID, t.t.From, t.t.To, t.t.Reason)
	}
	return b.String()
}

func all() orchReply { return orchReply{Strategies: AllStrategies()} }

type nopExecutor struct{}

func (nopExecutor) RestartProcesses(context.Context, rescheduling.Decision) error { return nil }
func (nopExecutor) RecreatePods(context.Context, rescheduling.Decision) error     { return nil }
func (nopExecutor) RestartJob(context.Context, rescheduling.Decision) error       { return nil }
func (nopExecutor) AvoidNode(context.Context, rescheduling.Decision) error        { return nil }

type nopCheckpoints struct{}

func (nopCheckpoints) LoadNewest(context.Context) (int64, error)    { return 0, nil }
func (nopCheckpoints) PersistNewest(context.Context) (int64, error) { return 0, nil }

func TestCoreInPlaceRecovery(t *testing.T) {
	w := newCoreWorld(t, testCoreConfig())
	f := w.fault(3, FaultProcessExit)
	if a := w.last(); a.msg != kindPause || !slices.Equal(a.except, []int{3}) {
		t.Fatalf("pause: %+v", a)
	}
	if !w.m.holding(0) {
		t.Fatal("not holding while stopping")
	}
	w.deliver(orchReply{})
	if a := w.last(); a.msg != kindNotice || len(a.payload.Notice.Faults) != 1 || a.payload.Notice.Faults[0].ID != f.ID {
		t.Fatalf("notice: %+v", a)
	}
	w.deliver(all())
	dec := w.last()
	if dec.kind != actDecide || len(dec.faults) != 1 {
		t.Fatalf("decide: %+v", dec)
	}
	w.step()
	w.m.decided(w.now, dec.id, levelInPlace, "restart rank-3")
	w.drain()
	rep := w.last()
	if rep.kind != actRepair || rep.strategy != StrategyRecoverInPlace {
		t.Fatalf("repair: %+v", rep)
	}
	w.step()
	w.m.registered(w.now, 3) // the new process may register before the executor returns
	w.m.repaired(w.now, rep.id, []int{3}, nil)
	w.drain()
	load := w.last()
	w.step()
	w.m.loaded(w.now, load.id, 120, nil)
	w.drain()
	if a := w.last(); a.msg != kindResume || a.payload.Resume.Step != 120 || !slices.Equal(a.payload.Resume.Restarted, []int{3}) || a.payload.Resume.Strategy != StrategyRecoverInPlace {
		t.Fatalf("resume: %+v %+v", a, a.payload.Resume)
	}
	if w.m.holding(0) || !w.m.holding(3) {
		t.Fatal("once the resume went out, holding a newcomer, or not holding the restarted rank 3")
	}
	w.deliver(orchReply{})
	w.wantStates(StateStopping, StateNotifying, StateDeciding, StateRestarting, StateLoading, StateResuming, StateRecovered)
	st := w.m.status(0)
	if st.Current != nil || len(st.History) != 1 {
		t.Fatalf("status: %+v", st)
	}
	o := st.History[0]
	if o.ResumedStep != 120 || o.Strategy != StrategyRecoverInPlace || !slices.Equal(o.FaultyRanks, []int{3}) ||
		o.Detected != time.Millisecond || o.Stopped != 2*time.Millisecond || o.Resumed != 7*time.Millisecond {
		t.Fatalf("record: %+v", o)
	}
	// A late report of the same death is covered by the restart.
	old := Fault{ID: "late", Kind: FaultLost, Position: Position{1, 3}, Time: f.Time}
	w.m.fault(w.now, old)
	w.drain()
	if w.m.run != nil {
		t.Fatalf("a fault from before the restart started %+v", w.m.run.o)
	}
}

// TestCoreRestartOnTwoNodes: hangs on ranks of two nodes, the later ones
// arriving while the job stops. Every faulty rank is repaired; one that
// its restart did not bring back stays faulty, and the repair that
// follows covers it.
func TestCoreRestartOnTwoNodes(t *testing.T) {
	w := newCoreWorld(t, testCoreConfig())
	w.fault(0, FaultHang) // node 0
	first := w.last()
	w.fault(1, FaultHang) // node 0
	w.fault(3, FaultHang) // node 1
	// The pause is asked again without the hung ranks, which would hold
	// it up; the first one's outcome is stale.
	if a := w.last(); a.msg != kindPause || a.id == first.id || !slices.Equal(a.except, []int{0, 1, 3}) {
		t.Fatalf("pause: %+v", a)
	}
	w.step()
	w.m.delivered(w.now, first.id, []rankResult{{rank: 1, err: ErrAckTimeout}})
	w.drain()
	w.deliver(orchReply{})
	if a := w.last(); a.msg != kindNotice || !slices.Equal(targets(a), []int{2}) || !slices.Equal(a.payload.Notice.Ranks(), []int{0, 1, 3}) {
		t.Fatalf("notice: %+v", a)
	}
	w.deliver(all())
	if dec := w.last(); dec.kind != actDecide || len(dec.faults) != 3 {
		t.Fatalf("decide: %+v", dec)
	}
	w.step()
	w.m.decided(w.now, w.last().id, levelInPlace, "in place")
	w.drain()
	rep := w.last()
	var pos []Position
	for _, f := range rep.faults {
		pos = append(pos, f.Position)
	}
	if rep.kind != actRepair || rep.strategy != StrategyRecoverInPlace || !slices.Equal(pos, []Position{{0, 0}, {0, 1}, {1, 3}}) {
		t.Fatalf("repair: %+v", rep)
	}
	w.step()
	w.m.repaired(w.now, rep.id, []int{0, 1, 3}, nil)
	w.m.registered(w.now, 0)
	w.m.registered(w.now, 3)
	w.drain()
	w.tick() // rank 1 never registers again
	rep = w.last()
	if rep.kind != actRepair || rep.strategy != StrategyRecover || len(rep.faults) != 1 ||
		rep.faults[0].Position != (Position{0, 1}) || rep.faults[0].Kind != FaultLost {
		t.Fatalf("after the restart timed out: %+v\n%s", rep, w.reasons())
	}
	w.step()
	w.m.repaired(w.now, rep.id, []int{0, 1}, nil) // node 0 replaced
	w.m.registered(w.now, 1)
	w.drain()
	if w.m.run.o.State != StateReplacing {
		t.Fatalf("moved on before rank 0's replacement registered:\n%s", w.reasons())
	}
	w.m.registered(w.now, 0)
	w.drain()
	w.m.loaded(w.now, w.last().id, 40, nil)
	w.drain()
	if a := w.last(); a.msg != kindResume || len(a.except) != 0 || !slices.Equal(a.payload.Resume.Restarted, []int{0, 1, 3}) {
		t.Fatalf("resume: %+v %+v", a, a.payload.Resume)
	}
	w.deliver(orchReply{})
	w.wantStates(StateStopping, StateNotifying, StateDeciding, StateRestarting, StateReplacing, StateLoading, StateResuming, StateRecovered)
	if o := w.m.history[0]; !slices.Equal(o.FaultyRanks, []int{0, 1, 3}) || o.Round != 1 || o.ResumedStep != 40 {
		t.Fatalf("record: %+v", o)
	}
}

func TestCoreRetry(t *testing.T) {
	w := newCoreWorld(t, testCoreConfig())
	w.fault(1, FaultOpError)
	if a := w.last(); len(a.except) != 0 {
		t.Fatalf("an op error leaves the rank in: %+v", a)
	}
	w.deliver(orchReply{})
	w.deliver(all())
	w.deliver(orchReply{}) // retry
	if a := w.last(); a.msg != kindResume || a.payload.Resume.Step != -1 || a.payload.Resume.Strategy != StrategyRetry {
		t.Fatalf("resume: %+v", a)
	}
	w.deliver(orchReply{})
	w.wantStates(StateStopping, StateNotifying, StateRetrying, StateResuming, StateRecovered)

	// A retry that fails on a rank goes on to the policy.
	w = newCoreWorld(t, testCoreConfig())
	w.fault(1, FaultOpError)
	w.deliver(orchReply{})
	w.deliver(all())
	w.deliver(orchReply{}, 2)
	dec := w.last()
	if dec.kind != actDecide || len(dec.faults) != 2 {
		t.Fatalf("decide: %+v", dec)
	}
	// A rank that does not support retry rules it out.
	w = newCoreWorld(t, testCoreConfig())
	w.fault(1, FaultOpError)
	w.deliver(orchReply{})
	w.deliver(orchReply{Strategies: []Strategy{StrategyRecoverInPlace}})
	w.wantStates(StateStopping, StateNotifying, StateDeciding)
}

func TestCoreEscalation(t *testing.T) {
	w := newCoreWorld(t, testCoreConfig())
	w.fault(2, FaultHang)
	w.deliver(orchReply{})
	w.deliver(all())
	w.m.decided(w.now, w.last().id, levelInPlace, "in place")
	w.drain()
	w.step()
	w.m.repaired(w.now, w.last().id, nil, errors.New("exec failed"))
	w.drain()
	rep := w.last()
	if rep.strategy != StrategyRecover {
		t.Fatalf("after in place failed: %+v", rep)
	}
	w.tick() // the replaced processes never register
	w.wantStates(StateStopping, StateNotifying, StateDeciding, StateRestarting, StateReplacing, StateDumping)
	w.step()
	w.m.persisted(w.now, w.last().id, 90, nil)
	w.drain()
	if a := w.last(); a.msg != kindStop {
		t.Fatalf("exit: %+v", a)
	}
	w.deliver(orchReply{})
	w.wantStates(StateStopping, StateNotifying, StateDeciding, StateRestarting, StateReplacing, StateDumping, StateExiting, StateExited)
	if o := w.m.history[0]; o.Strategy != StrategyDump {
		t.Fatalf("strategy %s", o.Strategy)
	}

	// The policy may skip in place, and a trainer may not support it.
	for _, tc := range []struct {
		lvl   level
		reply orchReply
		want  State
	}{
		{levelReplace, all(), StateReplacing},
		{levelJob, all(), StateDumping},
		{levelGiveUp, all(), StateDumping},
		{levelInPlace, orchReply{Strategies: []Strategy{StrategyRecover}}, StateReplacing},
		{levelInPlace, orchReply{}, StateDumping},
	} {
		w := newCoreWorld(t, testCoreConfig())
		w.fault(2, FaultProcessExit)
		w.deliver(orchReply{})
		w.deliver(tc.reply)
		w.m.decided(w.now, w.last().id, tc.lvl, "x")
		w.drain()
		if got := w.m.run.o.State; got != tc.want {
			t.Errorf("level %v, strategies %v: %s, want %s", tc.lvl, tc.reply.Strategies, got, tc.want)
		}
	}
	// Without an executor or checkpoints: exit.
	w = newCoreWorld(t, newCoreConfig(OrchestrationConfig{}))
	w.fault(2, FaultProcessExit)
	w.deliver(orchReply{})
	w.deliver(all())
	w.m.decided(w.now, w.last().id, levelInPlace, "x")
	w.drain()
	w.deliver(orchReply{})
	w.wantStates(StateStopping, StateNotifying, StateDeciding, StateExiting, StateExited)
}

func TestCoreFaultDuringRecovery(t *testing.T) {
	w := newCoreWorld(t, testCoreConfig())
	w.fault(3, FaultProcessExit)
	w.deliver(orchReply{}, 1) // rank 1 refuses to pause: faulty too
	if got := w.m.run.o.FaultyRanks; !slices.Equal(got, []int{1, 3}) {
		t.Fatalf("faulty %v", got)
	}
	w.deliver(all())
	w.m.decided(w.now, w.last().id, levelInPlace, "x")
	w.drain()
	rep := w.last()
	if len(rep.faults) != 2 {
		t.Fatalf("repair: %+v", rep)
	}
	w.fault(0, FaultProcessExit) // during the restart: another round after it
	w.step()
	w.m.repaired(w.now, rep.id, []int{1, 3}, nil)
	w.m.registered(w.now, 1)
	w.m.registered(w.now, 3)
	w.drain()
	if a := w.last(); a.msg != kindPause || !slices.Equal(a.except, []int{0}) || w.m.run.o.Round != 2 {
		t.Fatalf("second round: %+v round %d", a, w.m.run.o.Round)
	}
	w.deliver(orchReply{})
	w.deliver(all())
	w.m.decided(w.now, w.last().id, levelInPlace, "x")
	w.drain()
	w.step()
	w.m.repaired(w.now, w.last().id, []int{0}, nil)
	w.m.registered(w.now, 0)
	w.drain()
	w.m.loaded(w.now, w.last().id, 7, nil)
	w.drain()
	if a := w.last(); !slices.Equal(a.payload.Resume.Restarted, []int{0, 1, 3}) {
		t.Fatalf("resume: %+v", a.payload.Resume)
	}
	w.fault(2, FaultOpError) // while resuming: the resume is abandoned
	w.wantStates(StateStopping, StateNotifying, StateDeciding, StateRestarting,
		StateStopping, StateNotifying, StateDeciding, StateRestarting, StateLoading, StateResuming,
		StateStopping)
	w.deliver(orchReply{})
	w.deliver(all())
	w.deliver(orchReply{})
	w.deliver(orchReply{})
	if o := w.m.history[0]; o.State != StateRecovered || o.Round != 3 || o.ResumedStep != 7 {
		t.Fatalf("record: %+v\n%s", o, w.reasons())
	}

	// Past MaxRounds the recovery dumps and exits.
	w = newCoreWorld(t, testCoreConfig())
	w.fault(0, FaultOpError)
	for range 3 {
		w.deliver(orchReply{})
		w.deliver(all())
		w.deliver(orchReply{})
		w.deliver(orchReply{}, 1) // the resume fails on rank 1
	}
	if got := w.m.run.o.State; got != StateDumping {
		t.Fatalf("after 3 rounds: %s\n%s", got, w.reasons())
	}
}

func TestCoreLinkSwitch(t *testing.T) {
	w := newCoreWorld(t, testCoreConfig())
	link := &LinkRequest{Node: 1, Devices: []int{0, 1}, Target: LinkStandby}
	if _, err := w.m.request(w.now, KindLinkSwitch, link, nil); err != nil {
		t.Fatal(err)
	}
	w.drain()
	if _, err := w.m.request(w.now, KindStressTest, nil, &StressRequest{Ranks: []int{1}, Test: "hbm"}); !errors.Is(err, ErrBusy) {
		t.Fatalf("a second request: %v", err)
	}
	w.deliver(orchReply{})
	if a := w.last(); a.msg != kindSwitch || !slices.Equal(targets(a), []int{2, 3}) {
		t.Fatalf("switch: %+v", a)
	}
	w.deliver(orchReply{})
	w.deliver(orchReply{})
	w.wantStates(StatePausing, StateSwitching, StateContinuing, StateSwitched)
	if st := w.m.status(0); len(st.Links) != 2 || st.Links[1] != (LinkState{Node: 1, Device: 1, Target: LinkStandby}) {
		t.Fatalf("links: %+v", st.Links)
	}
	// The switchback clears them.
	w.m.request(w.now, KindSwitchback, &LinkRequest{Node: 1, Devices: []int{0, 1}, Target: LinkPrimary}, nil)
	w.drain()
	w.deliver(orchReply{})
	w.deliver(orchReply{})
	w.deliver(orchReply{})
	if st := w.m.status(1); len(st.Links) != 0 || len(st.History) != 1 || st.History[0].Kind != KindSwitchback {
		t.Fatalf("after switchback: %+v", st)
	}

	// A switch that fails on one rank hands over to recovery.
	w = newCoreWorld(t, testCoreConfig())
	w.m.request(w.now, KindLinkSwitch, link, nil)
	w.drain()
	w.deliver(orchReply{})
	w.deliver(orchReply{}, 3)
	w.wantStates(StatePausing, StateSwitching, StateFailed, StateStopping)
	failed, rec := w.m.history[0], w.m.run.o
	if failed.HandedOverTo != rec.ID || rec.HandedOverFrom != failed.ID || len(rec.Faults) != 1 || rec.Faults[0].Kind != FaultLink || rec.Faults[0].Position != (Position{1, 3}) {
		t.Fatalf("handover: %+v\n%+v", failed, rec)
	}
	if a := w.last(); a.msg != kindPause || len(a.except) != 0 {
		t.Fatalf("pause after handover: %+v", a)
	}

	// A fault during the switch: the switch ends its step, then hands over.
	w = newCoreWorld(t, testCoreConfig())
	w.m.request(w.now, KindLinkSwitch, link, nil)
	w.drain()
	w.deliver(orchReply{})
	w.fault(0, FaultProcessExit)
	if w.m.run.o.State != StateSwitching {
		t.Fatalf("state %s", w.m.run.o.State)
	}
	w.deliver(orchReply{})
	w.wantStates(StatePausing, StateSwitching, StateFailed, StateStopping)
	if rec := w.m.run.o; !slices.Equal(rec.FaultyRanks, []int{0}) || !slices.Equal(w.last().except, []int{0}) {
		t.Fatalf("recovery: %+v", rec)
	}

	// A stress test that passes, and one that fails.
	w = newCoreWorld(t, testCoreConfig())
	w.m.request(w.now, KindStressTest, nil, &StressRequest{Nodes: []int{0}, Test: "hbm"})
	w.drain()
	w.deliver(orchReply{})
	if a := w.last(); a.msg != kindStress || !slices.Equal(targets(a), []int{0, 1}) {
		t.Fatalf("stress: %+v", a)
	}
	w.deliver(orchReply{})
	w.deliver(orchReply{})
	w.m.request(w.now, KindStressTest, nil, &StressRequest{Ranks: []int{2}, Test: "hbm"})
	w.drain()
	w.deliver(orchReply{})
	w.deliver(orchReply{}, 2)
	w.wantStates(StatePausing, StateTesting, StateContinuing, StatePassed, StatePausing, StateTesting, StateFailed, StateStopping)
	if f := w.m.run.o.Faults; len(f) != 1 || f[0].Kind != FaultStressTest {
		t.Fatalf("faults %+v", f)
	}
}

func TestCoreTimeouts(t *testing.T) {
	// Each state times out on its own: nothing answers.
	w := newCoreWorld(t, testCoreConfig())
	w.fault(1, FaultOpError)
	for w.m.run != nil {
		w.tick()
	}
	w.wantStates(StateStopping, StateNotifying, StateRetrying, StateDeciding, StateDumping, StateExiting, StateExited)
	w = newCoreWorld(t, testCoreConfig())
	w.fault(1, FaultProcessExit)
	w.tick()
	w.tick()
	w.m.decided(w.now, w.last().id, levelInPlace, "x")
	w.drain()
	for w.m.run != nil {
		w.tick()
	}
	w.wantStates(StateStopping, StateNotifying, StateDeciding, StateRestarting, StateReplacing, StateDumping, StateExiting, StateExited)
	w = newCoreWorld(t, testCoreConfig())
	w.m.request(w.now, KindLinkSwitch, &LinkRequest{Node: 0, Devices: []int{0}, Target: LinkStandby}, nil)
	w.drain()
	w.deliver(orchReply{})
	w.tick()
	w.wantStates(StatePausing, StateSwitching, StateFailed, StateStopping)
	// A loading that times out resumes from the ranks' own state.
	w = newCoreWorld(t, testCoreConfig())
	w.fault(1, FaultProcessExit)
	w.deliver(orchReply{})
	w.deliver(all())
	w.m.decided(w.now, w.last().id, levelInPlace, "x")
	w.drain()
	w.m.registered(w.now, 1)
	w.m.repaired(w.now, w.last().id, []int{1}, nil)
	w.drain()
	w.tick()
	if a := w.last(); a.msg != kindResume || a.payload.Resume.Step != -1 {
		t.Fatalf("resume after a load timeout: %+v", a)
	}
	// A stale outcome changes nothing.
	before := len(w.trans)
	w.m.delivered(w.now, w.last().id-1, nil)
	w.m.loaded(w.now, w.last().id, 5, nil)
	w.drain()
	if len(w.trans) != before {
		t.Fatalf("stale outcomes moved the machine:\n%s", w.reasons())
	}
}

// coreInput is one input of the exhaustive and random tests.
type coreInput struct {
	name string
	do   func(w *coreWorld)
}

func coreInputs() []coreInput {
	cur := func(w *coreWorld) action {
		if len(w.actions) == 0 {
			return action{}
		}
		return w.actions[len(w.actions)-1]
	}
	results := func(w *coreWorld, a action, fail int, reply orchReply) []rankResult {
		var res []rankResult
		for _, r := range targets(a) {
			rr := rankResult{rank: r, node: r / 2, reply: reply}
			if r == fail {
				rr.err, rr.reply = ErrAckTimeout, orchReply{}
			}
			res = append(res, rr)
		}
		return res
	}
	return []coreInput{
		{"exit0", func(w *coreWorld) { w.fault(0, FaultProcessExit) }},
		{"operr1", func(w *coreWorld) { w.fault(1, FaultOpError) }},
		{"hang2", func(w *coreWorld) { w.fault(2, FaultHang) }},
		{"ok", func(w *coreWorld) {
			w.step()
			w.m.delivered(w.now, cur(w).id, results(w, cur(w), -1, all()))
			w.drain()
		}},
		{"fail1", func(w *coreWorld) { w.step(); w.m.delivered(w.now, cur(w).id, results(w, cur(w), 1, all())); w.drain() }},
		{"noretry", func(w *coreWorld) {
			w.step()
			w.m.delivered(w.now, cur(w).id, results(w, cur(w), -1, orchReply{Strategies: []Strategy{StrategyRecover}}))
			w.drain()
		}},
		{"inplace", func(w *coreWorld) { w.step(); w.m.decided(w.now, cur(w).id, levelInPlace, "x"); w.drain() }},
		{"replace", func(w *coreWorld) { w.step(); w.m.decided(w.now, cur(w).id, levelReplace, "x"); w.drain() }},
		{"repaired", func(w *coreWorld) {
			w.step()
			var ranks []int
			for _, f := range cur(w).faults {
				ranks = append(ranks, f.Position.Rank)
			}
			w.m.repaired(w.now, cur(w).id, ranks, nil)
			w.drain()
		}},
		{"repairfail", func(w *coreWorld) { w.step(); w.m.repaired(w.now, cur(w).id, nil, errors.New("x")); w.drain() }},
		{"registered", func(w *coreWorld) {
			w.step()
			for r := range coreRanks {
				w.m.registered(w.now, r)
			}
			w.drain()
		}},
		{"registered1", func(w *coreWorld) { w.step(); w.m.registered(w.now, 1); w.drain() }},
		{"loaded", func(w *coreWorld) { w.step(); w.m.loaded(w.now, cur(w).id, 10, nil); w.drain() }},
		{"persisted", func(w *coreWorld) { w.step(); w.m.persisted(w.now, cur(w).id, 10, nil); w.drain() }},
		{"link", func(w *coreWorld) {
			w.step()
			w.m.request(w.now, KindLinkSwitch, &LinkRequest{Node: 1, Devices: []int{0}, Target: LinkStandby}, nil)
			w.drain()
		}},
		{"answer", func(w *coreWorld) { // whatever the state waits for, succeeding
			a := cur(w)
			w.step()
			switch a.kind {
			case actBroadcast:
				w.m.delivered(w.now, a.id, results(w, a, -1, all()))
			case actDecide:
				w.m.decided(w.now, a.id, levelInPlace, "x")
			case actRepair:
				var ranks []int
				for _, f := range a.faults {
					ranks = append(ranks, f.Position.Rank)
				}
				w.m.repaired(w.now, a.id, ranks, nil)
				for _, r := range ranks {
					w.m.registered(w.now, r)
				}
			case actLoad:
				w.m.loaded(w.now, a.id, 10, nil)
			case actPersist:
				w.m.persisted(w.now, a.id, 10, nil)
			}
			w.drain()
		}},
		{"tick", func(w *coreWorld) {
			if w.m.run != nil {
				w.tick()
			}
		}},
	}
}

// settle ticks the machine until idle and checks that each tick moves it
// and that it gets there in a bounded number of ticks.
func settle(t testing.TB, w *coreWorld, path []string) {
	t.Helper()
	for n := 0; w.m.run != nil; n++ {
		if n > 100 {
			t.Fatalf("%v: still in %s after %d timeouts:\n%s", path, w.m.run.o.State, n, w.reasons())
		}
		before := len(w.trans)
		w.tick()
		if len(w.trans) == before {
			t.Fatalf("%v: the timeout of %s moved nothing", path, w.m.run.o.State)
		}
	}
	for _, o := range w.m.history {
		if !o.State.Terminal() {
			t.Fatalf("%v: #%d ended in %s", path, o.ID, o.State)
		}
	}
}

// TestCoreExhaustive feeds every sequence of up to depth inputs (5 with
// TASKD_HEAVY=1), checking the invariants after each input, and then lets
// the timeouts run: every orchestration ends in a terminal state. Then
// it feeds every sequence one shorter and has another machine take the
// state over, which must end it too.
func TestCoreExhaustive(t *testing.T) {
	depth := 4
	if heavy() {
		depth = 5
	}
	if testing.Short() {
		depth = 3
	}
	exhaust(t, depth, false)
	exhaust(t, depth-1, true)
}

func exhaust(t *testing.T, depth int, takeOver bool) {
	ins := coreInputs()
	cfg := testCoreConfig()
	seqs := 0
	idx := make([]int, depth)
	for {
		w := newCoreWorld(t, cfg)
		var path []string
		for _, i := range idx {
			path = append(path, ins[i].name)
			ins[i].do(w)
		}
		if takeOver {
			path = append(path, "takeover")
			w.takeOver(0, 1, 2, 3)
		}
		settle(t, w, path)
		seqs++
		// Next sequence, odometer style.
		k := depth - 1
		for k >= 0 {
			idx[k]++
			if idx[k] < len(ins) {
				break
			}
			idx[k] = 0
			k--
		}
		if k < 0 {
			break
		}
	}
	t.Logf("%d sequences of %d inputs, taken over %v", seqs, depth, takeOver)
}

// TestCoreRandom feeds long random sequences of inputs.
func TestCoreRandom(t *testing.T) {
	ins := coreInputs()
	n := 1000
	if heavy() {
		n = 20000
	}
	cfg := testCoreConfig()
	for seed := range uint64(n) {
		rng := rand.New(rand.NewPCG(seed, 1))
		w := newCoreWorld(t, cfg)
		var path []string
		for range 60 {
			in := ins[rng.IntN(len(ins))]
			switch n := rng.IntN(60); {
			case n == 0:
				in = coreInput{"takeover", func(w *coreWorld) { w.takeOver(rng.Perm(coreRanks)[:rng.IntN(coreRanks+1)]...) }}
			case n < 30:
				in = ins[len(ins)-2] // answer: the machine gets far
			}
			path = append(path, in.name)
			in.do(w)
		}
		settle(t, w, path)
	}
}
