package agent

import (
	"bytes"
	"context"
	"log/slog"
	"maps"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/topology"
)

// save writes step into rank's segment as a rank's Checkpointer would,
// through ckpt's writer.
func save(t *testing.T, a *Agent, rank int, step int64, size int) {
	t.Helper()
	path, _, err := a.ckpts.segment(rank, "", int64(size)+8192)
	if err != nil {
		t.Fatal(err)
	}
	w, err := ckpt.NewWriter(ckpt.WriterConfig{Path: path})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if err := w.Save(context.Background(), step, ckpt.Blob{Name: "w", Data: bytes.Repeat([]byte{byte(step)}, size)}); err != nil {
		t.Fatal(err)
	}
}

// TestSegmentsMadeAtOnce: a rank's segment is made while another rank's
// is still being made (its shard's lock held), not after it.
func TestSegmentsMadeAtOnce(t *testing.T) {
	a, _, _ := shellAgent(t, 2, 0, `exit 0`)
	t.Cleanup(func() { a.ckpts.release(context.Background(), true) })
	sh, _, err := a.ckpts.shardOf(0, "")
	if err != nil {
		t.Fatal(err)
	}
	defer sh.mu.Unlock() // rank 0's segment "being made" all along
	done := make(chan error, 1)
	go func() {
		_, _, err := a.ckpts.segment(1, "", 1<<20)
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(time.Minute):
		t.Fatal("rank 1's segment waits for rank 0's")
	}
}

// TestLoadAfterTheFirst: a rank's first load of a process is the step
// the job agreed on; a later one is the newest step every local rank
// holds, or the step its peers agreed on, never the first answer again.
func TestLoadAfterTheFirst(t *testing.T) {
	a, _, _ := shellAgent(t, 2, 0, `exit 0`)
	t.Cleanup(func() { a.ckpts.release(context.Background(), true) })
	s := a.slots[0]
	for r := range 2 {
		save(t, a, r, 0, 1000)
	}
	ctx := context.Background()
	load := func(pid int, at *int64) loadAnswer {
		t.Helper()
		ans, err := a.ckpts.load(ctx, s, pid, "", at)
		if err != nil {
			t.Fatal(err)
		}
		return ans
	}
	if ans := load(100, nil); ans.Step != 0 || ans.Tier != "memory" {
		t.Fatalf("first load: %+v", ans)
	}
	for step := int64(1); step <= 4; step++ {
		for r := range 2 {
			save(t, a, r, step, 1000)
		}
		if ans := load(100, nil); ans.Step != step || ans.Tier != "memory" {
			t.Fatalf("load after the save of step %d: %+v", step, ans)
		}
	}
	at := int64(3)
	if ans := load(100, &at); ans.Step != 3 || ans.Tier != "memory" {
		t.Fatalf("load of the step agreed, 3: %+v", ans)
	}
	if steps, disk, _ := a.ckpts.heldSteps(0); len(steps) != 2 || steps[0] != 4 || steps[1] != 3 || disk != -1 {
		t.Fatalf("held: %v, disk %d; want [4 3], -1", steps, disk)
	}
	// The rank's next process (a restart, with none agreed) loads the
	// newest step every rank holds.
	s.mu.Lock()
	s.starts++
	s.mu.Unlock()
	if ans := load(200, nil); ans.Step != 4 {
		t.Fatalf("a restarted process's first load: %+v", ans)
	}
}

