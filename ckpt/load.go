package ckpt

import (
	"context"
	"errors"
	"fmt"
	"net"
	"runtime/debug"
	"slices"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// Tier names a place a step is loaded from.
type Tier string

// The tiers, in the order Load prefers them.
const (
	TierMemory  Tier = "memory"
	TierReplica Tier = "replica"
	TierDisk    Tier = "disk"
)

// TierError says why a tier did not serve a load.
type TierError struct {
	Tier Tier
	Err  error
}

// Error is "tier: reason".
func (e *TierError) Error() string { return fmt.Sprintf("%s: %v", e.Tier, e.Err) }

// Unwrap returns the reason.
func (e *TierError) Unwrap() error { return e.Err }

// LoadReport says which tier served a load and why the tiers preferred to
// it did not, or, when none served, why each failed.
type LoadReport struct {
	Shard   int
	Step    int64 // -1 when no tier served
	Tier    Tier  // "" when no tier served
	Refused []*TierError
	// Notes are what the serving tier passed over on its way, such as a
	// newer disk step whose shard file was truncated.
	Notes []error
	// SealedOnLoad is set when memory served a step that was complete but
	// not sealed (its owner died before it computed the CRCs): Load
	// computed them as it copied the step and sealed it, so they guard the
	// step from now on, but nothing checked this copy (the Checkpoint is
	// Unverified).
	SealedOnLoad bool
}

// String says, on one line, which tier served and why the others did not.
func (r LoadReport) String() string {
	var b strings.Builder
	if r.Tier == "" {
		fmt.Fprintf(&b, "shard %d: no tier holds an intact step", r.Shard)
	} else {
		fmt.Fprintf(&b, "shard %d: step %d from %s", r.Shard, r.Step, r.Tier)
	}
	if r.SealedOnLoad {
		b.WriteString(" (unsealed: CRCs computed and sealed on load)")
	}
	for _, e := range r.Refused {
		fmt.Fprintf(&b, "; %s refused: %v", e.Tier, e.Err)
	}
	for _, e := range r.Notes {
		fmt.Fprintf(&b, "; passed over: %v", e)
	}
	return b.String()
}

// Load returns shard's newest intact step by preference: memory, with the
// newest step every local shard holds intact (so the node's shards load
// one step); else this shard's newest copy on a peer, restored into local
// memory; else the newest committed step on disk; a tier is passed over
// when a later one holds a newer step. Every CRC is verified; a memory
// step not yet sealed is sealed as it is copied (LoadReport.SealedOnLoad).
// The report
// says which tier served, why the others did not and what was passed over
// (a step with a flipped bit). With several nodes, let the control plane
// choose one step for every shard and call LoadStep. A replica is restored
// by writing the shard's segment: call Load before the shard's trainer
// starts saving again.
func (o *Owner) Load(ctx context.Context, shard int) (*Checkpoint, LoadReport, error) {
	return o.load(ctx, shard, -1)
}

// LoadStep is Load for a given step, which every tier must hold.
func (o *Owner) LoadStep(ctx context.Context, shard int, step int64) (*Checkpoint, LoadReport, error) {
	if step < 0 {
		return nil, LoadReport{Shard: shard, Step: -1}, fmt.Errorf("ckpt: LoadStep: step %d is negative", step)
	}
	return o.load(ctx, shard, step)
}

func (o *Owner) load(ctx context.Context, shard int, step int64) (ck *Checkpoint, rep LoadReport, err error) {
	defer recoverFault(&err, debug.SetPanicOnFault(true))
	rep = LoadReport{Shard: shard, Step: -1}
	if err := o.acquire(); err != nil {
		return nil, rep, err
	}
	defer o.ops.RUnlock()
	seg, err := o.seg(shard)
	if err != nil {
		return nil, rep, err
	}
	ctx, span := o.tracer.Start(ctx, "ckpt.Load", trace.WithAttributes(attribute.Int("ckpt.shard", shard)))
	defer func() {
		rep.Notes = slices.CompactFunc(rep.Notes, func(a, b error) bool { return a.Error() == b.Error() })
		tier := string(rep.Tier)
		if tier == "" {
			tier = "none"
		}
		o.m.loads.WithLabelValues(tier).Inc()
		span.SetAttributes(attribute.String("ckpt.tier", tier), attribute.Int64("ckpt.step", rep.Step))
		span.End()
	}()
	refuse := func(t Tier, err error) {
		if errors.Is(err, ErrCorrupt) {
			o.m.crcFailures.Inc()
		}
		rep.Refused = append(rep.Refused, &TierError{t, err})
		o.log.Info("ckpt: load tier refused", "shard", shard, "tier", t, "err", err)
	}
	served := func(t Tier, c *Checkpoint) (*Checkpoint, LoadReport, error) {
		rep.Tier, rep.Step = t, c.Step
		o.log.Info("ckpt: loaded", "shard", shard, "step", c.Step, "tier", t, "bytes", c.Size(), "sealed_on_load", rep.SealedOnLoad)
		return c, rep, nil
	}

	if step >= 0 {
		return o.loadGiven(ctx, seg, step, &rep, refuse, served)
	}

	// Memory, if it holds the newest step: the newest every local shard
	// holds intact, unless disk committed a newer one.
	diskStep := int64(-1)
	if o.cfg.Dir != "" {
		diskStep = newestCommitted(o.cfg.Dir)
	}
	var mem []int64
	for attempt := 0; ; attempt++ {
		steps, passed, err := o.intactSteps()
		mem = steps
		rep.Notes = append(rep.Notes, passed...)
		if err != nil {
			refuse(TierMemory, err)
			break
		}
		if mem[0] < diskStep {
			refuse(TierMemory, fmt.Errorf("newest intact step %d is older than committed disk step %d", mem[0], diskStep))
			break
		}
		c, err := o.loadStep(seg, mem[0], &rep)
		if err == nil {
			return served(TierMemory, c)
		}
		if attempt > 0 {
			refuse(TierMemory, err)
			break
		}
		// Damaged since it was verified: verify this shard afresh.
		rep.Notes = append(rep.Notes, fmt.Errorf("memory shard %d: %w", shard, err))
		o.forget(shard)
	}

	// Replica: this shard's newest copy on a peer.
	floor := diskStep
	if len(mem) > 0 {
		floor = max(floor, mem[0])
	}
	if len(o.cfg.Peers) == 0 || o.cfg.Replicas < 0 {
		refuse(TierReplica, errors.New("no peers configured"))
	} else if c, err := o.fetch(ctx, seg, -1); err != nil {
		refuse(TierReplica, err)
	} else if c.Step < floor {
		refuse(TierReplica, fmt.Errorf("peer's step %d is older than step %d held elsewhere", c.Step, floor))
	} else {
		return served(TierReplica, c)
	}

	// Disk: the newest committed step.
	if o.cfg.Dir == "" {
		refuse(TierDisk, errors.New("no disk tier configured"))
	} else {
		c, why, err := LoadDisk(o.cfg.Dir, shard)
		rep.Notes = append(rep.Notes, why...)
		for _, w := range why {
			if errors.Is(w, ErrCorrupt) {
				o.m.crcFailures.Inc()
			}
		}
		if err == nil {
			return served(TierDisk, c)
		}
		refuse(TierDisk, err)
	}

	// Last resort: an intact memory step older than what disk claimed.
	if len(mem) > 0 {
		if c, err := o.loadStep(seg, mem[0], &rep); err == nil {
			return served(TierMemory, c)
		}
	}
	return nil, rep, fmt.Errorf("%w for shard %d: %s", ErrNoStep, shard, rep)
}

// loadGiven loads a given step: from memory, a replica or disk.
func (o *Owner) loadGiven(ctx context.Context, seg *segment, step int64, rep *LoadReport,
	refuse func(Tier, error), served func(Tier, *Checkpoint) (*Checkpoint, LoadReport, error)) (*Checkpoint, LoadReport, error) {
	c, err := o.loadStep(seg, step, rep)
	if err == nil {
		return served(TierMemory, c)
	}
	refuse(TierMemory, err)
	if len(o.cfg.Peers) == 0 || o.cfg.Replicas < 0 {
		refuse(TierReplica, errors.New("no peers configured"))
	} else if c, err := o.fetch(ctx, seg, step); err != nil {
		refuse(TierReplica, err)
	} else {
		return served(TierReplica, c)
	}
	if o.cfg.Dir == "" {
		refuse(TierDisk, errors.New("no disk tier configured"))
	} else if c, err := LoadDiskStep(o.cfg.Dir, step, rep.Shard); err != nil {
		refuse(TierDisk, err)
	} else {
		return served(TierDisk, c)
	}
	return nil, *rep, fmt.Errorf("%w for shard %d at step %d: %s", ErrNoStep, rep.Shard, step, rep)
}

// loadStep copies step out of seg, from the newest half that holds it
// intact, and seals that half as it copies it if it was not, saying so in
// rep.
func (o *Owner) loadStep(seg *segment, step int64, rep *LoadReport) (*Checkpoint, error) {
	mu := o.sealMu(seg.hdr.Shard)
	mu.Lock()
	defer mu.Unlock()
	var why []error
	for _, i := range seg.newest() {
		if m, ok := seg.metaOK(i); !ok || m.Step != step {
			continue
		}
		c, sealed, err := seg.loadHalf(i, o.cfg.Workers, nil, true)
		if err == nil {
			if rep != nil {
				rep.SealedOnLoad = sealed
			}
			return c, nil
		}
		why = append(why, err)
	}
	if len(why) == 0 {
		for i := range 2 {
			if err := seg.whyNot(i); err != nil {
				why = append(why, err)
			}
		}
		return nil, fmt.Errorf("%s holds no step %d (it holds %v): %w", seg.path, step, memorySteps(seg), errors.Join(why...))
	}
	return nil, errors.Join(why...)
}

// newestCommitted is the newest step with a CommitFile in dir, or -1.
func newestCommitted(dir string) int64 {
	steps, committed, err := stepDirs(dir)
	if err != nil {
		return -1
	}
	for _, s := range steps {
		if committed[s] {
			return s
		}
	}
	return -1
}

// fetch asks peers for their copy of seg's shard at step (-1: newest),
// in PickPeers's order (so those that received this node's saves first),
// restores it into seg and copies it out.
func (o *Owner) fetch(ctx context.Context, seg *segment, step int64) (*Checkpoint, error) {
	shard := seg.hdr.Shard
	ctx, span := o.tracer.Start(ctx, "ckpt.FetchReplica", trace.WithAttributes(attribute.Int("ckpt.shard", shard)))
	defer span.End()
	var errs []error
	for _, p := range o.peers {
		m, _, err := o.withConn(ctx, o.cfg.Peers[p], func(conn net.Conn) (StepMeta, int64, error) {
			m, err := getReplica(conn, shard, step, o.cfg.IOTimeout, func(need int64) (*segment, error) {
				if need > seg.hdr.HalfSize {
					return nil, fmt.Errorf("%w: replica needs %d bytes per half, %s has %d", ErrTooLarge, need, seg.path, seg.hdr.HalfSize)
				}
				return seg, nil
			})
			return m, m.DataSize(), err
		})
		if err != nil {
			errs = append(errs, fmt.Errorf("peer %s: %w", p, err))
			continue
		}
		o.m.replicaBytes.WithLabelValues("received").Add(float64(m.DataSize()))
		c, err := o.loadStep(seg, m.Step, nil)
		if err != nil {
			errs = append(errs, fmt.Errorf("peer %s: restored step %d: %w", p, m.Step, err))
			continue
		}
		return c, nil
	}
	if len(errs) == 0 {
		return nil, errors.New("no peers")
	}
	return nil, errors.Join(errs...)
}
