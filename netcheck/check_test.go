package netcheck

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

// loopbackNodes starts n agents on loopback and names them n00, n01, ...
func loopbackNodes(t *testing.T, n int) ([]Node, []*Agent) {
	nodes := make([]Node, n)
	agents := make([]*Agent, n)
	for i := range nodes {
		agents[i] = startAgent(t, AgentConfig{})
		nodes[i] = Node{Name: names(n)[i], Addr: agents[i].Addr().String()}
	}
	return nodes, agents
}

func TestCheckLoopback(t *testing.T) {
	nodes, agents := loopbackNodes(t, 5)
	agents[3].Close() // n03's agent is gone: connections are refused
	reg := prometheus.NewRegistry()
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	defer tp.Shutdown(context.Background())
	c, err := NewChecker(Config{
		Prober: &TCPProber{Bytes: 1 << 20},
		// These tests are about reachability: a loopback probe takes a
		// millisecond or two and jitters by several times on a busy
		// machine, so keep timing out of the verdicts.
		Policy:         Policy{ProbeTimeout: 20 * time.Second, StragglerRatio: 100},
		Registerer:     reg,
		TracerProvider: tp,
	})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := c.Check(context.Background(), nodes)
	if err != nil {
		t.Fatal(err)
	}
	var text strings.Builder
	rep.WriteText(&text)
	if got := rep.Bad(); !slices.Equal(got, []string{"n03"}) {
		t.Fatalf("bad = %v, want [n03]\n%s", got, text.String())
	}
	if rep.Nodes[3].Verdict != Faulty || !strings.Contains(rep.Nodes[3].Reason, "connection refused") {
		t.Fatalf("n03: %+v", rep.Nodes[3])
	}
	if rep.Reference == nil || rep.Reference.Verdict != Healthy {
		t.Fatalf("reference: %+v\n%s", rep.Reference, text.String())
	}
	for _, want := range []string{"faulty", "n03", "connection refused", "healthy  n00"} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("text report lacks %q:\n%s", want, text.String())
		}
	}

	if got := metric(t, reg, "faultline_netcheck_bad_node", "n03", "faulty"); got != 1 {
		t.Fatalf("faultline_netcheck_bad_node{n03} = %v", got)
	}
	if got := metric(t, reg, "faultline_netcheck_nodes", "healthy"); got != 4 {
		t.Fatalf("healthy nodes gauge = %v", got)
	}
	if got := metric(t, reg, "faultline_netcheck_probes_total", "ok") + metric(t, reg, "faultline_netcheck_probes_total", "error"); int(got) != rep.Probes {
		t.Fatalf("probe counter %v, report %d", got, rep.Probes)
	}
	var probeSpans int
	for _, s := range spans.Ended() {
		if s.Name() == "netcheck.Probe" {
			probeSpans++
		}
	}
	if probeSpans != rep.Probes {
		t.Fatalf("%d probe spans for %d probes", probeSpans, rep.Probes)
	}

	// The JSON form reads back equal.
	data, err := rep.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	back, err := ParseReport(data)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(rep, back); diff != "" {
		t.Fatalf("report round trip (-want +got):\n%s", diff)
	}
	var generic map[string]any
	if err := json.Unmarshal(data, &generic); err != nil || generic["nodes"] == nil {
		t.Fatalf("report JSON: %v", err)
	}

	// A second check on a healed cluster resets the bad-node series.
	nodes[3] = Node{Name: "n03", Addr: startAgent(t, AgentConfig{}).Addr().String()}
	rep, err = c.Check(context.Background(), nodes)
	if err != nil || !rep.OK() {
		t.Fatalf("healed cluster: %v, %v", rep.Bad(), err)
	}
	if got := metric(t, reg, "faultline_netcheck_bad_node", "n03", "faulty"); got != -1 {
		t.Fatalf("stale bad-node series: %v", got)
	}
}

func TestCheckTwoNodes(t *testing.T) {
	// N = 2 with one node down: the reference breaks the tie.
	nodes, agents := loopbackNodes(t, 2)
	agents[0].Close()
	c, err := NewChecker(Config{Prober: &TCPProber{Bytes: 1 << 20}, Policy: Policy{StragglerRatio: 100}})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := c.Check(context.Background(), nodes)
	if err != nil {
		t.Fatal(err)
	}
	if got := rep.Bad(); !slices.Equal(got, []string{"n00"}) || rep.Nodes[1].Verdict != Healthy {
		var b strings.Builder
		rep.WriteText(&b)
		t.Fatalf("bad = %v\n%s", got, b.String())
	}
}

func TestCheckErrors(t *testing.T) {
	if _, err := NewChecker(Config{Parallel: -1}); err == nil || !strings.Contains(err.Error(), "Parallel") {
		t.Fatalf("Parallel -1: err = %v", err)
	}
	if _, err := NewChecker(Config{Policy: Policy{ConfirmPeers: -2}}); err == nil || !strings.Contains(err.Error(), "ConfirmPeers") {
		t.Fatalf("ConfirmPeers -2: err = %v", err)
	}
	c, err := NewChecker(Config{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Check(context.Background(), []Node{{Name: "checker", Addr: "127.0.0.1:1"}}); err == nil {
		t.Fatal("a node named like the reference was accepted")
	}
	if _, err := c.Check(context.Background(), []Node{{Name: "a"}, {Name: "a"}}); err == nil {
		t.Fatal("duplicate names were accepted")
	}
	nodes, _ := loopbackNodes(t, 2)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := c.Check(ctx, nodes); err == nil {
		t.Fatal("a cancelled check returned a report")
	}
}
