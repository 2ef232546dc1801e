package hang

import (
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/internal/testkit"
)

var sinkDuration time.Duration

// nowPair is the baseline of the op timer: the two clock reads that any
// timing of an op needs.
func nowPair() {
	start := time.Now()
	sinkDuration += time.Since(start)
}

// BenchmarkTimeNowPair is the baseline of BenchmarkTimerStartEnd alone.
func BenchmarkTimeNowPair(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		nowPair()
	}
}

func BenchmarkTimerStartEnd(b *testing.B) {
	w, err := New(Config{LearnTimeouts: true})
	if err != nil {
		b.Fatal(err)
	}
	op := w.Op("HcclAllReduce", "dp")
	b.ReportAllocs()
	v := testkit.Paired{Base: nowPair, Unit: "x-nowpair"}
	for b.Loop() {
		v.Tick(b)
		op.Start(0).End()
	}
	b.StopTimer()
	v.Report(b)
}

// BenchmarkTimerStartEndInFlight keeps 64 ops in flight, so that every
// Start and End works among that many.
func BenchmarkTimerStartEndInFlight(b *testing.B) {
	w, err := New(Config{LearnTimeouts: true})
	if err != nil {
		b.Fatal(err)
	}
	op := w.Op("HcclAllReduce", "dp")
	var ring [64]Timing
	for i := range ring {
		ring[i] = op.Start(i)
	}
	b.ReportAllocs()
	v := testkit.Paired{Base: nowPair, Unit: "x-nowpair"}
	i := 0
	for b.Loop() {
		v.Tick(b)
		ring[i].End()
		ring[i] = op.Start(i)
		i = (i + 1) % len(ring)
	}
	b.StopTimer()
	v.Report(b)
}

func BenchmarkTimerStartEndParallel(b *testing.B) {
	w, err := New(Config{LearnTimeouts: true})
	if err != nil {
		b.Fatal(err)
	}
	op := w.Op("HcclAllReduce", "dp")
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			op.Start(0).End()
		}
	})
}

func BenchmarkHeartbeatBeat(b *testing.B) {
	w, err := New(Config{})
	if err != nil {
		b.Fatal(err)
	}
	hb := w.Heartbeat("trainer")
	b.ReportAllocs()
	for b.Loop() {
		hb.Beat()
	}
}

// job10k is 10,000 ranks, each with a Python and a native thread of 64
// frames, drawn from 4 distinct stacks per kind that share their
// outermost 40 frames: a job where a few ranks went another way.
func job10k() []*Dump {
	rng := rand.New(rand.NewPCG(10, 10000))
	stacks := func(kind Kind) [][]Frame {
		out := make([][]Frame, 4)
		for s := range out {
			fs := make([]Frame, 64)
			for i := range fs {
				depth := 63 - i // fs[0] innermost
				if depth < 40 {
					fs[i] = Frame{Func: fmt.Sprintf("%s_common_%d", kind, depth), File: "/opt/lib/common.py", Line: depth + 1}
				} else {
					fs[i] = Frame{Func: fmt.Sprintf("%s_path%d_%d", kind, s, depth), File: fmt.Sprintf("/opt/lib/path%d.py", s), Line: depth}
				}
			}
			out[s] = fs
		}
		return out
	}
	py, native := stacks(KindPython), stacks(KindNative)
	dumps := make([]*Dump, 10000)
	for r := range dumps {
		s := 0
		if x := rng.IntN(1000); x < 3 {
			s = 1 + x // about 0.1% of the ranks in each of three odd places
		}
		dumps[r] = &Dump{Rank: r, World: 10000, Host: fmt.Sprintf("node-%d", r/8), State: "S (sleeping)", Threads: []Thread{
			{Kind: KindPython, ID: uint64(r), Name: "MainThread", Frames: py[s]},
			{Kind: KindNative, ID: uint64(r), Name: "python3", Frames: native[s]},
		}}
	}
	return dumps
}

