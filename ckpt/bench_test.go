package ckpt

import (
	"context"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// The benchmarks save, seal, load and persist benchSize bytes in 16
// blobs: 256 MiB by default, FAULTLINE_CKPT_BENCH_MIB=1024 for the issue's
// 1 GiB in 64 MiB blobs. Each has its baseline beside it: BenchmarkMemcpy
// (the same bytes with copy()), BenchmarkCRC32C (hash/crc32 Castagnoli
// over the same bytes, on one goroutine) and BenchmarkRawWriteFsync (the
// same bytes with plain writes and one fsync). The disk benchmarks write
// under FAULTLINE_CKPT_BENCH_DIR (default the test's temporary directory);
// a tmpfs there measures persist's own cost without the disk's.
func benchDir(b *testing.B) string {
	if d := os.Getenv("FAULTLINE_CKPT_BENCH_DIR"); d != "" {
		dir, err := os.MkdirTemp(d, "bench-")
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { os.RemoveAll(dir) })
		return dir
	}
	return b.TempDir()
}

func benchSize() int64 {
	if n, err := strconv.Atoi(os.Getenv("FAULTLINE_CKPT_BENCH_MIB")); err == nil && n >= 16 {
		return int64(n) << 20
	}
	return 256 << 20
}

func benchBlobs(b *testing.B) []Blob {
	total := benchSize()
	out := make([]Blob, 16)
	for i := range out {
		d := make([]byte, total/16)
		for j := 0; j < len(d); j += 4096 {
			d[j] = byte(i + j)
		}
		out[i] = Blob{Name: fmt.Sprintf("layer.%02d", i), Data: d}
	}
	return out
}

func benchWriter(b *testing.B, dir string) (*Owner, *Writer) {
	o, err := NewOwner(OwnerConfig{ShmDir: shmDir(b), Shards: []int{0}, Capacity: benchSize() + 1<<20, Dir: dir,
		Retention: Retention{KeepLatest: -1}})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { o.Remove() })
	w, err := NewWriter(WriterConfig{Path: o.SegmentPath(0)})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { w.Close() })
	return o, w
}

func BenchmarkMemcpy(b *testing.B) {
	src := benchBlobs(b)
	dst := make([][]byte, len(src))
	for i := range src {
		dst[i] = make([]byte, len(src[i].Data))
		copy(dst[i], src[i].Data) // fault the pages in, as the segment's are
	}
	b.SetBytes(benchSize())
	b.ResetTimer()
	for b.Loop() {
		for i := range src {
			copy(dst[i], src[i].Data)
		}
	}
}

func BenchmarkCRC32C(b *testing.B) {
	crc := crcBaseline(benchBlobs(b))
	b.SetBytes(benchSize())
	for b.Loop() {
		crc()
	}
}

// paired measures a baseline beside the benchmark, iteration by
// iteration with the timer stopped, and reports the benchmark's bandwidth
// as a fraction of the baseline's ("x-memcpy", "x-crc32", "x-rawwrite"):
// on a shared machine, pairing cancels most of the load's swings.
type paired struct {
	name      string
	base, run time.Duration
}

func (p *paired) baseline(b *testing.B, f func()) {
	b.StopTimer()
	t := time.Now()
	f()
	p.base += time.Since(t)
	b.StartTimer()
}

func (p *paired) timed(f func()) {
	t := time.Now()
	f()
	p.run += time.Since(t)
}

func (p *paired) report(b *testing.B) {
	if p.run > 0 {
		b.ReportMetric(float64(p.base)/float64(p.run), p.name)
	}
}

func memcpyBaseline(src []Blob) func() {
	dst := make([][]byte, len(src))
	for i := range src {
		dst[i] = make([]byte, len(src[i].Data))
		copy(dst[i], src[i].Data)
	}
	return func() {
		for i := range src {
			copy(dst[i], src[i].Data)
		}
	}
}

// BenchmarkSaveMemory times what blocks the trainer: the copy into shared
// memory, over GOMAXPROCS goroutines.
func BenchmarkSaveMemory(b *testing.B) {
	src := benchBlobs(b)
	_, w := benchWriter(b, "")
	ctx := context.Background()
	memcpy := memcpyBaseline(src)
	p := paired{name: "x-memcpy"}
	b.SetBytes(benchSize())
	b.ReportAllocs()
	b.ResetTimer()
	step := int64(0)
	for b.Loop() {
		p.baseline(b, memcpy)
		p.timed(func() {
			if err := w.Save(ctx, step, src...); err != nil {
				b.Fatal(err)
			}
		})
		step++
	}
	p.report(b)
}

