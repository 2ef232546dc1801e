package agent

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/internal/atomicfile"
	"github.com/faultline-ml/faultline/trace"
)

// The dotting ring of a rank: a file in /dev/shm that the rank's faultline
// Python package maps and fills with records (the only producer) and that
// the agent drains (the only consumer). Little-endian. Header, 4096 bytes:
//
//	off size field
//	  0    8 magic      "FLTRING\x00"
//	  8    4 version    1
//	 12    4 header     4096
//	 16    8 capacity   bytes of the data area, a power of two, >= 64 KiB
//	 24    4 switch     trace.Kind k on at bit k (agent, live)
//	 28    4 flags      bit 0: time collectives (agent)
//	 32    8 dropped    records the producer dropped (producer, live)
//	 40    8 pid        the producer's pid, written when it attaches
//	 64    8 write      bytes ever written (producer, live)
//	128    8 read       bytes ever consumed (consumer, live)
//
// Index i lies at 4096 + i mod capacity. A record is 8-byte aligned and
// never straddles the end of the data area; a padding record fills it up
// to the end when the next record does not fit:
//
//	off size field
//	  0    4 len        bytes of the record, a multiple of 8
//	  4    1 type       RingRecordType
//	  5    1 domain     0 "default", 1 "communication"
//	  6    2 name_len
//	  8    8 time       unix nanoseconds
//	 16    8 id         a range start and its end share it
//	 24    4 tid
//	 28    4 aux        a collective's element count, or 0
//	 32      name       UTF-8, zero-padded to a multiple of 8
//
// The producer writes a record, then stores write; the consumer loads
// write, reads the records up to it, then stores read. A range's start
// and end records are published together when the range ends.
const (
	RingHeaderSize  = 4096
	RingMinCapacity = 64 << 10
	RingMaxCapacity = 1 << 30

	ringMagic      = "FLTRING\x00"
	ringVersion    = 1
	ringRecordSize = 32

	offCapacity = 16
	offSwitch   = 24
	offFlags    = 28
	offDropped  = 32
	offPid      = 40
	offWrite    = 64
	offRead     = 128
)

// RingTimeCollectives is the flag that asks the producer for the
// collective records (the hang watchdog's input), whatever the switch.
const RingTimeCollectives = 1

// RingRecordType is the type of a ring record.
type RingRecordType uint8

// Record types. A padding record fills the end of the data area; Drain
// skips it.
const (
	RingPadding RingRecordType = iota
	RingRangeStart
	RingRangeEnd
	RingMark
	RingCollectiveStart
	RingCollectiveEnd
	RingCollectiveError
	numRingTypes
)

var ringTypeNames = [numRingTypes]string{"padding", "range start", "range end", "mark", "collective start", "collective end", "collective error"}

// String names t.
func (t RingRecordType) String() string {
	if t < numRingTypes {
		return ringTypeNames[t]
	}
	return fmt.Sprintf("RingRecordType(%d)", uint8(t))
}

// Ring record domains.
const (
	RingDomainDefault       = 0
	RingDomainCommunication = 1
)

// RingRecord is one record of a ring. Name aliases the ring's memory: it
// is valid during the Drain callback only.
type RingRecord struct {
	Type   RingRecordType
	Domain uint8
	Time   int64  // unix nanoseconds
	ID     uint64 // a range's start and end, and a collective's records, share it
	TID    uint32 // the producing thread
	Aux    uint32 // a collective start's element count, if it fits, else 0
	Name   []byte // range and mark names, a collective's CommOp JSON, an error's text
}

// ErrRingCorrupt is wrapped by the errors of Drain that report records
// a producer cannot have written.
var ErrRingCorrupt = errors.New("agent: corrupt dotting ring")

// RingError says what is wrong in a ring, and where.
type RingError struct {
	Path  string
	Index uint64 // the ring index (bytes ever written) of the fault
	Field string
	Msg   string
}

