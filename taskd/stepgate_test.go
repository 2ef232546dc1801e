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
// test can wait for that.
func gatedLoop(ctx context.Context, g *StepGate, steps *int, step <-chan struct{}) {
	g.Lock()
	defer g.Unlock()
	for g.NextStepLocked(ctx) {
		g.NotifyLocked()
		g.Unlock()
		select {
		case <-step:
		case <-ctx.Done():
		}
		g.Lock()
		*steps++
		g.NotifyLocked()
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

	g.Lock()
	if g.StartedLocked() || g.RunningLocked() {
		t.Fatal("a new gate is started or running")
	}
	g.ResumeLocked()
	g.Unlock()
	step <- struct{}{} // the first step ends; the loop starts a second
	g.Lock()
	for steps != 1 || !g.busy {
		g.WaitLocked(ctx)
	}
	g.Unlock()

	paused := make(chan error)
	go func() {
		g.Lock()
		defer g.Unlock()
		paused <- g.PauseLocked(ctx)
	}()
	synctest.Wait()
	select {
	case err := <-paused:
		t.Fatalf("PauseLocked returned %v while a step was in flight", err)
	default:
	}
	step <- struct{}{} // the second step ends
	if err := <-paused; err != nil {
		t.Fatal(err)
	}
	g.Lock()
	if steps != 2 || g.RunningLocked() {
		t.Fatalf("after the pause: %d steps, running %v; want 2, false", steps, g.RunningLocked())
	}
	short, cancelShort := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancelShort()
	if err := g.WaitLocked(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a paused loop changed something: WaitLocked = %v", err)
	}

	g.ResumeLocked()
	for !g.busy { // the third step is in flight
		g.WaitLocked(ctx)
	}
	g.StopLocked()
	if err := g.PauseLocked(ctx); err != nil || !g.StoppedLocked() || !g.StartedLocked() {
		t.Fatalf("PauseLocked after StopLocked = %v, stopped %v", err, g.StoppedLocked())
	}
	g.Unlock()
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
	g.Lock()
	g.ResumeLocked()
	for !g.busy {
		g.WaitLocked(ctx)
	}
	pctx, pcancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer pcancel()
	if err := g.PauseLocked(pctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("PauseLocked with a step that never ends = %v", err)
	}
	g.Unlock()
	cancel()
	wg.Wait()
}
