package taskd

import (
	"iter"
	"sort"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/faultline-ml/faultline/trace"
)

// DomainState is a worker's state for one marker domain of the profiling
// switch, as MindCluster's profiling plugin reports it.
type DomainState string

// Domain states.
const (
	DomainOpened  DomainState = "opened"  // the worker applied a switch that turns the domain on
	DomainClosed  DomainState = "closed"  // the worker applied a switch that turns the domain off
	DomainWaiting DomainState = "waiting" // the worker has not acknowledged the current switch yet
	DomainFailed  DomainState = "failed"  // the worker could not apply the current switch
)

var markerDomains = [...]string{trace.DomainDefault, trace.DomainCommunication}

// Domains yields the marker domains a switch status reports, in order:
// the keys of WorkerSwitch.Domains.
func Domains() iter.Seq[string] {
	return func(yield func(string) bool) {
		for _, d := range markerDomains {
			if !yield(d) {
				return
			}
		}
	}
}

// WorkerSwitch is one worker's state of the current switch.
type WorkerSwitch struct {
	Position Position
	Domains  map[string]DomainState
	// Error is the worker's reason when a domain failed.
	Error string
}

// SwitchStatus is the job's switch and how far its fan-out got.
type SwitchStatus struct {
	Switch trace.Switch
	// Version increases with every change (it is the change's time in
	// nanoseconds, or one more than the last version). Zero means no switch
	// was set.
	Version uint64
	Workers []WorkerSwitch
}

// switchTracker holds the job's switch and each worker's progress towards
// it; it decides who needs a (re-)send. It is pure: times come from the
// caller and the caller serialises access.
type switchTracker struct {
	sw         trace.Switch
	version    uint64
	doc        string
	changedAt  time.Time
	completeAt time.Time // when every live worker acknowledged version; zero until then
	ackTimeout time.Duration
	maxBackoff time.Duration
	workers    map[int]*workerSwitch // by rank
	ids        map[uint64]time.Time  // envelopes carrying the current version, and when each was sent
	// lagging counts the live workers that have not acknowledged the
	// current version, so that each acknowledgement tells in O(1)
	// whether the fan-out is complete.
	lagging int
}

type workerSwitch struct {
	node     int
	expected bool   // a rank of the job's shape: kept when gone
	live     bool   // registered and not lost or evicted since
	acked    uint64 // the version the worker acknowledged last
	err      string // its error for acked, "" when applied
	nextSend time.Time
	bo       *backoff.ExponentialBackOff
}

func newSwitchTracker(ackTimeout, maxBackoff time.Duration) *switchTracker {
	return &switchTracker{ackTimeout: ackTimeout, maxBackoff: maxBackoff, workers: make(map[int]*workerSwitch), ids: make(map[uint64]time.Time)}
}

func (t *switchTracker) newBackoff() *backoff.ExponentialBackOff {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = t.ackTimeout
	bo.MaxInterval = t.maxBackoff
	bo.RandomizationFactor = 0.1
	bo.Multiplier = 2
	bo.MaxElapsedTime = 0 // a laggard is retried for as long as it is live
	bo.Reset()
	return bo
}

// expect lists a rank the job should have, so that it shows as waiting
// before it registers, and after it is gone.
func (t *switchTracker) expect(rank, node int) {
	t.ensure(rank, node)
	t.workers[rank].expected = true
}

func (t *switchTracker) ensure(rank, node int) {
	if t.workers[rank] == nil {
		t.workers[rank] = &workerSwitch{node: node, bo: t.newBackoff()}
	}
}

// set makes sw the job's switch. It reports false when sw is the switch
// already held (nothing to send).
func (t *switchTracker) set(sw trace.Switch, now time.Time) bool {
	if t.version > 0 && sw == t.sw {
		return false
	}
	t.sw = sw
	// The change's time, so that versions keep increasing across manager
	// restarts and a worker can ignore a late copy of an older switch.
	t.version = max(t.version+1, uint64(now.UnixNano()))
	t.doc = sw.String()
	t.changedAt = now
	t.completeAt = time.Time{}
	clear(t.ids)
	t.lagging = 0
	for _, w := range t.workers {
		w.nextSend = time.Time{}
		w.bo.Reset()
		if w.live {
			t.lagging++
		}
	}
	return true
}

