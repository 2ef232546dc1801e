package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/faultline-ml/faultline/internal/freeport"
	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/taskd"
)

// TestGrowCore feeds node 0's grow core the nodes waiting to join, tick
// by tick, and checks what it says and when it takes them in: time comes
// in, nothing sleeps.
func TestGrowCore(t *testing.T) {
	const wait = 30 * time.Second
	type seen struct {
		at      time.Duration // since the start
		waiting []int
		busy    bool
		saved   int64
		fail    bool   // the take (wanted here) fails
		say     string // a part of what it says, "" for nothing
		take    []int  // the nodes it takes in, nil for none
	}
	name := func(n int) string { return fmt.Sprintf("node %d", n) }
	for _, tc := range []struct {
		name  string
		room  int
		ticks []seen
	}{
		{"none waits: nothing", 1, []seen{
			{at: 0}, {at: time.Minute, saved: 5},
		}},
		{"one that fills the job: at its next save", 1, []seen{
			{at: 0, waiting: []int{7}, saved: 3, say: "node 7 came to join the job"},
			{at: time.Second, waiting: []int{7}, saved: 3},
			{at: 2 * time.Second, waiting: []int{7}, saved: 4, take: []int{7}},
		}},
		{"one of room for two: the join timeout after it came, then the next save", 2, []seen{
			{at: 0, waiting: []int{7}, saved: 3, say: "--join-timeout 30s after the last came"},
			{at: 29 * time.Second, waiting: []int{7}, saved: 9},
			{at: 30 * time.Second, waiting: []int{7}, saved: 9},
			{at: 31 * time.Second, waiting: []int{7}, saved: 10, take: []int{7}},
		}},
		{"a second one before the timeout: both, at once", 2, []seen{
			{at: 0, waiting: []int{7}, saved: 3, say: "node 7 came"},
			{at: 10 * time.Second, waiting: []int{6, 7}, saved: 5, say: "node 6 came"},
			{at: 11 * time.Second, waiting: []int{6, 7}, saved: 6, take: []int{7, 6}},
		}},
		{"more than room: the first that came", 1, []seen{
			{at: 0, waiting: []int{8}, saved: 1, say: "node 8"},
			{at: time.Second, waiting: []int{5, 8}, saved: 2, say: "node 5", take: []int{8}},
		}},
		{"no save: the join timeout after it decided", 1, []seen{
			{at: 0, waiting: []int{7}, saved: -1, say: "node 7"},
			{at: 29 * time.Second, waiting: []int{7}, saved: -1},
			{at: 30 * time.Second, waiting: []int{7}, saved: -1, take: []int{7}},
		}},
		{"not while busy", 1, []seen{
			{at: 0, waiting: []int{7}, busy: true, saved: 3, say: "node 7"},
			{at: time.Second, waiting: []int{7}, busy: true, saved: 4},
			{at: 2 * time.Second, waiting: []int{7}, saved: 4},
			{at: 3 * time.Second, waiting: []int{7}, saved: 5, take: []int{7}},
		}},
		{"one that left is not taken, and said again when it comes back", 1, []seen{
			{at: 0, waiting: []int{7}, saved: 3, say: "node 7"},
			{at: time.Second, saved: 4},
			{at: 2 * time.Second, waiting: []int{7}, saved: 5, say: "node 7"},
			{at: 3 * time.Second, waiting: []int{7}, saved: 6, take: []int{7}},
		}},
		{"a failed take: again a second later", 1, []seen{
			{at: 0, waiting: []int{7}, saved: 3, say: "node 7"},
			{at: time.Second, waiting: []int{7}, saved: 4, take: []int{7}, fail: true},
			{at: 1500 * time.Millisecond, waiting: []int{7}, saved: 5},
			{at: 2 * time.Second, waiting: []int{7}, saved: 5},
			{at: 2100 * time.Millisecond, waiting: []int{7}, saved: 6, take: []int{7}},
		}},
		{"no room: said once, never taken", 0, []seen{
			{at: 0, waiting: []int{7}, saved: 3, say: "which has its MAX nodes"},
			{at: time.Minute, waiting: []int{7, 8}, saved: 9},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := newGrowCore(tc.room, wait)
			t0 := time.Unix(1e9, 0)
			for _, s := range tc.ticks {
				var said []string
				var took []int
				for _, act := range c.tick(t0.Add(s.at), s.waiting, s.busy, s.saved, name) {
					switch act.kind {
					case growSayAction:
						said = append(said, act.why)
					case growTakeAction:
						took = act.nodes
					}
				}
				if s.say == "" && len(said) > 0 || s.say != "" && !strings.Contains(strings.Join(said, "\n"), s.say) {
					t.Errorf("at %v: said %q, want %q", s.at, said, s.say)
				}
				if diff := cmp.Diff(s.take, took); diff != "" {
					t.Errorf("at %v: took (-want +got):\n%s", s.at, diff)
				}
				if s.fail {
					c.failed(t0.Add(s.at))
				}
			}
		})
	}
}

