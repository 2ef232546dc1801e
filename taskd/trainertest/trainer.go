package trainertest

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/faultline-ml/faultline/taskd"
)

// Event is something the trainer did.
type Event struct {
	// Kind is one of: "start" (the loop started, Step the step it
	// continues after), "pause", "resume", "save", "retry", "switch-link",
	// "stress-test", "stop" and "hang". Step is the last completed step.
	Kind string
	Step int64
	// Detail says more: the strategy of a resume, the target of a link
	// switch, an error.
	Detail string
}

func (e Event) String() string {
	s := fmt.Sprintf("%s %d", e.Kind, e.Step)
	if e.Detail != "" {
		s += " " + e.Detail
	}
	return s
}

// Config configures a Trainer. The zero value of each field is its
// documented default.
type Config struct {
	// StepTime is how long a step takes (default 10 ms).
	StepTime time.Duration
	// SwitchTime is how long a link switch takes (default 0).
	SwitchTime time.Duration
	// Strategies are the recovery strategies the trainer reports (default
	// taskd.AllStrategies).
	Strategies []taskd.Strategy
	// SaveEvery saves a checkpoint after every step whose number is a
	// multiple of it, through Save; 0 never saves.
	SaveEvery int64
	// Save saves a checkpoint of step; an error is reported as an event
	// and training goes on.
	Save func(ctx context.Context, step int64) error
	// Load loads a checkpoint and returns its step: step itself, or, when
	// step is -1, the newest the trainer holds (-1 when none). Nil: the
	// trainer holds none and cannot load a given step.
	Load func(ctx context.Context, step int64) (int64, error)
	// OnEvent, when set, sees every event, in order, from the loop's
	// goroutine or a taskd.Trainer call's. It must not call the Trainer.
	OnEvent func(Event)
}

// Trainer is a fake training loop. It implements taskd.Trainer and every
// optional interface of it.
type Trainer struct {
	cfg Config

	gate taskd.StepGate

	mu      sync.Mutex    // guards the fields below
	hung    chan struct{} // closed by Unhang; nil unless hung
	step    int64         // last completed step, -1 before the first
	links   map[int]taskd.LinkTarget
	fail    map[string]error
	retries int
}

// New returns a paused trainer; Run runs its loop.
func New(cfg Config) *Trainer {
	if cfg.StepTime <= 0 {
		cfg.StepTime = 10 * time.Millisecond
	}
	if cfg.Strategies == nil {
		cfg.Strategies = taskd.AllStrategies()
	}
	return &Trainer{cfg: cfg, step: -1, links: make(map[int]taskd.LinkTarget), fail: make(map[string]error)}
}

var (
	_ taskd.Trainer        = (*Trainer)(nil)
	_ taskd.StrategyLister = (*Trainer)(nil)
	_ taskd.StepRetrier    = (*Trainer)(nil)
	_ taskd.LinkSwitcher   = (*Trainer)(nil)
	_ taskd.StressTester   = (*Trainer)(nil)
)

func (t *Trainer) emit(kind string, step int64, detail string) {
	if t.cfg.OnEvent != nil {
		t.cfg.OnEvent(Event{Kind: kind, Step: step, Detail: detail})
	}
}

// Run runs the step loop until ctx ends or Stop is called; it returns nil
// then.
func (t *Trainer) Run(ctx context.Context) error {
	for t.gate.Next(ctx) {
		step := t.Step() + 1
		if err := t.runStep(ctx); err != nil {
			return nil
		}
		t.mu.Lock()
		t.step = step
		t.mu.Unlock()
		if t.cfg.SaveEvery > 0 && t.cfg.Save != nil && step%t.cfg.SaveEvery == 0 {
			if err := t.cfg.Save(ctx, step); err != nil {
				t.emit("save", step, "failed: "+err.Error())
			} else {
				t.emit("save", step, "")
			}
		}
	}
	return nil
}

// runStep sleeps for a step, or, while hung, until ctx ends.
func (t *Trainer) runStep(ctx context.Context) error {
	timer := time.NewTimer(t.cfg.StepTime)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-timer.C:
	}
	t.mu.Lock()
	hung := t.hung
	t.mu.Unlock()
	if hung == nil {
		return nil
	}
	select {
	case <-hung:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Step returns the last completed step, -1 before the first.
func (t *Trainer) Step() int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.step
}

// Running reports whether the loop runs steps now.
func (t *Trainer) Running() bool { return t.gate.Running() }

// Links returns the links that a switch moved, by device.
func (t *Trainer) Links() map[int]taskd.LinkTarget {
	t.mu.Lock()
	defer t.mu.Unlock()
	return maps.Clone(t.links)
}

// Retries returns how many times RetryStep ran.
func (t *Trainer) Retries() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.retries
}

