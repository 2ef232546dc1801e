package ckpt

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"runtime/debug"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// Restore makes shard's segment hold step intact, so that its trainer
// reads the step from there (Writer.Load or LoadInto, or a trainer in
// another language from the segment itself), and reports which tier
// served it and why the tiers preferred to it did not. Memory first:
// nothing is done when a half holds the step intact (see Held; a step
// complete but not yet sealed is sealed, LoadReport.SealedOnLoad). Else a
// replica of the shard held here (a node that took a lost node's place
// holds those the lost node sent it), then a peer's, the peers asked in
// PickPeers's order, each in turn; else the disk tier. A step fetched or read is written into the half that does
// not hold the segment's newest step, as a save is, straight from the
// connection or the file: every CRC is checked as the bytes arrive, the
// step counts only once all of them held, and the blobs are never copied
// into the owner's memory. A step larger than the segment's halves grows
// the segment first, keeping its newest step. When no tier holds the step
// intact the error wraps ErrNoStep and the report says why each did not.
// Call it while the shard's trainer does not save.
func (o *Owner) Restore(ctx context.Context, shard int, step int64) (rep LoadReport, err error) {
	rep = LoadReport{Shard: shard, Step: -1}
	if step < 0 {
		return rep, fmt.Errorf("ckpt: restore shard %d: step %d is negative", shard, step)
	}
	ctx, span := o.tracer.Start(ctx, "ckpt.Restore", trace.WithAttributes(attribute.Int("ckpt.shard", shard), attribute.Int64("ckpt.step", step)))
	defer func() {
		tier := string(rep.Tier)
		if tier == "" {
			tier = "none"
		}
		o.m.loads.WithLabelValues(tier).Inc()
		span.SetAttributes(attribute.String("ckpt.tier", tier))
		span.End()
	}()
	refuse := func(t Tier, err error) {
		if errors.Is(err, layout.ErrCorrupt) {
			o.m.crcFailures.Inc()
		}
		rep.Refused = append(rep.Refused, &TierError{t, err})
		o.log.Info("ckpt: restore tier refused", "shard", shard, "step", step, "tier", t, "err", err)
	}
	served := func(t Tier) (LoadReport, error) {
		rep.Tier, rep.Step = t, step
		o.log.Info("ckpt: restored", "shard", shard, "step", step, "tier", t, "sealed_on_load", rep.SealedOnLoad)
		return rep, nil
	}

	sealed, err := o.restoreMemory(ctx, shard, step)
	if errors.Is(err, errClosed) || errors.Is(err, errNotLocal) {
		return rep, err
	}
	if err == nil {
		rep.SealedOnLoad = sealed
		return served(TierMemory)
	}
	refuse(TierMemory, err)

	// A copy held here first: a node that took a lost node's place holds
	// the replicas the lost node sent it.
	switch err := o.restoreLocalReplica(shard, shard, step); {
	case err == nil:
		// The segment holds the shard now: the copy would only take memory,
		// and outlive the steps it was made of.
		o.dropReplica(shard)
		return served(TierReplica)
	case !errors.Is(err, errNoReplica):
		refuse(TierReplica, err)
	}
	if ps := o.peers.Load(); len(ps.order) == 0 || o.cfg.Replicas < 0 {
		refuse(TierReplica, errors.New("no peers configured"))
	} else {
		var errs []error
		for _, p := range ps.order {
			addr := ps.addrs[p]
			err := o.restoreReplica(ctx, addr, shard, shard, step)
			if err == nil {
				return served(TierReplica)
			}
			errs = append(errs, fmt.Errorf("peer %s (%s): %w", p, addr, err))
			if ctx.Err() != nil {
				break
			}
		}
		refuse(TierReplica, errors.Join(errs...))
	}

	if o.cfg.Dir == "" {
		refuse(TierDisk, errors.New("no disk tier configured"))
	} else if err := o.restoreDisk(shard, step); err != nil {
		refuse(TierDisk, err)
	} else {
		return served(TierDisk)
	}
	return rep, fmt.Errorf("%w for shard %d at step %d: %s", ErrNoStep, shard, step, rep)
}

// errNotLocal is the error of an operation on a shard this owner does not
// hold.
var errNotLocal = errors.New("not a local shard")

