package ckpt

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// flipStep flips a bit 100 bytes into the first blob of step in seg, once
// the step is sealed.
func flipStep(t *testing.T, seg *segment, step int64) {
	t.Helper()
	for i := range 2 {
		if m, ok := seg.metaOK(i); ok && m.Step == step {
			if !m.Sealed {
				t.Fatalf("step %d is not sealed", step)
			}
			flipBit(t, seg.path, seg.halfBase(i)+m.Blobs[0].Offset+100)
			return
		}
	}
	t.Fatalf("no half holds step %d", step)
}

// flipDisk flips a bit of shard's data file of step.
func flipDisk(t *testing.T, dir string, step int64, shard int) {
	t.Helper()
	flipBit(t, filepath.Join(layout.StepDir(dir, step), layout.ShardFile(shard)), 100)
}

// TestLoadNeverRollsBack damages the newest steps in one tier after
// another: each load serves the newest step still intact in some tier,
// never an older one, and says why it passed each newer one over.
func TestLoadNeverRollsBack(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	nd := newNode(t, OwnerConfig{Dir: dir}, 1)
	seg := nd.o.segs[0]
	nd.persistAll(t, 1)
	nd.persistAll(t, 2)

	// Step 2 damaged in memory, intact on disk: disk serves it.
	flipStep(t, seg, 2)
	ck, rep, err := nd.o.Load(ctx, 0)
	if err != nil || rep.Tier != TierDisk {
		t.Fatalf("Load = %s, %v; want step 2 from disk", rep, err)
	}
	checkShard(t, ck, 0, 2)
	if !strings.Contains(rep.String(), "step 2: memory") || !strings.Contains(rep.String(), "crc32c") {
		t.Fatalf("the report does not say why memory's step 2 was passed over: %s", rep)
	}

	// Step 3 committed (over step 1 in memory), then damaged in memory and
	// on disk: step 2 serves, from disk, as nothing is intact in memory.
	nd.persistAll(t, 3)
	flipStep(t, seg, 3)
	flipDisk(t, dir, 3, 0)
	ck, rep, err = nd.o.Load(ctx, 0)
	if err != nil || rep.Tier != TierDisk {
		t.Fatalf("Load = %s, %v; want step 2 from disk", rep, err)
	}
	checkShard(t, ck, 0, 2)
	for _, want := range []string{"step 3: memory", "step 3: disk:"} {
		if !strings.Contains(rep.String(), want) {
			t.Errorf("the report lacks %q: %s", want, rep)
		}
	}

	// Memory holds step 5 intact, disk committed step 6 (damaged) and
	// step 4: memory's step 5 is newer than every intact disk step.
	nd.persistAll(t, 4)
	nd.saveAll(t, 5)
	if err := nd.o.Seal(ctx, 0); err != nil {
		t.Fatal(err)
	}
	// Step 6 reaches disk from a second owner on another segment, as
	// another node of a shared disk tier would have it.
	other := newNode(t, OwnerConfig{Dir: dir}, 1)
	other.persistAll(t, 6)
	flipDisk(t, dir, 6, 0)
	ck, rep, err = nd.o.Load(ctx, 0)
	if err != nil || rep.Tier != TierMemory {
		t.Fatalf("Load = %s, %v; want step 5 from memory", rep, err)
	}
	checkShard(t, ck, 0, 5)
	if !strings.Contains(rep.String(), "step 6: disk:") {
		t.Errorf("the report does not say why disk's step 6 was passed over: %s", rep)
	}
	t.Logf("%s", rep)
}

