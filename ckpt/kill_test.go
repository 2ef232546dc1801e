package ckpt

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// TestSaveSIGKILL kills a trainer process that saves in a loop at random
// points, FAULTLINE_CKPT_TRIALS times (default 20; the full count
// is 200), while the owner seals its saves, and checks after each kill
// that the owner loads a complete step, never a torn one, never an older
// one than before, and sealed with every CRC valid once loaded.
func TestSaveSIGKILL(t *testing.T) {
	n := trials(20)
	ctx := context.Background()
	o, err := NewOwner(OwnerConfig{ShmDir: shmDir(t), Shards: []int{0}, Capacity: 2 << 20, PollInterval: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Remove()
	running(t, o)
	tb := newTestBlobs(64 << 10)
	r := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 1))
	last := int64(-1)
	torn, sealedOnLoad := 0, 0
	for trial := range n {
		c, _ := startChild(t, "saver", "FAULTLINE_CKPT_SEGMENT="+o.SegmentPath(0), fmt.Sprint("FAULTLINE_CKPT_START=", last+1))
		// Let it complete a random number of saves, then kill it at a
		// random point: on a loaded machine, a wall-clock delay alone
		// would mostly kill a trainer that has not been scheduled.
		seg := o.segs[0]
		want := max(seg.seq(0), seg.seq(1)) + 1 + uint64(r.IntN(20))
		for deadline := time.Now().Add(30 * time.Second); max(seg.seq(0), seg.seq(1)) < want; {
			if time.Now().After(deadline) {
				t.Fatalf("trial %d: the trainer made no progress in 30s", trial)
			}
			time.Sleep(50 * time.Microsecond)
		}
		c.killAfter(r, time.Millisecond)

		rep, err := InspectSegment(o.SegmentPath(0))
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range rep.Halves {
			if h.State == layout.StateWriting {
				torn++
			}
			if h.Corrupt {
				t.Fatalf("trial %d: a complete half fails its checks: %v", trial, h.Err)
			}
		}
		ck, lr, err := o.Load(ctx, 0)
		if err != nil {
			t.Fatalf("trial %d: %v", trial, err)
		}
		if lr.Tier != TierMemory {
			t.Fatalf("trial %d: served by %s, want memory: %s", trial, lr.Tier, lr)
		}
		if err := tb.check(ck); err != nil {
			t.Fatalf("trial %d: torn step loaded: %v", trial, err)
		}
		if ck.Step <= last {
			t.Fatalf("trial %d: loaded step %d, but this trainer saved from step %d on: a saved step was lost", trial, ck.Step, last+1)
		}
		if lr.SealedOnLoad {
			sealedOnLoad++
		}
		checkSealed(t, trial, o.SegmentPath(0), ck.Step)
		last = ck.Step
	}
	t.Logf("%d kills, %d during a save, %d loads sealed the step; newest step %d", n, torn, sealedOnLoad, last)
	if n >= 100 && torn == 0 {
		t.Errorf("no kill landed during a save in %d trials", n)
	}
}

// checkSealed fails the test unless the segment at path holds step sealed,
// with every CRC valid, and no half that fails a check.
func checkSealed(t *testing.T, trial int, path string, step int64) {
	t.Helper()
	rep, err := InspectSegment(path)
	if err != nil {
		t.Fatal(err)
	}
	for i, h := range rep.Halves {
		if h.Corrupt {
			t.Fatalf("trial %d: half %d fails its checks: %v", trial, i, h.Err)
		}
		if h.Err == nil && h.Meta.Step == step {
			if !h.Meta.Sealed {
				t.Fatalf("trial %d: step %d loaded but not sealed", trial, step)
			}
			return
		}
	}
	t.Fatalf("trial %d: no half holds step %d intact after it was loaded: %+v", trial, step, rep.Halves)
}