// BenchmarkLoadMemory restores a sealed step into the buffers of the
// previous load, as a trainer restores into its tensors, checking every
// CRC.
func BenchmarkLoadMemory(b *testing.B) {
	src := benchBlobs(b)
	o, w := benchWriter(b, "")
	ctx := context.Background()
	if err := w.Save(ctx, 1, src...); err != nil {
		b.Fatal(err)
	}
	if err := o.Seal(ctx, 0); err != nil {
		b.Fatal(err)
	}
	var ck Checkpoint
	if err := w.LoadInto(ctx, &ck); err != nil || ck.Unverified {
		b.Fatal(err)
	}
	memcpy := memcpyBaseline(src)
	p := paired{name: "x-memcpy"}
	// The CRC bounds a verified load: its ratio to one goroutine's CRC32C
	// says how much of the CRC's speed the load keeps.
	q := paired{name: "x-crc32"}
	b.SetBytes(benchSize())
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		p.baseline(b, memcpy)
		q.baseline(b, crcBaseline(src))
		p.timed(func() {
			if err := w.LoadInto(ctx, &ck); err != nil {
				b.Fatal(err)
			}
		})
	}
	q.run = p.run
	p.report(b)
	q.report(b)
}

// crcBaseline returns the CRC32C of src on one goroutine: the baseline of
// what checksums.
func crcBaseline(src []Blob) func() {
	return func() {
		for i := range src {
			crc32.Checksum(src[i].Data, castagnoli)
		}
	}
}

// BenchmarkSeal times the owner's seal of a save: the CRC of every blob,
// read from shared memory over GOMAXPROCS goroutines, and the stores of
// the seal.
func BenchmarkSeal(b *testing.B) {
	src := benchBlobs(b)
	o, w := benchWriter(b, "")
	ctx := context.Background()
	if err := w.Save(ctx, 1, src...); err != nil {
		b.Fatal(err)
	}
	seg := o.segs[0]
	i := seg.newest()[0]
	crc := crcBaseline(src)
	p := paired{name: "x-crc32"}
	b.SetBytes(benchSize())
	b.ReportAllocs()
	for b.Loop() {
		b.StopTimer()
		atomic.StoreUint32(seg.u32(seg.halfBase(i)+layout.OffSeal), layout.Unsealed) // as a new save would leave it
		b.StartTimer()
		p.baseline(b, crc)
		p.timed(func() {
			if err := o.Seal(ctx, 0); err != nil {
				b.Fatal(err)
			}
		})
	}
	b.StopTimer()
	if m, _ := seg.metaOK(i); !m.Sealed {
		b.Fatal("not sealed")
	}
	p.report(b)
}

// BenchmarkLoadMemoryAlloc loads into fresh buffers, which the kernel
// must fault in and zero.
func BenchmarkLoadMemoryAlloc(b *testing.B) {
	src := benchBlobs(b)
	o, w := benchWriter(b, "")
	ctx := context.Background()
	if err := w.Save(ctx, 1, src...); err != nil {
		b.Fatal(err)
	}
	if err := o.Seal(ctx, 0); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(benchSize())
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		if _, err := w.Load(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkPersist times the persist of one shard's sealed step: data
// file and manifest (each written, fsynced, renamed, directory fsynced),
// the commit and the three trackers. The seal, which Run does as soon as
// the save is made (BenchmarkSeal), and retention, which removes the
// previous step, run outside the timing, as the baseline's removal does.
func BenchmarkPersist(b *testing.B) {
	src := benchBlobs(b)
	dir := benchDir(b)
	o, w := benchWriter(b, dir)
	ctx := context.Background()
	raw, removeRaw := rawWriteFsync(b, src)
	p := paired{name: "x-rawwrite"}
	b.SetBytes(benchSize())
	b.ReportAllocs()
	step := int64(0)
	for b.Loop() {
		b.StopTimer()
		if err := w.Save(ctx, step, src...); err != nil {
			b.Fatal(err)
		}
		if err := o.Seal(ctx, 0); err != nil {
			b.Fatal(err)
		}
		if step > 0 {
			if _, err := ApplyRetention(dir, Retention{KeepLatest: 1}); err != nil {
				b.Fatal(err)
			}
		}
		removeRaw()
		step++
		b.StartTimer()
		persist := func() {
			p.timed(func() {
				if _, err := o.Persist(ctx, 0); err != nil {
					b.Fatal(err)
				}
			})
		}
		// Alternate which goes first: the second meets the first's
		// writeback on the disk.
		if step%2 == 0 {
			p.baseline(b, raw)
			persist()
		} else {
			persist()
			p.baseline(b, raw)
		}
	}
	p.report(b)
}

// rawWriteFsync returns the baseline of BenchmarkPersist, the same bytes
// written to a new file with plain writes and one fsync, and a function
// that removes the file it wrote.
func rawWriteFsync(b *testing.B, src []Blob) (write, remove func()) {
	dir := benchDir(b)
	i := 0
	name := ""
	remove = func() {
		if name != "" {
			os.Remove(name)
		}
	}
	return func() {
		name = filepath.Join(dir, fmt.Sprint(i))
		i++
		f, err := os.Create(name)
		if err != nil {
			b.Fatal(err)
		}
		for _, s := range src {
			if _, err := f.Write(s.Data); err != nil {
				b.Fatal(err)
			}
		}
		if err := f.Sync(); err != nil {
			b.Fatal(err)
		}
		f.Close()
	}, remove
}

func BenchmarkRawWriteFsync(b *testing.B) {
	src := benchBlobs(b)
	write, remove := rawWriteFsync(b, src)
	b.SetBytes(benchSize())
	b.ReportAllocs()
	for b.Loop() {
		write()
		b.StopTimer()
		remove() // as retention does, outside the timing
		b.StartTimer()
	}
}
