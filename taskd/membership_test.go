package taskd

import (
	"slices"
	"testing"
	"time"
)

func TestMembership(t *testing.T) {
	ms := newMembership(time.Second)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	for _, step := range []struct {
		at   time.Duration
		rank int
		ok   bool
	}{
		{0, 1, true},
		{2 * time.Second, 3, true}, // rank 0 is missing: nothing to settle
		{4 * time.Second, 0, true},
		{4500 * time.Millisecond, 2, true}, // fills the gap within settle
		{5000 * time.Millisecond, 1, true}, // again: no newcomer, settling on
		{5400 * time.Millisecond, 4, true}, // a newcomer within settle joins
		{8 * time.Second, 5, false},        // 0 to 4, settled for a second
		{8 * time.Second, 4, true},
		{time.Hour, 0, true},
		{time.Hour, 9, false},
	} {
		ms.complete(at(step.at))
		if err := ms.admit(at(step.at), step.rank); (err == nil) != step.ok {
			t.Fatalf("rank %d at %v: %v, want admitted %v", step.rank, step.at, err, step.ok)
		}
	}
}

// TestMembershipGap: a rank past a gap, first to join, neither keeps the
// rendezvous open nor moves its settling: ranks 0 and 1 complete it, and
// the rank past the gap is given back as no rank of the job.
func TestMembershipGap(t *testing.T) {
	ms := newMembership(time.Second)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	for _, j := range []struct {
		at   time.Duration
		rank int
	}{{0, 7}, {100 * time.Millisecond, 0}, {200 * time.Millisecond, 1}, {900 * time.Millisecond, 9}} {
		if out := ms.complete(at(j.at)); out != nil {
			t.Fatalf("complete at %v: %v", j.at, out)
		}
		if err := ms.admit(at(j.at), j.rank); err != nil {
			t.Fatalf("rank %d at %v: %v", j.rank, j.at, err)
		}
	}
	if !ms.of(1) || ms.of(7) {
		t.Fatalf("before the rendezvous completed: rank 1 of the job %v, rank 7 %v", ms.of(1), ms.of(7))
	}
	if out := ms.complete(at(1200 * time.Millisecond)); !slices.Equal(out, []int{7, 9}) {
		t.Fatalf("the ranks past the gap: %v, want [7 9]", out)
	}
	if err := ms.admit(at(1300*time.Millisecond), 2); err == nil {
		t.Fatal("rank 2, after the rendezvous of ranks 0 and 1, admitted")
	}
	if ms.of(7) || !ms.of(1) {
		t.Fatalf("once complete: rank 7 of the job %v, rank 1 %v", ms.of(7), ms.of(1))
	}
}
