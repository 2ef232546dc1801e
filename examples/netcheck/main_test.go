package main

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/netcheck"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// startAgent runs "netcheck agent" in this process and returns what it
// printed (its probe address, and its metrics URL if asked for) and a
// function that stops it.
func startAgent(t *testing.T, args ...string) (addr, metricsURL string, stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, append([]string{"agent"}, args...), pw, os.Stderr)
		pw.Close()
	}()
	got := make(chan [2]string, 1)
	go func() {
		lines := bufio.NewScanner(pr)
		var metrics string
		for lines.Scan() {
			l := lines.Text()
			if m, ok := strings.CutPrefix(l, "metrics on "); ok {
				metrics = m
			}
			if a, ok := strings.CutPrefix(l, "listening on "); ok {
				got <- [2]string{a, metrics}
				break
			}
		}
		io.Copy(io.Discard, pr)
	}()
	select {
	case g := <-got:
		addr, metricsURL = g[0], g[1]
	case <-time.After(20 * time.Second):
		t.Fatal("agent did not start")
	}
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		if code := <-done; code != 0 {
			t.Errorf("agent exit %d", code)
		}
	}
	t.Cleanup(stop)
	return addr, metricsURL, stop
}

func runCLI(args ...string) (int, string, string) {
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), args, &stdout, &stderr)
	return code, stdout.String(), stderr.String()
}

func TestRun(t *testing.T) {
	a, _, _ := startAgent(t, "--listen", "127.0.0.1:0")
	b, _, _ := startAgent(t, "--listen", "127.0.0.1:0")
	c, _, stopC := startAgent(t, "--listen", "127.0.0.1:0")
	nodes := "a=" + a + ",b=" + b + ",c=" + c

	// Loopback probes take a millisecond and jitter by several times on a
	// busy machine: these tests are about reachability, so a large ratio
	// keeps timing out of the verdicts.
	code, out, errOut := runCLI("run", "--nodes", nodes, "--bytes", "1048576", "--format", "json", "--ratio", "100")
	if code != 0 {
		t.Fatalf("exit %d: %s\n%s", code, errOut, out)
	}
	rep, err := netcheck.ParseReport([]byte(out))
	if err != nil {
		t.Fatal(err)
	}
	if !rep.OK() || len(rep.Nodes) != 3 {
		t.Fatalf("report: %+v", rep)
	}

	stopC()
	code, out, errOut = runCLI("run", "--nodes", nodes, "--bytes", "1048576", "--timeout", "5s", "--ratio", "100")
	if code != 1 {
		t.Fatalf("exit %d with c down: %s\n%s", code, errOut, out)
	}
	if !strings.Contains(out, "faulty") || !strings.Contains(out, "failed against healthy") {
		t.Fatalf("text report:\n%s", out)
	}
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "faulty") && !strings.Contains(l, " c ") {
			t.Fatalf("wrong node blamed: %s", l)
		}
	}
}

func TestRunInSwitchOrder(t *testing.T) {
	// Four agents on four loopback addresses; the topology puts .2 and .4
	// under one ASW, so round 0 must pair them.
	var nodes []string
	for i, ip := range []string{"127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"} {
		addr, _, _ := startAgent(t, "--listen", ip+":0")
		nodes = append(nodes, string(rune('a'+i))+"="+addr)
	}
	topo := filepath.Join(t.TempDir(), "topology_config")
	os.WriteFile(topo, []byte("asw-1 psw 127.0.0.2\nasw-2 psw 127.0.0.3\nasw-1 psw 127.0.0.4\nasw-2 psw 127.0.0.5\n"), 0o644)
	code, out, errOut := runCLI("run", "--nodes", strings.Join(nodes, ","), "--bytes", "65536", "--format", "json", "--topology", topo, "--ratio", "100")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	rep, err := netcheck.ParseReport([]byte(out))
	if err != nil {
		t.Fatal(err)
	}
	var order []string
	for _, n := range rep.Nodes {
		order = append(order, n.Name)
	}
	if got := strings.Join(order, ""); got != "acbd" {
		t.Fatalf("check order %s, want acbd", got)
	}
	if e := rep.Nodes[0].Evidence[0]; e.Round != 0 || e.Peer != "c" {
		t.Fatalf("a's first probe: %+v", e)
	}
}

func TestAgentMetrics(t *testing.T) {
	addr, metrics, _ := startAgent(t, "--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0")
	if code, _, errOut := runCLI("run", "--nodes", "x="+addr, "--bytes", "65536", "--ratio", "100"); code != 0 {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	// The agent counts a request once it has answered: poll for it.
	want := `faultline_netcheck_agent_requests_total{op="transfer",result="ok"} 1`
	var body []byte
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		resp, err := http.Get(metrics)
		if err != nil {
			t.Fatal(err)
		}
		body, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		if strings.Contains(string(body), want) {
			return
		}
	}
	t.Fatalf("metrics lack %s:\n%s", want, body)
}

func TestSwitchbox(t *testing.T) {
	code, out, _ := runCLI("switchbox", "--timeout", "2s")
	if code != 1 || !strings.Contains(out, "FAIL, 0 of 4 pairs") || !strings.Contains(out, "no accelerator backend") {
		t.Fatalf("exit %d:\n%s", code, out)
	}
	code, out, _ = runCLI("switchbox", "--pairs", "0:1", "--min-channels", "1", "--format", "json")
	if code != 1 || !strings.Contains(out, `"pair": "0:1"`) {
		t.Fatalf("exit %d:\n%s", code, out)
	}
}

func TestUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		msg  string
	}{
		{nil, "usage"},
		{[]string{"frobnicate"}, "unknown command"},
		{[]string{"run"}, "--nodes is required"},
		{[]string{"run", "--nodes", "a"}, "want name=host:port"},
		{[]string{"run", "--nodes", "a=b"}, "missing port"},
		{[]string{"run", "--nodes", "a=h:1", "--format", "xml"}, "--format"},
		{[]string{"run", "--nodes", "a=h:1", "--ratio", "0.5"}, "StragglerRatio"},
		{[]string{"run", "--nodes", "a=h:1", "--topology", "/nonexistent"}, "no such file"},
		{[]string{"switchbox", "--pairs", "0:0"}, "itself"},
		{[]string{"switchbox", "--min-channels", "9"}, "MinChannels"},
	} {
		code, _, errOut := runCLI(tc.args...)
		if code != 2 || !strings.Contains(errOut, tc.msg) {
			t.Errorf("%v: exit %d, stderr %q; want 2 and %q", tc.args, code, errOut, tc.msg)
		}
	}
}
