package agent

import (
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/faultline-ml/faultline/taskd"
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

// TestSilentFor: the spares wait while a job node not yet declared lost
// has been silent since about the first loss, and not for a spare, a
// node known lost, a node that beats, or one silent past its deadline.
func TestSilentFor(t *testing.T) {
	now := time.Now()
	interval, deadline := time.Second, 6*time.Second
	worker := func(node int, quiet time.Duration) taskd.MemberInfo {
		return taskd.MemberInfo{Role: taskd.RoleWorker, Position: taskd.Position{Node: node}, LastSeen: now.Add(-quiet)}
	}
	for _, tc := range []struct {
		name    string
		members []taskd.MemberInfo
		want    time.Duration
	}{
		{"every node beats", []taskd.MemberInfo{worker(0, 0), worker(1, interval), worker(2, 2*interval)}, 0},
		{"a node silent since the loss", []taskd.MemberInfo{worker(0, 0), worker(2, 4*interval)}, interval},
		{"a node known lost", []taskd.MemberInfo{worker(0, 0), worker(1, 4*interval)}, 0},
		{"a silent spare", []taskd.MemberInfo{worker(0, 0), worker(3, 4*interval)}, 0},
		{"past the deadline", []taskd.MemberInfo{worker(0, 0), worker(2, deadline+interval)}, 0},
		{"a proxy", []taskd.MemberInfo{worker(0, 0), {Role: taskd.RoleProxy, Position: taskd.Position{Node: 2}, LastSeen: now.Add(-4 * interval)}}, 0},
	} {
		if got := silentFor(tc.members, 3, []int{1}, now, interval, deadline); got != tc.want {
			t.Errorf("%s: wait %v, want %v", tc.name, got, tc.want)
		}
	}
}
