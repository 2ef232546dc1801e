package main

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/hang"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/trace"
)

// modelBytes is the size of each rank's synthetic model state.
const modelBytes = 256 << 10

// groups are a rank's communicators: tensor parallelism over the pairs
// of ranks on a node, data parallelism across the pairs.
type groups struct {
	TP, DP           string
	TPRanks, DPRanks []int
}

func groupsOf(rank, world, ppn int) groups {
	tp := 1
	if ppn%2 == 0 {
		tp = 2
	}
	base := rank / tp * tp
	g := groups{TP: fmt.Sprintf("tp-%d", base/tp), DP: fmt.Sprintf("dp-%d", rank%tp)}
	for r := base; r < base+tp; r++ {
		g.TPRanks = append(g.TPRanks, r)
	}
	for r := rank % tp; r < world; r += tp {
		g.DPRanks = append(g.DPRanks, r)
	}
	return g
}

func (g groups) parallelGroups(rank int) trace.ParallelGroups {
	return trace.ParallelGroups{
		g.TP: {GroupName: "tp", GroupRank: slices.Index(g.TPRanks, rank), GlobalRanks: g.TPRanks},
		g.DP: {GroupName: "dp", GroupRank: slices.Index(g.DPRanks, rank), GlobalRanks: g.DPRanks},
	}
}

// trainerConfig is what a trainer needs besides its parts.
type trainerConfig struct {
	Rank, Local      int
	Groups           groups
	StepTime         time.Duration // nominal time of a healthy step
	SaveEvery        int64         // flash checkpoint to memory every so many steps
	PersistEvery     int64         // and to disk every so many saves
	SwitchTime       time.Duration // a link switch
	PauseGrace       time.Duration // a pause lets the step in flight finish for this long, then aborts it
	Segment, CkptDir string        // this rank's checkpoint segment and the job's disk tier
}

// trainer is a synthetic training loop that implements taskd.Trainer.
// Each step loads data, runs forward (with a tensor-parallel all-gather
// inside), backward, and a data-parallel all-reduce over the fabric, all
// dotted with trace and the collectives timed by a hang watchdog; every
// SaveEvery steps it saves its state to its flash-checkpoint segment.
// Compute is sleeping: the demo is about what happens around it.
type trainer struct {
	cfg    trainerConfig
	rec    *trace.Recorder
	fab    *fabricClient
	ck     *ckpt.Writer
	say    func(format string, args ...any)
	model  []byte
	gather struct {
		op    trace.CommOp
		timer *hang.Op
	}
	reduce struct {
		op    trace.CommOp
		timer *hang.Op
	}

	gate taskd.StepGate

	// dotting is closed once the job's profiling switch is in force on
	// rec (setSwitch): the first start waits for it.
	dotting     chan struct{}
	dottingOnce sync.Once

	mu    sync.Mutex    // guards the fields below
	step  int64         // last completed step
	abort chan struct{} // the step in flight's; nil between steps
	// Faults injected by the operator.
	slowCompute, slowIO float64
	hangNext            bool
	failSwitch          string
	links               map[int]taskd.LinkTarget
}

func newTrainer(cfg trainerConfig, rec *trace.Recorder, wd *hang.Watchdog, fab *fabricClient, ck *ckpt.Writer, say func(string, ...any)) *trainer {
	t := &trainer{cfg: cfg, rec: rec, fab: fab, ck: ck, say: say, model: make([]byte, modelBytes),
		dotting: make(chan struct{}), slowCompute: 1, slowIO: 1, links: map[int]taskd.LinkTarget{}}
	t.gather.op = trace.CommOp{OpName: "HcclAllGather", GroupName: cfg.Groups.TP, Count: 1 << 20, DataType: "bf16", StreamID: 1}
	t.gather.timer = wd.Op("HcclAllGather", cfg.Groups.TP)
	t.reduce.op = trace.CommOp{OpName: "HcclAllReduce", GroupName: cfg.Groups.DP, Count: 1 << 22, DataType: "bf16", StreamID: 1}
	t.reduce.timer = wd.Op("HcclAllReduce", cfg.Groups.DP)
	return t
}