// TestLoadShard loads read-only, from a segment and a disk tier, as the
// flashckpt command does: a damaged newest step in memory is served from
// disk, a given step from either half, and a missing disk tier is one
// with nothing on it yet.
func TestLoadShard(t *testing.T) {
	dir := t.TempDir()
	nd := newNode(t, OwnerConfig{Dir: dir}, 1)
	path := nd.o.SegmentPath(0)
	nd.persistAll(t, 1)
	nd.persistAll(t, 2)
	flipStep(t, nd.o.segs[0], 2)

	ck, rep, err := LoadShard(path, dir, 0, -1)
	if err != nil || rep.Tier != TierDisk || len(rep.Notes) == 0 || !errors.Is(rep.Notes[0], layout.ErrCorrupt) {
		t.Fatalf("LoadShard = %s, %v; want step 2 from disk, memory's passed over as corrupt", rep, err)
	}
	checkShard(t, ck, 0, 2)
	t.Logf("%s", rep)

	// Step 1 is in the older half.
	ck, rep, err = LoadShard(path, dir, 0, 1)
	if err != nil || rep.Tier != TierMemory {
		t.Fatalf("LoadShard(step 1) = %s, %v; want memory", rep, err)
	}
	checkShard(t, ck, 0, 1)

	// Memory alone: step 2 fails its checks, so step 1 serves, and the
	// report says why.
	ck, rep, err = LoadShard(path, "", 0, -1)
	if err != nil || rep.Tier != TierMemory || ck.Step != 1 || !strings.Contains(rep.String(), "step 2: memory") {
		t.Fatalf("LoadShard(memory only) = %s, %v", rep, err)
	}

	// A step no tier holds: ErrNoStep, and what each tier holds.
	_, rep, err = LoadShard(path, dir, 0, 7)
	if !errors.Is(err, ErrNoStep) || len(rep.Refused) != 2 || !strings.Contains(err.Error(), "not 7") {
		t.Fatalf("LoadShard(step 7) = %s, %v", rep, err)
	}

	// No disk tier yet, no segment: nothing to load, and that is said.
	_, _, err = LoadShard(filepath.Join(t.TempDir(), "none"), filepath.Join(t.TempDir(), "none"), 0, -1)
	if !errors.Is(err, ErrNoStep) || !strings.Contains(err.Error(), "nothing on disk yet") || !strings.Contains(err.Error(), "no segment") {
		t.Fatalf("LoadShard of nothing = %v", err)
	}
	if _, _, err := LoadDisk(filepath.Join(t.TempDir(), "none"), 0); !errors.Is(err, ErrNoStep) || !strings.Contains(err.Error(), "nothing on disk yet") {
		t.Fatalf("LoadDisk of a missing tier = %v", err)
	}
	if r, err := InspectDir(filepath.Join(t.TempDir(), "none")); err != nil || !r.Absent {
		t.Fatalf("InspectDir of a missing tier = %+v, %v; want Absent", r, err)
	}
	if err := Verify(filepath.Join(t.TempDir(), "none"), path); !errors.Is(err, layout.ErrCorrupt) || strings.Contains(err.Error(), "none") {
		t.Fatalf("Verify = %v; want the damaged step 2 alone, a missing disk tier no problem", err)
	}
}

// TestCommonStep has one shard of two save a step the other never does
// (its save was killed): the shards agree on the step before, which is
// what each loads, and a flipped bit in one shard's copy of a step is
// made up for by its copy in another tier.
func TestCommonStep(t *testing.T) {
	dir := t.TempDir()
	nd := newNode(t, OwnerConfig{Dir: dir}, 2)
	nd.persistAll(t, 1)
	if err := nd.ws[0].Save(context.Background(), 2, shardBlobs(0, 2)...); err != nil {
		t.Fatal(err)
	}
	if _, err := nd.o.Persist(context.Background(), 0); err != nil {
		t.Fatal(err)
	}
	segs := map[int]string{0: nd.o.SegmentPath(0), 1: nd.o.SegmentPath(1)}
	step, why, err := CommonStep(dir, segs)
	if err != nil || step != 1 || len(why) == 0 || !strings.Contains(why[0].Error(), "step 2: shard 1 holds it in no tier") {
		t.Fatalf("CommonStep = %d, %v, %v; want 1, step 2 passed over", step, why, err)
	}
	for s, p := range segs {
		ck, _, err := LoadShard(p, dir, s, step)
		if err != nil {
			t.Fatal(err)
		}
		checkShard(t, ck, s, 1)
	}

	// Shard 1's step 1 damaged on disk is still intact in memory.
	flipDisk(t, dir, 1, 1)
	if step, why, err := CommonStep(dir, segs); err != nil || step != 1 {
		t.Fatalf("CommonStep = %d, %v, %v; want 1", step, why, err)
	}
	// Damaged in memory too, it is lost: no step is common.
	if err := nd.o.Seal(context.Background(), 1); err != nil {
		t.Fatal(err)
	}
	flipStep(t, nd.o.segs[1], 1)
	step, why, err = CommonStep(dir, segs)
	if !errors.Is(err, ErrNoStep) || !strings.Contains(err.Error(), "step 1: shard 1: memory:") {
		t.Fatalf("CommonStep = %d, %v, %v; want ErrNoStep naming shard 1's step 1", step, why, err)
	}
	// A shard with no segment and no disk step holds nothing.
	if _, _, err := CommonStep(filepath.Join(t.TempDir(), "none"), map[int]string{0: filepath.Join(os.TempDir(), "none")}); !errors.Is(err, ErrNoStep) {
		t.Fatalf("CommonStep of nothing = %v", err)
	}
}
