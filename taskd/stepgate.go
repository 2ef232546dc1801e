package taskd

import (
	"context"
	"sync"
)

// StepGate is what a Trainer's step loop shares with its Pause, Resume
// and Stop: whether the loop is asked to run, whether a step is in
// flight, whether the trainer ever started or was stopped. Its mutex
// (Lock, Unlock) guards that and may guard the trainer's own state too;
// every method ending in Locked must be called with it held. The zero
// StepGate is paused and ready to use.
//
// The loop calls NextStepLocked before each step and NotifyLocked after
// it; Pause calls PauseLocked, which returns once the step in flight has
// ended, so that the trainer can then load a checkpoint or reconfigure.
type StepGate struct {
	mu      sync.Mutex
	changed chan struct{} // closed and replaced by NotifyLocked
	run     bool          // asked to run
	busy    bool          // the loop is in a step
	started bool          // ResumeLocked was called
	stopped bool
}

// Lock locks the gate's mutex.
func (g *StepGate) Lock() { g.mu.Lock() }

// Unlock unlocks the gate's mutex.
func (g *StepGate) Unlock() { g.mu.Unlock() }

// NotifyLocked wakes every WaitLocked. Call it after changing anything a
// waiter may be waiting for.
func (g *StepGate) NotifyLocked() {
	if g.changed != nil {
		close(g.changed)
	}
	g.changed = make(chan struct{})
}

// WaitLocked releases the mutex until the next NotifyLocked or the end of
// ctx, and takes it again before it returns ctx's error or nil.
func (g *StepGate) WaitLocked(ctx context.Context) error {
	if g.changed == nil {
		g.changed = make(chan struct{})
	}
	ch := g.changed
	g.mu.Unlock()
	defer g.mu.Lock()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// NextStepLocked is called by the loop before each step. It waits, the
// loop counting as paused, while the loop is not asked to run, and
// reports false once the gate is stopped or ctx ends; true means a step
// may start.
func (g *StepGate) NextStepLocked(ctx context.Context) bool {
	for !g.run || g.stopped {
		if g.stopped {
			return false
		}
		if g.busy {
			g.busy = false
			g.NotifyLocked()
		}
		if g.WaitLocked(ctx) != nil {
			return false
		}
	}
	g.busy = true
	return true
}

// PauseLocked asks the loop to stop before its next step and waits until
// it has (or the gate is stopped); it returns ctx's error if ctx ends
// first.
func (g *StepGate) PauseLocked(ctx context.Context) error {
	g.run = false
	g.NotifyLocked()
	for g.busy && !g.stopped {
		if err := g.WaitLocked(ctx); err != nil {
			return err
		}
	}
	return nil
}

// ResumeLocked lets the loop run.
func (g *StepGate) ResumeLocked() {
	g.started, g.run = true, true
	g.NotifyLocked()
}

// StopLocked stops the loop for good: NextStepLocked reports false from
// then on, and PauseLocked returns at once.
func (g *StepGate) StopLocked() {
	g.stopped, g.run = true, false
	g.NotifyLocked()
}

// StartedLocked reports whether ResumeLocked was ever called.
func (g *StepGate) StartedLocked() bool { return g.started }

// StoppedLocked reports whether StopLocked was called.
func (g *StepGate) StoppedLocked() bool { return g.stopped }

// RunningLocked reports whether the loop is asked to run and not stopped.
func (g *StepGate) RunningLocked() bool { return g.run && !g.stopped }
