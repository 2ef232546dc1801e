package main

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/faultline-ml/faultline/trace"
)

// maxOpenRanges bounds the ranges started and not yet ended, so that a
// caller that never ends them cannot grow the table without limit.
const maxOpenRanges = 1 << 14

var (
	errBadMarker    = errors.New("bad marker")
	errUnknownRange = errors.New("no open range with this id")
	errTooManyOpen  = fmt.Errorf("more than %d ranges open", maxOpenRanges)
)

// marker is a marker name and domain resolved to a kind. The name is
// copied only where it must be kept (a communication op, or a name of the
// caller's), so that step, forward, dataloader and save_checkpoint cost no
// allocation.
type marker struct {
	kind trace.Kind
	step uint64 // for trace.Step
	name string // a constant, or "" to copy the caller's name when used
}

// parseMarker resolves name and domain ("" meaning "default"). name may
// point into C memory: it is not kept.
func parseMarker(name, domain string) (marker, error) {
	switch domain {
	case "", trace.DomainDefault:
	case trace.DomainCommunication:
		if name == "" {
			return marker{}, fmt.Errorf("%w: empty communication marker name", errBadMarker)
		}
		return marker{kind: trace.CommunicationOperator}, nil
	default:
		return marker{}, fmt.Errorf("%w: domain %q is not %q or %q", errBadMarker, domain, trace.DomainDefault, trace.DomainCommunication)
	}
	switch name {
	case trace.MarkerForward:
		return marker{kind: trace.FP, name: trace.MarkerForward}, nil
	case trace.MarkerDataLoader:
		return marker{kind: trace.DataLoader, name: trace.MarkerDataLoader}, nil
	case trace.MarkerSaveCheckpoint:
		return marker{kind: trace.SaveCheckpoint, name: trace.MarkerSaveCheckpoint}, nil
	}
	if n, ok := strings.CutPrefix(name, trace.StepMarkerPrefix); ok {
		step, err := strconv.ParseUint(n, 10, 64)
		if err == nil {
			return marker{kind: trace.Step, step: step}, nil
		}
	}
	return marker{}, fmt.Errorf("%w: %q is not \"step <n>\", %q, %q or %q in domain %q",
		errBadMarker, name, trace.MarkerForward, trace.MarkerDataLoader, trace.MarkerSaveCheckpoint, trace.DomainDefault)
}

// rangeTable turns the recorder's spans into ids that cross the C ABI and
// back: range_end gets an id, and the span it names records the end.
type rangeTable struct {
	rec    *trace.Recorder
	device uint32

	mu   sync.Mutex
	open map[uint64]trace.Span
}

func newRangeTable(rec *trace.Recorder, device uint32) *rangeTable {
	return &rangeTable{rec: rec, device: device, open: make(map[uint64]trace.Span)}
}

// start records the start of a range and returns its id, or 0 when the
// kind is switched off (or the recorder's buffer is full) and nothing was
// recorded. name may point into C memory.
func (t *rangeTable) start(name, domain string) (uint64, error) {
	m, err := parseMarker(name, domain)
	if err != nil {
		return 0, err
	}
	if !t.rec.Enabled(m.kind) {
		return 0, nil
	}
	t.mu.Lock()
	full := len(t.open) >= maxOpenRanges
	t.mu.Unlock()
	if full {
		return 0, errTooManyOpen
	}
	var sp trace.Span
	switch {
	case m.kind == trace.Step:
		sp = t.rec.StartStep(m.step, t.device, 0)
	case m.name != "":
		sp = t.rec.Start(m.kind, m.name, t.device, 0)
	default:
		sp = t.rec.Start(m.kind, strings.Clone(name), t.device, 0)
	}
	id := sp.ID()
	if id == 0 {
		sp.End() // counts the dropped end beside the dropped start
		return 0, nil
	}
	t.mu.Lock()
	t.open[id] = sp
	t.mu.Unlock()
	return id, nil
}

// end records the end of the range id. An id of 0 (a range that was not
// recorded) is accepted and does nothing.
func (t *rangeTable) end(id uint64) error {
	if id == 0 {
		return nil
	}
	t.mu.Lock()
	sp, ok := t.open[id]
	delete(t.open, id)
	t.mu.Unlock()
	if !ok {
		return fmt.Errorf("%w: %d", errUnknownRange, id)
	}
	sp.End()
	return nil
}

// mark records an instant. name may point into C memory.
func (t *rangeTable) mark(name, domain string) error {
	m, err := parseMarker(name, domain)
	if err != nil {
		return err
	}
	if !t.rec.Enabled(m.kind) {
		return nil
	}
	n := m.name
	if n == "" {
		n = strings.Clone(name)
	}
	t.rec.Mark(m.kind, n, t.device, 0)
	return nil
}

// openRanges returns how many ranges are open.
func (t *rangeTable) openRanges() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.open)
}
