package ckpt

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/faultline-ml/faultline/ckpt/layout"
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

// Load returns shard's newest intact step, and never an older one while a
// newer committed step is intact in some tier. The candidates are the
// steps every local shard holds intact in memory (so that the node's
// shards load one step) and the committed steps on disk; newest first,
// each is served from memory, else from this shard's newest copy on a
// peer when that is as new (restored into local memory), else from disk.
// Every CRC is verified; a memory step not yet sealed is sealed as it is
// copied (LoadReport.SealedOnLoad). The report says which tier served,
// why the tiers preferred to it did not, and why each newer step was
// passed over (a flipped bit, a step some local shard lacks). With
// several nodes, let the control plane choose one step for every shard
// and call LoadStep. A replica is restored by writing the shard's
// segment: call Load before the shard's trainer starts saving again.
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
		if errors.Is(err, layout.ErrCorrupt) {
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

	// Candidates: the steps every local shard holds intact in memory, and
	// the committed disk steps.
	var mem, disk tierSteps
	var passed []error
	mem.steps, passed, mem.none = o.intactSteps()
	rep.Notes = append(rep.Notes, passed...)
	mem.load = func(s int64) (*Checkpoint, error) {
		c, err := o.loadStep(seg, s, &rep)
		if err != nil {
			// Damaged since it was verified: the next load verifies afresh.
			o.forget(shard)
		}
		return c, err
	}
	if o.cfg.Dir == "" {
		disk.none = errors.New("no disk tier configured")
	} else {
		disk = diskSteps(o.cfg.Dir, shard)
	}
	fetch := func() (*Checkpoint, error) {
		if len(o.peers.Load().order) == 0 || o.cfg.Replicas < 0 {
			return nil, errors.New("no peers configured")
		}
		return o.fetch(ctx, seg, -1)
	}
	notes := len(rep.Notes)
	c, t := loadNewest(&rep, mem, fetch, disk)
	for _, e := range rep.Notes[notes:] {
		if errors.Is(e, layout.ErrCorrupt) {
			o.m.crcFailures.Inc()
		}
	}
	for _, e := range rep.Refused {
		o.log.Info("ckpt: load tier refused", "shard", shard, "tier", e.Tier, "err", e.Err)
	}
	if c == nil {
		return nil, rep, fmt.Errorf("%w for shard %d: %s", ErrNoStep, shard, rep)
	}
	return served(t, c)
}

// tierSteps is what a load knows of one tier of a shard before it reads
// any data: the steps the tier may serve, newest first (their tables or
// commits say so; load checks every CRC), or why it has none.
type tierSteps struct {
	steps []int64
	none  error
	notes []error // what a load should know, such as a tracker naming a missing step
	load  func(step int64) (*Checkpoint, error)
	// lacks, if set, says why the tier does not hold a step.
	lacks func(step int64) error
}

// loadNewest serves the newest step that a tier holds intact. It tries
// the candidate steps of memory and disk newest first, each in memory,
// then from a replica (fetched once, when memory lacks a candidate), then
// on disk, so that no tier's older step is served while a newer one is
// intact in another. rep gets a note for each candidate passed over, with
// why, and the tiers preferred to the one that served (every tier, when
// none did) are refused with why. It returns the tier that served, or a
// nil Checkpoint. fetch, if not nil, asks peers for the shard's newest
// copy.
func loadNewest(rep *LoadReport, mem tierSteps, fetch func() (*Checkpoint, error), disk tierSteps) (*Checkpoint, Tier) {
	rep.Notes = append(rep.Notes, mem.notes...)
	rep.Notes = append(rep.Notes, disk.notes...)
	cands := slices.Concat(mem.steps, disk.steps)
	slices.Sort(cands)
	slices.Reverse(cands)
	cands = slices.Compact(cands)
	var memWhy, replicaWhy error
	var replica *Checkpoint
	fetched := fetch == nil
	getReplica := func() {
		if !fetched {
			fetched = true
			replica, replicaWhy = fetch()
		}
	}
	refuse := func(t Tier, step int64, why error) {
		switch {
		case why != nil:
		case t == TierMemory && len(mem.steps) == 0:
			why = mem.none
		case t == TierMemory:
			why = fmt.Errorf("its newest intact step %d is older than step %d", mem.steps[0], step)
		case replica != nil:
			why = fmt.Errorf("the peer's step %d is older than step %d", replica.Step, step)
		}
		if why != nil {
			rep.Refused = append(rep.Refused, &TierError{t, why})
		}
	}
	serve := func(c *Checkpoint, t Tier) (*Checkpoint, Tier) {
		if t != TierMemory {
			refuse(TierMemory, c.Step, memWhy)
		}
		if t == TierDisk && fetch != nil {
			refuse(TierReplica, c.Step, replicaWhy)
		}
		return c, t
	}
	for _, s := range cands {
		if replica != nil && replica.Step >= s {
			return serve(replica, TierReplica)
		}
		if slices.Contains(mem.steps, s) {
			c, err := mem.load(s)
			if err == nil {
				return c, TierMemory
			}
			rep.Notes = append(rep.Notes, fmt.Errorf("step %d: memory: %w", s, err))
			memWhy = cmp.Or(memWhy, fmt.Errorf("step %d failed its checks", s))
		}
		getReplica()
		if replica != nil && replica.Step >= s {
			return serve(replica, TierReplica)
		}
		if slices.Contains(disk.steps, s) {
			c, err := disk.load(s)
			if err == nil {
				return serve(c, TierDisk)
			}
			rep.Notes = append(rep.Notes, fmt.Errorf("step %d: disk: %w", s, err))
		}
	}
	getReplica()
	if replica != nil {
		return serve(replica, TierReplica)
	}
	refuse(TierMemory, -1, memWhy)
	if fetch != nil {
		refuse(TierReplica, -1, replicaWhy)
	}
	diskWhy := disk.none
	if diskWhy == nil {
		diskWhy = errors.New("no committed step is intact")
	}
	rep.Refused = append(rep.Refused, &TierError{TierDisk, diskWhy})
	return nil, ""
}

