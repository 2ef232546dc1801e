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
	// The agents listen on this host: the checker takes no part.
	if rep.Reference != nil || len(rep.Notes) != 1 || !strings.HasPrefix(rep.Notes[0], "no reference: the checker runs on the host of a") {
		t.Fatalf("reference %+v, notes %q", rep.Reference, rep.Notes)
	}

	stopC()
	code, out, errOut = runCLI("run", "--nodes", nodes, "--bytes", "1048576", "--timeout", "5s", "--ratio", "100")
	if code != 1 {
		t.Fatalf("exit %d with c down: %s\n%s", code, errOut, out)
	}
	if !strings.Contains(out, "faulty") || !strings.Contains(out, "failed against working a, b") {
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
	other, _, _ := startAgent(t, "--listen", "127.0.0.1:0")
	addr, metrics, _ := startAgent(t, "--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0")
	// y's agent probes x's, which serves the transfer. Two nodes alone
	// need a floor to be judged healthy.
	if code, out, errOut := runCLI("run", "--nodes", "y="+other+",x="+addr, "--bytes", "65536", "--min-bandwidth", "1MB"); code != 0 {
		t.Fatalf("exit %d: %s\n%s", code, errOut, out)
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

// TestRunWithoutBaseline: two nodes and no reference have one probe and
// nothing to compare it with: unknown, exit 1, unless a floor says what a
// healthy link does; a floor above the link names it.
func TestRunWithoutBaseline(t *testing.T) {
	a, _, _ := startAgent(t, "--listen", "127.0.0.1:0")
	b, _, _ := startAgent(t, "--listen", "127.0.0.1:0")
	nodes := "a=" + a + ",b=" + b
	code, out, errOut := runCLI("run", "--nodes", nodes, "--bytes", "65536", "--no-reference")
	if code != 1 || !strings.Contains(out, "unknown  a") || !strings.Contains(out, "unknown  b") || !strings.Contains(out, "note: no baseline") {
		t.Fatalf("no floor: exit %d: %s\n%s", code, errOut, out)
	}
	code, out, errOut = runCLI("run", "--nodes", nodes, "--bytes", "65536", "--no-reference", "--min-bandwidth", "8Mbit")
	if code != 0 {
		t.Fatalf("a floor below the link: exit %d: %s\n%s", code, errOut, out)
	}
	code, out, errOut = runCLI("run", "--nodes", nodes, "--bytes", "65536", "--no-reference", "--min-bandwidth", "1000TB")
	if code != 1 || !strings.Contains(out, "links no verdict explains") || !strings.Contains(out, "a→b") {
		t.Fatalf("a floor above the link: exit %d: %s\n%s", code, errOut, out)
	}
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
		{[]string{"run", "--nodes", "a=h:1", "--ratio", "0.5"}, "--ratio 0.5: want at least 1"},
		{[]string{"run", "--nodes", "a=h:1", "--ratio", "NaN"}, "--ratio NaN: want at least 1"},
		{[]string{"run", "--nodes", "a=h:1", "--timeout", "-1s"}, "--timeout -1s: want a positive duration"},
		{[]string{"run", "--nodes", "a=h:1", "--rounds", "-1"}, "--rounds -1"},
		{[]string{"run", "--nodes", "a=h:1", "--max-rtt", "-1ms"}, "--max-rtt -1ms"},
		{[]string{"run", "--nodes", "a=h:1", "--bytes", "0"}, "--bytes 0: want at least 1"},
		{[]string{"run", "--nodes", "a=h:1", "--repeats", "0"}, "--repeats 0: want 1 to 100"},
		{[]string{"run", "--nodes", "a=h:1", "--bytes", "536870912"}, "--bytes 536870912 × --repeats 3: more than the 1073741824 bytes"},
		{[]string{"run", "--nodes", "a=h:1", "--min-bandwidth", "50"}, `invalid value "50" for flag -min-bandwidth: bandwidth "50" has no unit: write 50Mbit for megabits or 50MB`},
		{[]string{"run", "--nodes", "a=h:1", "--min-bandwidth", "100mbps"}, "bits to some and bytes to tc"},
		{[]string{"run", "--nodes", "a=h:1,b=h:1"}, "--nodes: a and b have one address, h:1"},
		{[]string{"run", "--nodes", "a=10.0.0.1:1,b=[::ffff:10.0.0.1]:1"}, "--nodes: a and b have one address"},
		{[]string{"run", "--nodes", "a=h:1,a=h:2"}, `--nodes: name "a" is given twice`},
		{[]string{"run", "--nodes", "checker=h:1"}, `--nodes: "checker" is the name the checker takes as the reference`},
		{[]string{"run", "--nodes", "a=h:1", "--topology", "/nonexistent"}, "no such file"},
		{[]string{"switchbox", "--pairs", "0:0"}, "--pairs: device pair 1 \"0:0\": a device paired with itself"},
		{[]string{"switchbox", "--min-channels", "9"}, "--min-channels 9: want 1 to the 4 pairs of --pairs"},
		{[]string{"switchbox", "--min-bandwidth", "10000"}, "has no unit"},
		{[]string{"agent", "--listen", "256.0.0.1:1"}, "netcheck: agent: listen tcp"},
		{[]string{"agent", "--listen", "127.0.0.1:0", "--metrics", "256.0.0.1:1"}, "netcheck: --metrics: listen tcp"},
	} {
		code, _, errOut := runCLI(tc.args...)
		if code != 2 || !strings.Contains(errOut, tc.msg) {
			t.Errorf("%v: exit %d, stderr %q; want 2 and %q", tc.args, code, errOut, tc.msg)
		}
		// Errors name flags, not Go fields, and say the package once.
		if strings.Contains(errOut, "netcheck: netcheck") || strings.Contains(errOut, "Policy.") || strings.Contains(errOut, "Config.") {
			t.Errorf("%v: stderr %q", tc.args, errOut)
		}
	}
}
