package hang

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/faultline-ml/faultline/internal/promreg"
)

const instrumentation = "github.com/faultline-ml/faultline/hang"

// metrics are a Watchdog's collectors. Each carries the constant label
// rank, so that watchdogs of several ranks can share one registry.
type metrics struct {
	hung        prometheus.Gauge
	dumpStarted prometheus.Gauge
	dumpEnded   prometheus.Gauge
	faults      *prometheus.CounterVec
	dumpSeconds prometheus.Histogram
	opTimeout   *prometheus.GaugeVec

	reg *promreg.Registrar
}

func newMetrics(reg prometheus.Registerer, rank int, inFlight func() float64) (*metrics, error) {
	labels := prometheus.Labels{"rank": strconv.Itoa(rank)}
	r := promreg.New(reg, "hang: Config.Registerer (rank "+strconv.Itoa(rank)+")")
	f := promauto.With(r)
	m := &metrics{
		reg: r,
		hung: f.NewGauge(prometheus.GaugeOpts{
			Name:        "faultline_hang_hung",
			Help:        "1 while an op of this rank is past its timeout, else 0 (xpu_timer's XPU_TIMER_COMMON_HANG).",
			ConstLabels: labels,
		}),
		dumpStarted: f.NewGauge(prometheus.GaugeOpts{
			Name:        "faultline_hang_dump_started",
			Help:        "1 once a stack dump has started for the current fault, else 0 (XPU_TIMER_COMMON_START_DUMP).",
			ConstLabels: labels,
		}),
		dumpEnded: f.NewGauge(prometheus.GaugeOpts{
			Name:        "faultline_hang_dump_ended",
			Help:        "1 once the stack dump of the current fault has ended, written or failed, else 0 (XPU_TIMER_COMMON_END_DUMP).",
			ConstLabels: labels,
		}),
		faults: f.NewCounterVec(prometheus.CounterOpts{
			Name:        "faultline_hang_faults_total",
			Help:        "Faults detected, by kind (hang, op_error, heartbeat).",
			ConstLabels: labels,
		}, []string{"kind"}),
		dumpSeconds: f.NewHistogram(prometheus.HistogramOpts{
			Name:        "faultline_hang_dump_duration_seconds",
			Help:        "Time to capture and write one stack file.",
			Buckets:     prometheus.ExponentialBuckets(0.01, 2, 14),
			ConstLabels: labels,
		}),
		opTimeout: f.NewGaugeVec(prometheus.GaugeOpts{
			Name:        "faultline_hang_op_timeout_seconds",
			Help:        "Timeout now applied to new ops, by op and group: learned or fixed.",
			ConstLabels: labels,
		}, []string{"op", "group"}),
	}
	f.NewGaugeFunc(prometheus.GaugeOpts{
		Name:        "faultline_hang_ops_in_flight",
		Help:        "Ops started and not yet ended.",
		ConstLabels: labels,
	}, inFlight)
	for _, k := range []FaultKind{FaultHang, FaultOpError, FaultHeartbeat} {
		m.faults.WithLabelValues(k.String()) // export zeros
	}
	if err := r.Err(); err != nil {
		return nil, err
	}
	return m, nil
}