// TestGenerationOf reads the generation of a job's control-plane name.
func TestGenerationOf(t *testing.T) {
	for _, tc := range []struct {
		job, served string
		g           int
		ok          bool
	}{
		{"job", "job", 0, true},
		{"job", "job-g1", 1, true},
		{"job", "job-g12", 12, true},
		{"job-g3", "job-g3-g2", 2, true},
		{"job-g3", "job-g3", 0, true},
		{"job", "job-g0", 0, false},
		{"job", "job-g01", 0, false},
		{"job", "job-g-1", 0, false},
		{"job", "job-gx", 0, false},
		{"job", "other-g1", 0, false},
		{"job", "jobs-g1", 0, false},
		{"job", "job-g", 0, false},
	} {
		g, ok := generationOf(tc.job, tc.served)
		if g != tc.g || ok != tc.ok {
			t.Errorf("generationOf(%q, %q) = %d, %v; want %d, %v", tc.job, tc.served, g, ok, tc.g, tc.ok)
		}
	}
}

// TestResizedNextJoining: the runs of an elastic job carry its MAX and the
// node's launch rank; a node that waits to join runs at its position past
// the job's nodes and spares, knowing only the job's MAX, and joins with
// the step the grown job resumes from.
func TestResizedNextJoining(t *testing.T) {
	c := Config{Job: "j", Command: []string{"x"}, Nodes: 3, MinNodes: 2, NodeRank: 1, SpareNodes: 1, ProcsPerNode: 2}
	// The job went on as job-g1 without node 1: it waits to join.
	r := &Resized{Joining: true, Node: 1, NodeRank: 4 + 1, Generation: 1, Restarts: 2}
	n := r.Next(c)
	if n.Nodes != 3 || n.NodeRank != 5 || !n.joining || n.maxNodes != 3 || n.launchRank != 1 || n.Generation != 1 || n.Restarts != 2 {
		t.Fatalf("the waiting run's config: %+v", n)
	}
	if err := n.Validate(); err != nil {
		t.Fatalf("the waiting run's config: %v", err)
	}
	n.setDefaults()
	if !n.spare() || n.joinBase() != 4 || !n.growable() || n.positions() != 8 {
		t.Fatalf("the waiting run: spare %v, joinBase %d, growable %v, positions %d", n.spare(), n.joinBase(), n.growable(), n.positions())
	}
	// The job takes it in as node 2 of 3.
	g := &Resized{From: 2, To: 3, Node: 5, NodeRank: 2, Generation: 2, Restarts: 3, Waited: true, grown: &growth{step: 41, from: 0},
		name: "the node started as --node-rank 1 (waiting to join)"}
	if !strings.Contains(g.Error(), "the node started as --node-rank 1 (waiting to join) joins the job as node 2 of 3") {
		t.Errorf("the grow's error: %v", g)
	}
	n = g.Next(n)
	if n.Nodes != 3 || n.NodeRank != 2 || n.joining || n.grown == nil || n.grown.step != 41 || n.maxNodes != 3 || n.launchRank != 1 {
		t.Fatalf("the grown run's config: %+v", n)
	}
	// A node of the job is refused a position past its nodes and spares.
	c.NodeRank = 5
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "NodeRank = 5: outside [0, 4)") {
		t.Fatalf("NodeRank 5 of a job of 3 and a spare: %v", err)
	}
}

