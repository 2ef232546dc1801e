package rescheduling

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// stormFaults returns n faults from nodes nodes, within one second: each
// node's processes exit, hang, lose heartbeats and log errors at once.
func stormFaults(n, nodes int, t0 time.Time) []Fault {
	out := make([]Fault, n)
	for i := range out {
		node := i % nodes
		f := Fault{
			Node:     fmt.Sprintf("node-%04d", node),
			Pod:      fmt.Sprintf("job-worker-%04d", node),
			Process:  fmt.Sprint((i / nodes) % 8),
			Time:     t0.Add(time.Duration(i) * 100 * time.Microsecond),
			Kind:     KindExit,
			ExitCode: []int{1, 9, 137, 139, 134}[i%5],
		}
		switch i % 7 {
		case 3:
			f.Kind, f.ExitCode = KindHang, 0
		case 5:
			f.Kind, f.ExitCode = KindHeartbeat, 0
		}
		out[i] = f
	}
	return out
}

// BenchmarkDecideStorm decides a storm of 10,000 faults from 1,000 nodes
// (one op); the baseline inserts each fault into a map keyed by node, the
// least a deduplicating consumer does.
func BenchmarkDecideStorm(b *testing.B) {
	const faults, nodes = 10000, 1000
	ctx := context.Background()
	run := func(b *testing.B, cfg func() Config) {
		clk := newClock()
		storm := stormFaults(faults, nodes, clk.Now())
		decisions := 0
		for i := 0; i < b.N; i++ {
			c := cfg()
			c.Now = clk.Now
			p, err := NewPolicy(c)
			if err != nil {
				b.Fatal(err)
			}
			decisions = 0
			for _, f := range storm {
				if p.Decide(ctx, f).Action != NoAction {
					decisions++
				}
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*faults), "ns/fault")
		b.ReportMetric(float64(decisions), "decisions")
	}
	b.Run("policy", func(b *testing.B) {
		run(b, func() Config { return Config{} })
	})
	b.Run("policy-observed", func(b *testing.B) {
		tp := sdktrace.NewTracerProvider() // records spans, exports none
		defer tp.Shutdown(ctx)
		run(b, func() Config {
			return Config{
				Registerer:     prometheus.NewRegistry(),
				Logger:         slog.New(slog.NewJSONHandler(io.Discard, nil)),
				TracerProvider: tp,
			}
		})
	})
	b.Run("baseline-map-insert", func(b *testing.B) {
		storm := stormFaults(faults, nodes, time.Now())
		for i := 0; i < b.N; i++ {
			m := map[string]Fault{}
			for _, f := range storm {
				if _, ok := m[f.Node]; !ok {
					m[f.Node] = f
				}
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*faults), "ns/fault")
	})
}
