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
	// fuseChunk is the unit in which a replica is read and checksummed:
	// small enough that the checksum reads from cache what was just read.
	fuseChunk = 64 << 10
	// warmChunk is the unit of copyBlobs's checksums: small, so that warm
	// has all of its cache lines in flight at once and the CRC that
	// follows reads them from L1 (2 KiB measured best on an EPYC core; 4
	// and 8 KiB within 10%).
	warmChunk = 2 << 10
	// copyChunk is the unit of fusedCopyCRC: at least the 1 MiB from
	// which runtime.memmove uses non-temporal stores on amd64, and small
	// enough to stay in the cache between the checksum and the copy.
	copyChunk = 1 << 20
	// cacheLine is the stride of warm.
	cacheLine = 64
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
		warm         byte // what warm read, kept so that its loads stay
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
				p.crc, p.warm = warmCRC(s)
			case sum:
				p.crc, p.warm = fusedCopyCRC(dst[p.blob][p.lo:p.hi], s)
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

// fusedCopyCRC copies src into dst and returns the CRC32C of src, a
// copyChunk at a time: the checksum reads the chunk from memory, warm
// 2 KiB ahead, and leaves it in the cache, from which the copy reads it.
// A copy that large is one runtime.memmove streams past the cache on
// amd64, so the destination is written without being read first: the
// load moves the bytes copy() moves, where checksumming the copy in
// cache-sized pieces read every destination line before writing it, a
// third more memory traffic. A writer that changes src between the two is
// one that broke the segment's protocol (state, then gen), which the
// caller's check of gen after the copy catches. It also returns what warm
// read.
func fusedCopyCRC(dst, src []byte) (crc uint32, w byte) {
	dst = dst[:len(src)]
	for o := 0; o < len(src); o += copyChunk {
		s := src[o:min(o+copyChunk, len(src))]
		for k := 0; k < len(s); k += warmChunk {
			c := s[k:min(k+warmChunk, len(s))]
			w += warm(c)
			crc = crc32.Update(crc, castagnoli, c)
		}
		copy(dst[o:], s)
	}
	return crc, w
}

// warmCRC returns the CRC32C of src, checksummed a warmed chunk at a
// time, and what warm read.
func warmCRC(src []byte) (crc uint32, w byte) {
	for o := 0; o < len(src); o += warmChunk {
		s := src[o:min(o+warmChunk, len(src))]
		w += warm(s)
		crc = crc32.Update(crc, castagnoli, s)
	}
	return crc, w
}

// warm loads one byte of each cache line of b and returns their sum, which
// the caller must keep (or the compiler drops the loads). The loads are
// independent, so the core has all of b's cache misses in flight at once,
// where a CRC's own reads of memory wait on the hardware prefetcher's one
// stream, which leaves a core at about half the memory's bandwidth.
func warm(b []byte) (sum byte) {
	for i := 0; i < len(b); i += cacheLine {
		sum += b[i]
	}
	return sum
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
		*err = fmt.Errorf("ckpt: memory fault at %#x (a shared-memory file cut short under its mapping?): %v; load what the other tiers hold (flashckpt load), then remove the segment and restart its owner, which creates it again", f.Addr(), r)
	}
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)