// TestElasticGrows: node 0 of a job of 1 to 2 nodes starts alone and,
// once JoinTimeout has passed, goes on as a job of 1. Node 1 comes then,
// started as it would have been: the manager's answer names the job's new
// shape, node 1 waits to join it, and node 0 takes it in: both runs end
// with a *Resized to 2 nodes, and the ranks start again in a world of 2,
// with the restart count on by one.
func TestElasticGrows(t *testing.T) {
	dir := t.TempDir()
	port, err := freeport.Find(8)
	if err != nil {
		t.Fatal(err)
	}
	cfg := func(node int) Config {
		shm := filepath.Join(dir, "shm"+strconv.Itoa(node))
		if err := os.MkdirAll(shm, 0o755); err != nil {
			t.Fatal(err)
		}
		return Config{Job: "agent-test-grow", Nodes: 2, MinNodes: 1, NodeRank: node, JoinTimeout: 300 * time.Millisecond,
			MasterAddr: "127.0.0.1", MasterPort: port, HeartbeatDeadline: 3 * time.Second,
			Command: []string{"sh", "-c", `echo "$RANK $WORLD_SIZE $TORCHELASTIC_RESTART_COUNT" >> "$WORK/seen"; [ "$WORLD_SIZE" = 2 ] || sleep 60`}, NoPython: true,
			Out: filepath.Join(dir, "out"+strconv.Itoa(node)), ShmDir: shm,
			Security: taskd.Security{Token: "0123456789abcdef0123456789abcdef", Insecure: true},
			Env:      append(os.Environ(), "WORK="+dir), Stdout: os.Stderr, Stderr: os.Stderr}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	// runs runs a node's agent again while it returns a *Resized, and
	// returns the *Resized errors, then the last error.
	runs := func(c Config, rs chan<- *Resized) error {
		defer close(rs)
		for {
			a, err := New(c)
			if err != nil {
				return err
			}
			err = a.Run(ctx)
			a.Close()
			var r *Resized
			if !errors.As(err, &r) {
				return err
			}
			rs <- r
			c = r.Next(c)
		}
	}
	rs0, rs1 := make(chan *Resized, 4), make(chan *Resized, 4)
	errs := make(chan error, 2)
	go func() { errs <- runs(cfg(0), rs0) }()
	if r := <-rs0; r.To != 1 || r.Generation != 1 {
		t.Fatalf("node 0 alone: %v, want a job of 1 node, generation 1", r)
	}
	testkit.WaitFor(t, "node 0's rank in a world of 1", func() bool {
		b, _ := os.ReadFile(filepath.Join(dir, "seen"))
		return string(b) == "0 1 0\n"
	})
	go func() { errs <- runs(cfg(1), rs1) }()
	if r := <-rs1; !r.Joining || r.Generation != 1 || r.NodeRank != 3 {
		t.Fatalf("node 1 after the job went on without it: %v (%+v), want it waiting to join generation 1 at position 3", r, r)
	}
	if r := <-rs0; r.From != 1 || r.To != 2 || r.NodeRank != 0 || r.Generation != 2 || r.Restarts != 1 || r.grown == nil {
		t.Fatalf("node 0 as the job took in node 1: %v (%+v)", r, r)
	}
	if r := <-rs1; r.From != 1 || r.To != 2 || r.NodeRank != 1 || r.Generation != 2 || !r.Waited || r.grown == nil || r.grown.from != 0 {
		t.Fatalf("node 1 as the job took it in: %v (%+v)", r, r)
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	b, _ := os.ReadFile(filepath.Join(dir, "seen"))
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	slices.Sort(lines[1:])
	if got, want := strings.Join(lines, "\n"), "0 1 0\n0 2 1\n1 2 1"; got != want {
		t.Fatalf("the ranks saw %q, want %q", got, want)
	}
}

// TestPlanAdopters: in the run after node 2 joined a job of 2 nodes of 2
// ranks, its ranks 4 and 5 hold nothing of their own yet (their first
// load failed): a recovery resumes the job from the newest step node 0's
// ranks 0 and 1 hold, which ranks 4 and 5 take, rather than start over;
// once they hold steps of their own, those count.
func TestPlanAdopters(t *testing.T) {
	c := newJobCore(3)
	c.adopters = map[int]int{2: 0}
	c.startRound("r")
	c.report(heldReport{Round: "r", Node: 0, Ranks: map[int][]int64{0: {9, 8}, 1: {9, 8}}, Replicas: map[int][]int64{2: {9}, 3: {9}}})
	c.report(heldReport{Round: "r", Node: 1, Ranks: map[int][]int64{2: {9, 8}, 3: {9, 8}}})
	c.report(heldReport{Round: "r", Node: 2, Ranks: map[int][]int64{4: {}, 5: {}}})
	plan, _, why := c.plan(nil, time.Second)
	if plan.step != 9 || !slices.Equal(plan.replica, []int{4, 5}) {
		t.Fatalf("plan = %+v (%s), want step 9, ranks 4 and 5 from node 0's", plan, why)
	}
	c.startRound("r2")
	c.report(heldReport{Round: "r2", Node: 0, Ranks: map[int][]int64{0: {11, 10}, 1: {11, 10}}})
	c.report(heldReport{Round: "r2", Node: 1, Ranks: map[int][]int64{2: {11, 10}, 3: {11, 10}}})
	c.report(heldReport{Round: "r2", Node: 2, Ranks: map[int][]int64{4: {10}, 5: {10}}})
	if plan, _, why := c.plan(nil, time.Second); plan.step != 10 || len(plan.replica) != 0 {
		t.Fatalf("plan = %+v (%s), want step 10, every rank from its memory", plan, why)
	}
}
