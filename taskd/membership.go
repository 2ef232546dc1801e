package taskd

import (
	"fmt"
	"slices"
	"time"
)

// membership is the ranks of a job whose shape is not given
// (ManagerConfig.Nodes and ProcsPerNode unset) while orchestration is on:
// those of its first complete rendezvous. Until then every rank that
// registers joins. The rendezvous is complete once ranks 0 to n-1 joined,
// none missing, and that run has not grown for settle; from then on the
// job's ranks are 0 to n-1, and a rank of n or more is not of the job:
// one that joined past a gap is dropped, and a later one refused, so that
// a token holder that joins as a rank of its own and goes silent cannot
// start a recovery that stops the others, nor keep the rendezvous open by
// joining as a rank past the job's. Like the orchestration core it is
// pure: the caller gives it the time.
type membership struct {
	settle time.Duration
	ranks  map[int]bool // joined before the rendezvous completed
	run    int          // ranks 0 to run-1 joined, none missing
	last   time.Time    // when run last grew
	world  int          // once complete, the ranks are 0 to world-1; 0 before
}

func newMembership(settle time.Duration) *membership {
	return &membership{settle: settle, ranks: make(map[int]bool)}
}

// complete completes the rendezvous at now if it is, and returns the
// ranks that joined past a gap, in order: they are not of the job.
func (ms *membership) complete(now time.Time) (outsiders []int) {
	if ms.world > 0 || ms.run == 0 || now.Sub(ms.last) < ms.settle {
		return nil
	}
	for r := range ms.ranks {
		if r >= ms.run {
			outsiders = append(outsiders, r)
		}
	}
	slices.Sort(outsiders)
	ms.world, ms.ranks = ms.run, nil
	return outsiders
}

// admit takes in that rank registers at now, or says why it is not of the
// job. The caller completes the rendezvous first.
func (ms *membership) admit(now time.Time, rank int) error {
	switch {
	case ms.world == 0:
		if !ms.ranks[rank] {
			ms.ranks[rank] = true
			for ms.ranks[ms.run] {
				ms.run++
				ms.last = now
			}
		}
		return nil
	case rank < ms.world:
		return nil
	}
	return fmt.Errorf("rank %d is not of this job: without a shape (ManagerConfig.Nodes and ProcsPerNode), the job's ranks are those of its first complete rendezvous, 0 to %d, and no other joins; give the shape for a job whose ranks may join later", rank, ms.world-1)
}

// of reports whether rank is of the job: below the world once the
// rendezvous is complete, and before then in the run of ranks joined from
// 0, none missing; a rank past a gap may be no rank of the job, and its
// loss is no fault of the job.
func (ms *membership) of(rank int) bool {
	if ms.world > 0 {
		return rank < ms.world
	}
	return rank < ms.run
}
