package ckpt

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// Seal computes the CRCs of the blobs of each complete step of shard that
// is not sealed yet, and writes them into the segment (Sealing in the
// FORMAT section). Run does it for every new save within PollInterval;
// Persist, PersistNewest, Replicate and Load do it first where needed. A
// node agent that does not Run may call it after each save.
func (o *Owner) Seal(ctx context.Context, shard int) (err error) {
	defer recoverFault(&err, debug.SetPanicOnFault(true))
	if err := o.acquire(); err != nil {
		return err
	}
	defer o.ops.RUnlock()
	seg, err := o.seg(shard)
	if err != nil {
		return err
	}
	return errors.Join(o.sealHalf(ctx, seg, 0, nil), o.sealHalf(ctx, seg, 1, nil))
}

// sealMu serialises the sealers of shard: Run's, and the persist, replica
// and load that seal first.
func (o *Owner) sealMu(shard int) *sync.Mutex {
	mu, _ := o.sealing.LoadOrStore(shard, &sync.Mutex{})
	return mu.(*sync.Mutex)
}

// sealHalf seals half i of seg if it holds a complete, unsealed step. A
// writer taking the half over meanwhile is no error: its save is the next
// to seal. pause is segment.seal's.
func (o *Owner) sealHalf(ctx context.Context, seg *segment, i int, pause func()) (err error) {
	if m, ok := seg.metaOK(i); !ok || m.Sealed {
		return nil
	}
	mu := o.sealMu(seg.hdr.Shard)
	mu.Lock()
	defer mu.Unlock()
	start := time.Now()
	_, span := o.tracer.Start(ctx, "ckpt.Seal", trace.WithAttributes(attribute.Int("ckpt.shard", seg.hdr.Shard), attribute.Int("ckpt.half", i)))
	defer span.End()
	sealed, err := seg.seal(i, o.cfg.Workers, pause, nil)
	if errors.Is(err, ErrSuperseded) || errors.Is(err, errNotComplete) {
		return nil
	}
	if err != nil {
		if errors.Is(err, layout.ErrCorrupt) {
			o.m.crcFailures.Inc()
		}
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
		return fmt.Errorf("ckpt: seal shard %d: %w", seg.hdr.Shard, err)
	}
	if sealed {
		o.m.sealSeconds.Observe(time.Since(start).Seconds())
		o.log.Debug("ckpt: step sealed", "shard", seg.hdr.Shard, "half", i, "took", time.Since(start))
	}
	return nil
}

// verifyHalf checks every CRC of half i, if it is sealed, without copying
// it.
func verifyHalf(seg *segment, i int) error {
	return seg.read(i, false, func(m layout.StepMeta, half []byte, _ func() error) error {
		return checkBlobs(m, half)
	})
}

// checkBlobs checks the CRC of every blob of a sealed m in half, in
// parallel, and returns every mismatch, joined. An unsealed m has none to
// check.
func checkBlobs(m layout.StepMeta, half []byte) error {
	if !m.Sealed {
		return nil
	}
	crcs, err := copyBlobs(nil, blobData(m, half), 0, true)
	if err != nil {
		return err
	}
	return checkCRCs(m, crcs)
}
