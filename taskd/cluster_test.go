package taskd

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/taskd/lease"
	"github.com/faultline-ml/faultline/trace"
)

// cluster is an in-process job: a manager, proxies and workers on loopback.
type cluster struct {
	t       testing.TB
	sec     Security
	job     string
	m       *Manager
	mcfg    ManagerConfig
	proxies map[int]*Proxy
	workers map[int]*Worker
	cancels map[any]context.CancelFunc
	wg      sync.WaitGroup
	mu      sync.Mutex
	applied map[int]trace.Switch
	onApply func(rank int, sw trace.Switch)
	onMsg   func(rank int, m Message) error
	ack     time.Duration // AckTimeout of proxies and workers
}

func newCluster(t testing.TB, sec Security, mcfg ManagerConfig) *cluster {
	c := &cluster{t: t, sec: sec, job: "job-1", ack: testTimings.ack, proxies: map[int]*Proxy{}, workers: map[int]*Worker{}, cancels: map[any]context.CancelFunc{}, applied: map[int]trace.Switch{}}
	mcfg.Job = c.job
	mcfg.Listen = orDefault(mcfg.Listen, "127.0.0.1:0")
	mcfg.Security = sec
	mcfg.HeartbeatInterval = orDefault(mcfg.HeartbeatInterval, testTimings.interval)
	mcfg.HeartbeatDeadline = orDefault(mcfg.HeartbeatDeadline, testTimings.deadline)
	mcfg.AckTimeout = orDefault(mcfg.AckTimeout, testTimings.ack)
	mcfg.ProxyToken = orDefault(mcfg.ProxyToken, testProxyToken)
	c.mcfg = mcfg
	c.startManager()
	t.Cleanup(c.close)
	return c
}

func (c *cluster) startManager() {
	m, err := NewManager(c.mcfg)
	if err != nil {
		c.t.Fatal(err)
	}
	c.m = m
	c.mcfg.Listen = m.Addr().String() // a restart takes the same port
	c.run(m, m.Run)
}

func (c *cluster) run(key any, f func(context.Context) error) {
	ctx, cancel := context.WithCancel(context.Background())
	c.cancels[key] = cancel
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		// An in-process worker that recovery restarted is evicted: its
		// successor is the test's to start. A manager whose lease term
		// the test ended stops.
		if err := f(ctx); err != nil && !errors.Is(err, ErrEvicted) && !errors.Is(err, lease.ErrLost) {
			c.t.Errorf("%T.Run: %v", key, err)
		}
	}()
}

func (c *cluster) stop(key any, closer interface{ Close() error }) {
	c.cancels[key]()
	closer.Close()
	delete(c.cancels, key)
}

func (c *cluster) addProxy(node int) *Proxy {
	p, err := NewProxy(ProxyConfig{Job: c.job, Node: node, Upstream: c.m.Addr().String(), Listen: "127.0.0.1:0", Security: c.sec, UpstreamToken: c.mcfg.ProxyToken, AckTimeout: c.ack, ReconnectMax: 500e6})
	if err != nil {
		c.t.Fatal(err)
	}
	c.proxies[node] = p
	c.run(p, p.Run)
	return p
}

// addWorker starts a worker behind the node's proxy, or attached to the
// manager directly when the node has none.
func (c *cluster) addWorker(node, rank int) *Worker {
	up := c.m.Addr().String()
	if p := c.proxies[node]; p != nil {
		up = p.Addr().String()
	}
	w, err := NewWorker(WorkerConfig{Job: c.job, Node: node, Rank: rank, Upstream: up, Security: c.sec, AckTimeout: c.ack, ReconnectMax: 500e6,
		OnSwitch: func(sw trace.Switch) error {
			c.mu.Lock()
			c.applied[rank] = sw
			f := c.onApply
			c.mu.Unlock()
			if f != nil {
				f(rank, sw)
			}
			return nil
		},
		OnMessage: func(m Message) error {
			if c.onMsg != nil {
				return c.onMsg(rank, m)
			}
			return nil
		}})
	if err != nil {
		c.t.Fatal(err)
	}
	c.workers[rank] = w
	c.run(w, w.Run)
	return w
}

