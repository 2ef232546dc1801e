package netcheck

import (
	"context"
	"errors"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// startAgent runs an agent on a loopback port until the test ends.
func startAgent(t testing.TB, cfg AgentConfig) *Agent {
	t.Helper()
	if cfg.Listen == "" {
		cfg.Listen = "127.0.0.1:0"
	}
	a, err := NewAgent(cfg)
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { errc <- a.Run(context.Background()) }()
	t.Cleanup(func() {
		a.Close()
		if err := <-errc; err != nil {
			t.Errorf("agent Run = %v", err)
		}
	})
	return a
}

func ctxTimeout(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func TestAgentProbes(t *testing.T) {
	reg := prometheus.NewRegistry()
	a := startAgent(t, AgentConfig{Registerer: reg})
	b := startAgent(t, AgentConfig{})
	p := &TCPProber{Bytes: 4 << 20, Pings: 3, Repeats: 2}

	// From the checker itself, straight to the agent.
	m, err := p.Probe(ctxTimeout(t, 20*time.Second), Node{Name: "checker"}, Node{Name: "a", Addr: a.Addr().String()})
	if err != nil {
		t.Fatal(err)
	}
	if m.Bytes != 4<<20 || m.Bandwidth <= 0 || m.RTT <= 0 || m.Elapsed <= 0 {
		t.Fatalf("direct probe: %+v", m)
	}
	// From a's agent to b's.
	m, err = p.Probe(ctxTimeout(t, 20*time.Second), Node{Name: "a", Addr: a.Addr().String()}, Node{Name: "b", Addr: b.Addr().String()})
	if err != nil {
		t.Fatal(err)
	}
	if m.Bandwidth <= 0 || m.RTT <= 0 {
		t.Fatalf("remote probe: %+v", m)
	}
	if got := metric(t, reg, "faultline_netcheck_agent_bytes_total", "received"); got != 2*4<<20 {
		t.Fatalf("agent received %v bytes, want %d (two repeats)", got, 2*4<<20)
	}
	// The agent counts a request once its answer is written: Close waits
	// for that.
	a.Close()
	if got := value(t, a.requests.WithLabelValues("probe", "ok")); got != 1 {
		t.Fatalf("probes served = %v, want 1", got)
	}
}

// value returns the value of a counter or gauge.
func value(t testing.TB, c prometheus.Collector) float64 {
	t.Helper()
	ch := make(chan prometheus.Metric, 1)
	c.Collect(ch)
	var m dto.Metric
	if err := (<-ch).Write(&m); err != nil {
		t.Fatal(err)
	}
	if m.Counter != nil {
		return m.GetCounter().GetValue()
	}
	return m.GetGauge().GetValue()
}

func TestAgentRefuses(t *testing.T) {
	reg := prometheus.NewRegistry()
	a := startAgent(t, AgentConfig{MaxBytes: 1 << 20, Registerer: reg})
	b := startAgent(t, AgentConfig{})
	p := &TCPProber{Bytes: 2 << 20}
	_, err := p.Probe(ctxTimeout(t, 20*time.Second), Node{}, Node{Name: "a", Addr: a.Addr().String()})
	if err == nil || !strings.Contains(err.Error(), "exceeds") {
		t.Fatalf("oversized transfer: err = %v", err)
	}
	// Repeats count: three transfers of 512 KiB are 1.5 MiB.
	_, err = (&TCPProber{Bytes: 512 << 10, Repeats: 3}).Probe(ctxTimeout(t, 20*time.Second), Node{}, Node{Name: "a", Addr: a.Addr().String()})
	if err == nil || !strings.Contains(err.Error(), "exceeds") {
		t.Fatalf("oversized repeated transfer: err = %v", err)
	}
	// A probe command asking a to move more than it allows, at once or
	// repeated.
	for _, p := range []*TCPProber{p, {Bytes: 512 << 10, Repeats: 3}} {
		_, err = p.Probe(ctxTimeout(t, 20*time.Second), Node{Name: "a", Addr: a.Addr().String()}, Node{Name: "b", Addr: b.Addr().String()})
		if err == nil || !strings.Contains(err.Error(), "want 1 to 1048576 bytes in all") {
			t.Fatalf("oversized probe command (%d bytes × %d): err = %v", p.Bytes, p.Repeats, err)
		}
	}
	// Within the bound, repeated.
	if _, err := (&TCPProber{Bytes: 256 << 10, Repeats: 4}).Probe(ctxTimeout(t, 20*time.Second), Node{}, Node{Name: "a", Addr: a.Addr().String()}); err != nil {
		t.Fatalf("transfer of 4 × 256 KiB within a 1 MiB bound: %v", err)
	}
	// Garbage is closed and counted.
	c, err := net.Dial("tcp", a.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	c.Write([]byte("GET / HTTP/1.0\r\n\r\n"))
	c.SetReadDeadline(time.Now().Add(20 * time.Second))
	if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil {
		t.Fatalf("agent answered garbage: %d, %v", n, err)
	}
	c.Close()
	// The agent counted the request before it closed the connection.
	if got := metric(t, reg, "faultline_netcheck_agent_requests_total", "unknown", "error"); got != 1 {
		t.Fatalf("bad requests = %v, want 1", got)
	}
}

func TestAgentMaxConns(t *testing.T) {
	reg := prometheus.NewRegistry()
	a := startAgent(t, AgentConfig{MaxConns: 1, Registerer: reg})
	// The first connection, idle, takes the only place; the agent
	// accepts in order, so the second is refused.
	idle, err := net.Dial("tcp", a.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	extra, err := net.Dial("tcp", a.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	extra.SetReadDeadline(time.Now().Add(20 * time.Second))
	if n, err := extra.Read(make([]byte, 1)); n != 0 || err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("connection past MaxConns: read %d, %v; want it closed", n, err)
	}
	if got := metric(t, reg, "faultline_netcheck_agent_requests_total", "connect", "refused"); got != 1 {
		t.Fatalf("refused connections = %v, want 1", got)
	}
	// Its place freed, the agent serves again.
	idle.Close()
	p := &TCPProber{Bytes: 64 << 10, Repeats: 1}
	testkit.WaitFor(t, "the agent to serve again", func() bool {
		_, err := p.Probe(ctxTimeout(t, 20*time.Second), Node{}, Node{Name: "a", Addr: a.Addr().String()})
		return err == nil
	})
	if _, err := NewAgent(AgentConfig{Listen: "127.0.0.1:0", MaxConns: -1}); err == nil || !strings.Contains(err.Error(), "MaxConns") {
		t.Fatalf("MaxConns -1: err = %v", err)
	}
}

func TestProbeDeadlines(t *testing.T) {
	// An endpoint that accepts and then says nothing: every probe must
	// still end by its deadline.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	held := make(chan net.Conn, 8)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				close(held)
				return
			}
			held <- c
		}
	}()
	defer func() {
		ln.Close()
		for c := range held {
			c.Close()
		}
	}()
	a := startAgent(t, AgentConfig{})
	p := &TCPProber{Bytes: 1 << 20}
	for _, from := range []Node{{Name: "checker"}, {Name: "a", Addr: a.Addr().String()}} {
		start := time.Now()
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		_, err := p.Probe(ctx, from, Node{Name: "mute", Addr: ln.Addr().String()})
		cancel()
		if err == nil {
			t.Fatalf("probe from %s to a mute endpoint succeeded", from.Name)
		}
		if took := time.Since(start); took > 10*time.Second {
			t.Fatalf("probe from %s took %v past a 300ms deadline", from.Name, took)
		}
	}
	// Cancellation without a deadline also ends a probe.
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := p.Probe(ctx, Node{}, Node{Name: "mute", Addr: ln.Addr().String()})
		errc <- err
	}()
	cancel()
	select {
	case err := <-errc:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("cancelled probe: err = %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("a cancelled probe did not return")
	}
}

func TestAgentLifecycle(t *testing.T) {
	if _, err := NewAgent(AgentConfig{Listen: "127.0.0.1:0", MaxBytes: -1}); err == nil || !strings.Contains(err.Error(), "MaxBytes") {
		t.Fatalf("bad config: err = %v", err)
	}
	a, err := NewAgent(AgentConfig{Listen: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	a.Close() // never run: closes the listener
	a.Close()
	if _, err := net.Dial("tcp", a.Addr().String()); err == nil {
		t.Fatal("listener still open after Close")
	}

	a, err = NewAgent(AgentConfig{Listen: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- a.Run(ctx) }()
	// An open connection does not hold up the shutdown.
	c, err := net.Dial("tcp", a.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("Run = %v, want context.Canceled", err)
	}
	if err := a.Run(context.Background()); err == nil {
		t.Fatal("second Run succeeded")
	}
	a.Close()
}

// metric returns the value of the series of name with the given label
// values, or -1.
func metric(t testing.TB, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			if len(m.GetLabel()) != len(labels) {
				continue
			}
			for i, l := range m.GetLabel() {
				if l.GetValue() != labels[i] {
					continue next
				}
			}
			switch {
			case m.Counter != nil:
				return m.GetCounter().GetValue()
			case m.Gauge != nil:
				return m.GetGauge().GetValue()
			case m.Histogram != nil:
				return float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return -1
}
