package ckpt

import (
	"context"
	"encoding/binary"
	"errors"
	"runtime"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// newestMeta returns the newest half of seg and its meta, failing the
// test if it has none.
func newestMeta(t *testing.T, seg *segment) (int, layout.StepMeta) {
	t.Helper()
	c := seg.newest()
	if len(c) == 0 {
		t.Fatal("no complete half")
	}
	m, _ := seg.metaOK(c[0])
	return c[0], m
}

func TestSealAfterSave(t *testing.T) {
	ctx := context.Background()
	o, w := newPair(t, OwnerConfig{})
	if err := w.Save(ctx, 1, blobs(1)...); err != nil {
		t.Fatal(err)
	}
	seg := o.segs[0]
	i, m := newestMeta(t, seg)
	if m.Sealed || m.Blobs[0].CRC32C != 0 {
		t.Fatalf("a save left the step sealed: %+v", m)
	}
	// Complete but unsealed: loadable, as the save left it, and no
	// corruption.
	ck, err := w.Load(ctx)
	if err != nil || !ck.Unverified || ck.Step != 1 {
		t.Fatalf("Load = %+v, %v; want step 1, unverified", ck, err)
	}
	if err := Verify("", w.cfg.Path); err != nil {
		t.Fatal(err)
	}

	if err := o.Seal(ctx, 0); err != nil {
		t.Fatal(err)
	}
	m, _ = seg.metaOK(i)
	if !m.Sealed {
		t.Fatal("Seal left the step unsealed")
	}
	for k, b := range blobs(1) {
		if m.Blobs[k].CRC32C != layout.CRC32C(b.Data) {
			t.Fatalf("blob %q sealed with %#08x, its CRC32C is %#08x", b.Name, m.Blobs[k].CRC32C, layout.CRC32C(b.Data))
		}
	}
	if err := o.Seal(ctx, 0); err != nil { // nothing left to seal
		t.Fatal(err)
	}
	if ck, err := w.Load(ctx); err != nil || ck.Unverified {
		t.Fatalf("Load of the sealed step = %+v, %v", ck, err)
	}
	// The next save into the half clears the seal.
	for step := int64(2); step <= 3; step++ {
		if err := w.Save(ctx, step, blobs(step)...); err != nil {
			t.Fatal(err)
		}
	}
	if m, _ := seg.metaOK(i); m.Step != 3 || m.Sealed {
		t.Fatalf("half %d after step 3 was saved into it: %+v", i, m)
	}
}

func TestLoadSealsUnsealedStep(t *testing.T) {
	ctx := context.Background()
	o, w := newPair(t, OwnerConfig{})
	if err := w.Save(ctx, 7, blobs(7)...); err != nil {
		t.Fatal(err)
	}
	ck, rep, err := o.Load(ctx, 0)
	if err != nil || rep.Tier != TierMemory || !rep.SealedOnLoad || !ck.Unverified || ck.Step != 7 {
		t.Fatalf("Load = %+v, %s, %v; want step 7 from memory, sealed on load", ck, rep, err)
	}
	if !strings.Contains(rep.String(), "sealed on load") {
		t.Fatalf("report does not say it sealed: %s", rep)
	}
	r, err := InspectSegment(w.cfg.Path)
	if err != nil {
		t.Fatal(err)
	}
	if h := r.Halves[r.NewestHalf]; !h.Meta.Sealed || h.Err != nil || h.Meta.Blobs[1].CRC32C != layout.CRC32C(blobs(7)[1].Data) {
		t.Fatalf("after the load the half is %+v", h)
	}
	ck, rep, err = o.Load(ctx, 0)
	if err != nil || rep.SealedOnLoad || ck.Unverified {
		t.Fatalf("second Load = %+v, %s, %v; want a verified step", ck, rep, err)
	}
}

// TestSealInterrupted stops a seal at each of its stores, as the death of
// the owner would (the goroutine exits there, its deferred unpin running
// as a new owner's reset of the pins would): readers then find the step
// complete and unsealed, never a half-written seal, and a new seal
// completes it.
func TestSealInterrupted(t *testing.T) {
	ctx := context.Background()
	o, w := newPair(t, OwnerConfig{})
	seg := o.segs[0]
	tb := newTestBlobs(1 << 10)
	stores := len(tb.step(1)) + 1 // the CRC array, then seal_crc; the seal word is last
	for stop := 1; stop <= stores; stop++ {
		step := int64(stop)
		if err := w.Save(ctx, step, tb.step(step)...); err != nil {
			t.Fatal(err)
		}
		i, _ := newestMeta(t, seg)
		var wg sync.WaitGroup
		wg.Go(func() {
			n := 0
			seg.seal(i, 1, func() {
				if n++; n == stop {
					runtime.Goexit()
				}
			}, nil)
		})
		wg.Wait()
		m, err := seg.parse(i)
		if err != nil || m.Sealed {
			t.Fatalf("stopped at store %d: meta %+v, %v; want complete and unsealed", stop, m, err)
		}
		if stop == stores && binary.LittleEndian.Uint32(seg.half(i)[layout.OffSealCRC:]) != layout.SealCRC(seg.half(i)[:m.MetaSize()]) {
			t.Fatalf("stopped at store %d, before the seal word: seal_crc not yet in place", stop)
		}
		if err := Verify("", w.cfg.Path); err != nil {
			t.Fatalf("stopped at store %d: %v", stop, err)
		}
		ck, err := w.Load(ctx)
		if err != nil || !ck.Unverified {
			t.Fatalf("stopped at store %d: Load = %+v, %v", stop, ck, err)
		}
		if err := tb.check(ck); err != nil {
			t.Fatal(err)
		}
		if err := o.Seal(ctx, 0); err != nil {
			t.Fatal(err)
		}
		if ck, err := w.Load(ctx); err != nil || ck.Unverified || ck.Step != step {
			t.Fatalf("after a new seal: Load = %+v, %v", ck, err)
		}
	}
}

// TestBadSealIsCorrupt flips a bit in the CRC array of a sealed step: the
// seal no longer holds, the step is corrupt, and loads fall back to the
// previous one. A flipped seal word is caught the same way.
func TestBadSealIsCorrupt(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		off  func(m layout.StepMeta) int64
	}{
		{"crc array", func(m layout.StepMeta) int64 { return layout.StepHeaderSize + m.TableSize() + 5 }},
		{"seal_crc", func(layout.StepMeta) int64 { return layout.OffSealCRC + 1 }},
		{"seal word", func(layout.StepMeta) int64 { return layout.OffSeal + 1 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o, w := newPair(t, OwnerConfig{})
			for step := int64(1); step <= 2; step++ {
				if err := w.Save(ctx, step, blobs(step)...); err != nil {
					t.Fatal(err)
				}
			}
			if err := o.Seal(ctx, 0); err != nil {
				t.Fatal(err)
			}
			seg := o.segs[0]
			i, m := newestMeta(t, seg)
			flipBit(t, seg.path, seg.halfBase(i)+tc.off(m))
			ck, rep, err := o.Load(ctx, 0)
			if err != nil || ck.Step != 1 || len(rep.Notes) == 0 || !errors.Is(rep.Notes[0], layout.ErrCorrupt) {
				t.Fatalf("Load = step %v, %s, %v; want step 1, step 2 passed over as corrupt", ck, rep, err)
			}
			if err := Verify("", w.cfg.Path); !errors.Is(err, layout.ErrCorrupt) {
				t.Fatalf("Verify = %v, want ErrCorrupt", err)
			}
			t.Logf("%s", rep)
		})
	}
}