// Error names the ring, the index and the field.
func (e *RingError) Error() string {
	return fmt.Sprintf("agent: dotting ring %s: index %d: %s: %s", e.Path, e.Index, e.Field, e.Msg)
}

// Unwrap lets errors.Is(err, ErrRingCorrupt) hold.
func (e *RingError) Unwrap() error { return ErrRingCorrupt }

// Ring is the consumer's side of one rank's dotting ring. Its methods are
// not safe for concurrent use, except Dropped, Pid, SetSwitch and
// SetFlags, which touch one word each.
type Ring struct {
	path  string
	mem   []byte
	data  []byte
	mask  uint64
	read  uint64 // the consumer's index; also stored at offRead
	rec   RingRecord
	words *[RingHeaderSize / 8]atomic.Uint64
}

// CreateRing creates the ring file at path (mode 0600; atomically
// replacing one there) with a data area of capacity bytes, a power of two
// between RingMinCapacity and RingMaxCapacity, and maps it. The switch
// starts all off and collectives timed (RingTimeCollectives).
func CreateRing(path string, capacity int) (*Ring, error) {
	if capacity < RingMinCapacity || capacity > RingMaxCapacity || bits.OnesCount(uint(capacity)) != 1 {
		return nil, fmt.Errorf("agent: dotting ring %s: capacity %d: want a power of two in [%d, %d]", path, capacity, RingMinCapacity, RingMaxCapacity)
	}
	f, err := atomicfile.Create(path, 0o600)
	if err != nil {
		return nil, fmt.Errorf("agent: dotting ring: %w", err)
	}
	size := RingHeaderSize + capacity
	if err := f.Truncate(int64(size)); err != nil {
		f.Abort()
		return nil, fmt.Errorf("agent: dotting ring %s: size %d: %w", path, size, err)
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		f.Abort()
		return nil, fmt.Errorf("agent: dotting ring %s: map %d bytes: %w", path, size, err)
	}
	le := binary.LittleEndian
	copy(mem, ringMagic)
	le.PutUint32(mem[8:], ringVersion)
	le.PutUint32(mem[12:], RingHeaderSize)
	le.PutUint64(mem[offCapacity:], uint64(capacity))
	le.PutUint32(mem[offFlags:], RingTimeCollectives)
	if err := f.Commit(); err != nil {
		unix.Munmap(mem)
		return nil, fmt.Errorf("agent: dotting ring: %w", err)
	}
	return newRing(path, mem), nil
}

// newRing is the consumer of a ring whose header and capacity are in mem.
func newRing(path string, mem []byte) *Ring {
	c := binary.LittleEndian.Uint64(mem[offCapacity:])
	r := &Ring{
		path:  path,
		mem:   mem,
		data:  mem[RingHeaderSize : RingHeaderSize+c],
		mask:  c - 1,
		words: (*[RingHeaderSize / 8]atomic.Uint64)(unsafe.Pointer(&mem[0])),
	}
	r.read = r.words[offRead/8].Load()
	return r
}

// Path is the ring's file.
func (r *Ring) Path() string { return r.path }

// Dropped is the number of records the producer dropped because the ring
// was full or it had too many ranges open.
func (r *Ring) Dropped() uint64 { return r.words[offDropped/8].Load() }

// Pid is the pid of the process producing into the ring, 0 before one
// attaches.
func (r *Ring) Pid() int { return int(r.words[offPid/8].Load()) }

// SetSwitch sets the kinds the producer dots, at once.
func (r *Ring) SetSwitch(s trace.Switch) {
	var b uint32
	for k := range trace.Kinds() {
		if s.Enabled(k) {
			b |= 1 << k
		}
	}
	r.word32(offSwitch).Store(b)
}

// SetFlags sets the flags word (RingTimeCollectives).
func (r *Ring) SetFlags(flags uint32) { r.word32(offFlags).Store(flags) }

func (r *Ring) word32(off int) *atomic.Uint32 {
	return (*atomic.Uint32)(unsafe.Pointer(&r.mem[off]))
}

