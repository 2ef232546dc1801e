package netcheck

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/faultline-ml/faultline/internal/promreg"
)

// DefaultReference is the name the checker takes as the reference.
const DefaultReference = "checker"

// Config configures a Checker. The zero value of every field is a
// documented default.
type Config struct {
	// Policy judges the probes; its zero value holds the defaults.
	Policy Policy
	// Prober runs the probes; nil means &TCPProber{}.
	Prober Prober
	// Reference is the name under which the checker itself takes part as
	// the reference (probing nodes directly, with an empty From.Addr);
	// default DefaultReference. It must differ from every node's name.
	// A reference is a witness apart from the nodes: its link must be at
	// least as fast as theirs, and it must not run on a node's host, whose
	// link its probes would share (and whose agent it would reach over
	// loopback). So the checker takes no part when a node's agent address
	// is one of its host's own; the report's notes say so.
	Reference string
	// NoReference keeps the checker out of the probes, for a Prober that
	// cannot probe from the checker. Clusters of two or three nodes may
	// then end with unknown verdicts: two nodes alone have no baseline
	// unless Policy.MinBandwidth gives one.
	NoReference bool
	// Parallel bounds the probes that run at once. Default 256.
	Parallel int
	// Logger receives a line per round and the verdicts; nil discards.
	Logger *slog.Logger
	// Registerer receives the checker's metrics; nil means none.
	Registerer prometheus.Registerer
	// TracerProvider traces checks and probes; nil means none.
	TracerProvider trace.TracerProvider
}

// Validate reports a field that cannot work.
func (c Config) Validate() error {
	if c.Parallel < 0 {
		return fmt.Errorf("netcheck: Config.Parallel = %d: must not be negative", c.Parallel)
	}
	return c.Policy.Validate()
}

// Checker runs network checks: it drives a Planner with real probes. One
// Checker may run many checks, one after another or at once.
type Checker struct {
	cfg    Config
	log    *slog.Logger
	tracer trace.Tracer
	reg    *promreg.Registrar

	checks    prometheus.Counter
	checkTime prometheus.Histogram
	probes    *prometheus.CounterVec
	probeTime prometheus.Histogram
	verdicts  *prometheus.GaugeVec
	badNodes  *prometheus.GaugeVec
	metricsMu sync.Mutex // one check at a time updates the gauges
}

// NewChecker returns a checker for cfg. Its metrics are registered on
// cfg.Registerer until Close.
func NewChecker(cfg Config) (*Checker, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Policy = cfg.Policy.withDefaults()
	cfg.Prober = cmp.Or(cfg.Prober, Prober(&TCPProber{}))
	cfg.Reference = cmp.Or(cfg.Reference, DefaultReference)
	cfg.Parallel = cmp.Or(cfg.Parallel, 256)
	log := cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	tp := cmp.Or(cfg.TracerProvider, trace.TracerProvider(noop.NewTracerProvider()))
	r := promreg.New(cfg.Registerer, "netcheck: Config.Registerer")
	f := promauto.With(r)
	c := &Checker{
		cfg:    cfg,
		log:    log,
		tracer: tp.Tracer("github.com/faultline-ml/faultline/netcheck"),
		reg:    r,
		checks: f.NewCounter(prometheus.CounterOpts{
			Name: "faultline_netcheck_checks_total",
			Help: "Network checks completed.",
		}),
		checkTime: f.NewHistogram(prometheus.HistogramOpts{
			Name:    "faultline_netcheck_check_duration_seconds",
			Help:    "Time a whole network check took.",
			Buckets: prometheus.ExponentialBuckets(0.1, 2, 12),
		}),
		probes: f.NewCounterVec(prometheus.CounterOpts{
			Name: "faultline_netcheck_probes_total",
			Help: "Probes run by the checker, by result (ok, error).",
		}, []string{"result"}),
		probeTime: f.NewHistogram(prometheus.HistogramOpts{
			Name:    "faultline_netcheck_probe_duration_seconds",
			Help:    "Time one probe took, failed ones included.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
		}),
		verdicts: f.NewGaugeVec(prometheus.GaugeOpts{
			Name: "faultline_netcheck_nodes",
			Help: "Nodes of the last check by verdict (healthy, faulty, straggler, unknown).",
		}, []string{"verdict"}),
		badNodes: f.NewGaugeVec(prometheus.GaugeOpts{
			Name: "faultline_netcheck_bad_node",
			Help: "1 for each node the last check found faulty or straggling, by node and verdict.",
		}, []string{"node", "verdict"}),
	}
	if err := r.Err(); err != nil {
		return nil, err
	}
	return c, nil
}

// Close unregisters the checker's metrics, so that another checker may
// use the Registerer. It is idempotent; checks still run after it,
// uncounted.
func (c *Checker) Close() error {
	c.reg.UnregisterAll()
	return nil
}

