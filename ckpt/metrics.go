package ckpt

import (
	"cmp"
	"fmt"
	"log/slog"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/faultline-ml/faultline/internal/promreg"
)

const instrumentation = "github.com/faultline-ml/faultline/ckpt"

// register checks the Registrar that the metrics of a Writer or an Owner
// were built on: a collision, such as two Writers on one Registerer, is an
// error of the constructor rather than promauto's panic, and leaves
// nothing registered.
func register(r *promreg.Registrar) error {
	if err := r.Err(); err != nil {
		return fmt.Errorf("%w (give each Writer and each Owner of a process its own Registerer, such as prometheus.WrapRegistererWith with a distinct shard label)", err)
	}
	return nil
}

// writerMetrics are a Writer's collectors.
type writerMetrics struct {
	reg         *promreg.Registrar
	saveSeconds prometheus.Histogram
	saveBytes   prometheus.Counter
	saveSkipped prometheus.Counter
}

func newWriterMetrics(reg prometheus.Registerer) (*writerMetrics, error) {
	r := promreg.New(reg, "ckpt: WriterConfig.Registerer")
	f := promauto.With(r)
	m := &writerMetrics{
		reg: r,
		saveSeconds: f.NewHistogram(prometheus.HistogramOpts{
			Name:    "faultline_ckpt_save_blocking_seconds",
			Help:    "Time a save into shared memory blocked the trainer.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
		}),
		saveBytes: f.NewCounter(prometheus.CounterOpts{
			Name: "faultline_ckpt_save_bytes_total",
			Help: "Bytes saved into shared memory.",
		}),
		saveSkipped: f.NewCounter(prometheus.CounterOpts{
			Name: "faultline_ckpt_save_skipped_total",
			Help: "Saves skipped because the owner was reading the target half.",
		}),
	}
	return m, register(r)
}

// ownerMetrics are an Owner's collectors.
type ownerMetrics struct {
	reg              *promreg.Registrar
	sealSeconds      prometheus.Histogram
	persistSeconds   prometheus.Histogram
	persistBytes     prometheus.Counter
	persistFailures  prometheus.Counter
	commits          prometheus.Counter
	crcFailures      prometheus.Counter
	loads            *prometheus.CounterVec
	replicaBytes     *prometheus.CounterVec
	replicaFailures  prometheus.Counter
	replicaRefused   prometheus.Counter
	replicaAbandoned prometheus.Counter
	replicaBehind    *prometheus.GaugeVec
}

func newOwnerMetrics(reg prometheus.Registerer) (*ownerMetrics, error) {
	r := promreg.New(reg, "ckpt: OwnerConfig.Registerer")
	f := promauto.With(r)
	m := &ownerMetrics{
		reg: r,
		sealSeconds: f.NewHistogram(prometheus.HistogramOpts{
			Name:    "faultline_ckpt_seal_seconds",
			Help:    "Time to seal one shard's save: compute and write the CRCs of its blobs.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
		}),
		persistSeconds: f.NewHistogram(prometheus.HistogramOpts{
			Name:    "faultline_ckpt_persist_seconds",
			Help:    "Time to persist one shard of a step to disk, fsync included.",
			Buckets: prometheus.ExponentialBuckets(0.01, 2, 16),
		}),
		persistBytes: f.NewCounter(prometheus.CounterOpts{
			Name: "faultline_ckpt_persist_bytes_total",
			Help: "Bytes persisted to disk.",
		}),
		persistFailures: f.NewCounter(prometheus.CounterOpts{
			Name: "faultline_ckpt_persist_failures_total",
			Help: "Persists that failed (disk full, corrupt or superseded source).",
		}),
		commits: f.NewCounter(prometheus.CounterOpts{
			Name: "faultline_ckpt_commits_total",
			Help: "Steps committed on disk (trackers written).",
		}),
		crcFailures: f.NewCounter(prometheus.CounterOpts{
			Name: "faultline_ckpt_crc_failures_total",
			Help: "Blobs, manifests or headers whose checksum did not match.",
		}),
		loads: f.NewCounterVec(prometheus.CounterOpts{
			Name: "faultline_ckpt_loads_total",
			Help: "Loads by the tier that served them (memory, replica, disk, none).",
		}, []string{"tier"}),
		replicaBytes: f.NewCounterVec(prometheus.CounterOpts{
			Name: "faultline_ckpt_replica_bytes_total",
			Help: "Bytes of replicas sent to and received from peers.",
		}, []string{"direction"}),
		replicaFailures: f.NewCounter(prometheus.CounterOpts{
			Name: "faultline_ckpt_replica_failures_total",
			Help: "Replica transfers that failed.",
		}),
		replicaRefused: f.NewCounter(prometheus.CounterOpts{
			Name: "faultline_ckpt_replica_refused_total",
			Help: "Replica requests this owner's server refused before any shard byte moved: a client without the replica key, with another, of another protocol version, or no replica client.",
		}),
		replicaAbandoned: f.NewCounter(prometheus.CounterOpts{
			Name: "faultline_ckpt_replica_abandoned_total",
			Help: "Replica transfers given up because the trainer saved over the step being sent, having no other half to save into.",
		}),
		replicaBehind: f.NewGaugeVec(prometheus.GaugeOpts{
			Name: "faultline_ckpt_replica_saves_behind",
			Help: "Saves a shard's trainer had made after the step of its last replica when a peer took it: 1 or more, and that step is overwritten at the next save.",
		}, []string{"shard"}),
	}
	return m, register(r)
}

func tracerOf(tp trace.TracerProvider) trace.Tracer {
	return cmp.Or(tp, trace.TracerProvider(noop.NewTracerProvider())).Tracer(instrumentation)
}

func loggerOf(l *slog.Logger) *slog.Logger {
	return cmp.Or(l, slog.New(slog.DiscardHandler))
}
