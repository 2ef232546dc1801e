package taskd

import (
	"context"
	"errors"
	"fmt"
	"time"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
)

// Delivery is the outcome of a message for one rank.
type Delivery struct {
	Rank int
	// Err is nil when the worker acknowledged the message as applied,
	// *DeliveryError when it refused it, ErrNotConnected when no route to it
	// existed, or ErrAckTimeout.
	Err error
	// reply is the worker's answer to an orchestration message.
	reply []byte
}

// Errors of Broadcast.
var (
	ErrNotConnected = errors.New("taskd: worker not connected")
	ErrAckTimeout   = errors.New("taskd: no acknowledgement before the deadline")
	ErrTooLarge     = errors.New("taskd: message exceeds the size cap")
	ErrClosed       = errors.New("taskd: closed")
)

// DeliveryError is a worker's refusal of a message.
type DeliveryError struct {
	Rank int
	Msg  string
}

func (e *DeliveryError) Error() string { return fmt.Sprintf("taskd: rank %d: %s", e.Rank, e.Msg) }

type delivery struct {
	waiting map[int]time.Time // rank -> last sent, zero when never routed
	results map[int]error
	replies map[int][]byte
	done    chan struct{}
}

// Broadcast sends an application message to the targeted workers and waits
// until each acknowledged it, re-sending with backoff to those that did
// not, for at most DeliveryTimeout or until ctx ends. It returns one
// Delivery per targeted rank, in rank order.
func (m *Manager) Broadcast(ctx context.Context, to Target, kind string, payload []byte) ([]Delivery, error) {
	ctx, cancel := context.WithTimeout(ctx, m.cfg.DeliveryTimeout)
	defer cancel()
	return m.broadcast(ctx, to, kind, payload)
}

// broadcast is Broadcast bounded by ctx alone.
func (m *Manager) broadcast(ctx context.Context, to Target, kind string, payload []byte) ([]Delivery, error) {
	if len(kind)+len(payload) > m.cfg.MaxMessageBytes-1024 {
		return nil, fmt.Errorf("%w: %d bytes, cap %d", ErrTooLarge, len(kind)+len(payload), m.cfg.MaxMessageBytes-1024)
	}
	id := m.nextID.Add(1)
	env := &pb.Envelope{Id: id, Body: &pb.Envelope_Message{Message: &pb.UserMessage{Kind: kind, Payload: payload}}}
	d := &delivery{waiting: make(map[int]time.Time), results: make(map[int]error), replies: make(map[int][]byte), done: make(chan struct{})}
	m.mu.Lock()
	ranks := m.resolveLocked(to)
	for _, r := range ranks {
		d.waiting[r] = time.Time{}
	}
	if len(ranks) == 0 {
		close(d.done)
	}
	m.deliveries[id] = d
	m.mu.Unlock()
	defer func() {
		m.mu.Lock()
		delete(m.deliveries, id)
		m.mu.Unlock()
	}()
	bo := newBackoff(m.cfg.AckTimeout, 30*time.Second)
	wait := time.Duration(0)
	for {
		timer := time.NewTimer(wait)
		select {
		case <-d.done:
			timer.Stop()
			return m.results(d, ranks), nil
		case <-ctx.Done():
			timer.Stop()
			m.mu.Lock()
			for r, at := range d.waiting {
				if at.IsZero() {
					d.results[r] = ErrNotConnected
				} else {
					d.results[r] = ErrAckTimeout
				}
				m.met.acks.WithLabelValues("timeout").Inc()
			}
			m.mu.Unlock()
			select {
			case <-m.closed:
				return m.results(d, ranks), ErrClosed
			default:
			}
			return m.results(d, ranks), nil
		case <-m.closed:
			timer.Stop()
			return nil, ErrClosed
		case <-timer.C:
		}
		now := time.Now()
		m.mu.Lock()
		pending := make([]int, 0, len(d.waiting))
		for r := range d.waiting {
			pending = append(pending, r)
		}
		unrouted := m.routeLocked(env, pending)
		skip := make(map[int]bool, len(unrouted))
		for _, r := range unrouted {
			skip[r] = true
		}
		for _, r := range pending {
			if !skip[r] {
				d.waiting[r] = now
			}
		}
		m.met.messages.WithLabelValues("down", "message").Add(float64(len(pending) - len(unrouted)))
		m.mu.Unlock()
		wait = bo.NextBackOff()
		if len(unrouted) > 0 {
			wait = min(wait, m.cfg.HeartbeatInterval)
		}
	}
}

func (m *Manager) results(d *delivery, ranks []int) []Delivery {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]Delivery, 0, len(ranks))
	for _, r := range ranks {
		out = append(out, Delivery{Rank: r, Err: d.results[r], reply: d.replies[r]})
	}
	return out
}

// resolveLocked returns the ranks a target names: for All the live
// workers of the job (spares left out), for Nodes the live workers there,
// for Ranks the ranks as given.
func (m *Manager) resolveLocked(to Target) []int {
	var out []int
	nodes := make(map[int]bool, len(to.Nodes))
	for _, n := range to.Nodes {
		nodes[n] = true
	}
	if to.All || len(nodes) > 0 {
		for _, mm := range m.reg.list() {
			if mm.key.role == RoleWorker && (to.All && !m.spare(mm.pos) || nodes[mm.pos.Node]) {
				out = append(out, mm.key.id)
			}
		}
	}
	out = append(out, to.Ranks...)
	return sortedUnique(out)
}

// ackLocked applies one acknowledgement from a worker or proxy.
func (m *Manager) ackLocked(a *pb.Ack, now time.Time) {
	rank := int(a.GetFrom().GetPosition().GetRank())
	result := "ok"
	// What a worker says is kept for as long as its rank is, so it is
	// cut to a bound.
	errMsg := cut(a.GetError(), maxAckErrorBytes)
	if errMsg != "" {
		result = "error"
	}
	if sent, ok := m.sw.ack(a.GetId(), rank, errMsg); ok {
		m.met.acks.WithLabelValues(result).Inc()
		m.met.ackLatency.Observe(now.Sub(sent).Seconds())
		if errMsg != "" {
			m.log.Warn("taskd: worker could not apply the switch", "rank", rank, "err", errMsg)
		}
		return
	}
	d := m.deliveries[a.GetId()]
	if d == nil {
		return
	}
	sent, ok := d.waiting[rank]
	if !ok {
		return
	}
	m.met.acks.WithLabelValues(result).Inc()
	if !sent.IsZero() {
		m.met.ackLatency.Observe(now.Sub(sent).Seconds())
	}
	delete(d.waiting, rank)
	if errMsg != "" {
		d.results[rank] = &DeliveryError{Rank: rank, Msg: errMsg}
	}
	switch reply := a.GetReply(); {
	case len(reply) > maxAckReplyBytes:
		d.results[rank] = &DeliveryError{Rank: rank, Msg: fmt.Sprintf("reply of %d bytes, at most %d", len(reply), maxAckReplyBytes)}
	case len(reply) > 0:
		d.replies[rank] = reply
	}
	if len(d.waiting) == 0 {
		close(d.done)
	}
}

// Bounds of what an acknowledgement may make the manager keep.
const (
	maxAckErrorBytes = 1 << 10
	maxAckReplyBytes = 64 << 10
)
