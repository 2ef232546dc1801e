package trace

import (
	"sync/atomic"

	"golang.org/x/sys/cpu"
)

// Name forms of an entry.
const (
	nameLiteral = iota // rec.Name as given
	nameStep           // "step <step>"
	nameComm           // op as JSON
)

// entry is one record waiting in the ring. Names are kept in the form the
// caller gave them and encoded by the writer goroutine, off the caller's
// path.
type entry struct {
	rec      Record
	op       CommOp
	step     uint64
	nameForm uint8
	dom      uint8
}

type cell struct {
	seq atomic.Uint64 // pos+1 once the entry at pos is published
	e   entry
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
}

func newRing(size int) *ring {
	n := 64
	for n < size {
		n <<= 1
	}
	q := &ring{mask: uint64(n - 1), cells: make([]cell, n)}
	for i := range q.cells {
		q.cells[i].seq.Store(uint64(i))
	}
	return q
}

// claim reserves the next slot. The caller fills c.e and then calls
// c.seq.Store(pos+1). It reports false when the ring is full.
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

// consume calls fn for each published entry in order, up to max of them,
// and frees their slots. It stops at the first slot claimed but not yet
// published. Consumer only.
func (q *ring) consume(max int, fn func(*entry)) int {
	n := 0
	for ; n < max; n++ {
		c := &q.cells[q.head&q.mask]
		if c.seq.Load() != q.head+1 {
			break
		}
		fn(&c.e)
		c.e = entry{} // drop references to the caller's strings
		c.seq.Store(q.head + q.mask + 1)
		q.head++
	}
	return n
}
