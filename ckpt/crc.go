package ckpt

import (
	"fmt"
	"hash/crc32"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
)

// crcCombine returns the CRC32C of a||b from crcA = CRC32C(a),
// crcB = CRC32C(b) and lenB = len(b), as zlib's crc32_combine does: crcA
// times x^(8*lenB) modulo the polynomial, plus crcB. It lets workers
// checksum pieces of one blob in parallel, in O(log lenB).
func crcCombine(crcA, crcB uint32, lenB int64) uint32 {
	if lenB <= 0 {
		return crcA
	}
	return multModP(xPow8N(lenB), crcA) ^ crcB
}

// multModP returns a(x)*b(x) modulo the Castagnoli polynomial, in the
// reflected bit order of CRC-32 (bit 31 is x^0).
func multModP(a, b uint32) uint32 {
	var p uint32
	for m := uint32(1) << 31; m != 0 && a != 0; m >>= 1 {
		if a&m != 0 {
			p ^= b
			a ^= m
		}
		if b&1 != 0 {
			b = b>>1 ^ crc32.Castagnoli
		} else {
			b >>= 1
		}
	}
	return p
}

// xPow8N returns x^(8n) modulo the polynomial: the operator that appends
// n zero bytes to a CRC.
func xPow8N(n int64) uint32 {
	p := uint32(1) << 31  // x^0
	sq := uint32(1) << 23 // x^8
	for ; n > 0; n >>= 1 {
		if n&1 != 0 {
			p = multModP(sq, p)
		}
		sq = multModP(sq, sq)
	}
	return p
}

const (
	// fuseChunk is the unit of a fused copy and checksum: small enough that
	// the checksum reads the bytes the copy just brought into cache (the
	// L1 and L2 of one core).
	fuseChunk = 64 << 10
	// pieceSize is the unit of work a copy or checksum worker takes at a
	// time. Workers take pieces until none is left, so that on a loaded
	// machine a worker that gets less CPU does less of the work.
	pieceSize = 4 << 20
	// minParallel is the least data per worker worth another goroutine.
	minParallel = 4 << 20
)

// copyBlobs copies each src[i] into dst[i] (which must have the same
// length; dst nil: no copy) and, with sum, returns the CRC32C of each
// blob. The work is cut into pieces of at most pieceSize bytes of one
// blob, which up to workers goroutines (default GOMAXPROCS) take in turn;
// the CRCs of a blob's pieces are then combined. A fault while touching
// the memory (a shared-memory file truncated under its mapping) is
// returned as an error rather than crashing the process.
func copyBlobs(dst, src [][]byte, workers int, sum bool) ([]uint32, error) {
	type piece struct {
		blob, lo, hi int
		crc          uint32
	}
	var pieces []piece
	var total int64
	for b, s := range src {
		total += int64(len(s))
		for lo := 0; lo < len(s); lo += pieceSize {
			pieces = append(pieces, piece{blob: b, lo: lo, hi: min(lo+pieceSize, len(s))})
		}
	}
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	workers = int(max(1, min(int64(workers), int64(len(pieces)), total/minParallel)))

	var next atomic.Int64
	errs := make([]error, workers)
	run := func(w int) {
		defer recoverFault(&errs[w], debug.SetPanicOnFault(true))
		for {
			i := next.Add(1) - 1
			if i >= int64(len(pieces)) {
				return
			}
			p := &pieces[i]
			s := src[p.blob][p.lo:p.hi]
			switch {
			case dst == nil:
				p.crc = crc32.Update(0, castagnoli, s)
			case sum:
				p.crc = fusedCopyCRC(dst[p.blob][p.lo:p.hi], s)
			default:
				copy(dst[p.blob][p.lo:p.hi], s)
			}
		}
	}
	var wg sync.WaitGroup
	for w := 1; w < workers; w++ {
		wg.Go(func() { run(w) })
	}
	run(0)
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return nil, err
		}
	}
	if !sum {
		return nil, nil
	}
	crcs := make([]uint32, len(src))
	for _, p := range pieces {
		if p.lo == 0 {
			crcs[p.blob] = p.crc
			continue
		}
		crcs[p.blob] = crcCombine(crcs[p.blob], p.crc, int64(p.hi-p.lo))
	}
	return crcs, nil
}

// fusedCopyCRC copies src into dst chunk by chunk and returns the CRC32C
// of what it copied, reading each chunk from cache the second time.
func fusedCopyCRC(dst, src []byte) uint32 {
	var c uint32
	for o := 0; o < len(src); o += fuseChunk {
		e := min(o+fuseChunk, len(src))
		copy(dst[o:e], src[o:e])
		c = crc32.Update(c, castagnoli, dst[o:e])
	}
	return c
}

// recoverFault is deferred, with the previous setting of
// debug.SetPanicOnFault, by every function that touches a mapped segment:
//
//	defer recoverFault(&err, debug.SetPanicOnFault(true))
//
// A segment file cut short under its mapping (say, by a trainer that
// opened it for writing with truncation) then fails that call with an
// error in *err instead of killing the process with SIGBUS. Any other
// panic goes on.
func recoverFault(err *error, old bool) {
	debug.SetPanicOnFault(old)
	if r := recover(); r != nil {
		f, ok := r.(interface{ Addr() uintptr })
		if !ok {
			panic(r)
		}
		*err = fmt.Errorf("ckpt: memory fault at %#x (shared-memory file truncated?): %v", f.Addr(), r)
	}
}
