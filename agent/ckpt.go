package agent

import (
	"context"

	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/ckpt/layout"
)

// Message kinds between the agents and node 0's manager.
const (
	kindHeld    = "faultline-run/held"    // up: the steps a node holds in memory
	kindPersist = "faultline-run/persist" // down: persist the newest step every shard holds
	kindStop    = "faultline-run/stop"    // down: recovery gave up; stop every rank
)

// checkpoints is the memory tier of the node's ranks: one ckpt.Owner per
// local rank (its shard), made when the rank first asks for its segment,
// and the job's choice of the step to resume from.
type checkpoints struct {
	a *Agent

	mu     sync.Mutex
	ctx    context.Context // the owners run on it
	dir    string          // the job's checkpoint folder; "" until a rank names one
	shards map[int]*shard  // by rank
	starts map[int]int64   // the step of each start with none agreed, by start count
	wg     sync.WaitGroup
}

// shard is the segment of one rank and its owner.
type shard struct {
	owner  *ckpt.Owner
	half   int64
	cancel context.CancelFunc
}

func newCheckpoints(a *Agent) *checkpoints {
	return &checkpoints{a: a, ctx: context.Background(), shards: map[int]*shard{}, starts: map[int]int64{}}
}

// run sets the context the owners run on.
func (c *checkpoints) run(ctx context.Context) {
	c.mu.Lock()
	c.ctx = ctx
	c.mu.Unlock()
}

// setDir fixes the job's checkpoint folder: the first rank to name one
// names it for all.
func (c *checkpoints) setDirLocked(dir string) error {
	if dir == "" {
		return nil
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return fmt.Errorf("checkpoint dir %q: %w", dir, err)
	}
	switch c.dir {
	case "":
		c.dir = abs
	case abs:
	default:
		return fmt.Errorf("checkpoint dir %q: the job's ranks already save to %q: one checkpoint folder per job", dir, c.dir)
	}
	return nil
}

// segment returns rank's segment for dir, with halves of at least bytes
// bytes, making its owner on first use.
func (c *checkpoints) segment(rank int, dir string, bytes int64) (string, int64, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.setDirLocked(dir); err != nil {
		return "", 0, err
	}
	if sh := c.shards[rank]; sh != nil {
		if sh.half < bytes {
			half, err := sh.owner.Grow(rank, roundPage(bytes))
			if err != nil {
				return "", 0, fmt.Errorf("rank %d's segment cannot grow to halves of %d bytes: %w", rank, roundPage(bytes), err)
			}
			c.a.log.Info("agent: checkpoint segment grown", "rank", rank, "half_size", half)
			sh.half = half
		}
		return sh.owner.SegmentPath(rank), sh.half, nil
	}
	sh, err := c.openLocked(rank, bytes)
	if err != nil {
		return "", 0, err
	}
	return sh.owner.SegmentPath(rank), sh.half, nil
}

// openLocked makes rank's owner with halves of at least bytes, keeping an
// existing segment (an earlier agent's) and what it holds.
func (c *checkpoints) openLocked(rank int, bytes int64) (*shard, error) {
	a := c.a
	name := "faultline-" + a.cfg.Job
	path := ckpt.SegmentPath(a.cfg.ShmDir, name, rank)
	half := roundPage(max(bytes, 1))
	if h, err := readSegmentHeader(path); err == nil {
		half = max(half, h.HalfSize)
	}
	o, err := ckpt.NewOwner(ckpt.OwnerConfig{ShmDir: a.cfg.ShmDir, Name: name, Shards: []int{rank}, NumShards: a.world,
		Capacity: half, Dir: c.dir, PollInterval: 20 * time.Millisecond, Workers: 1,
		Registerer: wrapRank(a.cfg.Registerer, rank), Logger: a.log.With("rank", rank)})
	if err != nil {
		return nil, fmt.Errorf("rank %d's checkpoint segment: %w", rank, err)
	}
	ctx, cancel := context.WithCancel(c.ctx)
	sh := &shard{owner: o, half: half, cancel: cancel}
	c.shards[rank] = sh
	c.wg.Go(func() {
		if err := o.Run(ctx); err != nil && ctx.Err() == nil {
			a.log.Error("agent: checkpoint owner stopped", "rank", rank, "err", err)
		}
	})
	return sh, nil
}

// roundPage rounds n up to ckpt's page size.
func roundPage(n int64) int64 { return (n + 4095) &^ 4095 }

