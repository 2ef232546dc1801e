package trace

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// statsCollector exports a Recorder's counters. The counters
// live in atomics that the hot path and the writer goroutine update; the
// collector only reads them, so metrics cost nothing until scraped.
type statsCollector struct {
	c        *counters
	overflow *[numDomains]atomic.Uint64 // ring drops
	bits     *atomic.Uint32             // the switch

	written, dropped, bytes, files, errors, switchOn *prometheus.Desc
}

func newStatsCollector(c *counters, overflow *[numDomains]atomic.Uint64, bits *atomic.Uint32) *statsCollector {
	return &statsCollector{
		c: c, overflow: overflow, bits: bits,
		written: prometheus.NewDesc("faultline_trace_records_written_total",
			"Dotting records written to files.", []string{"domain"}, nil),
		dropped: prometheus.NewDesc("faultline_trace_records_dropped_total",
			"Dotting records dropped: the recorder's buffer was full, or a file could not be opened or written.",
			[]string{"domain", "reason"}, nil),
		bytes: prometheus.NewDesc("faultline_trace_written_bytes_total",
			"Bytes of dotting records written to files.", nil, nil),
		files: prometheus.NewDesc("faultline_trace_files_created_total",
			"Dotting record files created.", nil, nil),
		errors: prometheus.NewDesc("faultline_trace_write_errors_total",
			"Failed opens, writes and syncs of dotting record files.", nil, nil),
		switchOn: prometheus.NewDesc("faultline_trace_switch_enabled",
			"1 when the profiling switch has the kind on.", []string{"kind"}, nil),
	}
}

func (s *statsCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- s.written
	ch <- s.dropped
	ch <- s.bytes
	ch <- s.files
	ch <- s.errors
	ch <- s.switchOn
}

func (s *statsCollector) Collect(ch chan<- prometheus.Metric) {
	for d, name := range domainNames {
		ch <- prometheus.MustNewConstMetric(s.written, prometheus.CounterValue, float64(s.c.written[d].Load()), name)
		ch <- prometheus.MustNewConstMetric(s.dropped, prometheus.CounterValue, float64(s.c.dropped[d].Load()), name, "write_error")
		ch <- prometheus.MustNewConstMetric(s.dropped, prometheus.CounterValue, float64(s.overflow[d].Load()), name, "buffer_full")
	}
	ch <- prometheus.MustNewConstMetric(s.bytes, prometheus.CounterValue, float64(s.c.bytes.Load()))
	ch <- prometheus.MustNewConstMetric(s.files, prometheus.CounterValue, float64(s.c.files.Load()))
	ch <- prometheus.MustNewConstMetric(s.errors, prometheus.CounterValue, float64(s.c.errors.Load()))
	b := s.bits.Load()
	for _, k := range kinds {
		v := 0.0
		if b&kindBit(k) != 0 {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(s.switchOn, prometheus.GaugeValue, v, k.String())
	}
}
