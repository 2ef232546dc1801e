package taskd

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/faultline-ml/faultline/internal/promreg"
)

type managerMetrics struct {
	members       *prometheus.GaugeVec
	lost          *prometheus.CounterVec
	left          *prometheus.CounterVec
	complete      prometheus.Gauge
	refused       prometheus.Counter
	messages      *prometheus.CounterVec
	acks          *prometheus.CounterVec
	ackLatency    prometheus.Histogram
	faults        *prometheus.CounterVec
	faultDups     prometheus.Counter
	fanout        prometheus.Histogram
	resends       prometheus.Counter
	rateLimited   prometheus.Counter
	dropped       prometheus.Counter
	collected     prometheus.Counter
	handlerErrs   *prometheus.CounterVec
	eventsDropped prometheus.Counter
	deposed       prometheus.Counter
	guard         guardMetrics
}

// newManagerMetrics builds the manager's collectors and registers them
// through r; a Registrar on a nil Registerer gives collectors that count but are not exported.
func newManagerMetrics(r *promreg.Registrar) *managerMetrics {
	f := promauto.With(r)
	return &managerMetrics{
		members:       f.NewGaugeVec(prometheus.GaugeOpts{Name: "faultline_taskd_members", Help: "Live registered members by role."}, []string{"role"}),
		lost:          f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_taskd_lost_total", Help: "Members declared lost after missing their heartbeat deadline, by role."}, []string{"role"}),
		left:          f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_taskd_left_total", Help: "Members that left on purpose (no fault), by role."}, []string{"role"}),
		complete:      f.NewGauge(prometheus.GaugeOpts{Name: "faultline_taskd_job_complete", Help: "1 once every rank of the job left after its last step."}),
		refused:       f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_registrations_refused_total", Help: "Registrations refused because another live instance holds the position."}),
		messages:      f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_taskd_messages_total", Help: "Messages handled by the manager, by direction (up, down) and kind."}, []string{"direction", "kind"}),
		acks:          f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_taskd_acks_total", Help: "Acknowledgements of downward messages, by result (ok, error, timeout)."}, []string{"result"}),
		ackLatency:    f.NewHistogram(prometheus.HistogramOpts{Name: "faultline_taskd_ack_latency_seconds", Help: "Time from sending a downward message to its acknowledgement.", Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)}),
		faults:        f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_taskd_faults_total", Help: "Faults taken into the job's fault log, by kind (kinds that taskd does not define count as other)."}, []string{"kind"}),
		faultDups:     f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_fault_duplicates_total", Help: "Fault reports dropped as duplicates of a logged fault."}),
		fanout:        f.NewHistogram(prometheus.HistogramOpts{Name: "faultline_taskd_switch_fanout_seconds", Help: "Time from a switch change until every live worker acknowledged it.", Buckets: prometheus.ExponentialBuckets(0.001, 2, 16)}),
		resends:       f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_switch_resends_total", Help: "Switch sends to workers that had not acknowledged it."}),
		rateLimited:   f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_rate_limited_total", Help: "Calls refused by the per-connection rate limit."}),
		dropped:       f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_downlink_dropped_total", Help: "Downward messages dropped because a member's send queue was full (they are re-sent)."}),
		collected:     f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_collected_bytes_total", Help: "Bytes of dotting and stack files received from proxies."}),
		handlerErrs:   f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_taskd_handler_errors_total", Help: "Errors returned by plugin handlers, by handler."}, []string{"handler"}),
		eventsDropped: f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_events_dropped_total", Help: "Events not handed to the handlers because too many, or too many bytes of messages, were waiting."}),
		deposed:       f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_newer_term_seen_total", Help: "Registrations and heartbeats refused because the member had seen a newer lease term than the manager's."}),
		guard:         newGuardMetrics(f, "faultline_taskd_"),
	}
}

// newGuardMetrics builds a guard's counters, named with prefix.
func newGuardMetrics(f promauto.Factory, prefix string) guardMetrics {
	return guardMetrics{
		authFailures: f.NewCounter(prometheus.CounterOpts{Name: prefix + "auth_failures_total", Help: "Calls whose token was missing or wrong."}),
		calls:        f.NewCounterVec(prometheus.CounterOpts{Name: prefix + "calls_refused_total", Help: "Calls refused before their body was read, by reason (unauthenticated, permission, unknown_member, peer_limit, anonymous_calls, member_calls)."}, []string{"reason"}),
		conns:        f.NewCounterVec(prometheus.CounterOpts{Name: prefix + "connections_refused_total", Help: "Connections refused or closed, by reason (limit, pending_limit, auth_failures, message_limit, unfinished_bytes)."}, []string{"reason"}),
		open:         f.NewGauge(prometheus.GaugeOpts{Name: prefix + "connections", Help: "Connections open."}),
	}
}

type proxyMetrics struct {
	workers     prometheus.Gauge
	forwarded   *prometheus.CounterVec
	reconnects  prometheus.Counter
	rateLimited prometheus.Counter
	dropped     prometheus.Counter
	collected   prometheus.Counter
	fenced      prometheus.Counter
	guard       guardMetrics
}

func newProxyMetrics(r *promreg.Registrar) *proxyMetrics {
	f := promauto.With(r)
	return &proxyMetrics{
		workers:     f.NewGauge(prometheus.GaugeOpts{Name: "faultline_taskd_proxy_workers", Help: "Workers registered through this proxy."}),
		forwarded:   f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_taskd_proxy_forwarded_total", Help: "Messages routed by the proxy, by direction (up, down)."}, []string{"direction"}),
		reconnects:  f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_proxy_reconnects_total", Help: "Registrations of the proxy with the manager after the first."}),
		rateLimited: f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_proxy_rate_limited_total", Help: "Calls refused by the per-connection rate limit."}),
		dropped:     f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_proxy_downlink_dropped_total", Help: "Downward messages dropped because a worker's send queue was full (they are re-sent)."}),
		collected:   f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_proxy_collected_bytes_total", Help: "Bytes of dotting and stack files shipped to the manager."}),
		fenced:      f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_proxy_fenced_total", Help: "Managers and their messages refused because their lease term is older than the newest the proxy has seen."}),
		guard:       newGuardMetrics(f, "faultline_taskd_proxy_"),
	}
}

type workerMetrics struct {
	queued     prometheus.Gauge
	overflow   prometheus.Counter
	reconnects prometheus.Counter
	refused    prometheus.Counter
	fenced     prometheus.Counter
	applied    *prometheus.CounterVec
}

func newWorkerMetrics(r *promreg.Registrar) *workerMetrics {
	f := promauto.With(r)
	return &workerMetrics{
		queued:     f.NewGauge(prometheus.GaugeOpts{Name: "faultline_taskd_worker_queued_reports", Help: "Reports waiting for the manager's acknowledgement."}),
		overflow:   f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_worker_queue_overflow_total", Help: "Reports refused because the queue was full."}),
		reconnects: f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_worker_reconnects_total", Help: "Registrations after the first."}),
		refused:    f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_worker_registrations_refused_total", Help: "Registrations refused because another live instance holds the rank."}),
		fenced:     f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_worker_fenced_total", Help: "Managers and their messages refused because their lease term is older than the newest the worker has seen."}),
		applied:    f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_taskd_worker_messages_total", Help: "Downward messages handled, by kind and result (ok, error)."}, []string{"kind", "result"}),
	}
}
