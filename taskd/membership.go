package taskd

import (
	"fmt"
	"time"
)

// membership is the ranks of a job whose shape is not given
// (ManagerConfig.Nodes and ProcsPerNode unset) while orchestration is on:
// those of its first complete rendezvous. Until then every rank that
// registers joins. The rendezvous is complete once the ranks that joined
// are 0 to n-1, none missing, and no new one has joined for settle; from
// then on a rank of n or more is not of the job, and its registration is
// refused, so that a token holder that joins as a rank of its own and goes
// silent cannot start a recovery that stops the others. Like the
// orchestration core it is pure: the caller gives it the time.
type membership struct {
	settle time.Duration
	ranks  map[int]bool // joined before the rendezvous completed
	last   time.Time    // when a new rank last joined
	world  int          // once complete, the ranks are 0 to world-1; 0 before
}

func newMembership(settle time.Duration) *membership {
	return &membership{settle: settle, ranks: make(map[int]bool)}
}

// complete completes the rendezvous at now if it is.
func (ms *membership) complete(now time.Time) {
	if ms.world > 0 || len(ms.ranks) == 0 || now.Sub(ms.last) < ms.settle {
		return
	}
	for r := range len(ms.ranks) {
		if !ms.ranks[r] {
			return // a rank below the highest is missing: not complete
		}
	}
	ms.world, ms.ranks = len(ms.ranks), nil
}

// admit takes in that rank registers at now, or says why it is not of the
// job.
func (ms *membership) admit(now time.Time, rank int) error {
	ms.complete(now)
	switch {
	case ms.world == 0:
		if !ms.ranks[rank] {
			ms.ranks[rank] = true
			ms.last = now
		}
		return nil
	case rank < ms.world:
		return nil
	}
	return fmt.Errorf("rank %d is not of this job: without a shape (ManagerConfig.Nodes and ProcsPerNode), the job's ranks are those of its first complete rendezvous, 0 to %d, and no other joins; give the shape for a job whose ranks may join later", rank, ms.world-1)
}