// readSegmentHeader reads the header of the segment at path.
func readSegmentHeader(path string) (layout.SegmentHeader, error) {
	f, err := os.Open(path)
	if err != nil {
		return layout.SegmentHeader{}, err
	}
	defer f.Close()
	b := make([]byte, 64)
	if _, err := io.ReadFull(f, b); err != nil {
		return layout.SegmentHeader{}, err
	}
	return layout.ParseSegmentHeader(b)
}

// localSteps returns the steps every local rank holds intact in memory
// (every CRC of a sealed step checked), newest first; nil when some rank
// holds none.
func (c *checkpoints) localSteps() []int64 {
	var common []int64
	for i, s := range c.a.slots {
		rep, err := ckpt.InspectSegment(ckpt.SegmentPath(c.a.cfg.ShmDir, "faultline-"+c.a.cfg.Job, s.rank))
		if err != nil {
			c.a.log.Info("agent: no checkpoint in memory", "rank", s.rank, "err", err)
			return nil
		}
		var steps []int64
		for i, h := range rep.Halves {
			if h.Err == nil && h.State == layout.StateComplete {
				steps = append(steps, h.Meta.Step)
			} else if h.Err != nil {
				c.a.log.Info("agent: a half holds no intact step", "rank", s.rank, "half", i, "err", h.Err)
			}
		}
		if i == 0 {
			common = steps
			continue
		}
		common = slices.DeleteFunc(common, func(st int64) bool { return !slices.Contains(steps, st) })
	}
	slices.Sort(common)
	slices.Reverse(common)
	return slices.Compact(common)
}

// diskStep returns the newest step committed on disk, -1 when none.
func (c *checkpoints) diskStep() int64 {
	c.mu.Lock()
	dir := c.dir
	c.mu.Unlock()
	if dir == "" {
		return -1
	}
	b, err := os.ReadFile(filepath.Join(dir, layout.DLRoverTrackerFile))
	if err != nil {
		return -1
	}
	step, err := layout.ParseStepText(b)
	if err != nil {
		return -1
	}
	return step
}

