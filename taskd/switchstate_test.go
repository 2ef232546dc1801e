package taskd

import (
	"math/rand/v2"
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
	for r := range 4 {
		tr.expect(r, r/2)
	}
	for r := range 3 {
		tr.registered(r, r/2, 0, false)
	}
	if due := tr.due(t0); due != nil {
		t.Fatalf("due with no switch: %v", due)
	}
	sw := trace.Switch{Step: true}
	if !tr.set(sw, t0) || tr.set(sw, t0) {
		t.Fatal("set: a change must report true, the same switch false")
	}
	if got := tr.due(t0); !cmp.Equal(got, []int{0, 1, 2}) {
		t.Fatalf("due = %v, want the live ranks", got)
	}
	tr.sent(7, t0)
	// Nothing is due again before the ack timeout...
	if got := tr.due(t0.Add(2 * time.Second)); len(got) != 0 {
		t.Fatalf("re-sent early: %v", got)
	}
	if _, ok := tr.ack(7, 0, ""); !ok {
		t.Fatal("ack refused")
	}
	tr.ack(7, 1, "recorder busy")
	// ...then laggards are due again, with a growing interval.
	if got := tr.due(t0.Add(3500 * time.Millisecond)); !cmp.Equal(got, []int{2}) {
		t.Fatalf("laggards = %v, want [2]", got)
	}
	if got := tr.due(t0.Add(7 * time.Second)); len(got) != 0 {
		t.Fatalf("backoff not growing: %v", got)
	}
	if got := tr.due(t0.Add(11 * time.Second)); !cmp.Equal(got, []int{2}) {
		t.Fatalf("second re-send = %v", got)
	}
	if tr.complete(t0) {
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
	if got := tr.due(t0.Add(20 * time.Second)); !cmp.Equal(got, []int{0, 1, 3}) {
		t.Fatalf("due after registration = %v", got)
	}
	tr.unsent([]int{3})
	if got := tr.due(t0.Add(20 * time.Second)); !cmp.Equal(got, []int{3}) {
		t.Fatalf("unrouted rank not due again: %v", got)
	}
}

// TestSwitchTrackerCountsLaggards checks the tracker's count of live
// workers yet to acknowledge against a scan of every worker, over random
// registrations, losses, switch changes and acknowledgements.
func TestSwitchTrackerCountsLaggards(t *testing.T) {
	const ranks = 8
	for seed := range uint64(200) {
		rng := rand.New(rand.NewPCG(seed, 7))
		tr := newSwitchTracker(time.Second, 10*time.Second)
		for r := range ranks / 2 {
			tr.expect(r, 0)
		}
		now := t0
		var id uint64
		sws := []trace.Switch{trace.AllOn(), {Step: true}, {}}
		for step := range 200 {
			now = now.Add(time.Duration(rng.IntN(2000)) * time.Millisecond)
			r := rng.IntN(ranks)
			switch rng.IntN(6) {
			case 0:
				tr.set(sws[rng.IntN(len(sws))], now)
			case 1:
				sw := sws[rng.IntN(len(sws))]
				tr.registered(r, r/4, sw.Bits(), rng.IntN(2) == 0)
			case 2:
				tr.gone(r)
			case 3:
				if due := tr.due(now); len(due) > 0 {
					id++
					tr.sent(id, now)
				}
			default:
				msg := ""
				if rng.IntN(4) == 0 {
					msg = "busy"
				}
				tr.ack(id, r, msg)
			}
			want := tr.version != 0
			for _, w := range tr.workers {
				if w.live && w.acked != tr.version {
					want = false
				}
			}
			if got := tr.complete(now); got != want {
				t.Fatalf("seed %d step %d: complete %v, a scan says %v (lagging %d)", seed, step, got, want, tr.lagging)
			}
		}
	}
}