// Check probes nodes, given in topology order, until every node has a
// verdict or no probe can tell more, and returns the report. It returns an
// error only for bad input (names not unique, two names with one address)
// or when ctx ends; a node that cannot be reached is a verdict, not an
// error.
func (c *Checker) Check(ctx context.Context, nodes []Node) (*Report, error) {
	start := time.Now()
	ctx, span := c.tracer.Start(ctx, "netcheck.Check", trace.WithAttributes(attribute.Int("nodes", len(nodes))))
	defer span.End()

	byName := make(map[string]Node, len(nodes)+1)
	byAddr := make(map[string]string, len(nodes))
	names := make([]string, len(nodes))
	for i, n := range nodes {
		names[i] = n.Name
		byName[n.Name] = n
		if n.Addr == "" {
			continue
		}
		if other, dup := byAddr[canonical(n.Addr)]; dup && other != n.Name {
			return nil, fmt.Errorf("netcheck: nodes %q and %q have one address, %s: each node needs its own agent", other, n.Name, n.Addr)
		}
		byAddr[canonical(n.Addr)] = n.Name
	}
	ref := ""
	var notes []string
	if !c.cfg.NoReference {
		ref = c.cfg.Reference
		if _, clash := byName[ref]; clash {
			return nil, fmt.Errorf("netcheck: node name %q is the reference's; set Config.Reference", ref)
		}
		if node, addr := onThisHost(ctx, nodes); node != "" {
			notes = append(notes, fmt.Sprintf("no reference: the checker runs on the host of %s (%s), "+
				"whose link its probes would share, so it took no part", node, addr))
			c.log.Info("netcheck: no reference: the checker runs on a node's host", "node", node, "addr", addr)
			ref = ""
		} else {
			byName[ref] = Node{Name: ref}
		}
	}
	p, err := NewPlanner(names, ref, c.cfg.Policy)
	if err != nil {
		return nil, err
	}
	sem := make(chan struct{}, c.cfg.Parallel)
	for round := p.Next(); round != nil; round = p.Next() {
		c.log.Debug("netcheck: round", "round", p.Rounds()-1, "probes", len(round))
		results := make([]Measurement, len(round))
		var wg sync.WaitGroup
		for i, pr := range round {
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer func() { <-sem; wg.Done() }()
				results[i] = c.probe(ctx, byName[pr.From], byName[pr.To])
			}()
		}
		wg.Wait()
		if err := ctx.Err(); err != nil {
			span.SetStatus(codes.Error, err.Error())
			return nil, fmt.Errorf("netcheck: check cancelled: %w", err)
		}
		for _, m := range results {
			if err := p.Record(m); err != nil {
				return nil, err // a bug: the planner asked for these
			}
		}
	}
	rep := p.Report()
	rep.Notes = append(notes, rep.Notes...)
	c.observe(rep, time.Since(start))
	span.SetAttributes(attribute.Int("probes", rep.Probes), attribute.Int("rounds", rep.Rounds),
		attribute.StringSlice("bad", rep.Bad()))
	for _, n := range rep.Nodes {
		if n.Verdict != Healthy {
			c.log.Warn("netcheck: node not healthy", "node", n.Name, "verdict", n.Verdict, "reason", n.Reason)
		}
	}
	return rep, nil
}

// canonical returns addr in one spelling per address: IPv4 in IPv6 and
// upper-case host names count as what they are.
func canonical(addr string) string {
	if ap, err := netip.ParseAddrPort(addr); err == nil {
		return netip.AddrPortFrom(ap.Addr().Unmap().WithZone(""), ap.Port()).String()
	}
	return strings.ToLower(addr)
}

// onThisHost returns the first node whose agent listens on an address of
// this host, and that address; "" when none does.
func onThisHost(ctx context.Context, nodes []Node) (name, addr string) {
	local := map[netip.Addr]bool{}
	if addrs, err := net.InterfaceAddrs(); err == nil {
		for _, a := range addrs {
			if p, err := netip.ParsePrefix(a.String()); err == nil {
				local[p.Addr().Unmap()] = true
			}
		}
	}
	for _, n := range nodes {
		host, _, err := net.SplitHostPort(n.Addr)
		if err != nil {
			continue
		}
		ips := []netip.Addr{}
		if ip, err := netip.ParseAddr(host); err == nil {
			ips = append(ips, ip)
		} else if found, err := net.DefaultResolver.LookupNetIP(ctx, "ip", host); err == nil {
			ips = found
		}
		for _, ip := range ips {
			if ip = ip.Unmap().WithZone(""); ip.IsLoopback() || ip.IsUnspecified() || local[ip] {
				return n.Name, n.Addr
			}
		}
	}
	return "", ""
}

// probe runs one probe under the policy's deadline and never fails: an
// error becomes a failed measurement.
func (c *Checker) probe(ctx context.Context, from, to Node) Measurement {
	ctx, span := c.tracer.Start(ctx, "netcheck.Probe", trace.WithAttributes(
		attribute.String("from", from.Name), attribute.String("to", to.Name)))
	defer span.End()
	ctx, cancel := context.WithTimeout(ctx, c.cfg.Policy.ProbeTimeout)
	defer cancel()
	start := time.Now()
	m, err := c.cfg.Prober.Probe(ctx, from, to)
	m.From, m.To = from.Name, to.Name
	if m.Elapsed <= 0 {
		m.Elapsed = time.Since(start)
	}
	if err != nil {
		m.Error = err.Error()
	} else if m.Error != "" {
		err = errors.New(m.Error)
	}
	c.probeTime.Observe(m.Elapsed.Seconds())
	if err != nil {
		c.probes.WithLabelValues("error").Inc()
		span.SetStatus(codes.Error, m.Error)
	} else {
		c.probes.WithLabelValues("ok").Inc()
		span.SetAttributes(attribute.Float64("bandwidth_bytes_per_second", m.Bandwidth),
			attribute.Int64("rtt_ns", int64(m.RTT)))
	}
	return m
}

func (c *Checker) observe(rep *Report, took time.Duration) {
	c.checks.Inc()
	c.checkTime.Observe(took.Seconds())
	c.metricsMu.Lock()
	defer c.metricsMu.Unlock()
	for _, v := range []Verdict{Healthy, Faulty, Straggler, Unknown} {
		c.verdicts.WithLabelValues(string(v)).Set(float64(len(rep.Names(v))))
	}
	c.badNodes.Reset()
	for _, n := range rep.Nodes {
		if n.Verdict == Faulty || n.Verdict == Straggler {
			c.badNodes.WithLabelValues(n.Name, string(n.Verdict)).Set(1)
		}
	}
}
