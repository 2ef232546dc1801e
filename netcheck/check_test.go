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
	// The agents listen on this host: the checker is no reference.
	if rep.Reference != nil || len(rep.Notes) != 1 || !strings.HasPrefix(rep.Notes[0], "no reference: the checker runs on the host of n00 (127.0.0.1:") {
		t.Fatalf("reference %+v, notes %q", rep.Reference, rep.Notes)
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

// TestCheckTwoNodesOnThisHost: two nodes whose agents listen on the
// checker's host. The checker takes no part, since its probes would not
// leave the host; one probe alone is no baseline, so the nodes are
// unknown unless a floor is given, and a failed probe blames no one but
// is named.
func TestCheckTwoNodesOnThisHost(t *testing.T) {
	nodes, agents := loopbackNodes(t, 2)
	check := func(pol Policy) *Report {
		t.Helper()
		pol.StragglerRatio = 100
		c, err := NewChecker(Config{Prober: &TCPProber{Bytes: 1 << 20}, Policy: pol})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		rep, err := c.Check(context.Background(), nodes)
		if err != nil {
			t.Fatal(err)
		}
		if rep.Reference != nil || rep.Probes != 1 {
			t.Fatalf("reference %+v, %d probes: want the two nodes' probe alone", rep.Reference, rep.Probes)
		}
		return rep
	}
	verdicts := func(rep *Report) string {
		var b strings.Builder
		for _, n := range rep.Nodes {
			b.WriteByte(string(n.Verdict)[0])
		}
		return b.String()
	}
	if rep := check(Policy{}); verdicts(rep) != "uu" || !strings.HasPrefix(rep.Notes[1], "no baseline") {
		t.Fatalf("no floor: %s, notes %q", verdicts(rep), rep.Notes)
	}
	if rep := check(Policy{MinBandwidth: 1e6}); verdicts(rep) != "hh" {
		t.Fatalf("1 MB/s floor: %s, notes %q", verdicts(rep), rep.Notes)
	}
	agents[0].Close()
	rep := check(Policy{MinBandwidth: 1e6})
	if verdicts(rep) != "uu" || len(rep.Links) != 1 || rep.Links[0].Outcome != Failed || !strings.Contains(rep.Links[0].Error, "connection refused") {
		t.Fatalf("n00 down: %s, links %+v", verdicts(rep), rep.Links)
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
	_, err = c.Check(context.Background(), []Node{{Name: "a", Addr: "10.0.0.1:9700"}, {Name: "b", Addr: "[::ffff:10.0.0.1]:9700"}})
	if err == nil || err.Error() != `netcheck: nodes "a" and "b" have one address, [::ffff:10.0.0.1]:9700: each node needs its own agent` {
		t.Fatalf("two names with one address: err = %v", err)
	}
	nodes, _ := loopbackNodes(t, 2)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := c.Check(ctx, nodes); err == nil {
		t.Fatal("a cancelled check returned a report")
	}
}
