package agent

import (
	"testing"

	"github.com/google/go-cmp/cmp"
)

// TestPairSpares: a spare goes first to the lost node whose replicas it
// holds, so that nodes 1 and 2 lost together, node 2's replicas on spare
// 3 and node 1's on node 2, leave node 2 its replicas; then the nodes
// wait their turn in the order they were lost.
func TestPairSpares(t *testing.T) {
	ring := func(spare, node int) bool { return spare == node+1 } // replicas go to the next node
	for _, c := range []struct {
		name          string
		waiting, free []int
		want          map[int]int
	}{
		{"one lost, one spare", []int{1}, []int{3}, map[int]int{1: 3}},
		{"two lost, the spare holds the second's", []int{1, 2}, []int{3}, map[int]int{2: 3}},
		{"two lost, two spares", []int{1, 2}, []int{3, 4}, map[int]int{2: 3, 1: 4}},
		{"no spare", []int{1}, nil, map[int]int{}},
		{"a spare, none lost", nil, []int{3}, map[int]int{}},
	} {
		if got := pairSpares(c.waiting, c.free, ring); !cmp.Equal(got, c.want) {
			t.Errorf("%s: pairSpares(%v, %v) = %v, want %v", c.name, c.waiting, c.free, got, c.want)
		}
	}
}