// The trainer is no taskd.StepRetrier (retry would need the step's state
// kept across an aborted collective), and no StrategyLister: it supports
// every strategy but retry.
var (
	_ taskd.Trainer      = (*trainer)(nil)
	_ taskd.LinkSwitcher = (*trainer)(nil)
	_ taskd.StressTester = (*trainer)(nil)
)

// Run trains until ctx ends or Stop.
func (t *trainer) Run(ctx context.Context) error {
	for t.gate.Next(ctx) {
		t.mu.Lock()
		k := t.step + 1
		abort := make(chan struct{})
		t.abort = abort
		slow, slowIO := t.slowCompute, t.slowIO
		hangNow := t.hangNext
		t.hangNext = false
		t.mu.Unlock()
		// The end of ctx aborts the step in flight, as a pause does.
		stopAbort := context.AfterFunc(ctx, func() { t.abortStep(abort) })
		err := t.trainStep(ctx, k, abort, slow, slowIO, hangNow)
		stopAbort()
		t.mu.Lock()
		t.abort = nil
		done := err == nil && ctx.Err() == nil
		if done {
			t.step = k
		}
		t.mu.Unlock()
		switch {
		case ctx.Err() != nil:
			return nil
		case errors.Is(err, errFabricGone):
			return err
		case done:
			t.say("step %d", k)
		}
	}
	return nil
}

// abortStep aborts the step whose abort channel is abort, if it still
// runs.
func (t *trainer) abortStep(abort chan struct{}) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.abort == abort && abort != nil {
		close(abort)
		t.abort = nil
	}
}

// work stands for compute or I/O that takes about d.
func work(d time.Duration) {
	time.Sleep(time.Duration(float64(d) * (0.95 + 0.1*rand.Float64())))
}

// trainStep runs step k. When a collective is aborted it returns its
// error: the step does not count, and its open ranges stay open in the
// dotting.
func (t *trainer) trainStep(ctx context.Context, k int64, abort chan struct{}, slow, slowIO float64, hangNow bool) error {
	dev := uint32(t.cfg.Local)
	T := float64(t.cfg.StepTime)
	s := t.rec.StartStep(uint64(k), dev, 0)

	d := t.rec.Start(trace.DataLoader, trace.MarkerDataLoader, dev, 0)
	work(time.Duration(0.08 * T * slowIO))
	d.End()

	f := t.rec.Start(trace.FP, trace.MarkerForward, dev, 0)
	work(time.Duration(0.15 * T * slow))
	if len(t.cfg.Groups.TPRanks) > 1 {
		if err := t.allGather(k, abort); err != nil {
			return err
		}
	}
	work(time.Duration(0.15 * T * slow))
	f.End()

	work(time.Duration(0.4 * T * slow)) // backward: no marker, as in most trainers
	if err := t.allReduce(k, abort, hangNow); err != nil {
		return err
	}
	s.End()

	if k%t.cfg.SaveEvery == 0 {
		t.save(ctx, k)
	}
	return nil
}

func (t *trainer) allGather(k int64, abort chan struct{}) error {
	c := t.rec.StartComm(&t.gather.op, uint32(t.cfg.Local), 1)
	tm := t.gather.timer.Start(1)
	err := t.fab.collective(fmt.Sprintf("%s/%s/%d", t.gather.op.GroupName, t.gather.op.OpName, k), len(t.cfg.Groups.TPRanks), abort)
	tm.End()
	if err == nil {
		c.End()
	}
	return err
}

func (t *trainer) allReduce(k int64, abort chan struct{}, hangNow bool) error {
	c := t.rec.StartComm(&t.reduce.op, uint32(t.cfg.Local), 1)
	tm := t.reduce.timer.Start(1)
	var via collectives = t.fab
	if hangNow {
		via = deadLink{}
		t.say("event hang %d HcclAllReduce %s", k-1, t.reduce.op.GroupName)
	}
	err := via.collective(fmt.Sprintf("%s/%s/%d", t.reduce.op.GroupName, t.reduce.op.OpName, k), len(t.cfg.Groups.DPRanks), abort)
	tm.End()
	if err == nil {
		c.End()
	}
	return err
}