// restoreMemory says whether shard's segment holds step intact, sealing
// it if it was not, and if not, why.
func (o *Owner) restoreMemory(ctx context.Context, shard int, step int64) (sealed bool, err error) {
	if err := o.acquire(); err != nil {
		return false, err
	}
	defer o.ops.RUnlock()
	defer recoverFault(&err, debug.SetPanicOnFault(true))
	seg, err := o.seg(shard)
	if err != nil {
		return false, err
	}
	held, why := o.intactHalves(shard)
	var steps []int64
	for _, h := range held {
		if h.Step != step {
			steps = append(steps, h.Step)
			continue
		}
		if m, _ := seg.metaOK(h.Half); m.Sealed {
			return false, nil
		}
		if err := o.sealHalf(ctx, seg, h.Half, nil); err != nil {
			return false, err
		}
		if m, ok := seg.metaOK(h.Half); !ok || m.Step != step || !m.Sealed {
			return false, fmt.Errorf("%w: %s half %d, while it was sealed", ErrSuperseded, seg.path, h.Half)
		}
		return true, nil
	}
	return false, errors.Join(append([]error{fmt.Errorf("%s holds no step %d intact (it holds %v)", seg.path, step, steps)}, why...)...)
}

// restoreReplica writes the copy of shard from at step that the server
// at addr holds (a replica, or its own segment) into shard's segment.
func (o *Owner) restoreReplica(ctx context.Context, addr string, shard, from int, step int64) error {
	return o.restoreInto(shard, func(t *restoreTarget) error {
		m, err := o.getReplica(ctx, addr, from, step, t.open)
		if err != nil {
			o.m.replicaFailures.Inc()
			return err
		}
		o.m.replicaBytes.WithLabelValues("received").Add(float64(m.DataSize()))
		return nil
	})
}

// Adopt writes step of shard from into the segment of shard, its own:
// for a job whose shards are alike (data-parallel, every rank's state the
// model's), where a shard goes on from another's state, as the ranks of a
// node that joins a job do. The copy of from held here as a replica comes
// first; else the peers are asked (PickPeers's order), each of which
// serves from's step from its own segment, when from is its shard, or
// from the replica of it it holds. Every CRC is checked as the bytes
// arrive, as in Restore. The error wraps ErrNoStep when no intact copy of
// from at step is held here or by a peer.
func (o *Owner) Adopt(ctx context.Context, shard, from int, step int64) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if step < 0 {
		return fmt.Errorf("ckpt: adopt shard %d's step %d into shard %d: the step is negative", from, step, shard)
	}
	err := o.restoreLocalReplica(shard, from, step)
	if err == nil || !errors.Is(err, errNoReplica) {
		return err
	}
	errs := []error{err}
	ps := o.peers.Load()
	for _, p := range ps.order {
		addr := ps.addrs[p]
		err := o.restoreReplica(ctx, addr, shard, from, step)
		if err == nil {
			o.log.Info("ckpt: adopted a peer's shard", "shard", shard, "from", from, "step", step, "peer", p)
			return nil
		}
		errs = append(errs, fmt.Errorf("peer %s (%s): %w", p, addr, err))
		if ctx.Err() != nil {
			break
		}
	}
	return fmt.Errorf("ckpt: adopt shard %d's step %d into shard %d: %w: %w", from, step, shard, ErrNoStep, errors.Join(errs...))
}

// restoreLocalReplica writes step of the copy of shard from that this
// owner holds as a replica into shard's segment; an error wrapping
// errNoReplica when it holds none intact.
func (o *Owner) restoreLocalReplica(shard, from int, step int64) error {
	if _, err := os.Stat(ReplicaPath(o.cfg.ShmDir, o.cfg.Name, from)); err != nil {
		return fmt.Errorf("%w of shard %d here", errNoReplica, from)
	}
	fill := func(t *restoreTarget) error { return o.copyFromCopy(t, from, step) }
	err := o.restoreInto(shard, fill)
	if errors.Is(err, ErrSuperseded) {
		// A put wrote over the half found: the step may be in the other
		// one now.
		err = o.restoreInto(shard, fill)
	}
	return err
}

// copyFromCopy copies step of the copy of shard from held here into t.
func (o *Owner) copyFromCopy(t *restoreTarget, from int, step int64) error {
	seg, i, err := o.openCopy(from, step)
	if err != nil {
		return err
	}
	defer seg.close()
	return seg.read(i, false, func(m layout.StepMeta, half []byte, valid func() error) error {
		if m.Step != step {
			// A put wrote over the half between openCopy and read.
			return fmt.Errorf("%w: %s half %d holds step %d now, not %d", ErrSuperseded, seg.path, i, m.Step, step)
		}
		return t.copyStep(step, m.Blobs, func(k int) io.Reader {
			e := m.Blobs[k]
			return bytes.NewReader(half[e.Offset : e.Offset+e.Size])
		}, seg.path, valid)
	})
}

// restoreInto runs fill with a target in shard's segment, under the
// owner's lock and with a fault in the mapping an error.
func (o *Owner) restoreInto(shard int, fill func(*restoreTarget) error) (err error) {
	if err := o.acquire(); err != nil {
		return err
	}
	defer o.ops.RUnlock()
	defer recoverFault(&err, debug.SetPanicOnFault(true))
	seg, err := o.seg(shard)
	if err != nil {
		return err
	}
	t := restoreTarget{o: o, seg: seg}
	defer t.release()
	return fill(&t)
}

