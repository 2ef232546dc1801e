package ckpt

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// newPair returns an owner of shard 0 (or cfg.Shards) in a fresh
// shared-memory directory and a writer on its first shard's segment.
func newPair(t *testing.T, cfg OwnerConfig) (*Owner, *Writer) {
	t.Helper()
	nd := newNode(t, cfg, 1)
	return nd.o, nd.ws[0]
}

func blobs(step int64) []Blob {
	return []Blob{
		{Name: "model", Data: bytes.Repeat([]byte{byte(step)}, 1000+int(step))},
		{Name: "optimizer", Data: bytes.Repeat([]byte{byte(step), 0xAA}, 3000)},
	}
}

func TestSaveLoadDoubleBuffered(t *testing.T) {
	ctx := context.Background()
	_, w := newPair(t, OwnerConfig{})
	if _, err := w.Load(ctx); !errors.Is(err, ErrNoStep) {
		t.Fatalf("Load of an empty segment = %v, want ErrNoStep", err)
	}
	for step := int64(1); step <= 3; step++ {
		if err := w.Save(ctx, step, blobs(step)...); err != nil {
			t.Fatal(err)
		}
	}
	ck, err := w.Load(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if ck.Step != 3 || !bytes.Equal(ck.Blob("model"), blobs(3)[0].Data) || !bytes.Equal(ck.Blob("optimizer"), blobs(3)[1].Data) {
		t.Fatalf("loaded step %d with %d model bytes", ck.Step, len(ck.Blob("model")))
	}
	rep, err := InspectSegment(w.cfg.Path)
	if err != nil {
		t.Fatal(err)
	}
	steps := map[int64]bool{}
	for _, h := range rep.Halves {
		if h.Err != nil {
			t.Fatalf("half: %v", h.Err)
		}
		steps[h.Meta.Step] = true
	}
	if !steps[2] || !steps[3] || rep.Halves[rep.NewestHalf].Meta.Step != 3 || rep.Header.Active != uint32(rep.NewestHalf) {
		t.Fatalf("halves hold %v, newest half %d, active %d; want steps 2 and 3", steps, rep.NewestHalf, rep.Header.Active)
	}
}

func TestSaveFromReaders(t *testing.T) {
	ctx := context.Background()
	_, w := newPair(t, OwnerConfig{})
	data := bytes.Repeat([]byte("weights"), 50000)
	err := w.SaveFrom(ctx, 9, Source{Name: "model", Size: int64(len(data)), R: bytes.NewReader(data)})
	if err != nil {
		t.Fatal(err)
	}
	ck, err := w.Load(ctx)
	if err != nil || ck.Step != 9 || !bytes.Equal(ck.Blob("model"), data) {
		t.Fatalf("Load = step %v, %v", ck, err)
	}
	// A short reader fails the save and leaves step 9.
	err = w.SaveFrom(ctx, 10, Source{Name: "model", Size: 100, R: strings.NewReader("short")})
	if err == nil {
		t.Fatal("SaveFrom with a short reader succeeded")
	}
	if ck, err := w.Load(ctx); err != nil || ck.Step != 9 {
		t.Fatalf("after a failed save, Load = %v, %v; want step 9", ck, err)
	}
}

// TestSaveAroundPinnedHalf: while the owner reads the half of the older
// step (a persist), a save writes over the newest step instead, so that
// saves go on and the step being read is the one a crash leaves; with
// both halves pinned the save is skipped.
func TestSaveAroundPinnedHalf(t *testing.T) {
	ctx := context.Background()
	o, w := newPair(t, OwnerConfig{})
	for step := int64(1); step <= 2; step++ {
		if err := w.Save(ctx, step, blobs(step)...); err != nil {
			t.Fatal(err)
		}
	}
	// The owner pins the half that holds step 1, as a persist does.
	seg := o.segs[0]
	old, newest := seg.newest()[1], seg.newest()[0]
	pin := seg.u32(seg.halfBase(old) + layout.OffPin)
	atomic.AddUint32(pin, 1)
	for step := int64(3); step <= 4; step++ {
		if err := w.Save(ctx, step, blobs(step)...); err != nil {
			t.Fatalf("Save of step %d beside a pinned half = %v", step, err)
		}
	}
	if ck, err := w.Load(ctx); err != nil || ck.Step != 4 {
		t.Fatalf("Load = %v, %v; want step 4", ck, err)
	}
	if m, ok := seg.metaOK(old); !ok || m.Step != 1 {
		t.Fatalf("the pinned half holds %+v, want step 1", m)
	}
	other := seg.u32(seg.halfBase(newest) + layout.OffPin)
	atomic.AddUint32(other, 1)
	if err := w.Save(ctx, 5, blobs(5)...); !errors.Is(err, ErrBusy) {
		t.Fatalf("Save with both halves pinned = %v, want ErrBusy", err)
	}
	atomic.AddUint32(other, ^uint32(0))
	atomic.AddUint32(pin, ^uint32(0))
	if err := w.Save(ctx, 5, blobs(5)...); err != nil {
		t.Fatal(err)
	}
	if ck, err := w.Load(ctx); err != nil || ck.Step != 5 {
		t.Fatalf("Load = %v, %v; want step 5", ck, err)
	}
}

func TestSaveRejectsBadInput(t *testing.T) {
	_, w := newPair(t, OwnerConfig{})
	for _, tc := range []struct {
		step  int64
		blobs []Blob
		want  string
	}{
		{1, []Blob{{Name: ""}}, "blobs[0].name"},
		{1, []Blob{{Name: "a"}, {Name: "a"}}, "duplicate"},
		{-1, nil, "negative"},
	} {
		err := w.Save(context.Background(), tc.step, tc.blobs...)
		if err == nil || errors.Is(err, layout.ErrCorrupt) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Save(%d, %v) = %v, want an input error naming %q", tc.step, tc.blobs, err, tc.want)
		}
	}
}

