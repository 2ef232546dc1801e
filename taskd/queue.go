package taskd

import (
	"errors"
	"sync"

	"google.golang.org/protobuf/proto"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
)

// ErrQueueFull is returned when a report cannot be queued because the queue
// of reports waiting for the manager is full; the report is dropped and
// counted.
var ErrQueueFull = errors.New("taskd: report queue full")

// reportQueue holds upward reports, oldest first, until the manager
// acknowledges them. It outlives connections, so a reconnect loses nothing.
type reportQueue struct {
	mu    sync.Mutex
	items []*pb.Report
	max   int
	wake  chan struct{}
}

func newReportQueue(max int) *reportQueue {
	return &reportQueue{max: max, wake: make(chan struct{}, 1)}
}

func (q *reportQueue) push(r *pb.Report) error {
	q.mu.Lock()
	if len(q.items) >= q.max {
		q.mu.Unlock()
		return ErrQueueFull
	}
	q.items = append(q.items, r)
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
	return nil
}

// peek returns the oldest reports, at most n and at most maxBytes in all
// (but at least one).
func (q *reportQueue) peek(n, maxBytes int) []*pb.Report {
	q.mu.Lock()
	defer q.mu.Unlock()
	size := 0
	var out []*pb.Report
	for _, r := range q.items {
		s := proto.Size(r)
		if len(out) == n || (len(out) > 0 && size+s > maxBytes) {
			break
		}
		size += s
		out = append(out, r)
	}
	return out
}

// remove drops the reports whose ids are given.
func (q *reportQueue) remove(ids []string) {
	done := make(map[string]bool, len(ids))
	for _, id := range ids {
		done[id] = true
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	kept := q.items[:0]
	for _, r := range q.items {
		if !done[r.GetId()] {
			kept = append(kept, r)
		}
	}
	clear(q.items[len(kept):])
	q.items = kept
}

func (q *reportQueue) len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.items)
}
