package agent

import (
	"fmt"
	"maps"
	"slices"
	"strings"
)

// holdings is what the job holds to resume from, as the nodes report it:
// each rank's steps intact in memory, and each node's steps committed on
// its disk tier (the same folder on every node that shares one).
type holdings struct {
	memory  map[int][]int64 // by rank: in its own node's memory
	replica map[int][]int64 // by rank: in another node's memory
	disk    map[int][]int64 // by node
	nodeOf  func(rank int) int
}

// resumePlan is the step the job resumes from and where each rank loads
// it: the ranks in replica from another node's memory, those in disk from
// their node's disk tier, every other rank from its own memory.
type resumePlan struct {
	step    int64 // -1: none, the job starts over
	replica []int // ranks that load step from a replica
	disk    []int // ranks that load step from disk
}

// choose returns the newest step that every rank of ranks can load: held
// intact in its memory, in another node's memory (a replica), or committed
// on its node's disk. A nearer tier is preferred where it holds the step,
// but never at the price of an older step: a rank whose double buffer
// moved on past a step that it asked to persist (and that its peers still
// hold, their persist still under way) loads that step from disk, and a
// rank whose node was replaced loads it from a replica. why says, when it
// is not every rank's newest step, what kept it from a newer one.
func (h holdings) choose(ranks []int) (plan resumePlan, why string) {
	cands := map[int64]bool{}
	for _, r := range ranks {
		for _, s := range h.memory[r] {
			cands[s] = true
		}
		for _, s := range h.replica[r] {
			cands[s] = true
		}
	}
	for _, steps := range h.disk {
		for _, s := range steps {
			cands[s] = true
		}
	}
	order := slices.Sorted(maps.Keys(cands))
	slices.Reverse(order)
	var missing []string
	for _, s := range order {
		p := resumePlan{step: s}
		ok := true
		for _, r := range ranks {
			switch {
			case slices.Contains(h.memory[r], s):
			case slices.Contains(h.replica[r], s):
				p.replica = append(p.replica, r)
			case slices.Contains(h.disk[h.nodeOf(r)], s):
				p.disk = append(p.disk, r)
			default:
				ok = false
			}
			if !ok {
				if len(missing) < 3 {
					missing = append(missing, fmt.Sprintf("rank %d holds no step %d (memory %v, replicas %v, its node's disk %v)",
						r, s, h.memory[r], h.replica[r], h.disk[h.nodeOf(r)]))
				}
				break
			}
		}
		if ok {
			if len(missing) > 0 {
				why = "newer steps are not held by every rank: " + strings.Join(missing, "; ")
			}
			return p, why
		}
	}
	if len(order) > 0 {
		why = "no step is held by every rank: " + strings.Join(missing, "; ")
	}
	return resumePlan{step: -1}, why
}
