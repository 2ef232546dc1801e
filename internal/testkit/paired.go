package testkit

import (
	"testing"
	"time"
)

// Paired runs a batch of a benchmark's baseline, with the benchmark's
// timer stopped, every 1024 iterations of its loop, and reports the
// benchmark's time per iteration as a multiple of the baseline's (the
// metric Unit, "x-nowpair", say): on a shared machine the two then run
// under the same load, which a ratio of two separate benchmarks does not.
type Paired struct {
	Base func() // one iteration of the baseline
	Unit string // the metric's name
	i, n int
	d    time.Duration
}

const pairedBatch = 1024

// Tick is called once an iteration of the benchmark's loop.
func (p *Paired) Tick(b *testing.B) {
	if p.i++; p.i%pairedBatch != 1 {
		return
	}
	b.StopTimer()
	t := time.Now()
	for range pairedBatch {
		p.Base()
	}
	p.d += time.Since(t)
	p.n += pairedBatch
	b.StartTimer()
}

// Report reports the ratio once the benchmark's loop is done.
func (p *Paired) Report(b *testing.B) {
	if p.n > 0 && p.d > 0 && b.N > 0 {
		per := float64(b.Elapsed()) / float64(b.N)
		b.ReportMetric(per/(float64(p.d)/float64(p.n)), p.Unit)
	}
}