func TestInterruptedSaveKeepsPrevious(t *testing.T) {
	ctx := context.Background()
	o, w := newPair(t, OwnerConfig{})
	if err := w.Save(ctx, 1, blobs(1)...); err != nil {
		t.Fatal(err)
	}
	// A save that dies after copying half of its data.
	hw, err := o.segs[0].begin(layout.PlaceBlobs(2, []string{"model"}, []int64{5000}))
	if err != nil {
		t.Fatal(err)
	}
	copy(hw.blob(0), bytes.Repeat([]byte{7}, 2500))
	ck, err := w.Load(ctx)
	if err != nil || ck.Step != 1 {
		t.Fatalf("Load = %v, %v; want step 1", ck, err)
	}
	if err := Verify("", w.cfg.Path); err != nil {
		t.Fatalf("an interrupted save is no corruption: %v", err)
	}
}

func TestBitFlipFallsBackToPreviousStep(t *testing.T) {
	ctx := context.Background()
	o, w := newPair(t, OwnerConfig{})
	for step := int64(1); step <= 2; step++ {
		if err := w.Save(ctx, step, blobs(step)...); err != nil {
			t.Fatal(err)
		}
	}
	// Flip one bit of step 2's optimizer blob through the file, as a
	// faulty DIMM or a stray writer would, once the owner sealed it.
	if err := o.Seal(ctx, 0); err != nil {
		t.Fatal(err)
	}
	seg := o.segs[0]
	i := seg.newest()[0]
	m, _ := seg.metaOK(i)
	e, _ := m.Blob("optimizer")
	flipBit(t, w.cfg.Path, seg.halfBase(i)+e.Offset+100)

	ck, rep, err := o.Load(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	if ck.Step != 1 || rep.Tier != TierMemory || len(rep.Notes) != 1 || !errors.Is(rep.Notes[0], layout.ErrCorrupt) {
		t.Fatalf("Load = step %d: %s; want step 1 from memory, step 2 passed over as corrupt", ck.Step, rep)
	}
	t.Logf("report: %s", rep)
	wck, err := w.Load(ctx)
	if err != nil || wck.Step != 1 {
		t.Fatalf("writer Load = %v, %v; want step 1", wck, err)
	}
	err = Verify("", w.cfg.Path)
	if !errors.Is(err, layout.ErrCorrupt) || !strings.Contains(err.Error(), `"optimizer"`) {
		t.Fatalf("Verify = %v, want a CRC error naming the blob", err)
	}
}

func flipBit(t *testing.T, path string, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0x10
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

func TestNotEnoughSharedMemory(t *testing.T) {
	dir := shmDir(t)
	_, err := NewOwner(OwnerConfig{ShmDir: dir, Shards: []int{0}, Capacity: 1 << 45})
	if !errors.Is(err, ErrNoSpace) || !strings.Contains(err.Error(), dir) {
		t.Fatalf("err = %v, want ErrNoSpace naming %s", err, dir)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("left %d files behind", len(ents))
	}
}

// TestSmallShmMount is the case DLRover dies of with SIGBUS: a 64 MB
// /dev/shm (a container's default). It mounts one (root only).
func TestSmallShmMount(t *testing.T) {
	dir := t.TempDir()
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", dir).CombinedOutput(); err != nil {
		t.Skipf("cannot mount a tmpfs (not root?): %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("umount", dir).Run() })
	_, err := NewOwner(OwnerConfig{ShmDir: dir, Shards: []int{0}, Capacity: 40 << 20})
	if !errors.Is(err, ErrNoSpace) {
		t.Fatalf("40 MiB halves in 64 MiB: err = %v, want ErrNoSpace", err)
	}
	t.Logf("error as the operator sees it: %v", err)
	// What fits works, with every page reserved up front.
	o, w := newPair(t, OwnerConfig{ShmDir: dir, Capacity: 30 << 20})
	if err := w.Save(context.Background(), 1, Blob{Name: "model", Data: make([]byte, 29<<20)}); err != nil {
		t.Fatal(err)
	}
	// A second owner's segment no longer fits.
	if _, err := NewOwner(OwnerConfig{ShmDir: dir, Shards: []int{1}, Capacity: 4 << 20}); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("second segment: err = %v, want ErrNoSpace", err)
	}
	// Nor does a grown one: the save fails, saying why, and the step
	// saved stays.
	err = w.Save(context.Background(), 2, Blob{Name: "model", Data: make([]byte, 31<<20)})
	if !errors.Is(err, ErrTooLarge) || !errors.Is(err, ErrNoSpace) || !strings.Contains(err.Error(), "remount") {
		t.Fatalf("save that needs a larger segment than fits: err = %v, want ErrTooLarge and ErrNoSpace", err)
	}
	t.Logf("error as the operator sees it: %v", err)
	if ck, err := w.Load(context.Background()); err != nil || ck.Step != 1 {
		t.Fatalf("Load after the failed grow = %v, %v; want step 1", ck, err)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, ".*")); len(left) > 0 {
		t.Fatalf("the failed grow left %v", left)
	}
	o.Remove()
}

func TestTruncatedSegment(t *testing.T) {
	ctx := context.Background()
	o, w := newPair(t, OwnerConfig{})
	if err := w.Save(ctx, 1, blobs(1)...); err != nil {
		t.Fatal(err)
	}
	path := o.SegmentPath(0)
	if err := os.Truncate(path, layout.HeaderSize+8192); err != nil {
		t.Fatal(err)
	}
	// Mapped before the cut: a save faults, and says so instead of dying.
	if err := w.Save(ctx, 2, Blob{Name: "model", Data: make([]byte, 500000)}); err == nil || !strings.Contains(err.Error(), "fault") {
		t.Fatalf("save into a truncated segment = %v, want a memory fault error", err)
	}
	// Opened after the cut: refused before mapping.
	if _, err := NewWriter(WriterConfig{Path: path}); !errors.Is(err, layout.ErrCorrupt) || !strings.Contains(err.Error(), "truncated") {
		t.Fatalf("NewWriter on a truncated segment = %v", err)
	}
	if err := Verify("", path); !errors.Is(err, layout.ErrCorrupt) {
		t.Fatalf("Verify = %v, want ErrCorrupt", err)
	}
}

// TestSegmentTruncatedUnderMappings cuts a segment to nothing while an
// owner and a writer have it mapped, as a trainer that opens it for
// writing with truncation would: every call that touches it fails with an
// error, and neither the owner nor its Run loop dies of SIGBUS.
func TestSegmentTruncatedUnderMappings(t *testing.T) {
	// In a bubble, Run's polls follow a fake clock: the test sees exactly
	// how many polls met the fault.
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		logs := &syncBuffer{}
		const poll = time.Millisecond
		o, w := newPair(t, OwnerConfig{Dir: t.TempDir(), PollInterval: poll,
			Logger: slog.New(slog.NewTextHandler(logs, nil))})
		if err := w.Save(ctx, 1, blobs(1)...); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(o.SegmentPath(0), 0); err != nil {
			t.Fatal(err)
		}
		fault := func(what string, err error) {
			t.Helper()
			if err == nil || !strings.Contains(err.Error(), "fault") {
				t.Errorf("%s = %v, want a memory fault error", what, err)
			}
		}
		_, _, err := o.Load(ctx, 0)
		fault("Owner.Load", err)
		_, err = o.Persist(ctx, 0)
		fault("Owner.Persist", err)
		_, err = o.PersistNewest(ctx)
		fault("Owner.PersistNewest", err)
		_, err = w.Load(ctx)
		fault("Writer.Load", err)
		fault("Writer.Persist", w.Persist(context.Background(), 1))
		fault("Writer.Save", w.Save(ctx, 2, blobs(2)...))

		ctx, cancel := context.WithCancel(ctx)
		done := make(chan error)
		go func() { done <- o.Run(ctx) }()
		// A hundred polls meet the fault; it is logged once.
		time.Sleep(100 * poll)
		synctest.Wait()
		cancel()
		<-done
		if n := strings.Count(logs.String(), "cannot read a segment"); n != 1 {
			t.Errorf("Run logged the fault %d times in 100 polls, want once:\n%s", n, logs.String())
		}
	})
}