// TestSealSIGKILL kills an owner at random points while it seals the steps
// its trainer saves (a node agent and its trainer in one process, pausing
// between the stores of each seal so that most kills land inside one),
// max(FAULTLINE_CKPT_TRIALS/4, 5) times. After each kill no half fails a
// check (an interrupted seal leaves the step unsealed, never with a
// half-written seal), and a new owner loads a complete step, seals it if
// it must, and every CRC of it is then valid.
func TestSealSIGKILL(t *testing.T) {
	n := max(trials(20)/4, 5)
	ctx := context.Background()
	shm := shmDir(t)
	cfg := OwnerConfig{ShmDir: shm, Shards: []int{0}, Capacity: 2 << 20}
	o, err := NewOwner(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer o.Remove()
	o.Close() // the children own the segment from here on
	tb := newTestBlobs(64 << 10)
	r := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 3))
	last := int64(-1)
	midSeal, sealedOnLoad := 0, 0
	for trial := range n {
		c, _ := startChild(t, "sealer", "FAULTLINE_CKPT_SHM="+shm, fmt.Sprint("FAULTLINE_CKPT_START=", last+1))
		c.killAfter(r, 30*time.Millisecond)

		rep, err := InspectSegment(SegmentPath(shm, "faultline-ckpt", 0))
		if err != nil {
			t.Fatal(err)
		}
		for i, h := range rep.Halves {
			if h.Corrupt {
				t.Fatalf("trial %d: half %d fails its checks after the owner was killed: %v", trial, i, h.Err)
			}
		}
		o, err := NewOwner(cfg)
		if err != nil {
			t.Fatal(err)
		}
		seg := o.segs[0]
		for i := range 2 {
			if h := seg.half(i); seg.state(i) == layout.StateComplete && seg.sealWord(i) == layout.Unsealed &&
				strings.Trim(string(h[layout.OffSealCRC:layout.OffSealCRC+4])+string(h[layout.StepHeaderSize+rep.Halves[i].Meta.TableSize():rep.Halves[i].Meta.MetaSize()]), "\x00") != "" {
				midSeal++ // some of the seal stored, not its seal word
			}
		}
		ck, lr, err := o.Load(ctx, 0)
		if err != nil {
			t.Fatalf("trial %d: %v", trial, err)
		}
		if err := tb.check(ck); err != nil {
			t.Fatalf("trial %d: torn step loaded: %v", trial, err)
		}
		if ck.Step <= last {
			t.Fatalf("trial %d: loaded step %d, but the agent saved from step %d on", trial, ck.Step, last+1)
		}
		if lr.SealedOnLoad {
			sealedOnLoad++
		}
		o.Close()
		checkSealed(t, trial, SegmentPath(shm, "faultline-ckpt", 0), ck.Step)
		last = ck.Step
	}
	t.Logf("%d owner kills, %d in the middle of writing a seal, %d loads sealed the step; newest step %d", n, midSeal, sealedOnLoad, last)
	if n >= 50 && midSeal == 0 {
		t.Errorf("no kill landed in the middle of a seal in %d trials", n)
	}
}

// TestPersistSIGKILL kills an agent that persists two shards step after
// step at random points, and checks that no tracker then names a step
// that is not complete on disk, and that the committed step loads.
func TestPersistSIGKILL(t *testing.T) {
	n := max(trials(20)/4, 3)
	shm, dir := shmDir(t), t.TempDir()
	tb := newTestBlobs(32 << 10)
	r := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 2))
	last := int64(-1)
	for trial := range n {
		c, _ := startChild(t, "persister", "FAULTLINE_CKPT_SHM="+shm, "FAULTLINE_CKPT_DIR="+dir, fmt.Sprint("FAULTLINE_CKPT_START=", last+1))
		c.killAfter(r, 150*time.Millisecond)

		rep, err := InspectDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		if len(rep.Problems) > 0 {
			t.Fatalf("trial %d: %v", trial, errors.Join(rep.Problems...))
		}
		tracked, err := readTracker(dir)
		if err != nil {
			continue // killed before the first commit
		}
		for shard := range 2 {
			ck, why, err := LoadDisk(dir, shard)
			if err != nil {
				t.Fatalf("trial %d: tracker names step %d but: %v", trial, tracked.Step, err)
			}
			if ck.Step < tracked.Step {
				t.Fatalf("trial %d: loaded step %d, tracker names %d: %v", trial, ck.Step, tracked.Step, why)
			}
			if err := tb.check(ck); err != nil {
				t.Fatalf("trial %d: %v", trial, err)
			}
		}
		last = max(last, tracked.Step)
	}
	// The memory tier outlived the agent: a new one picks its segments up.
	o, err := NewOwner(OwnerConfig{ShmDir: shm, Shards: []int{0, 1}, Capacity: 4 << 20, Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Remove()
	// It swept what the killed agents left half written.
	for _, g := range []string{filepath.Join(dir, "*", ".shard-*.tmp-*"), filepath.Join(shm, ".*.tmp-*")} {
		if left, _ := filepath.Glob(g); len(left) > 0 {
			t.Fatalf("temporary files left after a new owner started: %v", left)
		}
	}
	step, err := o.PersistNewest(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if tr, err := readTracker(dir); err != nil || tr.Step != step {
		t.Fatalf("after save on failure of step %d, tracker = %+v, %v", step, tr, err)
	}
	t.Logf("%d kills; last committed step before the final save %d; saved on failure step %d in %s", n, last, step, filepath.Base(dir))
}