// collectives runs a rank's part of a collective until every member has
// arrived or abort is closed.
type collectives interface {
	collective(key string, size int, abort <-chan struct{}) error
}

// deadLink is a rank's link once the injected hang broke it: the chunk it
// sends is never acknowledged, so its collective never completes, and
// only an abort (a recovery's stop-and-clean) ends it.
type deadLink struct{}

func (deadLink) collective(_ string, _ int, abort <-chan struct{}) error {
	<-abort
	return errAborted
}

// model fills the synthetic model state of step k: its first 8 bytes are
// the step, so that a load can check which step it holds.
func (t *trainer) fillModel(k int64) {
	binary.LittleEndian.PutUint64(t.model, uint64(k))
	for i := 8; i+8 <= len(t.model); i += 4096 {
		binary.LittleEndian.PutUint64(t.model[i:], uint64(k)*0x9e3779b97f4a7c15^uint64(i))
	}
}

func modelStep(ck *ckpt.Checkpoint) (int64, error) {
	b := ck.Blob("model")
	if len(b) != modelBytes {
		return -1, fmt.Errorf("step %d: model blob of %d bytes, want %d", ck.Step, len(b), modelBytes)
	}
	if s := int64(binary.LittleEndian.Uint64(b)); s != ck.Step {
		return -1, fmt.Errorf("step %d holds the model of step %d", ck.Step, s)
	}
	return ck.Step, nil
}

// save flashes step k into memory, and asks the node agent to persist it
// every PersistEvery saves.
func (t *trainer) save(ctx context.Context, k int64) {
	sp := t.rec.Start(trace.SaveCheckpoint, trace.MarkerSaveCheckpoint, uint32(t.cfg.Local), 0)
	defer sp.End()
	t.fillModel(k)
	if err := t.ck.Save(ctx, k, ckpt.Blob{Name: "model", Data: t.model}); err != nil {
		t.say("event save %d failed: %v", k, err)
		return
	}
	if k%(t.cfg.SaveEvery*t.cfg.PersistEvery) == 0 {
		if err := t.ck.Persist(ctx, k); err != nil {
			t.say("event save %d memory; persist failed: %v", k, err)
			return
		}
		t.say("event save %d memory+disk", k)
		return
	}
	t.say("event save %d memory", k)
}

// load loads step (the newest the rank holds when -1) and says from where.
func (t *trainer) load(ctx context.Context, step int64) (int64, string, error) {
	ck, err := t.ck.Load(ctx)
	switch {
	case err == nil && (step < 0 || ck.Step == step):
		s, err := modelStep(ck)
		return s, "memory", err
	case err != nil && step < 0 && errors.Is(err, ckpt.ErrNoStep):
		return 0, "none", nil // a fresh job
	case err != nil && step < 0:
		return -1, "", err
	}
	// The step asked for is not the newest in memory: the other half of
	// the segment may hold it (InspectSegment checks its every CRC), else
	// the disk tier.
	if rep, err := ckpt.InspectSegment(t.cfg.Segment); err == nil {
		for _, h := range rep.Halves {
			if h.Err == nil && h.Meta.Step == step {
				return step, "memory", nil
			}
		}
	}
	ck, err = ckpt.LoadDiskStep(t.cfg.CkptDir, step, t.cfg.Rank)
	if err != nil {
		return -1, "", fmt.Errorf("step %d is neither in %s nor on disk: %w", step, t.cfg.Segment, err)
	}
	s, err := modelStep(ck)
	return s, "disk", err
}

// pause stops the loop at the next step boundary. A collective still
// waiting after PauseGrace is aborted: its peer is dead or stuck, and
// waiting longer would hold the whole job. (No step starts once the pause
// has begun: the one in flight then is the one the pause waits for.)
func (t *trainer) pause(ctx context.Context) error {
	grace := time.AfterFunc(t.cfg.PauseGrace, func() {
		t.mu.Lock()
		abort := t.abort
		t.mu.Unlock()
		t.abortStep(abort)
	})
	defer grace.Stop()
	if err := t.gate.Pause(ctx); err != nil {
		return fmt.Errorf("step %d did not stop: %w", t.Step()+1, err)
	}
	return nil
}