// syncBuffer is a bytes.Buffer safe for a logger and a test to share.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

func TestOwnerRestartKeepsSteps(t *testing.T) {
	ctx := context.Background()
	shm := shmDir(t)
	o, err := NewOwner(OwnerConfig{ShmDir: shm, Shards: []int{0}, Capacity: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	w, err := NewWriter(WriterConfig{Path: o.SegmentPath(0)})
	if err != nil {
		t.Fatal(err)
	}
	for step := int64(4); step <= 5; step++ {
		if err := w.Save(ctx, step, blobs(step)...); err != nil {
			t.Fatal(err)
		}
	}
	w.Close()
	o.Close()
	// A larger capacity grows the segment, and both steps go with it; a
	// smaller one keeps the larger segment.
	for _, capacity := range []int64{2 << 20, 1 << 20} {
		o2, err := NewOwner(OwnerConfig{ShmDir: shm, Shards: []int{0}, Capacity: capacity})
		if err != nil {
			t.Fatal(err)
		}
		ck, rep, err := o2.Load(ctx, 0)
		if err != nil || ck.Step != 5 || rep.Tier != TierMemory {
			t.Fatalf("capacity %d: Load after restart = %v, %v, %v", capacity, ck, rep, err)
		}
		o2.Close()
		r, err := InspectSegment(filepath.Join(shm, "faultline-ckpt-0"))
		if err != nil {
			t.Fatal(err)
		}
		if r.Header.HalfSize != 2<<20 || r.Halves[0].Meta.Step != 5 || r.Halves[1].Meta.Step != 4 || r.Halves[0].Err != nil || r.Halves[1].Err != nil {
			t.Fatalf("capacity %d: segment %+v, want halves of 2 MiB holding steps 5 and 4", capacity, r)
		}
	}
	if left, _ := filepath.Glob(filepath.Join(shm, ".*")); len(left) > 0 {
		t.Fatalf("growing left %v", left)
	}
}

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		cfg   OwnerConfig
		field string
	}{
		{OwnerConfig{Capacity: 1}, "Shards"},
		{OwnerConfig{Shards: []int{0}}, "Capacity"},
		{OwnerConfig{Shards: []int{0, 0}, Capacity: 1}, "Shards[1]"},
		{OwnerConfig{Shards: []int{4}, NumShards: 2, Capacity: 1}, "Shards[0]"},
		{OwnerConfig{Shards: []int{0}, Capacity: 1, Name: "a/b"}, "Name"},
		{OwnerConfig{Shards: []int{0}, Capacity: 1, Peers: map[string]string{"a": "x"}}, "Node"},
		{OwnerConfig{Shards: []int{0}, Capacity: 1, PollInterval: -1}, "PollInterval"},
	} {
		if err := tc.cfg.Validate(); err == nil || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("Validate(%+v) = %v, want an error naming %s", tc.cfg, err, tc.field)
		}
	}
	if err := (WriterConfig{}).Validate(); err == nil || !strings.Contains(err.Error(), "Path") {
		t.Errorf("WriterConfig{}.Validate() = %v", err)
	}
}

