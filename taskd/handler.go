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
	EventLeft                             // a worker or proxy left on purpose (its silence is no fault)
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

// eventQueue is an unblocking, bounded FIFO between the RPC handlers and
// the handler loop.
type eventQueue struct {
	mu      sync.Mutex
	items   []Event
	max     int
	dropped int
	wake    chan struct{}
}

func newEventQueue(max int) *eventQueue {
	return &eventQueue{max: max, wake: make(chan struct{}, 1)}
}

func (q *eventQueue) push(evs ...Event) {
	if len(evs) == 0 {
		return
	}
	q.mu.Lock()
	for _, ev := range evs {
		if len(q.items) >= q.max {
			q.dropped++
			continue
		}
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
	q.items = nil
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