// Drain calls fn for each record published since the last Drain, in
// order, then frees their room, and returns how many it delivered. fn
// must not keep rec or rec.Name. A record the producer cannot have written
// (a bad length, type or name length) ends the drain with a *RingError:
// the records before it are delivered and the rest of what is published
// is skipped, so that the next Drain starts at the producer's next record.
// A closed ring delivers nothing.
func (r *Ring) Drain(fn func(rec *RingRecord)) (int, error) {
	if r.mem == nil { // closed
		return 0, nil
	}
	w := r.words[offWrite/8].Load()
	n, err := r.drain(w, fn)
	r.words[offRead/8].Store(r.read)
	return n, err
}

// drain consumes records from r.read up to w.
func (r *Ring) drain(w uint64, fn func(rec *RingRecord)) (int, error) {
	capacity := r.mask + 1
	if w < r.read || w-r.read > capacity || w%8 != 0 {
		return 0, r.corrupt(w, r.read, "write", fmt.Sprintf("write index %d with read index %d and capacity %d", w, r.read, capacity))
	}
	le := binary.LittleEndian
	n := 0
	for r.read < w {
		off := r.read & r.mask
		h := r.data[off:]
		if len(h) < 8 {
			return n, r.corrupt(w, r.read, "len", "record header straddles the end of the data area")
		}
		size := uint64(le.Uint32(h))
		typ := RingRecordType(h[4])
		switch {
		case size < 8 || size%8 != 0:
			return n, r.corrupt(w, r.read, "len", fmt.Sprintf("%d is not a positive multiple of 8", size))
		case size > w-r.read:
			return n, r.corrupt(w, r.read, "len", fmt.Sprintf("%d runs past the write index %d", size, w))
		case off+size > capacity:
			return n, r.corrupt(w, r.read, "len", fmt.Sprintf("%d at offset %d straddles the end of the data area (%d bytes)", size, off, capacity))
		case typ == RingPadding:
			if off+size != capacity {
				return n, r.corrupt(w, r.read, "len", fmt.Sprintf("padding of %d at offset %d stops short of the end (%d)", size, off, capacity))
			}
			r.read += size
			continue
		case typ >= numRingTypes:
			return n, r.corrupt(w, r.read, "type", fmt.Sprintf("%d is no record type", typ))
		case size < ringRecordSize:
			return n, r.corrupt(w, r.read, "len", fmt.Sprintf("%d is shorter than a %s record (%d)", size, typ, ringRecordSize))
		case h[5] > RingDomainCommunication:
			return n, r.corrupt(w, r.read, "domain", fmt.Sprintf("%d is no domain", h[5]))
		}
		nameLen := uint64(le.Uint16(h[6:]))
		if nameLen > size-ringRecordSize {
			return n, r.corrupt(w, r.read, "name_len", fmt.Sprintf("%d does not fit in a record of %d", nameLen, size))
		}
		r.rec = RingRecord{
			Type:   typ,
			Domain: h[5],
			Time:   int64(le.Uint64(h[8:])),
			ID:     le.Uint64(h[16:]),
			TID:    le.Uint32(h[24:]),
			Aux:    le.Uint32(h[28:]),
			Name:   h[ringRecordSize : ringRecordSize+nameLen : ringRecordSize+nameLen],
		}
		r.read += size
		n++
		fn(&r.rec)
	}
	return n, nil
}

// corrupt skips everything published up to w and reports the fault at
// index i.
func (r *Ring) corrupt(w, i uint64, field, msg string) error {
	if w%8 == 0 {
		r.read = w // the producer's next record starts there
	}
	return &RingError{Path: r.path, Index: i, Field: field, Msg: msg}
}

// Close unmaps the ring. The file stays for a producer still writing;
// remove it when the job ends.
func (r *Ring) Close() error {
	if r.mem == nil {
		return nil
	}
	err := unix.Munmap(r.mem)
	r.mem, r.data, r.words = nil, nil, nil
	if err != nil {
		return fmt.Errorf("agent: dotting ring %s: unmap: %w", r.path, err)
	}
	return nil
}
