package ckpt

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/faultline-ml/faultline/ckpt/layout"
	"github.com/faultline-ml/faultline/internal/testkit"
)

// TestSaveGrowsSegment saves a step larger than the segment's halves: the
// save grows it into a new segment that receives the newest step first,
// the owner follows, and nothing the segment held is lost.
func TestSaveGrowsSegment(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	o, w := newPair(t, OwnerConfig{Capacity: 8192, Dir: dir})
	for step := int64(1); step <= 2; step++ {
		if err := w.Save(ctx, step, Blob{Name: "model", Data: []byte{byte(step)}}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := o.Persist(ctx, 0); err != nil { // the owner maps the small segment
		t.Fatal(err)
	}
	w2, err := NewWriter(WriterConfig{Path: o.SegmentPath(0)})
	if err != nil {
		t.Fatal(err)
	}
	defer w2.Close()
	big := Blob{Name: "model", Data: make([]byte, 9000)}
	big.Data[8999] = 3
	if err := w.Save(ctx, 3, big); err != nil {
		t.Fatalf("a save larger than the segment: %v", err)
	}
	if c := w.Capacity(); c < 9000 {
		t.Fatalf("Capacity after the save = %d", c)
	}
	r, err := InspectSegment(o.SegmentPath(0))
	if err != nil {
		t.Fatal(err)
	}
	if r.Header.HalfSize < 9000 || r.Halves[0].Meta.Step != 2 || r.Halves[1].Meta.Step != 3 || r.Halves[0].Err != nil || r.Halves[1].Err != nil {
		t.Fatalf("grown segment: %+v; want step 2, copied, beside step 3", r)
	}
	if !r.Halves[0].Meta.Sealed {
		t.Fatal("the copied step lost its seal")
	}
	// The owner maps the new segment on its next operation.
	ck, rep, err := o.Load(ctx, 0)
	if err != nil || rep.Tier != TierMemory || ck.Step != 3 || len(ck.Blob("model")) != 9000 || ck.Blob("model")[8999] != 3 {
		t.Fatalf("owner Load after the grow = %s, %v", rep, err)
	}
	if man, err := o.Persist(ctx, 0); err != nil || man.Step != 3 {
		t.Fatalf("owner Persist after the grow = %+v, %v", man, err)
	}
	// A writer mapping the old segment follows too, and grows it again.
	if err := w2.Save(ctx, 4, Blob{Name: "model", Data: make([]byte, 20000)}); err != nil {
		t.Fatal(err)
	}
	if ck, err := w.Load(ctx); err != nil || ck.Step != 4 {
		t.Fatalf("Load after a second grow = %+v, %v", ck, err)
	}
	if left, _ := filepath.Glob(filepath.Join(filepath.Dir(o.SegmentPath(0)), ".*")); len(left) > 0 {
		t.Fatalf("growing left %v", left)
	}
}

// TestGrowUnderSavingTrainer grows a segment, by starting an owner with a
// larger capacity, while a trainer process is saving into it, and kills
// the trainer at once: every save the trainer saw succeed is in the grown
// segment (the grow waited for the save under way, which a copy taken
// without the lock would leave behind in the old file).
func TestGrowUnderSavingTrainer(t *testing.T) {
	shm := shmDir(t)
	cfg := OwnerConfig{ShmDir: shm, Shards: []int{0}, Capacity: 2 << 20}
	o, err := NewOwner(cfg)
	if err != nil {
		t.Fatal(err)
	}
	o.Close()
	path := SegmentPath(shm, "faultline-ckpt", 0)
	tb := newTestBlobs(64 << 10)
	last := int64(-1)
	for trial := range 5 {
		cmd := testkit.Command(t, "saver", "FAULTLINE_CKPT_SEGMENT="+path,
			fmt.Sprint("FAULTLINE_CKPT_START=", last+1), "FAULTLINE_CKPT_REPORT=1")
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		lines := bufio.NewScanner(out)
		if !lines.Scan() {
			t.Fatalf("trial %d: the trainer stopped: %v", trial, lines.Err())
		}
		cfg.Capacity += 1 << 20
		o, err := NewOwner(cfg) // grows the segment under the trainer
		if err != nil {
			t.Fatal(err)
		}
		cmd.Process.Signal(syscall.SIGKILL)
		o.Close()
		reported := int64(-1)
		for lines.Scan() {
			if n, err := strconv.ParseInt(strings.TrimPrefix(lines.Text(), "saved "), 10, 64); err == nil {
				reported = n
			}
		}
		cmd.Wait()
		ck, err := LoadSegment(path)
		if err != nil {
			t.Fatal(err)
		}
		if err := tb.check(ck); err != nil {
			t.Fatalf("trial %d: %v", trial, err)
		}
		if ck.Step < reported {
			t.Fatalf("trial %d: the trainer saved step %d, the grown segment holds step %d: a save was lost", trial, reported, ck.Step)
		}
		if r, err := InspectSegment(path); err != nil || r.Header.HalfSize != alignUp(cfg.Capacity, layout.PageSize) {
			t.Fatalf("trial %d: segment %+v, %v", trial, r.Header, err)
		}
		last = ck.Step
	}
}

// TestGrowErrorsSayHowToRecover opens segments that cannot serve: each
// error names the file and what to do.
func TestGrowErrorsSayHowToRecover(t *testing.T) {
	shm := shmDir(t)
	o, err := NewOwner(OwnerConfig{ShmDir: shm, Shards: []int{0}, Capacity: 8192})
	if err != nil {
		t.Fatal(err)
	}
	o.Close()
	// Another shard's segment under this shard's name.
	if err := os.Rename(SegmentPath(shm, "faultline-ckpt", 0), SegmentPath(shm, "faultline-ckpt", 1)); err != nil {
		t.Fatal(err)
	}
	_, err = NewOwner(OwnerConfig{ShmDir: shm, Shards: []int{1}, Capacity: 8192})
	if err == nil || !strings.Contains(err.Error(), "OwnerConfig.Name") || !strings.Contains(err.Error(), "remove it") {
		t.Fatalf("a segment of another shard: %v", err)
	}
	// A file that is no segment.
	bad := SegmentPath(shm, "faultline-ckpt", 2)
	if err := os.WriteFile(bad, []byte("not a segment"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = NewOwner(OwnerConfig{ShmDir: shm, Shards: []int{2}, Capacity: 8192})
	if !errors.Is(err, layout.ErrCorrupt) || !strings.Contains(err.Error(), bad) || !strings.Contains(err.Error(), "remove it") {
		t.Fatalf("a file that is no segment: %v", err)
	}
	// A writer before its owner.
	_, err = NewWriter(WriterConfig{Path: SegmentPath(shm, "faultline-ckpt", 3)})
	if !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), "start the owner") {
		t.Fatalf("a writer with no segment: %v", err)
	}
}

// TestBadSaveGrowsNothing saves a step that is both too large and bad
// input: the error names the input, and the segment keeps its size.
func TestBadSaveGrowsNothing(t *testing.T) {
	_, w := newPair(t, OwnerConfig{Capacity: 8192})
	err := w.Save(context.Background(), 1, Blob{Name: "a", Data: make([]byte, 9000)}, Blob{Name: "a"})
	if err == nil || !strings.Contains(err.Error(), "duplicate") || errors.Is(err, layout.ErrCorrupt) || w.Capacity() != 8192 {
		t.Fatalf("Save of a bad, large step = %v, capacity %d", err, w.Capacity())
	}
}

// TestOwnerGrow grows a segment from the owner, as a node agent does for
// a Python trainer: the steps stay, a writer mapping the old segment
// saves into the new one, and a smaller size changes nothing.
func TestOwnerGrow(t *testing.T) {
	ctx := context.Background()
	o, w := newPair(t, OwnerConfig{Capacity: 8192})
	if err := w.Save(ctx, 1, Blob{Name: "model", Data: []byte{1}}); err != nil {
		t.Fatal(err)
	}
	if got, err := o.Grow(0, 100000); err != nil || got != alignUp(100000, layout.PageSize) {
		t.Fatalf("Grow = %d, %v", got, err)
	}
	if got, err := o.Grow(0, 9000); err != nil || got != alignUp(100000, layout.PageSize) {
		t.Fatalf("Grow to less = %d, %v", got, err)
	}
	if _, err := o.Grow(5, 9000); err == nil {
		t.Fatal("Grow of a shard that is not local succeeded")
	}
	if err := w.Save(ctx, 2, Blob{Name: "model", Data: make([]byte, 90000)}); err != nil || w.Capacity() != alignUp(100000, layout.PageSize) {
		t.Fatalf("Save after the owner grew the segment = %v; writer capacity %d", err, w.Capacity())
	}
	for step := int64(2); step >= 1; step-- {
		if _, rep, err := o.LoadStep(ctx, 0, step); err != nil || rep.Tier != TierMemory {
			t.Fatalf("LoadStep(%d) = %s, %v", step, rep, err)
		}
	}
}