// TestSealKeepsSavesOffItsHalf holds a seal halfway: the writer saves into
// the other half, and a save that would need the half being sealed writes
// over the newest step instead, as beside a half being persisted.
func TestSealKeepsSavesOffItsHalf(t *testing.T) {
	ctx := context.Background()
	o, w := newPair(t, OwnerConfig{})
	if err := w.Save(ctx, 1, blobs(1)...); err != nil {
		t.Fatal(err)
	}
	seg := o.segs[0]
	i, _ := newestMeta(t, seg)
	paused, resume := make(chan struct{}), make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		once := sync.Once{}
		if err := o.sealHalf(ctx, seg, i, func() {
			once.Do(func() {
				close(paused)
				<-resume
			})
		}); err != nil {
			t.Error(err)
		}
	})
	<-paused
	if err := w.Save(ctx, 2, blobs(2)...); err != nil {
		t.Fatalf("save into the other half while one is sealed: %v", err)
	}
	if err := w.Save(ctx, 3, blobs(3)...); err != nil {
		t.Fatalf("save beside the half being sealed = %v", err)
	}
	close(resume)
	wg.Wait()
	if m, _ := seg.metaOK(i); !m.Sealed || m.Step != 1 {
		t.Fatalf("half %d: %+v, want step 1 sealed", i, m)
	}
	if err := w.Save(ctx, 3, blobs(3)...); err != nil {
		t.Fatal(err)
	}
}