// restoreDisk writes the committed step of shard on disk into its
// segment, reading the shard file straight into the half.
func (o *Owner) restoreDisk(shard int, step int64) (err error) {
	man, err := checkDiskShard(o.cfg.Dir, step, shard)
	if err != nil {
		return err
	}
	name := filepath.Join(layout.StepDir(o.cfg.Dir, step), layout.ShardFile(shard))
	f, err := os.Open(name)
	if err != nil {
		return err
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil {
		return err
	} else if fi.Size() != man.Size {
		return &layout.ParseError{File: name, Offset: -1, Field: "size", Msg: fmt.Sprintf("file is %d bytes, manifest says %d (truncated?)", fi.Size(), man.Size)}
	}
	return o.restoreInto(shard, func(t *restoreTarget) error {
		return t.copyStep(step, man.Blobs, func(k int) io.Reader { return io.NewSectionReader(f, man.Blobs[k].Offset, man.Blobs[k].Size) }, name, nil)
	})
}

// copyStep writes step, of blobs (their names, sizes and CRC32C), read
// from src (src(k) for blob k), into t's segment, checking each blob's
// CRC as it arrives; file names the source in errors. valid, when not
// nil, is asked last whether the source still held the step.
func (t *restoreTarget) copyStep(step int64, blobs []layout.BlobEntry, src func(k int) io.Reader, file string, valid func() error) error {
	names, sizes := make([]string, len(blobs)), make([]int64, len(blobs))
	for k, e := range blobs {
		names[k], sizes[k] = e.Name, e.Size
	}
	meta := layout.PlaceBlobs(step, names, sizes)
	to, err := t.open(meta.End())
	if err != nil {
		return err
	}
	hw, err := to.begin(meta)
	if err != nil {
		return err
	}
	crcs, err := readBlobs(hw, src)
	if err != nil {
		return fmt.Errorf("ckpt: read %s: %w", file, err)
	}
	for k, e := range blobs {
		if crcs[k] != e.CRC32C {
			return withFile(crcMismatch(k, e, crcs[k]), file)
		}
	}
	if valid != nil {
		if err := valid(); err != nil {
			return err
		}
	}
	return hw.commit(crcs)
}

// readBlobs reads each blob of the save hw from the reader src gives for
// it, into the half, and returns their CRC32C.
func readBlobs(hw *halfWriter, src func(k int) io.Reader) ([]uint32, error) {
	crcs := make([]uint32, len(hw.meta.Blobs))
	for k, e := range hw.meta.Blobs {
		dst, r := hw.blob(k), src(k)
		for o := 0; o < len(dst); o += fuseChunk {
			end := min(o+fuseChunk, len(dst))
			if _, err := io.ReadFull(r, dst[o:end]); err != nil {
				return nil, fmt.Errorf("blob %q of step %d at byte %d of %d: %w", e.Name, hw.meta.Step, o, len(dst), err)
			}
			crcs[k] = crc32.Update(crcs[k], castagnoli, dst[o:end])
		}
	}
	return crcs, nil
}

// restoreTarget is the segment that a step restored into a local shard
// goes to: the owner's, or a larger one that replaces it when the step
// does not fit (which the owner maps at its next operation, and a writer
// at its next save). It is held with the shared lock of a save (growing,
// in the FORMAT section) until release.
type restoreTarget struct {
	o     *Owner
	seg   *segment
	to    *segment
	grown bool
}

// open returns the segment to write a step of need bytes per half into.
func (t *restoreTarget) open(need int64) (*segment, error) {
	to := t.seg
	if need > to.hdr.HalfSize {
		g, err := to.grow(need, 1)
		if errors.Is(err, errReplaced) {
			return nil, fmt.Errorf("ckpt: %s was grown by another process meanwhile: restore again", to.path)
		}
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrTooLarge, err)
		}
		t.o.log.Info("ckpt: segment grown for a restore", "shard", to.hdr.Shard, "half_size", g.hdr.HalfSize, "was", to.hdr.HalfSize)
		to, t.grown = g, true
	}
	if err := to.flock(unix.LOCK_SH); err != nil {
		if t.grown {
			to.close()
		}
		return nil, err
	}
	t.to = to
	if to.replaced() {
		t.release()
		return nil, fmt.Errorf("ckpt: %s was grown by another process meanwhile: restore again", to.path)
	}
	return to, nil
}

func (t *restoreTarget) release() {
	if t.to == nil {
		return
	}
	t.to.flock(unix.LOCK_UN)
	if t.grown {
		t.to.close()
	}
	t.to = nil
}
