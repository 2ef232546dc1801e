package taskd

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/faultline-ml/faultline/trace"
)

// EventKind says what happened in the job.
type EventKind int

// Event kinds.
const (
	EventRegistered  EventKind = iota + 1 // a worker or proxy registered (not a reconnect)
	EventFault                            // a fault was taken into the log (FaultLost included)
	EventMessage                          // a worker or proxy sent an application message
	EventSwitch                           // the job's profiling switch changed
	EventLeft                             // a worker or proxy left on purpose, or a spare was lost (its silence is no fault)
	EventJobComplete                      // every rank of the job left after its last step
)

func (k EventKind) String() string {
	switch k {
	case EventRegistered:
		return "registered"
	case EventFault:
		return "fault"
	case EventMessage:
		return "message"
	case EventSwitch:
		return "switch"
	case EventLeft:
		return "left"
	case EventJobComplete:
		return "job-complete"
	}
	return fmt.Sprintf("EventKind(%d)", int(k))
}

// Event is what the manager hands its handlers.
type Event struct {
	Kind EventKind
	Time time.Time
	// Role and Position say who registered or sent a message.
	Role     Role
	Position Position
	Fault    Fault        // EventFault
	Message  Message      // EventMessage
	Switch   trace.Switch // EventSwitch
	// Departure is who left (EventLeft); a proxy's Position.Rank is -1.
	Departure Departure
	// instance is the process that registered (EventRegistered).
	instance string
}

// Message is an application message between the manager and a member.
type Message struct {
	// ID is unique per sender; a message retried keeps its ID.
	ID      string
	Kind    string
	Payload []byte
	// From is the sender's position (upward messages only).
	From Position
}

// Handler is a named piece of orchestration (profiling, process recovery,
// NIC switch, ...) that the manager runs on every event, so that new
// orchestration lands without touching the transport. Handlers run one
// event at a time, in the order events happened; for each event they run in
// ascending Priority, ties by Name. An error or a panic is logged and
// counted and does not stop the others.
type Handler struct {
	Name     string
	Priority int
	Handle   func(ctx context.Context, m *Manager, ev Event) error
}

func sortHandlers(hs []Handler) []Handler {
	out := append([]Handler(nil), hs...)
	sort.SliceStable(out, func(i, j int) bool {
		if out[i].Priority != out[j].Priority {
			return out[i].Priority < out[j].Priority
		}
		return out[i].Name < out[j].Name
	})
	return out
}

// eventQueue is an unblocking FIFO between the RPC handlers and the
// handler loop, bounded in events and in the bytes of the messages they
// carry; past either bound an event is dropped and counted.
type eventQueue struct {
	mu       sync.Mutex
	items    []Event
	max      int
	bytes    int // of the messages' payloads queued
	maxBytes int
	dropped  func() // counts an event dropped
	wake     chan struct{}
}

// maxEventBytes bounds the message payloads waiting for the handlers.
const maxEventBytes = 64 << 20

func newEventQueue(max int, dropped func()) *eventQueue {
	return &eventQueue{max: max, maxBytes: maxEventBytes, dropped: dropped, wake: make(chan struct{}, 1)}
}

func (q *eventQueue) push(evs ...Event) {
	if len(evs) == 0 {
		return
	}
	q.mu.Lock()
	for _, ev := range evs {
		n := len(ev.Message.Payload)
		if len(q.items) >= q.max || q.bytes+n > q.maxBytes {
			q.dropped()
			continue
		}
		q.bytes += n
		q.items = append(q.items, ev)
	}
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
}

func (q *eventQueue) take() []Event {
	q.mu.Lock()
	defer q.mu.Unlock()
	evs := q.items
	q.items, q.bytes = nil, 0
	return evs
}

// runHandlers delivers events to the handlers until ctx ends.
func (m *Manager) runHandlers(ctx context.Context) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-m.events.wake:
		}
		for _, ev := range m.events.take() {
			for _, h := range m.handlers {
				if err := m.callHandler(ctx, h, ev); err != nil {
					m.met.handlerErrs.WithLabelValues(h.Name).Inc()
					m.log.Error("taskd: handler failed", "handler", h.Name, "event", ev.Kind, "err", err)
				}
			}
		}
	}
}

func (m *Manager) callHandler(ctx context.Context, h Handler, ev Event) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("panic: %v", r)
		}
	}()
	return h.Handle(ctx, m, ev)
}
