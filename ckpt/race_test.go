package ckpt

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// TestReadWhileSaving reads a segment while a writer saves into it as
// fast as it can and the owner seals each save. A reader may find no step
// it can use (the writer overwrote it meanwhile), but it must never load a
// torn step, never meet a half-written seal (a step is either unsealed or
// sealed with every CRC right), and never call an interrupted or
// overwritten half corrupt: only a flipped bit is that.
func TestReadWhileSaving(t *testing.T) {
	ctx := context.Background()
	o, w := newPair(t, OwnerConfig{Capacity: 1 << 20})
	tb := newTestBlobs(4 << 10)
	ro, err := openSegment(w.cfg.Path, true)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.close()

	var stop atomic.Bool
	var seals atomic.Int64
	var wg sync.WaitGroup
	wg.Go(func() {
		defer stop.Store(true)
		for step := int64(0); step < 3000 && !stop.Load(); step++ {
			if err := w.Save(ctx, step, tb.step(step)...); err != nil && !errors.Is(err, ErrBusy) {
				t.Errorf("save step %d: %v", step, err)
				return
			}
		}
	})
	wg.Go(func() {
		for !stop.Load() {
			if err := o.Seal(ctx, 0); err != nil {
				stop.Store(true)
				t.Errorf("seal while saving: %v", err)
				return
			}
			seals.Add(1)
		}
	})
	tbr := newTestBlobs(4 << 10) // the readers' own copy: tb belongs to the writer
	loads, misses, sealed := 0, 0, 0
	for !stop.Load() {
		ck, why := ro.load(1, nil)
		for _, err := range why {
			if errors.Is(err, layout.ErrCorrupt) {
				stop.Store(true)
				t.Fatalf("after %d loads, a half read during a save or a seal was called corrupt: %v", loads, err)
			}
		}
		for i := range 2 {
			if err := verifyHalf(ro, i); errors.Is(err, layout.ErrCorrupt) {
				stop.Store(true)
				t.Fatalf("after %d loads, verifying half %d during a save or a seal: %v", loads, i, err)
			}
		}
		if ck == nil {
			misses++
			continue
		}
		if err := tbr.check(ck); err != nil {
			stop.Store(true)
			t.Fatalf("torn step loaded: %v", err)
		}
		loads++
		if !ck.Unverified {
			sealed++
		}
	}
	wg.Wait()
	t.Logf("%d loads (%d of sealed steps), %d found no step; %d seal passes", loads, sealed, misses, seals.Load())
}
