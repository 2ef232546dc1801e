package taskd

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// gatedLoop runs a step loop on g that counts its steps; each step takes
// the step channel's next value. It notifies as a step starts, so that a
// test can wait for that; steps is guarded by g.mu.
func gatedLoop(ctx context.Context, g *StepGate, steps *int, step <-chan struct{}) {
	for g.Next(ctx) {
		g.mu.Lock()
		g.notifyLocked()
		g.mu.Unlock()
		select {
		case <-step:
		case <-ctx.Done():
		}
		g.mu.Lock()
		*steps++
		g.notifyLocked()
		g.mu.Unlock()
	}
}

// waitGate waits until cond, called with g.mu held, holds.
func waitGate(ctx context.Context, g *StepGate, cond func() bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for !cond() && g.waitLocked(ctx) == nil {
	}
}

// TestStepGate: a pause waits for the step in flight and no step starts
// after it; a resume lets the loop on; a stop ends the loop and makes a
// pause return at once. It runs in a synctest bubble, so that "nothing
// happened" is checked once every goroutine is parked.
func TestStepGate(t *testing.T) { synctest.Test(t, testStepGate) }

func testStepGate(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var g StepGate
	steps := 0
	step := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { gatedLoop(ctx, &g, &steps, step) })

	if g.Started() || g.Running() {
		t.Fatal("a new gate is started or running")
	}
	g.Resume()
	step <- struct{}{} // the first step ends; the loop starts a second
	waitGate(ctx, &g, func() bool { return steps == 1 && g.busy })

	paused := make(chan error)
	go func() { paused <- g.Pause(ctx) }()
	synctest.Wait()
	select {
	case err := <-paused:
		t.Fatalf("Pause returned %v while a step was in flight", err)
	default:
	}
	step <- struct{}{} // the second step ends
	if err := <-paused; err != nil {
		t.Fatal(err)
	}
	if g.Running() {
		t.Fatal("running after the pause")
	}
	g.mu.Lock()
	if steps != 2 {
		t.Fatalf("after the pause: %d steps, want 2", steps)
	}
	short, cancelShort := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancelShort()
	if err := g.waitLocked(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a paused loop changed something: waitLocked = %v", err)
	}
	g.mu.Unlock()

	g.Resume()
	waitGate(ctx, &g, func() bool { return g.busy }) // the third step is in flight
	g.Stop()
	if err := g.Pause(ctx); err != nil || !g.Stopped() || !g.Started() {
		t.Fatalf("Pause after Stop = %v, stopped %v", err, g.Stopped())
	}
	step <- struct{}{} // the step in flight at the stop ends, and the loop with it
	wg.Wait()
	if steps != 3 {
		t.Fatalf("%d steps, want 3", steps)
	}
}

// TestStepGateContext: the end of ctx ends a paused loop and a pause that
// waits for a step.
func TestStepGateContext(t *testing.T) { synctest.Test(t, testStepGateContext) }

func testStepGateContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var g StepGate
	steps := 0
	var wg sync.WaitGroup
	wg.Go(func() { gatedLoop(ctx, &g, &steps, make(chan struct{})) })
	g.Resume()
	waitGate(ctx, &g, func() bool { return g.busy })
	pctx, pcancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer pcancel()
	if err := g.Pause(pctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Pause with a step that never ends = %v", err)
	}
	cancel()
	wg.Wait()
}
