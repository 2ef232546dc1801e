package ckpt

import (
	"bytes"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

func TestCRCCombine(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	buf := make([]byte, 1<<16)
	for i := range buf {
		buf[i] = byte(r.Uint32())
	}
	for range 200 {
		n := r.IntN(len(buf))
		cut := r.IntN(n + 1)
		a, b := buf[:cut], buf[cut:n]
		if got, want := crcCombine(layout.CRC32C(a), layout.CRC32C(b), int64(len(b))), layout.CRC32C(buf[:n]); got != want {
			t.Fatalf("combine at %d of %d = %#x, want %#x", cut, n, got, want)
		}
	}
}

func TestCopyBlobsSplitsBlobs(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	sizes := []int{0, 9 << 20, 1, 5 << 20, 0, 3<<20 + 7}
	var src, dst [][]byte
	for _, n := range sizes {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(r.Uint32())
		}
		src, dst = append(src, b), append(dst, make([]byte, n))
	}
	zero := func() {
		for _, d := range dst {
			for i := range d {
				d[i] = 0
			}
		}
	}
	for _, workers := range []int{1, 2, 3, 7} {
		zero()
		crcs, err := copyBlobs(dst, src, workers, true)
		if err != nil {
			t.Fatal(err)
		}
		for i := range src {
			if crcs[i] != layout.CRC32C(src[i]) || !bytes.Equal(dst[i], src[i]) {
				t.Fatalf("workers %d blob %d: crc %#x want %#x, copy equal %v", workers, i, crcs[i], layout.CRC32C(src[i]), bytes.Equal(dst[i], src[i]))
			}
		}
		if crcs, err := copyBlobs(nil, src, workers, true); err != nil || !slices.Equal(crcs, func() []uint32 {
			var c []uint32
			for _, s := range src {
				c = append(c, layout.CRC32C(s))
			}
			return c
		}()) {
			t.Fatalf("workers %d, checksum only: %x, %v", workers, crcs, err)
		}
		zero()
		if crcs, err := copyBlobs(dst, src, workers, false); err != nil || crcs != nil {
			t.Fatalf("workers %d, copy only: %x, %v", workers, crcs, err)
		}
		for i := range src {
			if !bytes.Equal(dst[i], src[i]) {
				t.Fatalf("workers %d, copy only: blob %d differs", workers, i)
			}
		}
	}
}

// TestFusedCopyCRCLengths checks the copy and the CRC of lengths around
// the cache line and the chunks, and that a flipped bit anywhere changes
// the CRC.
func TestFusedCopyCRCLengths(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	src := make([]byte, 2*copyChunk+warmChunk+1)
	for i := range src {
		src[i] = byte(r.Uint32())
	}
	for _, n := range []int{0, 1, cacheLine - 1, cacheLine, cacheLine + 1, warmChunk - 1, warmChunk, warmChunk + 1, 3*warmChunk + cacheLine + 1,
		copyChunk - 1, copyChunk, copyChunk + 1, 2*copyChunk + warmChunk + 1} {
		s := src[:n]
		dst := make([]byte, n)
		crc, _ := fusedCopyCRC(dst, s)
		if want := layout.CRC32C(s); crc != want || !bytes.Equal(dst, s) {
			t.Fatalf("length %d: crc %#x want %#x, copy equal %v", n, crc, want, bytes.Equal(dst, s))
		}
		if crc, _ := warmCRC(s); crc != layout.CRC32C(s) {
			t.Fatalf("length %d: warmCRC %#x want %#x", n, crc, layout.CRC32C(s))
		}
		for range 8 {
			if n == 0 {
				break
			}
			f := bytes.Clone(s)
			f[r.IntN(n)] ^= 1 << r.IntN(8)
			if crc, _ := fusedCopyCRC(dst, f); crc == layout.CRC32C(s) {
				t.Fatalf("length %d: a flipped bit kept the CRC", n)
			}
		}
	}
}
