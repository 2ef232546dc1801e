package taskd

import (
	"fmt"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
)

// registrar is the Registerer a component's promauto factory registers
// through: it keeps what it registered on reg, so that Close can
// unregister it and the component can be built again on the same
// registry, and it keeps the first error instead of panicking, so that
// the constructor can return it. A nil reg registers nothing.
type registrar struct {
	reg   prometheus.Registerer
	field string // the config field reg came from, for errors
	done  []prometheus.Collector
	err   error
}

func newRegistrar(reg prometheus.Registerer, field string) *registrar {
	return &registrar{reg: reg, field: field}
}

// Register registers c on reg.
func (r *registrar) Register(c prometheus.Collector) error {
	if r.reg == nil {
		return nil
	}
	if err := r.reg.Register(c); err != nil {
		return fmt.Errorf("taskd: %s: register %s: %w", r.field, metricName(c), err)
	}
	r.done = append(r.done, c)
	return nil
}

// MustRegister registers each of cs, keeping the first error.
func (r *registrar) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil && r.err == nil {
			r.err = err
		}
	}
}

// Unregister unregisters c from reg.
func (r *registrar) Unregister(c prometheus.Collector) bool {
	return r.reg != nil && r.reg.Unregister(c)
}

// check returns the first registration error, having unregistered all
// that was registered; nil when every collector was registered.
func (r *registrar) check() error {
	if r.err != nil {
		r.unregisterAll()
	}
	return r.err
}

// unregisterAll unregisters what was registered. It is idempotent.
func (r *registrar) unregisterAll() {
	for _, c := range r.done {
		r.reg.Unregister(c)
	}
	r.done = nil
}

// metricName returns the name of c's first metric, for errors.
func metricName(c prometheus.Collector) string {
	ch := make(chan *prometheus.Desc, 64)
	go func() { c.Describe(ch); close(ch) }()
	name := fmt.Sprintf("%T", c)
	first := true
	for d := range ch {
		if !first {
			continue // drain
		}
		first = false
		// Desc has no accessor for its name; its String form starts with it.
		if _, rest, ok := strings.Cut(d.String(), `fqName: "`); ok {
			if n, _, ok := strings.Cut(rest, `"`); ok {
				name = n
			}
		}
	}
	return name
}

type managerMetrics struct {
	members     *prometheus.GaugeVec
	lost        *prometheus.CounterVec
	refused     prometheus.Counter
	messages    *prometheus.CounterVec
	acks        *prometheus.CounterVec
	ackLatency  prometheus.Histogram
	faults      *prometheus.CounterVec
	faultDups   prometheus.Counter
	fanout      prometheus.Histogram
	resends     prometheus.Counter
	rateLimited prometheus.Counter
	dropped     prometheus.Counter
	collected   prometheus.Counter
	handlerErrs *prometheus.CounterVec
}

// newManagerMetrics builds the manager's collectors and registers them
// through r; a nil r.reg gives collectors that count but are not exported.
func newManagerMetrics(r *registrar) *managerMetrics {
	f := promauto.With(r)
	return &managerMetrics{
		members:     f.NewGaugeVec(prometheus.GaugeOpts{Name: "faultline_taskd_members", Help: "Live registered members by role."}, []string{"role"}),
		lost:        f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_taskd_lost_total", Help: "Members declared lost after missing their heartbeat deadline, by role."}, []string{"role"}),
		refused:     f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_registrations_refused_total", Help: "Registrations refused because another live instance holds the position."}),
		messages:    f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_taskd_messages_total", Help: "Messages handled by the manager, by direction (up, down) and kind."}, []string{"direction", "kind"}),
		acks:        f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_taskd_acks_total", Help: "Acknowledgements of downward messages, by result (ok, error, timeout)."}, []string{"result"}),
		ackLatency:  f.NewHistogram(prometheus.HistogramOpts{Name: "faultline_taskd_ack_latency_seconds", Help: "Time from sending a downward message to its acknowledgement.", Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)}),
		faults:      f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_taskd_faults_total", Help: "Faults taken into the job's fault log, by kind."}, []string{"kind"}),
		faultDups:   f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_fault_duplicates_total", Help: "Fault reports dropped as duplicates of a logged fault."}),
		fanout:      f.NewHistogram(prometheus.HistogramOpts{Name: "faultline_taskd_switch_fanout_seconds", Help: "Time from a switch change until every live worker acknowledged it.", Buckets: prometheus.ExponentialBuckets(0.001, 2, 16)}),
		resends:     f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_switch_resends_total", Help: "Switch sends to workers that had not acknowledged it."}),
		rateLimited: f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_rate_limited_total", Help: "Calls refused by the per-connection rate limit."}),
		dropped:     f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_downlink_dropped_total", Help: "Downward messages dropped because a member's send queue was full (they are re-sent)."}),
		collected:   f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_collected_bytes_total", Help: "Bytes of dotting and stack files received from proxies."}),
		handlerErrs: f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_taskd_handler_errors_total", Help: "Errors returned by plugin handlers, by handler."}, []string{"handler"}),
	}
}

type proxyMetrics struct {
	workers     prometheus.Gauge
	forwarded   *prometheus.CounterVec
	reconnects  prometheus.Counter
	rateLimited prometheus.Counter
	dropped     prometheus.Counter
	collected   prometheus.Counter
}

func newProxyMetrics(r *registrar) *proxyMetrics {
	f := promauto.With(r)
	return &proxyMetrics{
		workers:     f.NewGauge(prometheus.GaugeOpts{Name: "faultline_taskd_proxy_workers", Help: "Workers registered through this proxy."}),
		forwarded:   f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_taskd_proxy_forwarded_total", Help: "Messages routed by the proxy, by direction (up, down)."}, []string{"direction"}),
		reconnects:  f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_proxy_reconnects_total", Help: "Registrations of the proxy with the manager after the first."}),
		rateLimited: f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_proxy_rate_limited_total", Help: "Calls refused by the per-connection rate limit."}),
		dropped:     f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_proxy_downlink_dropped_total", Help: "Downward messages dropped because a worker's send queue was full (they are re-sent)."}),
		collected:   f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_proxy_collected_bytes_total", Help: "Bytes of dotting and stack files shipped to the manager."}),
	}
}

type workerMetrics struct {
	queued     prometheus.Gauge
	overflow   prometheus.Counter
	reconnects prometheus.Counter
	refused    prometheus.Counter
	applied    *prometheus.CounterVec
}

func newWorkerMetrics(r *registrar) *workerMetrics {
	f := promauto.With(r)
	return &workerMetrics{
		queued:     f.NewGauge(prometheus.GaugeOpts{Name: "faultline_taskd_worker_queued_reports", Help: "Reports waiting for the manager's acknowledgement."}),
		overflow:   f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_worker_queue_overflow_total", Help: "Reports refused because the queue was full."}),
		reconnects: f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_worker_reconnects_total", Help: "Registrations after the first."}),
		refused:    f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_worker_registrations_refused_total", Help: "Registrations refused because another live instance holds the rank."}),
		applied:    f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_taskd_worker_messages_total", Help: "Downward messages handled, by kind and result (ok, error)."}, []string{"kind", "result"}),
	}
}