// lags reports whether w counts in lagging.
func (t *switchTracker) lags(w *workerSwitch) bool {
	return w.live && t.version != 0 && w.acked != t.version
}

// update applies f to w, keeping lagging right.
func (t *switchTracker) update(w *workerSwitch, f func()) {
	before := t.lags(w)
	f()
	switch after := t.lags(w); {
	case before && !after:
		t.lagging--
	case !before && after:
		t.lagging++
	}
}

// registered notes that rank registered, applying the switch bits it
// reported (has is false when it reported none). A worker that already
// applies the job's switch counts as acknowledged; any other is sent the
// switch at once.
func (t *switchTracker) registered(rank, node int, bits uint32, has bool) {
	t.ensure(rank, node)
	w := t.workers[rank]
	t.update(w, func() {
		w.node, w.live = node, true
		if t.version == 0 {
			return
		}
		if has && trace.SwitchFromBits(bits) == t.sw {
			w.acked, w.err = t.version, ""
			return
		}
		if w.acked == t.version && w.err == "" {
			w.acked = 0 // it restarted with another switch: send again
		}
		w.nextSend = time.Time{}
		w.bo.Reset()
	})
}

// gone notes that rank is no longer live (lost, evicted or left): the
// fan-out no longer waits for it. A rank the job's shape does not list is
// forgotten, so that the tracker holds only the ranks the job has.
func (t *switchTracker) gone(rank int) {
	w := t.workers[rank]
	if w == nil {
		return
	}
	t.update(w, func() { w.live = false })
	if !w.expected {
		delete(t.workers, rank)
	}
}

// due returns, in order, the live ranks that need the switch at now and
// schedules their next re-send.
func (t *switchTracker) due(now time.Time) []int {
	if t.lagging == 0 {
		return nil
	}
	var out []int
	for rank, w := range t.workers {
		if !t.lags(w) || now.Before(w.nextSend) {
			continue
		}
		w.nextSend = now.Add(w.bo.NextBackOff())
		out = append(out, rank)
	}
	sort.Ints(out)
	return out
}

// sent records that envelope id, sent at now, carries the current version.
func (t *switchTracker) sent(id uint64, now time.Time) { t.ids[id] = now }

// unsent makes ranks that could not be routed due again at once.
func (t *switchTracker) unsent(ranks []int) {
	for _, r := range ranks {
		if w := t.workers[r]; w != nil {
			w.nextSend = time.Time{}
		}
	}
}

// ack records rank's acknowledgement of envelope id, returning when the
// envelope was sent. It reports false for an envelope of an older version.
func (t *switchTracker) ack(id uint64, rank int, errMsg string) (time.Time, bool) {
	at, ok := t.ids[id]
	w := t.workers[rank]
	if !ok || w == nil {
		return time.Time{}, false
	}
	t.update(w, func() { w.acked, w.err = t.version, errMsg })
	return at, true
}

// complete reports whether every live worker acknowledged the current
// version, and marks when that first happened. It takes O(1).
func (t *switchTracker) complete(now time.Time) bool {
	if t.version == 0 || t.lagging > 0 {
		return false
	}
	if t.completeAt.IsZero() {
		t.completeAt = now
	}
	return true
}

func (t *switchTracker) status() SwitchStatus {
	st := SwitchStatus{Switch: t.sw, Version: t.version}
	ranks := make([]int, 0, len(t.workers))
	for r := range t.workers {
		ranks = append(ranks, r)
	}
	sort.Ints(ranks)
	for _, r := range ranks {
		w := t.workers[r]
		ws := WorkerSwitch{Position: Position{Node: w.node, Rank: r}, Domains: make(map[string]DomainState, len(markerDomains))}
		for _, d := range markerDomains {
			switch {
			case t.version == 0 || w.acked != t.version:
				ws.Domains[d] = DomainWaiting
			case w.err != "":
				ws.Domains[d] = DomainFailed
			case t.sw.DomainEnabled(d):
				ws.Domains[d] = DomainOpened
			default:
				ws.Domains[d] = DomainClosed
			}
		}
		if t.version != 0 && w.acked == t.version {
			ws.Error = w.err
		}
		st.Workers = append(st.Workers, ws)
	}
	return st
}
