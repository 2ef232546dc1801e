package trace

import (
	"math/bits"
	"math/rand/v2"
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

// Pairer pairs start and end records by Id into Ranges, separately per
// source kind (mspti writes a host and a device range under one Id). Names
// travel from whichever start carried one: mspti names only the host start,
// so the device range takes the host start's name. Memory is bounded: at
// most MaxOpen starts wait for their ends; beyond that the oldest is
// evicted and counted. The zero Pairer is ready to use with
// DefaultMaxOpen. A Pairer is not safe for concurrent use.
type Pairer struct {
	MaxOpen int // default DefaultMaxOpen

	// The open starts live in a slab, linked from the oldest to the
	// newest so that the oldest goes first in O(1). A few are found by
	// walking them from the newest; more, by (Id, source) in an
	// open-addressing table, built when they pass smallOpen and dropped
	// when none is left.
	open           idTable // (Id, source) → ref of the start in starts, while indexed
	indexed        bool
	nOpen          int
	starts         []openStart
	free           int32 // ref of the first free entry of starts, 0 if none
	oldest, newest int32 // refs, 0 when nothing is open
	names          nameRing
	stats          PairerStats
}

// A ref is an index into a slice plus one, so that 0 is none and the zero
// Pairer needs no set-up.

// smallOpen is how many open starts a Pairer finds by walking them, the
// newest first: a thread has a few nested ranges open, and comparing
// their keys costs less than hashing one.
const smallOpen = 8

type openStart struct {
	id         uint64
	src        uint32
	prev, next int32 // refs of the neighbours in start order; next also links the free entries
	ts         uint64
	name, dom  string
	pid, tid   uint32
	dev, strm  uint32
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
func (p *Pairer) Add(rec *Record) (r Range, ok bool) {
	ok = p.AddTo(rec, &r)
	return
}

// AddTo is Add that fills *r in place, where the caller keeps it (the
// next element of a slice), instead of returning a copy. It writes *r
// only when it reports true.
func (p *Pairer) AddTo(rec *Record, r *Range) bool {
	// Filled field by field: a Range built whole and then stored is
	// copied in wider words than it was stored in, which the processor
	// cannot forward.
	switch {
	case rec.Flag.IsStart():
		p.start(rec)
		return false
	case rec.Flag.IsEnd():
		pos, ref := p.find(rec.ID, rec.SourceKind)
		if ref == 0 {
			p.stats.UnmatchedEnds++
			return false
		}
		s := &p.starts[ref-1]
		r.Name, r.Domain = s.name, s.dom
		r.ID, r.Start, r.End = rec.ID, s.ts, rec.Timestamp
		r.ProcessID, r.ThreadID, r.DeviceID, r.StreamID = s.pid, s.tid, s.dev, s.strm
		r.SourceKind = rec.SourceKind
		p.remove(pos, ref)
		if r.Name == "" {
			if n, ok := p.names.get(rec.ID); ok {
				r.Name, r.Domain = n.name, n.dom
			}
		}
		p.stats.Ranges++
		return true
	case rec.Flag.IsInstant():
		p.stats.Instants++
		r.Name, r.Domain = rec.Name, rec.Domain
		r.ID, r.Start, r.End = rec.ID, rec.Timestamp, rec.Timestamp
		r.ProcessID, r.ThreadID, r.DeviceID, r.StreamID = rec.ProcessID, rec.ThreadID, rec.DeviceID, rec.StreamID
		r.SourceKind = rec.SourceKind
		return true
	}
	p.stats.Ignored++
	return false
}

func (p *Pairer) start(rec *Record) {
	name, dom := rec.Name, rec.Domain
	if name != "" {
		p.names.put(rec.ID, name, dom, p.maxOpen())
	} else if n, ok := p.names.get(rec.ID); ok {
		name, dom = n.name, n.dom
	}
	pos, ref := p.find(rec.ID, rec.SourceKind)
	if ref != 0 {
		p.stats.Evicted++ // replaced by the newer start; it becomes the newest
		p.unlink(ref)
	} else {
		ref = p.alloc()
		p.nOpen++
		if p.indexed {
			p.open.insert(pos, rec.ID, rec.SourceKind, ref)
		}
	}
	// Field by field: a composite literal would be built on the stack and
	// copied in words that the processor cannot forward from the stores.
	s := &p.starts[ref-1]
	s.id, s.src, s.ts = rec.ID, rec.SourceKind, rec.Timestamp
	s.name, s.dom = name, dom
	s.pid, s.tid, s.dev, s.strm = rec.ProcessID, rec.ThreadID, rec.DeviceID, rec.StreamID
	p.link(ref)
	if !p.indexed && p.nOpen > smallOpen {
		p.index()
	}
	for p.nOpen > p.maxOpen() {
		old := &p.starts[p.oldest-1]
		pos, _ := p.find(old.id, old.src)
		p.remove(pos, p.oldest)
		p.stats.Evicted++
	}
}

// find returns the ref of the open start with the key, 0 if none, and,
// while the starts are indexed, its slot in the table (or the free slot
// where insert puts the key).
func (p *Pairer) find(id uint64, src uint32) (pos int, ref int32) {
	if p.indexed {
		return p.open.find(id, src)
	}
	for ref := p.newest; ref != 0; {
		s := &p.starts[ref-1]
		if s.id == id && s.src == src {
			return -1, ref
		}
		ref = s.prev
	}
	return -1, 0
}

// index builds the table of the open starts.
func (p *Pairer) index() {
	p.indexed = true
	p.open.reset()
	for ref := p.oldest; ref != 0; ref = p.starts[ref-1].next {
		s := &p.starts[ref-1]
		pos, _ := p.open.find(s.id, s.src)
		p.open.insert(pos, s.id, s.src, ref)
	}
}

// alloc returns the ref of a free entry of starts.
func (p *Pairer) alloc() int32 {
	if ref := p.free; ref != 0 {
		p.free = p.starts[ref-1].next
		return ref
	}
	p.starts = append(p.starts, openStart{})
	return int32(len(p.starts))
}

// remove drops the open start ref, found at pos of the table.
func (p *Pairer) remove(pos int, ref int32) {
	if p.indexed {
		p.open.delete(pos)
	}
	if p.nOpen--; p.nOpen == 0 {
		p.indexed = false
	}
	p.unlink(ref)
	s := &p.starts[ref-1]
	s.name, s.dom = "", "" // for the collector
	s.next = p.free
	p.free = ref
}

// link makes ref the newest open start.
func (p *Pairer) link(ref int32) {
	s := &p.starts[ref-1]
	s.prev, s.next = p.newest, 0
	if p.newest != 0 {
		p.starts[p.newest-1].next = ref
	} else {
		p.oldest = ref
	}
	p.newest = ref
}

// unlink takes ref out of the start order.
func (p *Pairer) unlink(ref int32) {
	s := &p.starts[ref-1]
	if s.prev != 0 {
		p.starts[s.prev-1].next = s.next
	} else {
		p.oldest = s.next
	}
	if s.next != 0 {
		p.starts[s.next-1].prev = s.prev
	} else {
		p.newest = s.prev
	}
}

// Stats returns the pairer's counters.
func (p *Pairer) Stats() PairerStats {
	s := p.stats
	s.Open = p.nOpen
	return s
}

// nameRingMinSize is the size of a nameRing's first allocation.
const nameRingMinSize = 256

type nameEntry struct {
	id        uint64
	name, dom string
}

// nameRing keeps the names of the latest named starts for the other
// source's records of the same Id, which mspti leaves unnamed. Keeping one
// costs a store into the ring; the index that finds them by Id is built
// only once a record asks for a name, so that records of one source only
// (what a Recorder writes) never pay for it.
type nameRing struct {
	ents    []nameEntry // a ring from head, n long; grows up to the bound
	head, n int
	index   idTable // Id → ref into ents, once indexed
	indexed bool
}

// put keeps the name of id, the oldest going beyond limit names. A name
// already kept for id is replaced in place.
func (r *nameRing) put(id uint64, name, dom string, limit int) {
	if r.indexed {
		if _, ref := r.index.find(id, 0); ref != 0 {
			e := &r.ents[ref-1]
			e.name, e.dom = name, dom
			return
		}
	}
	for r.n > 0 && r.n >= limit {
		r.drop()
	}
	if r.n == len(r.ents) {
		r.grow(limit)
	}
	k := r.head + r.n
	if k >= len(r.ents) {
		k -= len(r.ents)
	}
	e := &r.ents[k]
	e.id, e.name, e.dom = id, name, dom
	r.n++
	if r.indexed {
		pos, _ := r.index.find(id, 0)
		r.index.insert(pos, id, 0, int32(k+1))
	}
}

// drop forgets the oldest name.
func (r *nameRing) drop() {
	e := &r.ents[r.head]
	if r.indexed {
		// Without an index an Id may be in the ring twice; the index
		// points at the newer.
		if pos, ref := r.index.find(e.id, 0); ref == int32(r.head+1) {
			r.index.delete(pos)
		}
	}
	e.name, e.dom = "", ""
	if r.head++; r.head == len(r.ents) {
		r.head = 0
	}
	r.n--
}

// grow makes room for more names, up to limit. Every named start keeps
// its name until limit names are kept, so the ring starts at a size that
// small limits reach at once: a reader per rank of a large job then
// allocates its ring once, not five times over.
func (r *nameRing) grow(limit int) {
	size := min(max(2*len(r.ents), nameRingMinSize), limit)
	ents := make([]nameEntry, size)
	for i := range r.n {
		ents[i] = r.ents[(r.head+i)%len(r.ents)]
	}
	r.ents, r.head = ents, 0
	if r.indexed {
		r.reindex()
	}
}

// get returns the name kept for id.
func (r *nameRing) get(id uint64) (nameEntry, bool) {
	if r.n == 0 {
		return nameEntry{}, false
	}
	if !r.indexed {
		r.indexed = true
		r.reindex()
	}
	_, ref := r.index.find(id, 0)
	if ref == 0 {
		return nameEntry{}, false
	}
	return r.ents[ref-1], true
}

// reindex builds the index from the ring, newer entries winning.
func (r *nameRing) reindex() {
	r.index.reset()
	for i := range r.n {
		k := (r.head + i) % len(r.ents)
		pos, ref := r.index.find(r.ents[k].id, 0)
		if ref != 0 {
			r.index.slots[pos].ref = int32(k + 1)
			continue
		}
		r.index.insert(pos, r.ents[k].id, 0, int32(k+1))
	}
}

// idTable maps (Id, source) keys to refs: open addressing with linear
// probing, at most half full, with deletion by backward shift so that no
// tombstones build up.
type idTable struct {
	slots []idSlot // len a power of two, or nil
	shift uint     // 64 - log2(len(slots))
	seed  uint64
	n     int
}

type idSlot struct {
	id  uint64
	src uint32
	ref int32 // 0: free
}

const idTableMinSlots = 16

// home returns the slot where a key's probe starts. The seed keeps keys
// chosen to collide from lining up.
func (t *idTable) home(id uint64, src uint32) int {
	return int(((id ^ t.seed) + uint64(src)*0xC2B2AE3D27D4EB4F) * 0x9E3779B97F4A7C15 >> t.shift)
}

// find returns the slot holding the key and its ref, or, with ref 0, the
// free slot where insert puts it.
func (t *idTable) find(id uint64, src uint32) (pos int, ref int32) {
	if t.slots == nil {
		t.seed = rand.Uint64()
		t.resize(idTableMinSlots)
	}
	mask := len(t.slots) - 1
	for k := t.home(id, src); ; k = (k + 1) & mask {
		s := &t.slots[k]
		if s.ref == 0 || (s.id == id && s.src == src) {
			return k, s.ref
		}
	}
}

// insert puts a key that find did not find at the pos it returned.
func (t *idTable) insert(pos int, id uint64, src uint32, ref int32) {
	t.slots[pos] = idSlot{id, src, ref}
	if t.n++; 2*t.n > len(t.slots) {
		t.resize(2 * len(t.slots))
	}
}

// delete empties pos and moves back the entries after it whose probe
// would otherwise cross the hole.
func (t *idTable) delete(pos int) {
	mask := len(t.slots) - 1
	t.n--
	for hole, k := pos, pos; ; {
		t.slots[hole] = idSlot{}
		for {
			k = (k + 1) & mask
			s := t.slots[k]
			if s.ref == 0 {
				return
			}
			// s stays if its home lies cyclically in (hole, k].
			if h := t.home(s.id, s.src); (k-h)&mask < (k-hole)&mask {
				continue
			}
			t.slots[hole] = s
			hole = k
			break
		}
	}
}

func (t *idTable) resize(size int) {
	old := t.slots
	t.slots = make([]idSlot, size)
	t.shift = uint(64 - bits.TrailingZeros(uint(size)))
	mask := size - 1
	for _, s := range old {
		if s.ref == 0 {
			continue
		}
		k := t.home(s.id, s.src)
		for t.slots[k].ref != 0 {
			k = (k + 1) & mask
		}
		t.slots[k] = s
	}
}

// reset empties the table, keeping its room.
func (t *idTable) reset() {
	clear(t.slots)
	t.n = 0
}
