package taskd

import (
	"context"
	"sync"
)

// StepGate is what a Trainer's step loop shares with its Pause, Resume
// and Stop: whether the loop is asked to run, whether a step is in
// flight, whether the trainer ever started or was stopped. The zero
// StepGate is paused and ready to use; its methods are safe for
// concurrent use.
//
// The loop calls Next before each step; Pause returns once the step in
// flight has ended (the loop called Next again), so that the trainer can
// then load a checkpoint or reconfigure. A trainer's own state that the
// loop changes during a step is the trainer's to guard.
type StepGate struct {
	mu      sync.Mutex
	changed chan struct{} // closed and replaced by notifyLocked
	run     bool          // asked to run
	busy    bool          // the loop is in a step
	started bool          // Resume was called
	stopped bool
}

// notifyLocked wakes every waitLocked.
func (g *StepGate) notifyLocked() {
	if g.changed != nil {
		close(g.changed)
	}
	g.changed = make(chan struct{})
}

// waitLocked releases the mutex until the next notifyLocked or the end of
// ctx, and takes it again before it returns ctx's error or nil.
func (g *StepGate) waitLocked(ctx context.Context) error {
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

// Next is called by the loop before each step, and ends the step before
// it. It waits, the loop counting as paused, while the loop is not asked
// to run, and reports false once the gate is stopped or ctx ends; true
// means a step may start.
func (g *StepGate) Next(ctx context.Context) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	for !g.run || g.stopped {
		if g.stopped {
			return false
		}
		if g.busy {
			g.busy = false
			g.notifyLocked()
		}
		if g.waitLocked(ctx) != nil {
			return false
		}
	}
	g.busy = true
	return true
}

// Pause asks the loop to stop before its next step and waits until it
// has (or the gate is stopped); it returns ctx's error if ctx ends first.
func (g *StepGate) Pause(ctx context.Context) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.run = false
	g.notifyLocked()
	for g.busy && !g.stopped {
		if err := g.waitLocked(ctx); err != nil {
			return err
		}
	}
	return nil
}

// Resume lets the loop run.
func (g *StepGate) Resume() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.started, g.run = true, true
	g.notifyLocked()
}

// Stop stops the loop for good: Next reports false from then on, and
// Pause returns at once.
func (g *StepGate) Stop() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.stopped, g.run = true, false
	g.notifyLocked()
}

// Started reports whether Resume was ever called.
func (g *StepGate) Started() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.started
}

// Stopped reports whether Stop was called.
func (g *StepGate) Stopped() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.stopped
}

// Running reports whether the loop is asked to run and not stopped.
func (g *StepGate) Running() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.run && !g.stopped
}
