package agent

import (
	"slices"
	"strings"
	"testing"
)

func TestChooseResumeStep(t *testing.T) {
	twoNodes := func(r int) int { return r / 2 }
	for _, tc := range []struct {
		name     string
		memory   map[int][]int64
		replica  map[int][]int64
		disk     map[int][]int64
		step     int64
		disk2    []int
		replica2 []int
		why      string
	}{
		{name: "every rank's newest", memory: map[int][]int64{0: {12, 11}, 1: {12, 11}, 2: {12, 11}, 3: {12, 11}}, step: 12},
		{name: "one rank a save behind", memory: map[int][]int64{0: {12, 11}, 1: {12, 11}, 2: {11, 10}, 3: {12, 11}}, step: 11, why: "rank 2 holds no step 12"},
		// Rank 0's persist of 9 was done and its buffer moved on; the
		// others still held 9 for theirs and wrote 10, 11 and 12 over
		// each other in their other half.
		{name: "a persist held the others back", memory: map[int][]int64{0: {12, 11}, 1: {12, 9}, 2: {11, 9}, 3: {12, 9}}, disk: map[int][]int64{0: {9}, 1: {9}},
			step: 9, disk2: []int{0}},
		{name: "disk alone", memory: map[int][]int64{}, disk: map[int][]int64{0: {19, 9}, 1: {19, 9}}, step: 19, disk2: []int{0, 1, 2, 3}},
		{name: "a node's own disk", memory: map[int][]int64{0: {5}, 1: {5}, 2: {7}, 3: {7}}, disk: map[int][]int64{1: {5}}, step: 5, disk2: []int{2, 3}},
		{name: "nothing", memory: map[int][]int64{0: {3}}, step: -1, why: "no step is held by every rank"},
		// Node 1 was replaced: its ranks hold nothing; node 0 holds their
		// replicas.
		{name: "a replaced node", memory: map[int][]int64{0: {37, 36}, 1: {37, 36}, 2: {}, 3: {}}, replica: map[int][]int64{2: {36}, 3: {37, 36}},
			disk: map[int][]int64{0: {29}}, step: 36, replica2: []int{2, 3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			plan, why := holdings{memory: tc.memory, replica: tc.replica, disk: tc.disk, nodeOf: twoNodes}.choose([]int{0, 1, 2, 3})
			if plan.step != tc.step || !slices.Equal(plan.disk, tc.disk2) || !slices.Equal(plan.replica, tc.replica2) || !strings.Contains(why, tc.why) {
				t.Fatalf("choose = %+v, %q; want step %d, replica %v, disk %v, why with %q", plan, why, tc.step, tc.replica2, tc.disk2, tc.why)
			}
		})
	}
}
