package taskd

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/faultline-ml/faultline/trace"
)

func domains(s DomainState) map[string]DomainState {
	return map[string]DomainState{trace.DomainDefault: s, trace.DomainCommunication: s}
}

func TestSwitchTracker(t *testing.T) {
	tr := newSwitchTracker(3*time.Second, 30*time.Second)
	live := map[int]bool{0: true, 1: true, 2: true}
	isLive := func(r int) bool { return live[r] }
	for r := range 4 {
		tr.expect(r, r/2)
	}
	if due := tr.due(t0, isLive); due != nil {
		t.Fatalf("due with no switch: %v", due)
	}
	sw := trace.Switch{Step: true}
	if !tr.set(sw, t0) || tr.set(sw, t0) {
		t.Fatal("set: a change must report true, the same switch false")
	}
	if got := tr.due(t0, isLive); !cmp.Equal(got, []int{0, 1, 2}) {
		t.Fatalf("due = %v, want the live ranks", got)
	}
	tr.sent(7, t0)
	// Nothing is due again before the ack timeout...
	if got := tr.due(t0.Add(2*time.Second), isLive); len(got) != 0 {
		t.Fatalf("re-sent early: %v", got)
	}
	if _, ok := tr.ack(7, 0, ""); !ok {
		t.Fatal("ack refused")
	}
	tr.ack(7, 1, "recorder busy")
	// ...then laggards are due again, with a growing interval.
	if got := tr.due(t0.Add(3500*time.Millisecond), isLive); !cmp.Equal(got, []int{2}) {
		t.Fatalf("laggards = %v, want [2]", got)
	}
	if got := tr.due(t0.Add(7*time.Second), isLive); len(got) != 0 {
		t.Fatalf("backoff not growing: %v", got)
	}
	if got := tr.due(t0.Add(11*time.Second), isLive); !cmp.Equal(got, []int{2}) {
		t.Fatalf("second re-send = %v", got)
	}
	if tr.complete(t0, isLive) {
		t.Fatal("complete with rank 2 waiting")
	}
	want := SwitchStatus{Switch: sw, Version: uint64(t0.UnixNano()), Workers: []WorkerSwitch{
		{Position: Position{0, 0}, Domains: map[string]DomainState{trace.DomainDefault: DomainOpened, trace.DomainCommunication: DomainClosed}},
		{Position: Position{0, 1}, Domains: domains(DomainFailed), Error: "recorder busy"},
		{Position: Position{1, 2}, Domains: domains(DomainWaiting)},
		{Position: Position{1, 3}, Domains: domains(DomainWaiting)},
	}}
	if d := cmp.Diff(want, tr.status()); d != "" {
		t.Fatal(d)
	}
	// An ack for an envelope of the old version counts for nothing.
	tr.set(trace.AllOn(), t0.Add(20*time.Second))
	if _, ok := tr.ack(7, 2, ""); ok {
		t.Fatal("stale ack accepted")
	}
	// A worker registering with the switch already applied is done; one
	// that restarted without it is due at once.
	tr.registered(2, 1, trace.AllOn().Bits(), true)
	tr.registered(3, 1, 0, false)
	live[3] = true
	if got := tr.due(t0.Add(20*time.Second), isLive); !cmp.Equal(got, []int{0, 1, 3}) {
		t.Fatalf("due after registration = %v", got)
	}
	tr.unsent([]int{3})
	if got := tr.due(t0.Add(20*time.Second), isLive); !cmp.Equal(got, []int{3}) {
		t.Fatalf("unrouted rank not due again: %v", got)
	}
}