// diskSteps lists the committed steps of dir for a load of shard, and
// notes a tracker that names a step that is not committed. A missing dir
// is a disk tier with nothing on it yet.
func diskSteps(dir string, shard int) tierSteps {
	t := tierSteps{load: func(s int64) (*Checkpoint, error) { return LoadDiskStep(dir, s, shard) }}
	steps, committed, err := stepDirs(dir)
	if errors.Is(err, fs.ErrNotExist) {
		t.none = fmt.Errorf("nothing on disk yet (%s does not exist)", dir)
		return t
	}
	if err != nil {
		t.none = err
		return t
	}
	for _, s := range steps {
		if committed[s] {
			t.steps = append(t.steps, s)
		}
	}
	if m, err := readTracker(dir); err == nil && !committed[m.Step] {
		t.notes = append(t.notes, fmt.Errorf("%s names step %d, which is not committed in %s", layout.TrackerFile, m.Step, dir))
	} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.notes = append(t.notes, fmt.Errorf("tracker: %w", err))
	}
	if len(t.steps) == 0 {
		t.none = fmt.Errorf("no committed step in %s", dir)
	}
	t.lacks = func(step int64) error { return uncommitted(dir, step, t.steps) }
	return t
}

// uncommitted says why the disk tier at dir, which holds the committed
// steps held, does not hold step: never persisted there, or persisted by
// some of its shards and not by the others.
func uncommitted(dir string, step int64, held []int64) error {
	stepDir := layout.StepDir(dir, step)
	if _, err := os.Stat(stepDir); err != nil {
		return fmt.Errorf("step %d was never persisted in %s (it holds committed steps %v)", step, dir, held)
	}
	var done, missing []int
	numShards := 0
	for s := range max(shardsIn(stepDir), 1) {
		b, err := os.ReadFile(filepath.Join(stepDir, layout.ShardManifestFile(s)))
		if err != nil {
			continue
		}
		if m, err := layout.ParseShardManifest(b); err == nil {
			numShards = max(numShards, m.NumShards)
		}
	}
	for s := range max(numShards, shardsIn(stepDir)) {
		if _, err := os.Stat(filepath.Join(stepDir, layout.ShardManifestFile(s))); err == nil {
			done = append(done, s)
		} else {
			missing = append(missing, s)
		}
	}
	return fmt.Errorf("step %d is not committed in %s: shards %v of %d persisted it and shards %v did not (a save or a persist cut short, or still under way); it holds committed steps %v",
		step, dir, done, max(numShards, len(done)), missing, held)
}

// loadGiven loads a given step: from memory, a replica or disk.
func (o *Owner) loadGiven(ctx context.Context, seg *segment, step int64, rep *LoadReport,
	refuse func(Tier, error), served func(Tier, *Checkpoint) (*Checkpoint, LoadReport, error)) (*Checkpoint, LoadReport, error) {
	c, err := o.loadStep(seg, step, rep)
	if err == nil {
		return served(TierMemory, c)
	}
	refuse(TierMemory, err)
	if len(o.peers.Load().order) == 0 || o.cfg.Replicas < 0 {
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

// fetch asks peers for their copy of seg's shard at step (-1: newest),
// in PickPeers's order (so those that received this node's saves first),
// restores it into seg (grown if the copy does not fit) and copies it out.
func (o *Owner) fetch(ctx context.Context, seg *segment, step int64) (*Checkpoint, error) {
	shard := seg.hdr.Shard
	ctx, span := o.tracer.Start(ctx, "ckpt.FetchReplica", trace.WithAttributes(attribute.Int("ckpt.shard", shard)))
	defer span.End()
	ps := o.peers.Load()
	var errs []error
	for _, p := range ps.order {
		addr := ps.addrs[p]
		c, err := func() (*Checkpoint, error) {
			t := restoreTarget{o: o, seg: seg}
			defer t.release()
			m, err := o.getReplica(ctx, addr, shard, step, t.open)
			if err != nil {
				return nil, err
			}
			o.m.replicaBytes.WithLabelValues("received").Add(float64(m.DataSize()))
			c, err := o.loadStep(t.to, m.Step, nil)
			if err != nil {
				return nil, fmt.Errorf("restored step %d: %w", m.Step, err)
			}
			return c, nil
		}()
		if err != nil {
			errs = append(errs, fmt.Errorf("peer %s (%s): %w", p, addr, err))
			continue
		}
		return c, nil
	}
	if len(errs) == 0 {
		return nil, errors.New("no peers")
	}
	return nil, errors.Join(errs...)
}
