package ckpt

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// The benchmarks save, load and persist benchSize bytes in 16 blobs:
// 256 MiB by default, FAULTLINE_CKPT_BENCH_MIB=1024 for the 1 GiB
// in 64 MiB blobs. Each has its baseline beside it: BenchmarkMemcpy (the
// same bytes with copy()) and BenchmarkRawWriteFsync (the same bytes with
// plain writes and one fsync).
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

func BenchmarkSaveMemory(b *testing.B) {
	src := benchBlobs(b)
	_, w := benchWriter(b, "")
	ctx := context.Background()
	b.SetBytes(benchSize())
	b.ReportAllocs()
	b.ResetTimer()
	step := int64(0)
	for b.Loop() {
		if err := w.Save(ctx, step, src...); err != nil {
			b.Fatal(err)
		}
		step++
	}
}

// BenchmarkLoadMemory restores into the buffers of the previous load, as a
// trainer restores into its tensors.
func BenchmarkLoadMemory(b *testing.B) {
	src := benchBlobs(b)
	_, w := benchWriter(b, "")
	ctx := context.Background()
	if err := w.Save(ctx, 1, src...); err != nil {
		b.Fatal(err)
	}
	var ck Checkpoint
	if err := w.LoadInto(ctx, &ck); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(benchSize())
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		if err := w.LoadInto(ctx, &ck); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLoadMemoryAlloc loads into fresh buffers, which the kernel
// must fault in and zero.
func BenchmarkLoadMemoryAlloc(b *testing.B) {
	src := benchBlobs(b)
	_, w := benchWriter(b, "")
	ctx := context.Background()
	if err := w.Save(ctx, 1, src...); err != nil {
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

// BenchmarkPersist times the persist of one shard's step: data file and
// manifest (each written, fsynced, renamed, directory fsynced), the
// commit and the three trackers. Retention, which removes the previous
// step, runs outside the timing, as the baseline's removal does.
func BenchmarkPersist(b *testing.B) {
	src := benchBlobs(b)
	dir := b.TempDir()
	o, w := benchWriter(b, dir)
	ctx := context.Background()
	b.SetBytes(benchSize())
	b.ReportAllocs()
	step := int64(0)
	for b.Loop() {
		b.StopTimer()
		if err := w.Save(ctx, step, src...); err != nil {
			b.Fatal(err)
		}
		if step > 0 {
			if _, err := ApplyRetention(dir, Retention{KeepLatest: 1}); err != nil {
				b.Fatal(err)
			}
		}
		step++
		b.StartTimer()
		if _, err := o.Persist(ctx, 0); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkRawWriteFsync(b *testing.B) {
	src := benchBlobs(b)
	dir := b.TempDir()
	b.SetBytes(benchSize())
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		name := filepath.Join(dir, fmt.Sprint(i))
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
		b.StopTimer()
		os.Remove(name) // as retention does, out of the timing
		b.StartTimer()
		i++
	}
}
