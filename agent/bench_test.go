package agent

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/ckpt"
)

// BenchmarkRecoveryChecks measures what choosing the step to resume from
// costs on a node of 2 ranks, each holding two steps of
// FAULTLINE_AGENT_BENCH_MIB (default 256) MiB: checking every CRC of the
// steps the ranks hold the first time (ranks in parallel), and again
// (nothing is read twice), beside the baseline of the same check done by
// ckpt.InspectSegment one rank after another, as each look of a recovery
// did before (x-inspect is the baseline's time over this one's, both
// timed in each iteration).
func BenchmarkRecoveryChecks(b *testing.B) {
	mib := 256
	if v, err := strconv.Atoi(os.Getenv("FAULTLINE_AGENT_BENCH_MIB")); err == nil && v > 0 {
		mib = v
	}
	a, _, _ := shellAgent(b, 2, 0, `exit 0`)
	defer a.ckpts.release(context.Background(), true)
	for r := range 2 {
		for step := int64(1); step <= 2; step++ {
			saveB(b, a, r, step, mib<<20)
		}
		o, _ := a.ckpts.owner(r)
		if _, _, err := o.Load(context.Background(), r); err != nil { // sealed
			b.Fatal(err)
		}
	}
	inspect := func() {
		for _, s := range a.slots {
			if _, err := ckpt.InspectSegment(a.ckpts.segmentPath(s.rank)); err != nil {
				b.Fatal(err)
			}
		}
	}
	// Each iteration times the check by new owners (nothing verified yet)
	// and the baseline, one after the other.
	b.Run("first", func(b *testing.B) {
		var own, base time.Duration
		for b.Loop() {
			a.ckpts.close()
			start := time.Now()
			if got := a.ckpts.localSteps(); len(got) != 2 {
				b.Fatal(got)
			}
			own += time.Since(start)
			start = time.Now()
			inspect()
			base += time.Since(start)
		}
		b.ReportMetric(float64(own.Milliseconds())/float64(b.N), "ms/check")
		b.ReportMetric(float64(base.Milliseconds())/float64(b.N), "ms/inspect")
		b.ReportMetric(float64(base)/float64(own), "x-inspect")
	})
	b.Run("again", func(b *testing.B) {
		a.ckpts.localSteps()
		var own, base time.Duration
		for b.Loop() {
			start := time.Now()
			if got := a.ckpts.localSteps(); len(got) != 2 {
				b.Fatal(got)
			}
			own += time.Since(start)
			start = time.Now()
			inspect()
			base += time.Since(start)
		}
		b.ReportMetric(float64(own.Microseconds())/float64(b.N), "us/check")
		b.ReportMetric(float64(base.Milliseconds())/float64(b.N), "ms/inspect")
		b.ReportMetric(float64(base)/float64(own), "x-inspect")
	})
}

func saveB(b *testing.B, a *Agent, rank int, step int64, size int) {
	path, _, err := a.ckpts.segment(rank, "", int64(size)+8192)
	if err != nil {
		b.Fatal(err)
	}
	w, err := ckpt.NewWriter(ckpt.WriterConfig{Path: path})
	if err != nil {
		b.Fatal(err)
	}
	defer w.Close()
	data := make([]byte, size)
	for i := range data {
		data[i] = byte(i) ^ byte(step)
	}
	if err := w.Save(context.Background(), step, ckpt.Blob{Name: "w", Data: data}); err != nil {
		b.Fatal(err)
	}
}