// TestHeldChecksEachSaveOnce: the steps every local rank holds are
// checked, every CRC, once per save: a second look trusts what the first
// verified until a writer writes the half again. (A byte flipped after
// the first look is therefore seen only when the half is written again:
// the check is a save's, not a read's.)
func TestHeldChecksEachSaveOnce(t *testing.T) {
	a, _, _ := shellAgent(t, 2, 0, `exit 0`)
	t.Cleanup(func() { a.ckpts.release(context.Background(), true) })
	for r := range 2 {
		save(t, a, r, 5, 1<<20)
		save(t, a, r, 6, 1<<20)
	}
	// The owners seal the saves within their poll interval.
	for r := range 2 {
		o, err := a.ckpts.owner(r)
		if err != nil || o == nil {
			t.Fatal(o, err)
		}
		if _, _, err := o.Load(context.Background(), r); err != nil {
			t.Fatal(err)
		}
	}
	if got := a.ckpts.localSteps(); len(got) != 2 || got[0] != 6 {
		t.Fatalf("localSteps = %v, want [6 5]", got)
	}
	f, err := os.OpenFile(a.ckpts.segmentPath(1), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	rep, err := ckpt.InspectSegment(a.ckpts.segmentPath(1))
	if err != nil {
		t.Fatal(err)
	}
	h := rep.Halves[rep.NewestHalf]
	off := 4096 + int64(rep.NewestHalf)*rep.Header.HalfSize + h.Meta.Blobs[0].Offset + 100
	if _, err := f.WriteAt([]byte{0xff}, off); err != nil {
		t.Fatal(err)
	}
	if got := a.ckpts.localSteps(); len(got) != 2 || got[0] != 6 {
		t.Fatalf("localSteps after a flip in a half checked already = %v, want [6 5] (not read again)", got)
	}
	// A new owner (an agent started again) checks everything anew.
	a.ckpts.close()
	if got := a.ckpts.localSteps(); len(got) != 1 || got[0] != 5 {
		t.Fatalf("localSteps of a new owner = %v, want [5]", got)
	}
}

// TestResumeFromDiskSaysWhy: a node that does not say what it holds
// within the deadline has the job resume from what the others hold and
// the disk, saying which node and how long it waited.
func TestResumeFromDiskSaysWhy(t *testing.T) {
	c := newJobCore(2)
	c.startRound("r1")
	if !c.report(heldReport{Round: "r1", Node: 0, Ranks: map[int][]int64{0: {9, 8}}, Disk: []int64{5}, Restarts: 2}) {
		t.Fatal("a report of the round was dropped")
	}
	if c.report(heldReport{Round: "r0", Node: 1, Ranks: map[int][]int64{1: {9, 8}}}) {
		t.Fatal("a report of an earlier round was taken")
	}
	if got := c.missing(); len(got) != 1 || got[0] != 1 {
		t.Fatalf("missing = %v, want [1]", got)
	}
	plan, restart, why := c.plan(nil, 50*time.Millisecond)
	if plan.step != 5 || restart != 3 || !strings.Contains(why, "nodes [1] did not say what they hold within 50ms") {
		t.Fatalf("plan = %+v, restart %d, why %q; want step 5 from disk, restart 3", plan, restart, why)
	}
}

// TestReplicasGoToAnotherSwitch: with the job's topology, a node's
// replicas go to a node under another access switch, not to the next
// node under its own; a node whose address the topology does not list
// has no switch.
func TestReplicasGoToAnotherSwitch(t *testing.T) {
	topo, err := topology.Parse([]byte("asw-a psw-1 10.0.0.1\nasw-a psw-1 10.0.0.2\nasw-b psw-1 127.0.0.1\n"))
	if err != nil {
		t.Fatal(err)
	}
	c := &checkpoints{a: &Agent{cfg: Config{Topology: topo}, log: slog.New(slog.DiscardHandler)}}
	peers := map[int]string{0: "10.0.0.1:29502", 1: "10.0.0.2:29502", 2: "127.0.0.1:29502", 3: "10.9.9.9:29502"}
	got := c.domainsOf(peers)
	if want := map[string]string{"0": "asw-a", "1": "asw-a", "2": "asw-b"}; !maps.Equal(got, want) {
		t.Fatalf("domains %v, want %v", got, want)
	}
	nodes := []string{"0", "1", "2", "3"}
	if p := ckpt.PickPeers("0", nodes, got, 1); !slices.Equal(p, []string{"2"}) {
		t.Errorf("node 0 replicates to %v, want [2] (another switch)", p)
	}
	if p := ckpt.PickPeers("0", nodes, nil, 1); !slices.Equal(p, []string{"1"}) {
		t.Errorf("without a topology node 0 replicates to %v, want [1] (the next node)", p)
	}
	if (&checkpoints{a: &Agent{log: slog.New(slog.DiscardHandler)}}).domainsOf(peers) != nil {
		t.Error("domains without a topology")
	}
}
