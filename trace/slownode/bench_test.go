package slownode

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"runtime"
	rtmetrics "runtime/metrics"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/trace"
	"github.com/faultline-ml/faultline/trace/slownode/internal/gen"
)

// benchJobs holds the jobs the benchmarks generate, once per process;
// TestMain removes them.
var benchJobs jobCache

type jobCache struct {
	mu   sync.Mutex
	dirs map[string]string
	root string
}

func (c *jobCache) get(b *testing.B, name string, cfg gen.Config) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if d, ok := c.dirs[name]; ok {
		return d
	}
	if c.root == "" {
		root, err := os.MkdirTemp("", "slownode-bench-")
		if err != nil {
			b.Fatal(err)
		}
		c.root, c.dirs = root, map[string]string{}
	}
	cfg.Root, cfg.Job = c.root, name
	start := time.Now()
	if _, err := gen.Generate(cfg); err != nil {
		b.Fatal(err)
	}
	// Written back before anything is measured: the kernel's writeback
	// of half a gigabyte would otherwise share the processors with the
	// first benchmarks.
	syscall.Sync()
	b.Logf("generated %s in %v", name, time.Since(start))
	c.dirs[name] = filepath.Join(c.root, name)
	return c.dirs[name]
}

func (c *jobCache) removeAll() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.root != "" {
		os.RemoveAll(c.root)
	}
}

// bench1k is the benchmark job: 1024 ranks (TP 8 × DP 128, 128
// hosts), 200 steps, a slow rank from step 100, with tensor- and
// data-parallel collectives, dataloader, forward and checkpoint markers.
func bench1k(b *testing.B) string {
	return benchJobs.get(b, "bench1k", gen.Config{TP: 8, DP: 128, PP: 1, Steps: 200, Seed: 1, Chunks: 1,
		CheckpointEach: 100, StepsPerFile: 100,
		Inject: []gen.Injection{{Kind: gen.SlowRank, Rank: 77, From: 100, Factor: 1.4}}})
}

func rankDirs(b *testing.B, job string) []string {
	ranks, err := trace.ListRanks(job)
	if err != nil {
		b.Fatal(err)
	}
	var dirs []string
	for _, r := range ranks {
		dirs = append(dirs, filepath.Join(job, itoa(r)))
	}
	return dirs
}

func itoa(i int) string { return string(appendInt(nil, i)) }

func appendInt(b []byte, i int) []byte {
	if i >= 10 {
		b = appendInt(b, i/10)
	}
	return append(b, byte('0'+i%10))
}

// BenchmarkReadOnly is the baseline: it reads the same files as
// BenchmarkAnalyze, with the reader's buffer size, and parses nothing.
func BenchmarkReadOnly(b *testing.B) { benchReadOnly(b, false) }

// BenchmarkReadOnlyCold is BenchmarkReadOnly with the page cache dropped
// before each run: the files come from disk, as a finished job's do.
// It needs root, and drops the cache of the whole machine.
func BenchmarkReadOnlyCold(b *testing.B) { benchReadOnly(b, true) }

// dropCaches empties the page cache, or skips b where it cannot.
func dropCaches(b *testing.B) {
	b.StopTimer()
	defer b.StartTimer()
	syscall.Sync() // dirty pages, the generator's, are not dropped
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("1"), 0); err != nil {
		b.Skipf("cannot drop the page cache (needs root): %v", err)
	}
}

func benchReadOnly(b *testing.B, cold bool) {
	job := bench1k(b)
	dirs := rankDirs(b, job)
	buf := make([]byte, 256<<10)
	var total int64
	b.ResetTimer()
	for b.Loop() {
		if cold {
			dropCaches(b)
		}
		total = 0
		for _, d := range dirs {
			ents, err := os.ReadDir(d)
			if err != nil {
				b.Fatal(err)
			}
			for _, e := range ents {
				if !trace.IsRecordFileName(e.Name()) {
					continue
				}
				f, err := os.Open(filepath.Join(d, e.Name()))
				if err != nil {
					b.Fatal(err)
				}
				for {
					n, err := f.Read(buf)
					total += int64(n)
					if err == io.EOF {
						break
					}
					if err != nil {
						b.Fatal(err)
					}
				}
				f.Close()
			}
		}
	}
	b.SetBytes(total)
}