// Pause implements taskd.Trainer.
func (t *trainer) Pause(ctx context.Context) (int64, error) {
	if err := t.pause(ctx); err != nil {
		return t.Step(), err
	}
	step := t.Step()
	t.say("event pause %d", step)
	return step, nil
}

// setSwitch puts the job's profiling switch in force on the recorder; the
// first lets the trainer start.
func (t *trainer) setSwitch(sw trace.Switch) {
	t.rec.SetSwitch(sw)
	t.dottingOnce.Do(func() { close(t.dotting) })
}

// Resume implements taskd.Trainer. The first waits for the job's profiling
// switch: the taskd worker starts its trainer as soon as it registers,
// and the manager sends the switch down the stream that opens after, so
// that a step begun before would go undotted, or its start would.
func (t *trainer) Resume(ctx context.Context, r taskd.ResumeRequest) error {
	if t.gate.Stopped() {
		return errors.New("stopped")
	}
	first := !t.gate.Started()
	if first {
		select {
		case <-t.dotting:
		case <-ctx.Done():
			return fmt.Errorf("no profiling switch from the manager yet: %w", ctx.Err())
		}
	}
	from := "where it paused"
	if r.Step >= 0 || first {
		if err := t.pause(ctx); err != nil {
			return err
		}
		step, tier, err := t.load(ctx, r.Step)
		if err != nil {
			return err
		}
		t.mu.Lock()
		t.step, from = step, tier
		t.mu.Unlock()
	}
	kind := "resume"
	if first {
		kind = "start"
	}
	// Said before the loop runs on, so that the event precedes its steps.
	t.say("event %s %d %s %s", kind, t.Step(), from, orDash(string(r.Strategy)))
	t.gate.Resume()
	return nil
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// SwitchLink implements taskd.LinkSwitcher: it takes SwitchTime, and fails
// when a failure was injected.
func (t *trainer) SwitchLink(ctx context.Context, l taskd.LinkRequest) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(t.cfg.SwitchTime):
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if why := t.failSwitch; why != "" {
		t.failSwitch = ""
		t.say("event switch-link %d failed: %s", t.step, why)
		return errors.New(why)
	}
	for _, d := range l.Devices {
		if l.Target == taskd.LinkPrimary {
			delete(t.links, d)
		} else {
			t.links[d] = l.Target
		}
	}
	t.say("event switch-link %d %s", t.step, l.Target)
	return nil
}

// StressTest implements taskd.StressTester: the synthetic devices pass.
func (t *trainer) StressTest(ctx context.Context, s taskd.StressRequest) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(t.cfg.StepTime):
	}
	t.say("event stress-test %d %s passed", t.Step(), s.Test)
	return nil
}

// Stop implements taskd.Trainer.
func (t *trainer) Stop(_ context.Context, reason string) error {
	t.gate.Stop()
	t.say("event stop %d %s", t.Step(), reason)
	return nil
}

// Step returns the last completed step.
func (t *trainer) Step() int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.step
}

// injection is what the operator injects into a rank
// (message kind msgInject).
type injection struct {
	Fault  string  `json:"fault"`            // faultSlowCompute, faultSlowIO, faultHang, "fail-switch" or "heal"
	Factor float64 `json:"factor,omitempty"` // how much slower
	Reason string  `json:"reason,omitempty"` // why a link switch fails
}

// inject applies an injection.
func (t *trainer) inject(payload []byte) error {
	var in injection
	if err := json.Unmarshal(payload, &in); err != nil {
		return fmt.Errorf("injection: %w", err)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	switch in.Fault {
	case faultSlowCompute:
		t.slowCompute = in.Factor
	case faultSlowIO:
		t.slowIO = in.Factor
	case faultHang:
		t.hangNext = true
	case "fail-switch":
		t.failSwitch = in.Reason
	case "heal":
		t.slowCompute, t.slowIO, t.hangNext, t.failSwitch = 1, 1, false, ""
	default:
		return fmt.Errorf("injection: unknown fault %q", in.Fault)
	}
	// The first step it slows: the next to start, after the one in flight.
	from := t.step + 1
	if t.abort != nil {
		from++
	}
	t.say("event inject %d %s", from, in.Fault)
	return nil
}