// BenchmarkCopy10kRankFrames is the baseline of BenchmarkMerge10kRanks:
// copying every frame of the job once.
func BenchmarkCopy10kRankFrames(b *testing.B) {
	dumps := job10k()
	dst := make([]Frame, 0, 10000*128)
	b.ReportAllocs()
	for b.Loop() {
		dst = dst[:0]
		for _, d := range dumps {
			for _, t := range d.Threads {
				dst = append(dst, t.Frames...)
			}
		}
	}
}

func BenchmarkMerge10kRanks(b *testing.B) {
	dumps := job10k()
	b.ReportAllocs()
	for b.Loop() {
		m, err := Merge(dumps, MergeConfig{})
		if err != nil || m.Ranks.Len() != 10000 {
			b.Fatal(err, m.Ranks)
		}
	}
}

// BenchmarkMerge10kRanksOutputs adds every output to the merge: folded
// stacks and SVG for both kinds, the pprof profile and the verdict.
func BenchmarkMerge10kRanksOutputs(b *testing.B) {
	dumps := job10k()
	b.ReportAllocs()
	for b.Loop() {
		m, err := Merge(dumps, MergeConfig{})
		if err != nil {
			b.Fatal(err)
		}
		for _, k := range []Kind{KindPython, KindNative} {
			m.WriteFolded(io.Discard, k)
			m.WriteSVG(io.Discard, k)
		}
		m.WritePprof(io.Discard)
		_ = m.Verdict()
	}
}

// writeJob10k writes the 10,000 rank files into a temporary folder.
func writeJob10k(b testing.TB) string {
	dir := b.TempDir()
	for _, d := range job10k() {
		data, err := d.Marshal()
		if err != nil {
			b.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, FileName(d.Rank, d.World)), data, 0o644); err != nil {
			b.Fatal(err)
		}
	}
	return dir
}

// BenchmarkReadFiles10kRanks is the baseline of BenchmarkMergeDir10kRanks:
// reading the 10,000 files raw.
func BenchmarkReadFiles10kRanks(b *testing.B) {
	dir := writeJob10k(b)
	entries, err := os.ReadDir(dir)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	for b.Loop() {
		for _, e := range entries {
			if _, err := os.ReadFile(filepath.Join(dir, e.Name())); err != nil {
				b.Fatal(err)
			}
		}
	}
}

func BenchmarkMergeDir10kRanks(b *testing.B) {
	dir := writeJob10k(b)
	b.ReportAllocs()
	for b.Loop() {
		m, err := MergeDir(dir, MergeConfig{})
		if err != nil || m.Ranks.Len() != 10000 || len(m.Problems) != 0 {
			b.Fatal(err, m.Ranks, m.Problems)
		}
	}
}

// TestMergeDir10kRanks merges 10,000 rank files from disk (a few seconds
// under -race).
func TestMergeDir10kRanks(t *testing.T) {
	dir := writeJob10k(t)
	start := time.Now()
	m, err := MergeDir(dir, MergeConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("merged 10,000 files in %v", time.Since(start))
	if m.World != 10000 || m.Ranks.Len() != 10000 || len(m.Problems) != 0 {
		t.Fatalf("world %d ranks %d problems %v", m.World, m.Ranks.Len(), m.Problems)
	}
	splits := m.Splits()
	if len(splits) != 2 {
		t.Fatalf("%d splits, want one per kind", len(splits))
	}
	for _, s := range splits {
		total := 0
		for _, g := range s.Groups {
			total += g.Ranks.Len()
		}
		if len(s.Groups) != 4 || total != 10000 || s.Groups[0].Ranks.Len() > 100 {
			t.Errorf("%s split: %d groups of %d ranks, smallest %d", s.Kind, len(s.Groups), total, s.Groups[0].Ranks.Len())
		}
	}
	t.Log(m.Verdict())
}
