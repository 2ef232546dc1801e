package trainertest

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
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

	gate    taskd.StepGate // guards the fields below; NotifyLocked on every change
	hung    bool
	step    int64 // last completed step, -1 before the first
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
	t.gate.Lock()
	defer t.gate.Unlock()
	for t.gate.NextStepLocked(ctx) {
		step := t.step + 1
		t.gate.Unlock()
		err := t.runStep(ctx)
		t.gate.Lock()
		if err != nil {
			return nil
		}
		t.step = step
		save := t.cfg.SaveEvery > 0 && t.cfg.Save != nil && step%t.cfg.SaveEvery == 0
		t.gate.NotifyLocked()
		if save {
			t.gate.Unlock()
			if err := t.cfg.Save(ctx, step); err != nil {
				t.emit("save", step, "failed: "+err.Error())
			} else {
				t.emit("save", step, "")
			}
			t.gate.Lock()
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
	t.gate.Lock()
	defer t.gate.Unlock()
	for t.hung {
		if err := t.gate.WaitLocked(ctx); err != nil {
			return err
		}
	}
	return nil
}

// Step returns the last completed step, -1 before the first.
func (t *Trainer) Step() int64 {
	t.gate.Lock()
	defer t.gate.Unlock()
	return t.step
}

// Running reports whether the loop runs steps now.
func (t *Trainer) Running() bool {
	t.gate.Lock()
	defer t.gate.Unlock()
	return t.gate.RunningLocked()
}

// Links returns the links that a switch moved, by device.
func (t *Trainer) Links() map[int]taskd.LinkTarget {
	t.gate.Lock()
	defer t.gate.Unlock()
	return maps.Clone(t.links)
}

// Retries returns how many times RetryStep ran.
func (t *Trainer) Retries() int {
	t.gate.Lock()
	defer t.gate.Unlock()
	return t.retries
}

// Hang makes the step in progress, or the next, never finish (a stuck
// kernel or collective) until Unhang: a pause then times out.
func (t *Trainer) Hang() {
	t.gate.Lock()
	defer t.gate.Unlock()
	t.hung = true
	t.gate.NotifyLocked()
	t.emit("hang", t.step, "")
}

// Unhang lets a hung step finish.
func (t *Trainer) Unhang() {
	t.gate.Lock()
	defer t.gate.Unlock()
	t.hung = false
	t.gate.NotifyLocked()
}

// FailNext makes the next call of the named taskd.Trainer method
// ("Pause", "Resume", "Strategies", "RetryStep", "SwitchLink",
// "StressTest", "Stop") return err instead of doing its work.
func (t *Trainer) FailNext(method string, err error) {
	t.gate.Lock()
	defer t.gate.Unlock()
	t.fail[method] = err
}

func (t *Trainer) injected(method string) error {
	err := t.fail[method]
	delete(t.fail, method)
	return err
}

// pauseLocked stops the loop at the next step boundary and waits for it.
func (t *Trainer) pauseLocked(ctx context.Context) error {
	if err := t.gate.PauseLocked(ctx); err != nil {
		return fmt.Errorf("trainertest: step %d did not finish: %w", t.step+1, err)
	}
	return nil
}

// Pause stops the loop at the next step boundary and returns the last
// completed step.
func (t *Trainer) Pause(ctx context.Context) (int64, error) {
	t.gate.Lock()
	defer t.gate.Unlock()
	if err := t.injected("Pause"); err != nil {
		return t.step, err
	}
	if err := t.pauseLocked(ctx); err != nil {
		return t.step, err
	}
	t.emit("pause", t.step, "")
	return t.step, nil
}

// Resume loads r.Step, or at the first start the newest checkpoint the
// trainer holds, and runs the loop on from it.
func (t *Trainer) Resume(ctx context.Context, r taskd.ResumeRequest) error {
	t.gate.Lock()
	defer t.gate.Unlock()
	if err := t.injected("Resume"); err != nil {
		return err
	}
	if t.gate.StoppedLocked() {
		return errors.New("trainertest: stopped")
	}
	first := !t.gate.StartedLocked()
	if r.Step >= 0 || (first && t.cfg.Load != nil) {
		if err := t.pauseLocked(ctx); err != nil {
			return err
		}
		if t.cfg.Load == nil {
			return fmt.Errorf("trainertest: cannot load step %d: %w", r.Step, taskd.ErrUnsupported)
		}
		step, err := t.cfg.Load(ctx, r.Step)
		if err != nil {
			return fmt.Errorf("trainertest: load step %d: %w", r.Step, err)
		}
		t.step = step
	}
	t.gate.ResumeLocked()
	if first {
		t.emit("start", t.step, string(r.Strategy))
	} else {
		t.emit("resume", t.step, string(r.Strategy))
	}
	return nil
}

// Strategies returns Config.Strategies.
func (t *Trainer) Strategies(context.Context, taskd.FaultNotice) ([]taskd.Strategy, error) {
	t.gate.Lock()
	defer t.gate.Unlock()
	if err := t.injected("Strategies"); err != nil {
		return nil, err
	}
	return slices.Clone(t.cfg.Strategies), nil
}

// RetryStep takes a step's time, as running the interrupted step again
// would, and leaves the counter: the step was not completed.
func (t *Trainer) RetryStep(ctx context.Context) error {
	t.gate.Lock()
	if err := t.injected("RetryStep"); err != nil {
		t.gate.Unlock()
		return err
	}
	t.retries++
	step := t.step
	t.gate.Unlock()
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
	t.gate.Lock()
	defer t.gate.Unlock()
	if err := t.injected("SwitchLink"); err != nil {
		t.emit("switch-link", t.step, "failed: "+err.Error())
		return err
	}
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
	t.gate.Lock()
	defer t.gate.Unlock()
	if err := t.injected("StressTest"); err != nil {
		t.emit("stress-test", t.step, s.Test+" failed: "+err.Error())
		return err
	}
	t.emit("stress-test", t.step, s.Test+" passed")
	return nil
}

// Stop ends the loop for good: Run returns.
func (t *Trainer) Stop(_ context.Context, reason string) error {
	t.gate.Lock()
	defer t.gate.Unlock()
	if err := t.injected("Stop"); err != nil {
		return err
	}
	t.gate.StopLocked()
	t.emit("stop", t.step, reason)
	return nil
}
