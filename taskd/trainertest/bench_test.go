package trainertest_test

import (
	"context"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/taskd"
)

// BenchmarkRecoveryInPlace measures, on a job of 64 worker processes with
// fake trainers (4 nodes of 16, a proxy process each, loopback), the time
// from a worker's SIGKILL to every rank training again after an in-place
// restart of it: the figures the manager reports (fault to detected,
// stopped and resumed), p50 and p99. The baseline, in the same run and on
// the same job, is a bare broadcast round trip to the 64 workers. Run
// with -benchtime=20x.
func BenchmarkRecoveryInPlace(b *testing.B) {
	j := startJob(b, jobConfig{nodes: 4, ppn: 16, stepTime: 20 * time.Millisecond, saveEvery: 5, timeouts: recoveryTimeouts()})
	world := 64
	b.Run("recovery/workers=64", func(b *testing.B) {
		var detected, stopped, resumed []time.Duration
		b.ResetTimer()
		for i := range b.N {
			rank := (7 + 13*i) % world
			j.signal(b, rank, syscall.SIGKILL)
			rec := j.next(b, taskd.KindRecovery)
			if rec.State != taskd.StateRecovered || rec.Strategy != taskd.StrategyRecoverInPlace {
				b.Fatalf("recovery %+v", rec)
			}
			detected, stopped, resumed = append(detected, rec.Detected), append(stopped, rec.Stopped), append(resumed, rec.Resumed)
		}
		b.StopTimer()
		report(b, "detected", detected)
		report(b, "stopped", stopped)
		report(b, "resumed", resumed)
	})
	b.Run("baseline-broadcast/workers=64", func(b *testing.B) {
		var rtt []time.Duration
		b.ResetTimer()
		for range b.N {
			start := time.Now()
			ds, err := j.m.Broadcast(context.Background(), taskd.AllWorkers(), "bench/ping", nil)
			if err != nil || len(ds) != world {
				b.Fatalf("broadcast: %d deliveries, %v", len(ds), err)
			}
			for _, d := range ds {
				if d.Err != nil {
					b.Fatalf("rank %d: %v", d.Rank, d.Err)
				}
			}
			rtt = append(rtt, time.Since(start))
		}
		b.StopTimer()
		report(b, "rtt", rtt)
	})
}

// report adds the p50 and p99 of ds, in milliseconds.
func report(b *testing.B, name string, ds []time.Duration) {
	slices.Sort(ds)
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	b.ReportMetric(ms(ds[len(ds)/2]), name+"-p50-ms")
	b.ReportMetric(ms(ds[(len(ds)*99)/100]), name+"-p99-ms")
}
