package trace

import (
	"sync/atomic"

	"golang.org/x/sys/cpu"
)

// Name forms of an entry.
const (
	nameLiteral = iota // name as given
	nameStep           // "step <step>"
	nameComm           // the side's op as JSON
	nameNone           // an end record: no name, no domain
	nameRecord         // the whole record is the side's rec
)

// entry is one record waiting in the ring, in one cache line with its
// cell's sequence: the fields a Recorder's record does not share with
// every other are kept, and names in the form the caller gave them, so
// that the caller's thread stores one line and the writer goroutine
// builds and encodes the record. What a few records need more (a CommOp,
// a record built elsewhere) is in the ring's side table.
type entry struct {
	ts, id      uint64
	name        string
	step        uint64
	dev, stream uint32
	flag        uint8 // a Flag; every flag fits
	form        uint8
	dom         uint8
}

type cell struct {
	seq atomic.Uint64 // pos+1 once the entry at pos is published
	e   entry
}

// side is what an entry at the same position carries beyond its cell.
type side struct {
	op  CommOp
	rec Record
}

// ring is a bounded multi-producer, single-consumer queue of entries: the
// bounded MPMC array queue of D. Vyukov with a single consumer. Producers
// claim a slot with one CAS and publish it with one store; a full ring
// refuses the entry instead of waiting. Nothing on the producer side
// allocates or locks.
type ring struct {
	_     cpu.CacheLinePad
	tail  atomic.Uint64 // next position to claim
	_     cpu.CacheLinePad
	head  uint64 // next position to consume; consumer only
	mask  uint64
	cells []cell
	sides []side
}

func newRing(size int) *ring {
	n := 64
	for n < size {
		n <<= 1
	}
	q := &ring{mask: uint64(n - 1), cells: make([]cell, n), sides: make([]side, n)}
	for i := range q.cells {
		q.cells[i].seq.Store(uint64(i))
	}
	return q
}

// claim reserves the next slot. The caller fills c.e, and for the forms
// nameComm and nameRecord q.side(pos), and then calls c.seq.Store(pos+1).
// It reports false when the ring is full.
func (q *ring) claim() (c *cell, pos uint64, ok bool) {
	pos = q.tail.Load()
	for {
		c = &q.cells[pos&q.mask]
		seq := c.seq.Load()
		switch d := int64(seq - pos); {
		case d == 0:
			if q.tail.CompareAndSwap(pos, pos+1) {
				return c, pos, true
			}
			pos = q.tail.Load()
		case d < 0:
			return nil, 0, false // the consumer has not freed this slot yet
		default:
			pos = q.tail.Load() // another producer took it
		}
	}
}

// side returns the side of the entry at pos.
func (q *ring) side(pos uint64) *side { return &q.sides[pos&q.mask] }

// consume calls fn for each published entry in order, up to max of them,
// and frees their slots. It stops at the first slot claimed but not yet
// published. Consumer only.
func (q *ring) consume(max int, fn func(*entry, *side)) int {
	n := 0
	for ; n < max; n++ {
		c := &q.cells[q.head&q.mask]
		if c.seq.Load() != q.head+1 {
			break
		}
		sd := q.side(q.head)
		fn(&c.e, sd)
		// Drop references to the caller's strings.
		switch c.e.form {
		case nameComm:
			sd.op = CommOp{}
		case nameRecord:
			sd.rec = Record{}
		}
		c.e = entry{}
		c.seq.Store(q.head + q.mask + 1)
		q.head++
	}
	return n
}