// TestRunSealsNewSaves shows the owner's Run sealing each save within one
// PollInterval of it, without anyone asking, and not before: in a bubble,
// the poll interval is exact.
func TestRunSealsNewSaves(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		const poll = 50 * time.Millisecond
		o, w := newPair(t, OwnerConfig{PollInterval: poll})
		done := make(chan error)
		go func() { done <- o.Run(ctx) }()
		sealed := func(step int64) bool {
			t.Helper()
			ck, err := w.Load(ctx)
			if err != nil || ck.Step != step {
				t.Fatalf("Load = %+v, %v; want step %d", ck, err, step)
			}
			return !ck.Unverified
		}
		for step := int64(1); step <= 3; step++ {
			if err := w.Save(ctx, step, blobs(step)...); err != nil {
				t.Fatal(err)
			}
			synctest.Wait()
			if sealed(step) {
				t.Fatalf("step %d sealed before a poll", step)
			}
			time.Sleep(poll)
			synctest.Wait()
			if !sealed(step) {
				t.Fatalf("step %d not sealed after one PollInterval", step)
			}
		}
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Fatalf("Run = %v", err)
		}
	})
}

// TestSaveWhileSealingBesidePersist: while the owner computes the CRCs of
// the newest step and the other half holds a step whose persist was
// asked for, a save takes the half being sealed rather than being
// skipped, and the seal gives way to it.
func TestSaveWhileSealingBesidePersist(t *testing.T) {
	ctx := context.Background()
	o, w := newPair(t, OwnerConfig{Dir: t.TempDir()})
	if err := w.Save(ctx, 1, blobs(1)...); err != nil {
		t.Fatal(err)
	}
	if err := w.Persist(ctx, 1); err != nil { // no Run: the request stays
		t.Fatal(err)
	}
	if err := w.Save(ctx, 2, blobs(2)...); err != nil {
		t.Fatal(err)
	}
	seg := o.segs[0]
	i, _ := newestMeta(t, seg)
	var saved error
	sealed, err := seg.seal(i, 1, nil, func() {
		saved = w.Save(ctx, 3, blobs(3)...)
	})
	if saved != nil {
		t.Fatalf("a save while the owner computed the CRCs of step 2 = %v, want it written over step 2", saved)
	}
	if sealed || !errors.Is(err, ErrSuperseded) {
		t.Fatalf("seal of the half a save took = %v, %v; want ErrSuperseded", sealed, err)
	}
	if m, _ := seg.metaOK(i); m.Step != 3 || m.Sealed {
		t.Fatalf("half %d: %+v, want step 3 unsealed", i, m)
	}
	if err := o.Seal(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if ck, err := w.Load(ctx); err != nil || ck.Step != 3 || ck.Unverified {
		t.Fatalf("Load = %+v, %v; want step 3 sealed", ck, err)
	}
}