func (c *cluster) appliedSwitch(rank int) (trace.Switch, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	sw, ok := c.applied[rank]
	return sw, ok
}

func (c *cluster) close() {
	for k, cancel := range c.cancels {
		cancel()
		if cl, ok := k.(interface{ Close() error }); ok {
			cl.Close()
		}
	}
	c.wg.Wait()
}

func (c *cluster) liveWorkers() int {
	n := 0
	for _, mi := range c.m.Members() {
		if mi.Role == RoleWorker {
			n++
		}
	}
	return n
}

func insecureSec() Security { return Security{Insecure: true} }

// testProxyToken is the proxies' token of the tests' managers and proxies.
const testProxyToken = "proxies-token-0123456789abcdef"

// proxySec is what a proxy of an insecure test cluster presents upstream.
func proxySec() Security { return Security{Insecure: true, Token: testProxyToken} }

func TestSmoke(t *testing.T) {
	spans := tracetest.NewSpanRecorder()
	reg := prometheus.NewRegistry()
	c := newCluster(t, insecureSec(), ManagerConfig{Registerer: reg, TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))})
	c.addProxy(0)
	c.addProxy(1)
	for r := range 8 {
		c.addWorker(r/4, r)
	}
	c.addWorker(2, 8) // attached directly
	testkit.WaitFor(t, "9 workers", func() bool { return c.liveWorkers() == 9 })
	sw := trace.Switch{Step: true, CommunicationOperator: true}
	if _, err := c.m.SetSwitch(sw); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, "switch applied", func() bool {
		for r := range 9 {
			if got, ok := c.appliedSwitch(r); !ok || got != sw {
				return false
			}
		}
		return true
	})
	testkit.WaitFor(t, "status opened", func() bool {
		for _, w := range c.m.SwitchStatus().Workers {
			if w.Domains["default"] != DomainOpened {
				return false
			}
		}
		return true
	})
	if err := c.workers[3].ReportFault(Fault{Kind: FaultHang, Message: "allreduce stuck"}); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, "fault", func() bool { return len(c.m.Faults(0)) == 1 })
	ds, err := c.m.Broadcast(context.Background(), AllWorkers(), "hello", []byte("x"))
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range ds {
		if d.Err != nil {
			t.Errorf("rank %d: %v", d.Rank, d.Err)
		}
	}
	if f := c.m.Faults(0); len(f) != 1 || f[0].Kind != FaultHang || f[0].Position != (Position{0, 3}) || f[0].ReporterRole != RoleWorker {
		t.Fatalf("faults: %+v", f)
	}
	// The fan-out's span ended once every worker acknowledged it.
	testkit.WaitFor(t, "the fan-out span", func() bool {
		for _, s := range spans.Ended() {
			if s.Name() == "taskd.switch.fanout" {
				return true
			}
		}
		return false
	})
	want := map[string]float64{
		`faultline_taskd_members{role="worker"}`:      9,
		`faultline_taskd_members{role="proxy"}`:       2,
		`faultline_taskd_faults_total{kind="hang"}`:   1,
		`faultline_taskd_switch_fanout_seconds_count`: 1,
	}
	var got map[string]float64
	testkit.WaitFor(t, "the metrics", func() bool {
		got = gathered(t, reg)
		for k, v := range want {
			if got[k] != v {
				return false
			}
		}
		return true
	})
	if n := got[`faultline_taskd_acks_total{result="ok"}`]; n < 18 { // 9 switch, 9 broadcast
		t.Errorf("acks = %v, want at least 18", n)
	}

}

// gathered returns the registry's samples by name{labels}.
func gathered(t testing.TB, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			name := mf.GetName()
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+`="`+l.GetValue()+`"`)
			}
			if len(labels) > 0 {
				name += "{" + strings.Join(labels, ",") + "}"
			}
			switch {
			case m.Counter != nil:
				out[name] = m.GetCounter().GetValue()
			case m.Gauge != nil:
				out[name] = m.GetGauge().GetValue()
			case m.Histogram != nil:
				out[name+"_count"] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return out
}
