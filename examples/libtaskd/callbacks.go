package main

import (
	"context"
	"fmt"
	"strconv"
	"sync"

	"github.com/faultline-ml/faultline/taskd"
)

// event names what a trainer's callback is called for. The numbers are
// part of the C ABI (TASKD_EVENT_* in the header).
type event int

const (
	eventPause           event = 1 // stop at the next step boundary; reply {"step": n}
	eventResume          event = 2 // start or continue; arg a taskd.ResumeRequest
	eventStop            event = 3 // end training for good; arg {"reason": ...}
	eventSwitchLink      event = 4 // arg a taskd.LinkRequest
	eventStrategies      event = 5 // arg a taskd.FaultNotice; reply ["retry", ...]
	eventRetryStep       event = 6 // redo the interrupted step from memory
	eventStressTest      event = 7 // arg a taskd.StressRequest
	eventProfilingSwitch event = 8 // arg the profilingSwitch document
	numEvents                  = 9
)

var eventNames = [numEvents]string{
	eventPause:           "pause",
	eventResume:          "resume",
	eventStop:            "stop",
	eventSwitchLink:      "switch_link",
	eventStrategies:      "strategies",
	eventRetryStep:       "retry_step",
	eventStressTest:      "stress_test",
	eventProfilingSwitch: "profiling_switch",
}

func (e event) String() string {
	if e > 0 && e < numEvents {
		return eventNames[e]
	}
	return "event(" + strconv.Itoa(int(e)) + ")"
}

// recovery reports whether e is one of the trainer's orchestration calls.
func (e event) recovery() bool { return e > 0 && e < eventProfilingSwitch }

// errUnsupported is a callback's "cannot do this" (TASKD_EUNSUPPORTED),
// which recovery reads as taskd.ErrUnsupported.
var errUnsupported = taskd.ErrUnsupported

// callback runs a trainer's handler of one event with its argument (a JSON
// document) and returns its reply (a JSON document or ""); an error is the
// trainer's failure, wrapping errUnsupported for what it cannot do.
type callback func(arg string) (string, error)

// callbacks holds a worker's registered callbacks. Calls of one event are
// serialised, so that a trainer's handler never runs twice at once.
type callbacks struct {
	mu   sync.Mutex
	fns  [numEvents]callback
	busy [numEvents]chan struct{} // one token per event
}

func newCallbacks() *callbacks {
	c := &callbacks{}
	for i := range c.busy {
		c.busy[i] = make(chan struct{}, 1)
	}
	return c
}

// set registers fn for e, replacing the one before; nil unregisters.
func (c *callbacks) set(e event, fn callback) error {
	if e <= 0 || e >= numEvents {
		return fmt.Errorf("%w: event %d", errBadArgument, int(e))
	}
	c.mu.Lock()
	c.fns[e] = fn
	c.mu.Unlock()
	return nil
}

// registered reports whether e has a callback.
func (c *callbacks) registered(e event) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return e > 0 && e < numEvents && c.fns[e] != nil
}

// anyRecovery reports whether any orchestration callback is registered.
func (c *callbacks) anyRecovery() bool {
	for e := event(1); e < numEvents; e++ {
		if e.recovery() && c.registered(e) {
			return true
		}
	}
	return false
}

// call runs e's callback with arg and returns its reply. Without a
// callback the error wraps errUnsupported. When ctx ends first, call
// returns ctx's error and the callback, which cannot be interrupted, is
// left to finish; the next call of e waits for it.
func (c *callbacks) call(ctx context.Context, e event, arg string) (string, error) {
	if e <= 0 || e >= numEvents {
		return "", fmt.Errorf("%w: event %d", errBadArgument, int(e))
	}
	c.mu.Lock()
	fn := c.fns[e]
	c.mu.Unlock()
	if fn == nil {
		return "", fmt.Errorf("%w: no %s callback registered", errUnsupported, e)
	}
	select {
	case c.busy[e] <- struct{}{}:
	case <-ctx.Done():
		return "", fmt.Errorf("%s callback still running from an earlier call: %w", e, ctx.Err())
	}
	type result struct {
		out string
		err error
	}
	done := make(chan result, 1)
	go func() {
		defer func() { <-c.busy[e] }()
		out, err := fn(arg)
		done <- result{out, err}
	}()
	select {
	case r := <-done:
		return r.out, r.err
	case <-ctx.Done():
		return "", fmt.Errorf("%s callback: %w", e, ctx.Err())
	}
}