// persistLocal persists the newest step of each local shard and waits
// for it to be committed.
func (c *checkpoints) persistLocal(ctx context.Context) error {
	c.mu.Lock()
	var owners []*ckpt.Owner
	for _, sh := range c.shards {
		owners = append(owners, sh.owner)
	}
	c.mu.Unlock()
	var errs []error
	for _, o := range owners {
		if _, err := o.PersistNewest(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// release gives the node's shared memory back as the job ends: always
// when it finished, and when it was stopped once the newest step in
// memory is on disk too. Otherwise the segments stay for an agent started
// again with the same job id, which resumes from them.
func (c *checkpoints) release(finished bool) {
	if !finished {
		steps := c.localSteps()
		if len(steps) > 0 && c.diskStep() < steps[0] {
			c.a.log.Info("agent: checkpoint segments kept: their newest step is not on disk", "step", steps[0])
			return
		}
	}
	c.mu.Lock()
	for _, sh := range c.shards {
		sh.cancel()
	}
	c.mu.Unlock()
	c.wg.Wait()
	c.mu.Lock()
	defer c.mu.Unlock()
	for r, sh := range c.shards {
		if err := sh.owner.Remove(); err != nil {
			c.a.log.Warn("agent: checkpoint segment not removed", "rank", r, "err", err)
		}
		delete(c.shards, r)
	}
}

// close stops the owners; the segments stay for the next agent.
func (c *checkpoints) close() {
	c.mu.Lock()
	for _, sh := range c.shards {
		sh.cancel()
	}
	c.mu.Unlock()
	c.wg.Wait()
	c.mu.Lock()
	for r, sh := range c.shards {
		sh.owner.Close()
		delete(c.shards, r)
	}
	c.mu.Unlock()
}

// loadAnswer tells a rank which step to load and where it lies.
type loadAnswer struct {
	Step    int64    `json:"step"`
	Tier    string   `json:"tier"` // memory, disk (copied into the segment first) or none
	Path    string   `json:"path,omitempty"`
	Half    int      `json:"half"`
	Reasons []string `json:"reasons,omitempty"`
}

// load finds the step rank s is to load: the step the job agreed on when
// it was started, or, at a start with none agreed, the newest step every
// rank holds (on one node, in memory; else on disk). Memory serves it when
// a half holds it intact (every CRC verified); else disk, copied into the
// segment first, so that the rank always reads its segment.
func (c *checkpoints) load(ctx context.Context, s *slot, dir string) (loadAnswer, error) {
	c.mu.Lock()
	err := c.setDirLocked(dir)
	c.mu.Unlock()
	if err != nil {
		return loadAnswer{}, err
	}
	s.mu.Lock()
	want, gen := s.resume, s.starts
	s.mu.Unlock()
	ans := loadAnswer{Step: -1, Tier: "none", Half: -1}
	if want < 0 {
		want = c.startStep(gen)
	}
	if want < 0 {
		ans.Reasons = append(ans.Reasons, "no step in memory that every rank holds, and none committed on disk")
		return ans, nil
	}
	path := ckpt.SegmentPath(c.a.cfg.ShmDir, "faultline-"+c.a.cfg.Job, s.rank)
	if h, why := findHalf(path, want); h >= 0 {
		return loadAnswer{Step: want, Tier: string(ckpt.TierMemory), Path: path, Half: h}, nil
	} else {
		ans.Reasons = append(ans.Reasons, "memory: "+why)
	}
	c.mu.Lock()
	dir = c.dir
	c.mu.Unlock()
	if dir == "" {
		ans.Reasons = append(ans.Reasons, "disk: no checkpoint folder named")
		return ans, nil
	}
	ck, err := ckpt.LoadDiskStep(dir, want, s.rank)
	if err != nil {
		ans.Reasons = append(ans.Reasons, fmt.Sprintf("disk: step %d: %v", want, err))
		return ans, nil
	}
	names, sizes := make([]string, len(ck.Blobs)), make([]int64, len(ck.Blobs))
	for i, b := range ck.Blobs {
		names[i], sizes[i] = b.Name, int64(len(b.Data))
	}
	if _, _, err := c.segment(s.rank, dir, layout.StepSize(names, sizes)); err != nil {
		return ans, err
	}
	w, err := ckpt.NewWriter(ckpt.WriterConfig{Path: path})
	if err != nil {
		return ans, err
	}
	err = w.Save(ctx, want, ck.Blobs...)
	w.Close()
	if err != nil {
		return ans, fmt.Errorf("copy disk step %d into %s: %w", want, path, err)
	}
	h, why := findHalf(path, want)
	if h < 0 {
		return ans, fmt.Errorf("disk step %d copied into %s, then not found there: %s", want, path, why)
	}
	return loadAnswer{Step: want, Tier: string(ckpt.TierDisk), Path: path, Half: h, Reasons: ans.Reasons}, nil
}

// findHalf returns the half of the segment at path that holds step intact
// (every CRC checked), or -1 and why none does.
func findHalf(path string, step int64) (int, string) {
	rep, err := ckpt.InspectSegment(path)
	if err != nil {
		return -1, err.Error()
	}
	var why []string
	for h, hr := range rep.Halves {
		switch {
		case hr.Err == nil && hr.State == layout.StateComplete && hr.Meta.Step == step:
			return h, ""
		case hr.Err != nil && hr.Meta.Step == step:
			why = append(why, fmt.Sprintf("half %d holds step %d damaged: %v", h, step, hr.Err))
		case hr.Err != nil:
			why = append(why, fmt.Sprintf("half %d: %v", h, hr.Err))
		default:
			why = append(why, fmt.Sprintf("half %d holds step %d", h, hr.Meta.Step))
		}
	}
	if len(why) == 0 {
		return -1, fmt.Sprintf("step %d is in neither half", step)
	}
	return -1, fmt.Sprintf("step %d is not held intact (%s)", step, strings.Join(why, "; "))
}

// startStep is the step every rank loads at a start with none agreed,
// the same for every rank of that start (gen counts the starts).
func (c *checkpoints) startStep(gen int) int64 {
	c.mu.Lock()
	if st, ok := c.starts[gen]; ok {
		c.mu.Unlock()
		return st
	}
	c.mu.Unlock()
	st := c.diskStep()
	if c.a.cfg.Nodes == 1 {
		if steps := c.localSteps(); len(steps) > 0 {
			st = max(st, steps[0])
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if prev, ok := c.starts[gen]; ok {
		return prev
	}
	c.starts[gen] = st
	return st
}

// wait waits until step (or a newer one) is committed on disk.
func (c *checkpoints) wait(ctx context.Context, step int64, timeout time.Duration) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		if got := c.diskStep(); got >= step {
			return got, nil
		}
		select {
		case <-ctx.Done():
			return c.diskStep(), fmt.Errorf("step %d not committed on disk within %v (newest committed: %d)", step, timeout, c.diskStep())
		case <-t.C:
		}
	}
}
