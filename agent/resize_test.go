package agent

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// TestShrink: the nodes left are renumbered in the order they had, down
// to MinNodes, and never without node 0.
func TestShrink(t *testing.T) {
	for _, c := range []struct {
		name       string
		nodes, min int
		live       []int
		want       map[int]int
		whyNot     string
	}{
		{"middle node lost", 3, 2, []int{0, 2}, map[int]int{0: 0, 2: 1}, ""},
		{"last node lost", 3, 2, []int{0, 1}, map[int]int{0: 0, 1: 1}, ""},
		{"two of four lost", 4, 1, []int{3, 0, 3}, map[int]int{0: 0, 3: 1}, ""},
		{"down to one", 2, 1, []int{0}, map[int]int{0: 0}, ""},
		{"below MIN", 3, 3, []int{0, 1}, nil, "fewer than the 3 the job needs (--nnodes 3:3)"},
		{"node 0 lost", 3, 1, []int{1, 2}, nil, "node 0, which serves the ranks' store and the job's manager, is lost"},
		{"none lost", 2, 1, []int{0, 1}, nil, "no node is missing"},
		{"strangers ignored", 2, 1, []int{0, 5, -1}, map[int]int{0: 0}, ""},
	} {
		m, whyNot := shrink(c.nodes, c.min, c.live, 4, "why")
		if c.whyNot != "" {
			if !strings.Contains(whyNot, c.whyNot) {
				t.Errorf("%s: why not %q, want %q", c.name, whyNot, c.whyNot)
			}
			continue
		}
		if whyNot != "" || m.From != c.nodes || m.To != len(c.want) || m.Restarts != 4 {
			t.Errorf("%s: %+v, %q", c.name, m, whyNot)
		}
		if d := cmp.Diff(c.want, m.Ranks); d != "" {
			t.Errorf("%s: ranks (-want +got):\n%s", c.name, d)
		}
	}
	if got, want := resizeWhy(3, []int{0, 2}, 2, "were lost"), "nodes [1] were lost; the job goes on with 2 nodes of 3 (world 6 → 4)"; got != want {
		t.Errorf("resizeWhy = %q, want %q", got, want)
	}
}

// TestResizedNext: the next run takes the job's new shape and counts its
// restarts on.
func TestResizedNext(t *testing.T) {
	r := &Resized{From: 3, To: 2, Node: 2, NodeRank: 1, Restarts: 1, Why: "nodes [1] were lost"}
	c := r.Next(Config{Job: "j", Command: []string{"train.py"}, Nodes: 3, MinNodes: 2, NodeRank: 2})
	if c.Nodes != 2 || c.NodeRank != 1 || c.MinNodes != 2 || c.Restarts != 1 {
		t.Fatalf("Next = %+v", c)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []Config{
		{Job: "j", Command: []string{"x"}, Nodes: 2, MinNodes: 3},
		{Job: "j", Command: []string{"x"}, Nodes: 3, MinNodes: 2, Manager: "h:1"},
		{Job: "j", Command: []string{"x"}, Restarts: -1},
		{Job: "j", Command: []string{"x"}, JoinTimeout: -1},
	} {
		if err := bad.Validate(); err == nil {
			t.Errorf("Validate(%+v) = nil", bad)
		}
	}
}
