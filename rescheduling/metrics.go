package rescheduling

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/faultline-ml/faultline/internal/promreg"
)

// policyMetrics are a Policy's collectors, resolved per label value once
// so that a decision in a storm costs no label lookup.
type policyMetrics struct {
	reg          *promreg.Registrar
	faults       [numClasses]prometheus.Counter
	decisions    [GiveUp + 1]prometheus.Counter
	exhausted    [GiveUp + 1]prometheus.Counter
	deduplicated prometheus.Counter
	suspects     prometheus.Gauge
}

func newPolicyMetrics(reg prometheus.Registerer) (*policyMetrics, error) {
	r := promreg.New(reg, "rescheduling: Config.Registerer")
	f := promauto.With(r) // nil: collectors that are never registered
	faults := f.NewCounterVec(prometheus.CounterOpts{
		Name: "faultline_rescheduling_faults_total",
		Help: "Faults decided on, by class.",
	}, []string{"class"})
	decisions := f.NewCounterVec(prometheus.CounterOpts{
		Name: "faultline_rescheduling_decisions_total",
		Help: "Decisions, by action (none: covered by an earlier decision or not a fault).",
	}, []string{"action"})
	exhausted := f.NewCounterVec(prometheus.CounterOpts{
		Name: "faultline_rescheduling_budget_exhausted_total",
		Help: "Times a spent budget moved a decision past an action.",
	}, []string{"action"})
	m := &policyMetrics{
		reg: r,
		deduplicated: f.NewCounter(prometheus.CounterOpts{
			Name: "faultline_rescheduling_faults_deduplicated_total",
			Help: "Faults covered by an earlier decision for the same event.",
		}),
		suspects: f.NewGauge(prometheus.GaugeOpts{
			Name: "faultline_rescheduling_suspect_nodes",
			Help: "Nodes that decisions asked to avoid.",
		}),
	}
	for c := Unclassified; c < numClasses; c++ {
		m.faults[c] = faults.WithLabelValues(c.String())
	}
	for a := NoAction; a <= GiveUp; a++ {
		m.decisions[a] = decisions.WithLabelValues(a.String())
		m.exhausted[a] = exhausted.WithLabelValues(a.String())
	}
	return m, r.Err()
}

// watchdogMetrics are a Watchdog's collectors.
type watchdogMetrics struct {
	reg        *promreg.Registrar
	executions *prometheus.CounterVec
	recovery   *prometheus.HistogramVec
	inFlight   prometheus.Gauge
}

func newWatchdogMetrics(reg prometheus.Registerer) (*watchdogMetrics, error) {
	r := promreg.New(reg, "rescheduling: WatchdogConfig.Registerer")
	f := promauto.With(r)
	m := &watchdogMetrics{
		reg: r,
		executions: f.NewCounterVec(prometheus.CounterOpts{
			Name: "faultline_rescheduling_executions_total",
			Help: "Executions of decisions, by action and result (ok, failed, gone, superseded, canceled).",
		}, []string{"action", "result"}),
		recovery: f.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "faultline_rescheduling_recovery_seconds",
			Help:    "Time from a fault to its target restarted, by action.",
			Buckets: prometheus.ExponentialBuckets(0.01, 2, 20),
		}, []string{"action"}),
		inFlight: f.NewGauge(prometheus.GaugeOpts{
			Name: "faultline_rescheduling_executions_in_flight",
			Help: "Decisions waiting out their backoff or executing.",
		}),
	}
	return m, r.Err()
}
