package trace

import (
	"strconv"
	"strings"
	"time"
)

// Range is a completed range (a start and an end record sharing an Id),
// or an instant, for which Start == End.
type Range struct {
	Name, Domain string // from the start record, or another source's start with the same Id
	ID           uint64
	Start, End   uint64 // nanoseconds
	ProcessID    uint32
	ThreadID     uint32
	DeviceID     uint32
	StreamID     uint32
	SourceKind   uint32 // SourceKindHost or SourceKindDevice: whose clock Start and End are on
}

// Duration returns End - Start.
func (r Range) Duration() time.Duration { return time.Duration(r.End - r.Start) }

// Kind returns the kind of the range, from its domain and name.
func (r Range) Kind() (Kind, bool) { return KindOf(r.Name, r.Domain) }

// Step returns n for a range named "step <n>".
func (r Range) Step() (uint64, bool) {
	s, ok := strings.CutPrefix(r.Name, StepMarkerPrefix)
	if !ok {
		return 0, false
	}
	n, err := strconv.ParseUint(s, 10, 64)
	return n, err == nil
}

// KindOf returns the kind of a marker: communication-domain markers are
// CommunicationOperator, "step <n>" is Step, and the marker names of
// forward, dataloader and save_checkpoint are FP, DataLoader and
// SaveCheckpoint.
func KindOf(name, domain string) (Kind, bool) {
	switch {
	case domain == DomainCommunication:
		return CommunicationOperator, true
	case strings.HasPrefix(name, StepMarkerPrefix):
		return Step, true
	case name == MarkerForward:
		return FP, true
	case name == MarkerDataLoader:
		return DataLoader, true
	case name == MarkerSaveCheckpoint:
		return SaveCheckpoint, true
	}
	return 0, false
}

// DefaultMaxOpen bounds the starts a Pairer holds waiting for their ends,
// and the names it keeps for the other source's records of an Id.
const DefaultMaxOpen = 8192

// PairerStats counts what a Pairer has seen.
type PairerStats struct {
	Ranges        uint64 // start/end pairs returned
	Instants      uint64 // instants returned
	UnmatchedEnds uint64 // ends with no open start
	Evicted       uint64 // starts dropped unmatched: over MaxOpen, or replaced by a start with the same key
	Ignored       uint64 // records that are neither start, end nor instant
	Open          int    // starts waiting for their ends
}

type pairKey struct {
	id  uint64
	src uint32
}

type openStart struct {
	seq       uint64
	ts        uint64
	name, dom string
	pid, tid  uint32
	dev, strm uint32
}

type nameEntry struct {
	name, dom string
}

// Pairer pairs start and end records by Id into Ranges, separately per
// source kind (mspti writes a host and a device range under one Id). Names
// travel from whichever start carried one: mspti names only the host start,
// so the device range takes the host start's name. Memory is bounded: at
// most MaxOpen starts wait for their ends; beyond that the oldest is
// evicted and counted. The zero Pairer is ready to use with
// DefaultMaxOpen. A Pairer is not safe for concurrent use.
type Pairer struct {
	MaxOpen int // default DefaultMaxOpen

	open   map[pairKey]openStart
	order  []pairKey // open keys in start order, possibly stale
	oseq   []uint64  // seq of each order entry
	ohead  int
	names  map[uint64]nameEntry
	norder []uint64
	nhead  int
	seq    uint64
	stats  PairerStats
}

func (p *Pairer) maxOpen() int {
	if p.MaxOpen > 0 {
		return p.MaxOpen
	}
	return DefaultMaxOpen
}

// Add takes one record. It returns a Range when rec ends a range or is an
// instant; for a start, an unmatched end or anything else it returns false.
// rec need not outlive the call.
func (p *Pairer) Add(rec *Record) (Range, bool) {
	if p.open == nil {
		p.open = make(map[pairKey]openStart)
		p.names = make(map[uint64]nameEntry)
	}
	key := pairKey{rec.ID, rec.SourceKind}
	switch {
	case rec.Flag.IsStart():
		name, dom := rec.Name, rec.Domain
		if name != "" {
			p.remember(rec.ID, name, dom)
		} else if n, ok := p.names[rec.ID]; ok {
			name, dom = n.name, n.dom
		}
		if _, dup := p.open[key]; dup {
			p.stats.Evicted++
		}
		p.seq++
		p.open[key] = openStart{seq: p.seq, ts: rec.Timestamp, name: name, dom: dom,
			pid: rec.ProcessID, tid: rec.ThreadID, dev: rec.DeviceID, strm: rec.StreamID}
		p.order = append(p.order, key)
		p.oseq = append(p.oseq, p.seq)
		p.evict()
		return Range{}, false
	case rec.Flag.IsEnd():
		s, ok := p.open[key]
		if !ok {
			p.stats.UnmatchedEnds++
			return Range{}, false
		}
		delete(p.open, key)
		if s.name == "" {
			if n, ok := p.names[rec.ID]; ok {
				s.name, s.dom = n.name, n.dom
			}
		}
		p.stats.Ranges++
		return Range{Name: s.name, Domain: s.dom, ID: rec.ID, Start: s.ts, End: rec.Timestamp,
			ProcessID: s.pid, ThreadID: s.tid, DeviceID: s.dev, StreamID: s.strm, SourceKind: rec.SourceKind}, true
	case rec.Flag.IsInstant():
		p.stats.Instants++
		return Range{Name: rec.Name, Domain: rec.Domain, ID: rec.ID, Start: rec.Timestamp, End: rec.Timestamp,
			ProcessID: rec.ProcessID, ThreadID: rec.ThreadID, DeviceID: rec.DeviceID, StreamID: rec.StreamID,
			SourceKind: rec.SourceKind}, true
	}
	p.stats.Ignored++
	return Range{}, false
}

// evict drops the oldest open starts beyond MaxOpen and compacts the
// order queue, whose entries for starts already ended are stale and whose
// consumed head would otherwise keep growing.
func (p *Pairer) evict() {
	for len(p.open) > p.maxOpen() {
		k, seq := p.order[p.ohead], p.oseq[p.ohead]
		p.ohead++
		if s, ok := p.open[k]; ok && s.seq == seq {
			delete(p.open, k)
			p.stats.Evicted++
		}
	}
	if len(p.order)-p.ohead > 2*len(p.open)+1024 || (p.ohead > 1024 && p.ohead > len(p.order)/2) {
		keep := p.order[:0]
		kseq := p.oseq[:0]
		for i := p.ohead; i < len(p.order); i++ {
			if s, ok := p.open[p.order[i]]; ok && s.seq == p.oseq[i] {
				keep = append(keep, p.order[i])
				kseq = append(kseq, p.oseq[i])
			}
		}
		p.order, p.oseq, p.ohead = keep, kseq, 0
	}
}

// remember keeps the name of a start for the other source's records of
// the same Id, bounded like the open starts.
func (p *Pairer) remember(id uint64, name, dom string) {
	if _, ok := p.names[id]; !ok {
		p.norder = append(p.norder, id)
	}
	p.names[id] = nameEntry{name, dom}
	for len(p.names) > p.maxOpen() {
		delete(p.names, p.norder[p.nhead])
		p.nhead++
	}
	if p.nhead > 1024 && p.nhead > len(p.norder)/2 {
		p.norder = append(p.norder[:0], p.norder[p.nhead:]...)
		p.nhead = 0
	}
}

// Stats returns the pairer's counters.
func (p *Pairer) Stats() PairerStats {
	s := p.stats
	s.Open = len(p.open)
	return s
}
