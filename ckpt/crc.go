package ckpt

import (
	"fmt"
	"hash/crc32"
	"runtime"
	"runtime/debug"
	"sync"
)

// crcCombine returns the CRC32C of a||b from crcA = CRC32C(a),
// crcB = CRC32C(b) and lenB = len(b): zlib's crc32_combine with the
// Castagnoli polynomial. It lets workers checksum pieces of one blob in
// parallel.
func crcCombine(crcA, crcB uint32, lenB int64) uint32 {
	if lenB <= 0 {
		return crcA
	}
	var even, odd [32]uint32
	odd[0] = crc32.Castagnoli // the operator for one zero bit
	row := uint32(1)
	for n := 1; n < 32; n++ {
		odd[n] = row
		row <<= 1
	}
	gf2Square(&even, &odd) // two zero bits
	gf2Square(&odd, &even) // four zero bits
	for {
		gf2Square(&even, &odd)
		if lenB&1 != 0 {
			crcA = gf2Times(&even, crcA)
		}
		lenB >>= 1
		if lenB == 0 {
			break
		}
		gf2Square(&odd, &even)
		if lenB&1 != 0 {
			crcA = gf2Times(&odd, crcA)
		}
		lenB >>= 1
		if lenB == 0 {
			break
		}
	}
	return crcA ^ crcB
}

func gf2Times(mat *[32]uint32, vec uint32) uint32 {
	var sum uint32
	for i := 0; vec != 0; i, vec = i+1, vec>>1 {
		if vec&1 != 0 {
			sum ^= mat[i]
		}
	}
	return sum
}

func gf2Square(square, mat *[32]uint32) {
	for n := range 32 {
		square[n] = gf2Times(mat, mat[n])
	}
}

const (
	// fuseChunk is the unit of a fused copy and checksum: small enough that
	// the checksum reads the bytes the copy just brought into cache.
	fuseChunk = 64 << 10
	// minPiece is the least work worth handing to another goroutine.
	minPiece = 4 << 20
)

// copyCRC copies each src[i] into dst[i] (which must have the same length,
// or be nil to checksum only) and returns the CRC32C of each src. The work
// is split over up to workers goroutines, by byte ranges that may cut a
// blob; their CRCs are combined. A fault while touching the memory (a
// shared-memory file truncated under its mapping) is returned as an error
// rather than crashing the process.
func copyCRC(dst, src [][]byte, workers int) ([]uint32, error) {
	var total int64
	for _, s := range src {
		total += int64(len(s))
	}
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	workers = int(max(1, min(int64(workers), total/minPiece)))

	type piece struct {
		blob   int
		lo, hi int
		crc    uint32
	}
	// Cut the concatenation of all blobs into workers equal ranges, then
	// cut those at blob boundaries.
	var pieces []piece
	bounds := make([]int, workers+1) // piece index where each worker starts
	var pos int64
	blob, inBlob := 0, 0
	for w := range workers {
		bounds[w] = len(pieces)
		end := total * int64(w+1) / int64(workers)
		for pos < end {
			for inBlob == len(src[blob]) {
				blob, inBlob = blob+1, 0
			}
			n := int(min(int64(len(src[blob])-inBlob), end-pos))
			pieces = append(pieces, piece{blob: blob, lo: inBlob, hi: inBlob + n})
			inBlob += n
			pos += int64(n)
		}
	}
	bounds[workers] = len(pieces)

	errs := make([]error, workers)
	run := func(w int) {
		defer recoverFault(&errs[w], debug.SetPanicOnFault(true))
		for i := bounds[w]; i < bounds[w+1]; i++ {
			p := &pieces[i]
			s := src[p.blob][p.lo:p.hi]
			var d []byte
			if dst != nil {
				d = dst[p.blob][p.lo:p.hi]
			}
			p.crc = fusedCopyCRC(d, s)
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

	crcs := make([]uint32, len(src))
	started := make([]bool, len(src))
	for _, p := range pieces {
		if !started[p.blob] {
			crcs[p.blob], started[p.blob] = p.crc, true
			continue
		}
		crcs[p.blob] = crcCombine(crcs[p.blob], p.crc, int64(p.hi-p.lo))
	}
	return crcs, nil
}

// fusedCopyCRC copies src into dst (nil: no copy) chunk by chunk and
// returns the CRC32C of src, reading each chunk from cache the second time.
func fusedCopyCRC(dst, src []byte) uint32 {
	var c uint32
	for o := 0; o < len(src); o += fuseChunk {
		e := min(o+fuseChunk, len(src))
		if dst != nil {
			copy(dst[o:e], src[o:e])
			c = crc32.Update(c, castagnoli, dst[o:e])
		} else {
			c = crc32.Update(c, castagnoli, src[o:e])
		}
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