// TestVersion1Segment reads a segment of the earlier layout, in which the
// writer computed every CRC: its steps count as sealed and load, but no
// owner or writer of this release writes into it.
func TestVersion1Segment(t *testing.T) {
	dir := shmDir(t)
	path := SegmentPath(dir, "faultline-ckpt", 0)
	const halfSize = 8192
	h, err := layout.SegmentHeader{Version: 1, HalfSize: halfSize}.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	file := make([]byte, layout.HeaderSize+2*halfSize)
	copy(file, h)
	data := []byte("weights of an earlier release")
	// The meta of step 3 (seq 1) with one blob, "model", of data at offset
	// 128, as a writer of layout version 1 wrote it.
	meta, err := os.ReadFile(filepath.Join("testdata", "version1-meta.bin"))
	if err != nil {
		t.Fatal(err)
	}
	half := file[layout.HeaderSize:]
	copy(half, meta)
	copy(half[128:], data)
	binary.LittleEndian.PutUint32(half[layout.OffState:], layout.StateComplete)
	if err := os.WriteFile(path, file, 0o600); err != nil {
		t.Fatal(err)
	}

	ck, err := LoadSegment(path)
	if err != nil || ck.Step != 3 || ck.Unverified || !bytes.Equal(ck.Blob("model"), data) {
		t.Fatalf("LoadSegment = %+v, %v", ck, err)
	}
	rep, err := InspectSegment(path)
	if err != nil || rep.Header.Version != 1 || !rep.Halves[0].Meta.Sealed || rep.Halves[0].Err != nil || rep.NewestHalf != 0 {
		t.Fatalf("InspectSegment = %+v, %v", rep, err)
	}
	if err := Verify("", path); err != nil {
		t.Fatal(err)
	}
	if _, err := NewWriter(WriterConfig{Path: path}); err == nil || !strings.Contains(err.Error(), "layout version 1") {
		t.Fatalf("NewWriter on a version 1 segment = %v", err)
	}
	if _, err := NewOwner(OwnerConfig{ShmDir: dir, Shards: []int{0}, Capacity: halfSize}); err == nil || !strings.Contains(err.Error(), "LoadSegment") {
		t.Fatalf("NewOwner on a version 1 segment = %v", err)
	}
	// The writer's CRC still guards the data.
	flipBit(t, path, layout.HeaderSize+128+4)
	if _, err := LoadSegment(path); !errors.Is(err, ErrNoStep) || !errors.Is(err, layout.ErrCorrupt) {
		t.Fatalf("LoadSegment of a flipped bit = %v", err)
	}
	if err := Verify("", path); !errors.Is(err, layout.ErrCorrupt) {
		t.Fatalf("Verify = %v", err)
	}
}
