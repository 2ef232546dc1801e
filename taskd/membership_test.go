package taskd

import (
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
		{2 * time.Second, 3, true}, // settled, but rank 0 and 2 are missing
		{4 * time.Second, 0, true},
		{6 * time.Second, 2, true},
		{6500 * time.Millisecond, 1, true}, // again: no newcomer, settling on
		{6900 * time.Millisecond, 4, true}, // a newcomer within settle joins
		{8 * time.Second, 5, false},        // 0 to 4, settled for a second
		{8 * time.Second, 4, true},
		{time.Hour, 0, true},
		{time.Hour, 9, false},
	} {
		if err := ms.admit(at(step.at), step.rank); (err == nil) != step.ok {
			t.Fatalf("rank %d at %v: %v, want admitted %v", step.rank, step.at, err, step.ok)
		}
	}
}
