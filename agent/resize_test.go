package agent

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/topology"
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
		m, whyNot := shrink(c.nodes, c.min, c.live, nil, nil, 4, 1, "why")
		if c.whyNot != "" {
			if !strings.Contains(whyNot, c.whyNot) {
				t.Errorf("%s: why not %q, want %q", c.name, whyNot, c.whyNot)
			}
			continue
		}
		if whyNot != "" || m.From != c.nodes || m.To != len(c.want) || m.Restarts != 4 || m.Generation != 1 {
			t.Errorf("%s: %+v, %q", c.name, m, whyNot)
		}
		if d := cmp.Diff(c.want, m.Ranks); d != "" {
			t.Errorf("%s: ranks (-want +got):\n%s", c.name, d)
		}
	}
	// With a topology, the nodes left take its switch order, node 0
	// first: node 3 shares node 0's access switch.
	topo, err := topology.Parse([]byte("asw-a psw-1 10.0.0.1\nasw-b psw-1 10.0.0.2\nasw-b psw-1 10.0.0.3\nasw-a psw-1 10.0.0.4\n"))
	if err != nil {
		t.Fatal(err)
	}
	addrs := map[int]string{0: "10.0.0.1:29502", 1: "10.0.0.2:29503", 2: "10.0.0.3:29504", 3: "10.0.0.4:29505"}
	m, whyNot := shrink(4, 2, []int{0, 2, 3}, topo, addrs, 1, 1, "why")
	if d := cmp.Diff(map[int]int{0: 0, 3: 1, 2: 2}, m.Ranks); whyNot != "" || d != "" {
		t.Errorf("in switch order: %q, ranks (-want +got):\n%s", whyNot, d)
	}
	// A node whose host the topology does not list: the order stays.
	addrs[3] = "10.9.9.9:29505"
	m, _ = shrink(4, 2, []int{0, 2, 3}, topo, addrs, 1, 1, "why")
	if d := cmp.Diff(map[int]int{0: 0, 2: 1, 3: 2}, m.Ranks); d != "" {
		t.Errorf("a host the topology does not know: ranks (-want +got):\n%s", d)
	}
	if got, want := resizeWhy(3, []int{0, 2}, 2, "were lost"), "nodes [1] were lost; the job goes on with 2 nodes of 3 (world 6 → 4)"; got != want {
		t.Errorf("resizeWhy = %q, want %q", got, want)
	}
}

// TestResizedNext: the next run takes the job's new shape and counts its
// restarts on.
func TestResizedNext(t *testing.T) {
	r := &Resized{From: 3, To: 2, Node: 2, NodeRank: 1, Restarts: 1, Generation: 1, Why: "nodes [1] were lost"}
	c := r.Next(Config{Job: "j", Command: []string{"train.py"}, Nodes: 3, MinNodes: 2, NodeRank: 2})
	if c.Nodes != 2 || c.NodeRank != 1 || c.MinNodes != 2 || c.Restarts != 1 || c.Generation != 1 {
		t.Fatalf("Next = %+v", c)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	// A spare that takes node 1's place: the job's shape stays.
	r = &Resized{From: 2, To: 2, Node: 2, NodeRank: 1, Why: "node 1 was lost; spare node 2 takes its place"}
	if c := r.Next(Config{Job: "j", Command: []string{"x"}, Nodes: 2, SpareNodes: 1, NodeRank: 2}); c.Nodes != 2 || c.NodeRank != 1 || c.SpareNodes != 1 || c.spare() {
		t.Fatalf("a takeover's Next = %+v", c)
	}
	if got := r.Error(); !strings.Contains(got, "spare node 2 takes the place of node 1") {
		t.Errorf("a takeover says %q", got)
	}
	for _, bad := range []Config{
		{Job: "j", Command: []string{"x"}, Nodes: 2, MinNodes: 3},
		{Job: "j", Command: []string{"x"}, Nodes: 3, MinNodes: 2, Manager: "h:1"},
		{Job: "j", Command: []string{"x"}, Restarts: -1},
		{Job: "j", Command: []string{"x"}, Generation: -1},
		{Job: "j", Command: []string{"x"}, JoinTimeout: -1},
	} {
		if err := bad.Validate(); err == nil {
			t.Errorf("Validate(%+v) = nil", bad)
		}
	}
}

// TestElasticStartsWithFewer: node 0 of a job of 1 to 2 nodes, alone:
// its rank does not start in a world of 2; once JoinTimeout has passed,
// Run returns a *Resized, and the run Next configures starts the rank
// once, in a world of 1, with restart count 0.
func TestElasticStartsWithFewer(t *testing.T) {
	dir := t.TempDir()
	cfg := Config{Job: "agent-test-elastic", Nodes: 2, MinNodes: 1, JoinTimeout: 200 * time.Millisecond,
		Command: []string{"sh", "-c", `echo "$WORLD_SIZE $TORCHELASTIC_RESTART_COUNT" >> "$WORK/seen"`}, NoPython: true,
		Out: filepath.Join(dir, "out"), ShmDir: dir, ManagerListen: "127.0.0.1:0",
		Security: taskd.Security{Token: "0123456789abcdef0123456789abcdef", Insecure: true},
		Env:      append(os.Environ(), "WORK="+dir), Stdout: os.Stderr, Stderr: os.Stderr}
	a, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	err = run(t, a)
	a.Close()
	var r *Resized
	if !errors.As(err, &r) || r.To != 1 || r.NodeRank != 0 || r.Restarts != 0 || r.Generation != 1 {
		t.Fatalf("Run = %v, want a *Resized to 1 node, restart count 0, generation 1", err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "seen")); err == nil {
		t.Fatalf("the rank started before the job's shape was known: %q", b)
	}
	a, err = New(r.Next(cfg))
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if err := run(t, a); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "seen")); err != nil || string(b) != "1 0\n" {
		t.Fatalf("the rank saw %q (%v), want one start in a world of 1 with restart count 0", b, err)
	}
}