// BenchmarkReadParse reads and parses the records with trace.RankReader
// and pairs them, without analysis: what package trace costs.
func BenchmarkReadParse(b *testing.B) {
	job := bench1k(b)
	dirs := rankDirs(b, job)
	var total uint64
	b.ResetTimer()
	for b.Loop() {
		total = 0
		for _, d := range dirs {
			rd, err := trace.OpenRankReader(d, trace.ReaderConfig{})
			if err != nil {
				b.Fatal(err)
			}
			var p trace.Pairer
			if err := rd.Read(func(r *trace.Record) error { p.Add(r); return nil }); err != nil {
				b.Fatal(err)
			}
			total += rd.Stats().Bytes
			rd.Close()
		}
	}
	b.SetBytes(int64(total))
}

// peakHeap samples the heap in use (runtime.MemStats.HeapInuse: the
// spans that hold objects) until stop is called. It reads runtime/metrics,
// which does not stop the world, as runtime.ReadMemStats would a hundred
// times a second under the goroutines measured.
func peakHeap() (stop func() uint64) {
	var peak uint64
	done, quit := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		samples := []rtmetrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}, {Name: "/memory/classes/heap/unused:bytes"}}
		t := time.NewTicker(10 * time.Millisecond)
		defer t.Stop()
		for {
			rtmetrics.Read(samples)
			peak = max(peak, samples[0].Value.Uint64()+samples[1].Value.Uint64())
			select {
			case <-quit:
				return
			case <-t.C:
			}
		}
	}()
	return func() uint64 { close(quit); <-done; return peak }
}

// BenchmarkAnalyze analyses the 1024-rank, 200-step job: read, parse,
// pair, derive steps, evaluate and build the result.
func BenchmarkAnalyze(b *testing.B) { benchAnalyze(b, false) }

// BenchmarkAnalyzeCold is BenchmarkAnalyze with the page cache dropped
// before each run; compare with BenchmarkReadOnlyCold.
func BenchmarkAnalyzeCold(b *testing.B) { benchAnalyze(b, true) }

func benchAnalyze(b *testing.B, cold bool) {
	job := bench1k(b)
	analyze := func() *Result {
		r, err := Analyze(context.Background(), job, Config{})
		if err != nil {
			b.Fatal(err)
		}
		if !equalInts(r.SlowCalculateRanks, 77) {
			b.Errorf("slow ranks %v, want [77]", r.SlowCalculateRanks)
		}
		return r
	}
	var r *Result
	b.ResetTimer()
	for b.Loop() {
		if cold {
			dropCaches(b)
		}
		r = analyze()
	}
	b.StopTimer()
	b.SetBytes(int64(r.Input.Bytes))
	b.ReportMetric(float64(r.Input.Records)*float64(b.N)/b.Elapsed().Seconds(), "records/s")
	b.ReportMetric(float64(untimedPeak(func() { analyze() }))/(1<<20), "peak-heap-MiB")
}

// untimedPeak runs f once more, outside the timed loop, and returns the
// heap's peak meanwhile. The sampler wakes a hundred times a second, and
// its wake-ups alone slowed an analysis it watched by a tenth.
func untimedPeak(f func()) uint64 {
	runtime.GC()
	stop := peakHeap()
	f()
	return stop()
}

// BenchmarkDetectorHour feeds a Detector an hour of a 1024-rank job at
// one step a second (3600 steps), as Watch does while a job runs, and
// reports the heap at its peak: memory does not grow with the steps.
func BenchmarkDetectorHour(b *testing.B) {
	j := newSyncJob(1024, 8, 1)
	steps := j.steps(0)
	hour := func() {
		d, err := New(Config{})
		if err != nil {
			b.Fatal(err)
		}
		d.AddGroups(j.groups())
		for n := int64(0); n < 3600; n++ {
			for r := range steps {
				st := steps[r]
				st.Number = n
				d.AddStep(r, st)
			}
		}
		if r := d.Result(); r.LastStep != 3599 {
			b.Fatalf("last step %d", r.LastStep)
		}
	}
	b.ResetTimer()
	for b.Loop() {
		hour()
	}
	b.StopTimer()
	b.ReportMetric(3600*1024*float64(b.N)/b.Elapsed().Seconds(), "rank-steps/s")
	b.ReportMetric(float64(untimedPeak(hour))/(1<<20), "peak-heap-MiB")
}
