package ckpt

import (
	"fmt"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

const instrumentation = "github.com/faultline-ml/faultline/ckpt"

// registered are collectors registered on a Registerer, so that Close
// can unregister them.
type registered struct {
	reg prometheus.Registerer
	cs  []prometheus.Collector
}

// register registers cs on reg (nil: none). A collision, such as two
// Writers on one Registerer, is an error rather than promauto's panic, and
// leaves nothing registered.
func register(reg prometheus.Registerer, cs ...prometheus.Collector) (registered, error) {
	if reg == nil {
		return registered{}, nil
	}
	for i, c := range cs {
		if err := reg.Register(c); err != nil {
			for _, d := range cs[:i] {
				reg.Unregister(d)
			}
			return registered{}, fmt.Errorf("ckpt: register metrics: %w (give each Writer and each Owner of a process its own Registerer, such as prometheus.WrapRegistererWith with a distinct shard label)", err)
		}
	}
	return registered{reg, cs}, nil
}

// unregister undoes register.
func (r registered) unregister() {
	for _, c := range r.cs {
		r.reg.Unregister(c)
	}
}

// writerMetrics are a Writer's collectors.
type writerMetrics struct {
	registered
	saveSeconds prometheus.Histogram
	saveBytes   prometheus.Counter
	saveSkipped prometheus.Counter
}

func newWriterMetrics(reg prometheus.Registerer) (*writerMetrics, error) {
	m := &writerMetrics{
		saveSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "faultline_ckpt_save_blocking_seconds",
			Help:    "Time a save into shared memory blocked the trainer.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
		}),
		saveBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "faultline_ckpt_save_bytes_total",
			Help: "Bytes saved into shared memory.",
		}),
		saveSkipped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "faultline_ckpt_save_skipped_total",
			Help: "Saves skipped because the owner was reading the target half.",
		}),
	}
	var err error
	m.registered, err = register(reg, m.saveSeconds, m.saveBytes, m.saveSkipped)
	return m, err
}

// ownerMetrics are an Owner's collectors.
type ownerMetrics struct {
	registered
	sealSeconds     prometheus.Histogram
	persistSeconds  prometheus.Histogram
	persistBytes    prometheus.Counter
	persistFailures prometheus.Counter
	commits         prometheus.Counter
	crcFailures     prometheus.Counter
	loads           *prometheus.CounterVec
	replicaBytes    *prometheus.CounterVec
	replicaFailures prometheus.Counter
}

func newOwnerMetrics(reg prometheus.Registerer) (*ownerMetrics, error) {
	m := &ownerMetrics{
		sealSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "faultline_ckpt_seal_seconds",
			Help:    "Time to seal one shard's save: compute and write the CRCs of its blobs.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
		}),
		persistSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "faultline_ckpt_persist_seconds",
			Help:    "Time to persist one shard of a step to disk, fsync included.",
			Buckets: prometheus.ExponentialBuckets(0.01, 2, 16),
		}),
		persistBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "faultline_ckpt_persist_bytes_total",
			Help: "Bytes persisted to disk.",
		}),
		persistFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "faultline_ckpt_persist_failures_total",
			Help: "Persists that failed (disk full, corrupt or superseded source).",
		}),
		commits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "faultline_ckpt_commits_total",
			Help: "Steps committed on disk (trackers written).",
		}),
		crcFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "faultline_ckpt_crc_failures_total",
			Help: "Blobs, manifests or headers whose checksum did not match.",
		}),
		loads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "faultline_ckpt_loads_total",
			Help: "Loads by the tier that served them (memory, replica, disk, none).",
		}, []string{"tier"}),
		replicaBytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "faultline_ckpt_replica_bytes_total",
			Help: "Bytes of replicas sent to and received from peers.",
		}, []string{"direction"}),
		replicaFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "faultline_ckpt_replica_failures_total",
			Help: "Replica transfers that failed.",
		}),
	}
	var err error
	m.registered, err = register(reg, m.sealSeconds, m.persistSeconds, m.persistBytes, m.persistFailures, m.commits,
		m.crcFailures, m.loads, m.replicaBytes, m.replicaFailures)
	return m, err
}

func tracerOf(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	return tp.Tracer(instrumentation)
}

func loggerOf(l *slog.Logger) *slog.Logger {
	if l == nil {
		return slog.New(slog.DiscardHandler)
	}
	return l
}