// Hang makes the step in progress, or the next, never finish (a stuck
// kernel or collective) until Unhang: a pause then times out.
func (t *Trainer) Hang() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.hung == nil {
		t.hung = make(chan struct{})
	}
	t.emit("hang", t.step, "")
}

// Unhang lets a hung step finish.
func (t *Trainer) Unhang() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.hung != nil {
		close(t.hung)
		t.hung = nil
	}
}

// FailNext makes the next call of the named taskd.Trainer method
// ("Pause", "Resume", "Strategies", "RetryStep", "SwitchLink",
// "StressTest", "Stop") return err instead of doing its work.
func (t *Trainer) FailNext(method string, err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.fail[method] = err
}

func (t *Trainer) injected(method string) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	err := t.fail[method]
	delete(t.fail, method)
	return err
}

// pause stops the loop at the next step boundary and waits for it.
func (t *Trainer) pause(ctx context.Context) error {
	if err := t.gate.Pause(ctx); err != nil {
		return fmt.Errorf("trainertest: step %d did not finish: %w", t.Step()+1, err)
	}
	return nil
}

// Pause stops the loop at the next step boundary and returns the last
// completed step.
func (t *Trainer) Pause(ctx context.Context) (int64, error) {
	if err := t.injected("Pause"); err != nil {
		return t.Step(), err
	}
	if err := t.pause(ctx); err != nil {
		return t.Step(), err
	}
	step := t.Step()
	t.emit("pause", step, "")
	return step, nil
}

// Resume loads r.Step, or at the first start the newest checkpoint the
// trainer holds, and runs the loop on from it.
func (t *Trainer) Resume(ctx context.Context, r taskd.ResumeRequest) error {
	if err := t.injected("Resume"); err != nil {
		return err
	}
	if t.gate.Stopped() {
		return errors.New("trainertest: stopped")
	}
	first := !t.gate.Started()
	if r.Step >= 0 || (first && t.cfg.Load != nil) {
		if err := t.pause(ctx); err != nil {
			return err
		}
		if t.cfg.Load == nil {
			return fmt.Errorf("trainertest: cannot load step %d: %w", r.Step, taskd.ErrUnsupported)
		}
		step, err := t.cfg.Load(ctx, r.Step)
		if err != nil {
			return fmt.Errorf("trainertest: load step %d: %w", r.Step, err)
		}
		t.mu.Lock()
		t.step = step
		t.mu.Unlock()
	}
	t.gate.Resume()
	if first {
		t.emit("start", t.Step(), string(r.Strategy))
	} else {
		t.emit("resume", t.Step(), string(r.Strategy))
	}
	return nil
}

// Strategies returns Config.Strategies.
func (t *Trainer) Strategies(context.Context, taskd.FaultNotice) ([]taskd.Strategy, error) {
	if err := t.injected("Strategies"); err != nil {
		return nil, err
	}
	return slices.Clone(t.cfg.Strategies), nil
}

// RetryStep takes a step's time, as running the interrupted step again
// would, and leaves the counter: the step was not completed.
func (t *Trainer) RetryStep(ctx context.Context) error {
	if err := t.injected("RetryStep"); err != nil {
		return err
	}
	t.mu.Lock()
	t.retries++
	step := t.step
	t.mu.Unlock()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(t.cfg.StepTime):
	}
	t.emit("retry", step, "")
	return nil
}

// SwitchLink takes SwitchTime and records l.Target for each of
// l.Devices.
func (t *Trainer) SwitchLink(ctx context.Context, l taskd.LinkRequest) error {
	if t.cfg.SwitchTime > 0 {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(t.cfg.SwitchTime):
		}
	}
	if err := t.injected("SwitchLink"); err != nil {
		t.emit("switch-link", t.Step(), "failed: "+err.Error())
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, d := range l.Devices {
		if l.Target == taskd.LinkPrimary {
			delete(t.links, d)
		} else {
			t.links[d] = l.Target
		}
	}
	t.emit("switch-link", t.step, string(l.Target))
	return nil
}

// StressTest takes a step's time and passes, unless FailNext says.
func (t *Trainer) StressTest(ctx context.Context, s taskd.StressRequest) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(t.cfg.StepTime):
	}
	step := t.Step()
	if err := t.injected("StressTest"); err != nil {
		t.emit("stress-test", step, s.Test+" failed: "+err.Error())
		return err
	}
	t.emit("stress-test", step, s.Test+" passed")
	return nil
}

// Stop ends the loop for good: Run returns.
func (t *Trainer) Stop(_ context.Context, reason string) error {
	if err := t.injected("Stop"); err != nil {
		return err
	}
	t.gate.Stop()
	t.emit("stop", t.Step(), reason)
	return nil
}
