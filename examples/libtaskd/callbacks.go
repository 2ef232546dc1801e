package main

import (
	"fmt"
	"strconv"
	"sync"
)

// event names what a trainer's callback is called for. The numbers are
// part of the C ABI (TASKD_EVENT_* in the header).
type event int

const (
	eventPause           event = 1 // stop stepping at the next safe point and wait
	eventResume          event = 2 // continue stepping
	eventStop            event = 3 // stop training for good
	eventSwitchLink      event = 4 // move traffic to another link; the argument says which
	eventProfilingSwitch event = 5 // the profiling switch changed; the argument is its JSON
	numEvents                  = 6
)

var eventNames = [numEvents]string{
	eventPause:           "pause",
	eventResume:          "resume",
	eventStop:            "stop",
	eventSwitchLink:      "switch_link",
	eventProfilingSwitch: "profiling_switch",
}

func (e event) String() string {
	if e > 0 && e < numEvents {
		return eventNames[e]
	}
	return "event(" + strconv.Itoa(int(e)) + ")"
}

func eventByName(name string) (event, bool) {
	for e := event(1); e < numEvents; e++ {
		if eventNames[e] == name {
			return e, true
		}
	}
	return 0, false
}

// callback runs a trainer's handler of one event with its argument (a JSON
// document or ""); an error is the trainer's refusal or failure.
type callback func(arg string) error

// callbacks holds a worker's registered callbacks. Calls of one event are
// serialised, so that a trainer's handler never runs twice at once.
type callbacks struct {
	mu  sync.Mutex
	fns [numEvents]callback
	run [numEvents]sync.Mutex
}

func newCallbacks() *callbacks { return &callbacks{} }

// set registers fn for e, replacing the one before; nil unregisters.
func (c *callbacks) set(e event, fn callback) bool {
	if e <= 0 || e >= numEvents {
		return false
	}
	c.mu.Lock()
	c.fns[e] = fn
	c.mu.Unlock()
	return true
}

// registered reports whether e has a callback.
func (c *callbacks) registered(e event) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return e > 0 && e < numEvents && c.fns[e] != nil
}

// call runs e's callback with arg. Without one, a profiling switch
// succeeds (the recorder has applied it) and a recovery request fails: the
// manager must not believe a trainer paused that cannot.
func (c *callbacks) call(e event, arg string) error {
	if e <= 0 || e >= numEvents {
		return fmt.Errorf("unknown event %d", int(e))
	}
	c.mu.Lock()
	fn := c.fns[e]
	c.mu.Unlock()
	if fn == nil {
		if e == eventProfilingSwitch {
			return nil
		}
		return fmt.Errorf("no %s callback registered", e)
	}
	c.run[e].Lock()
	defer c.run[e].Unlock()
	return fn(arg)
}
