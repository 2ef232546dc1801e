package netcheck

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// The network tests build hosts as network namespaces joined by veth pairs
// to a bridge in the root namespace, run a real agent in each (this test
// binary, re-executed), degrade links with tc, and check that the checker,
// running in the root namespace as the reference, names exactly the hosts
// that were degraded or cut.
//
// Set FAULTLINE_NETCHECK_HEAVY=1 for bigger clusters and transfers.

const (
	agentEnv   = "FAULTLINE_NETCHECK_TEST_AGENT"
	checkerEnv = "FAULTLINE_NETCHECK_TEST_CHECKER" // a checkRequest: run it and print the report
	copyEnv    = "FAULTLINE_NETCHECK_TEST_COPY"    // also serve plain io.Copy, for the benchmark
	heavyEnv   = "FAULTLINE_NETCHECK_HEAVY"
)

// runTestAgent is main for a host: it serves an agent on addr, and a plain
// io.Copy endpoint when asked, says "ready" on stdout and runs until
// signalled.
func runTestAgent(addr string) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	a, err := NewAgent(AgentConfig{Listen: addr})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if c := os.Getenv(copyEnv); c != "" {
		ln, err := net.Listen("tcp", c)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer ln.Close()
		go serveCopy(ln)
	}
	fmt.Println("ready", a.Addr())
	a.Run(ctx)
	return 0
}

// checkRequest is a check for runTestChecker to run on a host.
type checkRequest struct {
	Nodes   []Node
	Policy  Policy
	Bytes   int64
	Repeats int
}

// runTestChecker is main for a checker on a host: it runs the checks that
// reqs, checkRequests in a JSON array, ask for, one after another, and
// prints their reports as a JSON array.
func runTestChecker(reqs string) int {
	var rs []checkRequest
	if err := json.Unmarshal([]byte(reqs), &rs); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	var reps []*Report
	for _, r := range rs {
		c, err := NewChecker(Config{Prober: &TCPProber{Bytes: r.Bytes, Repeats: r.Repeats}, Policy: r.Policy, Parallel: 1})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		rep, err := c.Check(context.Background(), r.Nodes)
		c.Close()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		reps = append(reps, rep)
	}
	if err := json.NewEncoder(os.Stdout).Encode(reps); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

// serveCopy is the baseline peer: it reads an 8-byte size n, copies n bytes
// in with io.Copy, answers a byte, and copies n bytes out with io.Copy.
func serveCopy(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			var h [8]byte
			if _, err := io.ReadFull(c, h[:]); err != nil {
				return
			}
			n, _ := strconv.ParseInt(strings.TrimSpace(string(h[:])), 16, 64)
			io.Copy(io.Discard, io.LimitReader(c, n))
			c.Write(h[:1])
			io.Copy(c, io.LimitReader(zeros{}, n))
		}()
	}
}

type zeros struct{}

func (zeros) Read(b []byte) (int, error) {
	clear(b)
	return len(b), nil
}

// needNetns skips unless the test can build namespaces.
func needNetns(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("network namespace tests need root")
	}
	for _, tool := range []string{"ip", "tc"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("network namespace tests need %s from iproute2: %v", tool, err)
		}
	}
}

var fabrics atomic.Int32

// fabric is a bridge with hosts hanging from it.
type fabric struct {
	t      testing.TB
	id     string // unique in this machine: pid and a counter
	bridge string
	subnet string // "10.213.X."
	hosts  []*host
}

type host struct {
	name string
	ns   string
	veth string // the root namespace's end
	peer string // the host's end, inside ns
	ip   string
	addr string // its agent
	copy string // its io.Copy endpoint, when asked for
}

func run(t testing.TB, args ...string) {
	t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// newFabric builds n hosts, each running an agent, and removes everything
// when the test ends, whether it passes or not.
func newFabric(t testing.TB, n int, withCopy bool) *fabric {
	t.Helper()
	needNetns(t)
	seq := fabrics.Add(1)
	f := &fabric{t: t, id: strconv.FormatInt(int64(os.Getpid()), 36) + strconv.FormatInt(int64(seq), 36)}
	f.bridge = "fl" + f.id + "b"
	f.subnet = freeSubnet(t, os.Getpid()+int(seq))

	t.Cleanup(func() { exec.Command("ip", "link", "del", f.bridge).Run() })
	run(t, "ip", "link", "add", f.bridge, "type", "bridge")
	run(t, "ip", "addr", "add", f.subnet+"254/24", "dev", f.bridge)
	run(t, "ip", "link", "set", f.bridge, "up")

	for i := range n {
		h := &host{
			name: fmt.Sprintf("h%02d", i),
			ns:   fmt.Sprintf("faultline-%s-%d", f.id, i),
			veth: fmt.Sprintf("fl%sh%d", f.id, i),
			peer: fmt.Sprintf("fl%sp%d", f.id, i),
			ip:   fmt.Sprintf("%s%d", f.subnet, i+1),
		}
		f.hosts = append(f.hosts, h)
		t.Cleanup(func() { exec.Command("ip", "netns", "del", h.ns).Run() })
		run(t, "ip", "netns", "add", h.ns)
		run(t, "ip", "link", "add", h.veth, "type", "veth", "peer", "name", h.peer, "netns", h.ns)
		run(t, "ip", "link", "set", h.veth, "master", f.bridge, "up")
		run(t, "ip", "-n", h.ns, "addr", "add", h.ip+"/24", "dev", h.peer)
		run(t, "ip", "-n", h.ns, "link", "set", h.peer, "up")
		run(t, "ip", "-n", h.ns, "link", "set", "lo", "up")

		cmd := inNetns(t, h.ns, testkit.Command(t, "agent", agentEnv+"="+h.ip+":9700"))
		if withCopy {
			h.copy = h.ip + ":9701"
			cmd.Env = append(cmd.Env, copyEnv+"="+h.copy)
		}
		// Should this test process die, the agent dies with it.
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			cmd.Process.Kill()
			cmd.Wait()
		})
		ready := make(chan string, 1)
		go func() {
			line, _ := bufio.NewReader(stdout).ReadString('\n')
			ready <- line
			io.Copy(io.Discard, stdout)
		}()
		select {
		case line := <-ready:
			if !strings.HasPrefix(line, "ready ") {
				t.Fatalf("agent of %s: %q", h.name, line)
			}
			h.addr = strings.TrimSpace(strings.TrimPrefix(line, "ready "))
		case <-time.After(30 * time.Second):
			t.Fatalf("agent of %s not ready in 30 s", h.name)
		}
	}
	return f
}

// freeSubnet picks a 10.213.X.0/24 that no interface here uses.
func freeSubnet(t testing.TB, seed int) string {
	out, err := exec.Command("ip", "-4", "-o", "addr").Output()
	if err != nil {
		t.Fatal(err)
	}
	for i := range 250 {
		s := fmt.Sprintf("10.213.%d.", (seed+i)%250)
		if !strings.Contains(string(out), " "+s) {
			return s
		}
	}
	t.Fatal("no free 10.213.X.0/24 subnet")
	return ""
}

// inNetns makes cmd run in the network namespace ns.
func inNetns(t testing.TB, ns string, cmd *exec.Cmd) *exec.Cmd {
	t.Helper()
	ip, err := exec.LookPath("ip")
	if err != nil {
		t.Fatal(err)
	}
	cmd.Args = append([]string{"ip", "netns", "exec", ns, cmd.Path}, cmd.Args[1:]...)
	cmd.Path = ip
	return cmd
}

// checkFrom runs checks on host i, beside its agent, one after another,
// and returns their reports.
func (f *fabric) checkFrom(i int, reqs ...checkRequest) []*Report {
	f.t.Helper()
	js, err := json.Marshal(reqs)
	if err != nil {
		f.t.Fatal(err)
	}
	cmd := inNetns(f.t, f.hosts[i].ns, testkit.Command(f.t, "checker", checkerEnv+"="+string(js)))
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.Output()
	if err != nil {
		f.t.Fatalf("checker on %s: %v", f.hosts[i].name, err)
	}
	var reps []*Report
	if err := json.Unmarshal(out, &reps); err != nil || len(reps) != len(reqs) {
		f.t.Fatalf("checker on %s: %d reports for %d checks, %v\n%s", f.hosts[i].name, len(reps), len(reqs), err, out)
	}
	return reps
}

func (f *fabric) nodes() []Node {
	nodes := make([]Node, len(f.hosts))
	for i, h := range f.hosts {
		nodes[i] = Node{Name: h.name, Addr: h.addr}
	}
	return nodes
}

// qdisc puts the same root qdisc on both ends of host i's link, so that
// both directions suffer.
func (f *fabric) qdisc(i int, spec ...string) error {
	h := f.hosts[i]
	for _, args := range [][]string{
		append([]string{"tc", "qdisc", "replace", "dev", h.veth, "root"}, spec...),
		append([]string{"tc", "-n", h.ns, "qdisc", "replace", "dev", h.peer, "root"}, spec...),
	} {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			return fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	return nil
}

// netemSupported reports whether tc can add a netem qdisc here, trying it
// on a veth pair of its own.
func netemSupported(t testing.TB) bool {
	name := "fl" + strconv.FormatInt(int64(os.Getpid()), 36) + "nt"
	run(t, "ip", "link", "add", name, "type", "veth", "peer", "name", name+"p")
	defer exec.Command("ip", "link", "del", name).Run()
	return exec.Command("tc", "qdisc", "add", "dev", name, "root", "netem", "delay", "1ms").Run() == nil
}

// shape limits host i's link to rate with a token bucket.
func (f *fabric) shape(i int, rate string) {
	if err := f.qdisc(i, "tbf", "rate", rate, "burst", "32kb", "latency", "400ms"); err != nil {
		f.t.Fatal(err)
	}
}

// cut takes host i off the bridge.
func (f *fabric) cut(i int) {
	run(f.t, "ip", "link", "set", f.hosts[i].veth, "down")
}

type degrade struct {
	kind string // "shape", "cut", "delay", "loss"
	host int
}

type scenario struct {
	name    string
	n       int
	faults  []degrade
	bytes   int64
	timeout time.Duration
	rate    string // of a shaped link
	// partial: a shaped link cannot finish one transfer by the deadline,
	// and its straggler's reason gives the rate it moved at.
	partial bool
	// unknown are the hosts, not degraded, whose speed nothing can judge.
	unknown []int
}

func (sc scenario) want() map[string]Verdict {
	want := map[string]Verdict{}
	for _, h := range sc.unknown {
		want[fmt.Sprintf("h%02d", h)] = Unknown
	}
	for _, d := range sc.faults {
		v := Straggler
		if d.kind == "cut" {
			v = Faulty
		}
		want[fmt.Sprintf("h%02d", d.host)] = v
	}
	return want
}

func TestNetworkNamespaces(t *testing.T) {
	needNetns(t)
	scenarios := []scenario{
		{name: "N=6 one shaped", n: 6, faults: []degrade{{"shape", 2}}},
		{name: "N=6 shaped and cut", n: 6, faults: []degrade{{"shape", 1}, {"cut", 4}}},
		{name: "N=2 one shaped", n: 2, faults: []degrade{{"shape", 0}}},
		// h00's one completed probe, with the checker, has nothing to be
		// compared with.
		{name: "N=2 one cut", n: 2, faults: []degrade{{"cut", 1}}, unknown: []int{0}},
		{name: "N=3 one cut", n: 3, faults: []degrade{{"cut", 0}}},
		{name: "N=3 shaped and cut", n: 3, faults: []degrade{{"shape", 2}, {"cut", 1}}},
		// 60 ms each way: slow start makes every transfer take several
		// round trips, so the probe needs more time.
		{name: "N=4 delay", n: 4, faults: []degrade{{"delay", 3}}, bytes: 128 << 10, timeout: 5 * time.Second},
		{name: "N=4 loss", n: 4, faults: []degrade{{"loss", 0}}, timeout: 3 * time.Second},
		// 4 MiB each way at 8 Mbit/s take 8 s, past the deadline: the
		// link is slow, not dead.
		{name: "N=3 too slow to finish", n: 3, faults: []degrade{{"shape", 2}}, bytes: 4 << 20, rate: "8mbit", partial: true},
	}
	if os.Getenv(heavyEnv) != "" {
		scenarios = append(scenarios,
			scenario{name: "N=16 two shaped one cut", n: 16, faults: []degrade{{"shape", 3}, {"shape", 12}, {"cut", 7}},
				bytes: 8 << 20, timeout: 10 * time.Second, rate: "200mbit"},
			scenario{name: "N=16 healthy", n: 16, bytes: 8 << 20, timeout: 10 * time.Second},
			scenario{name: "N=9 two cut", n: 9, faults: []degrade{{"cut", 0}, {"cut", 8}}},
		)
	}
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			if sc.bytes == 0 {
				// 2 MiB take a few milliseconds on a healthy link, so
				// that a busy machine's scheduling stall of some 10 ms
				// stays a fraction of a transfer, not a multiple of it.
				sc.bytes = 2 << 20
			}
			if sc.rate == "" {
				sc.rate = "40mbit"
			}
			if sc.timeout == 0 {
				sc.timeout = 1500 * time.Millisecond
			}
			for _, d := range sc.faults {
				if (d.kind == "delay" || d.kind == "loss") && !netemSupported(t) {
					t.Skip("this kernel has no netem queueing discipline (sch_netem)")
				}
			}
			f := newFabric(t, sc.n, false)
			for _, d := range sc.faults {
				switch d.kind {
				case "shape":
					f.shape(d.host, sc.rate)
				case "cut":
					f.cut(d.host)
				case "delay", "loss":
					spec := []string{"netem", "delay", "60ms"}
					if d.kind == "loss" {
						spec = []string{"netem", "loss", "30%"}
					}
					if err := f.qdisc(d.host, spec...); err != nil {
						t.Fatal(err)
					}
				}
			}
			c, err := NewChecker(Config{
				Prober: &TCPProber{Bytes: sc.bytes, Repeats: 2},
				// A healthy transfer of 2 MiB here takes a few
				// milliseconds and, on a busy shared machine, jitters by
				// several times; a 40 Mbit/s link takes some 100 times
				// longer. A ratio of 10 keeps the one clear of the other.
				Policy: Policy{ProbeTimeout: sc.timeout, StragglerRatio: 10},
				// All hosts share this machine's CPUs: probes at once
				// would slow each other and blur the figures.
				Parallel: 1,
			})
			if err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			rep, err := c.Check(context.Background(), f.nodes())
			if err != nil {
				t.Fatal(err)
			}
			var text strings.Builder
			rep.WriteText(&text)
			t.Logf("check took %v\n%s", time.Since(start).Round(time.Millisecond), text.String())
			defer func() {
				if t.Failed() {
					js, _ := rep.Marshal()
					t.Logf("report:\n%s", js)
				}
			}()
			want := sc.want()
			for _, res := range rep.Nodes {
				v, bad := want[res.Name]
				switch {
				case !bad && res.Verdict != Healthy:
					t.Errorf("healthy %s judged %s: %s", res.Name, res.Verdict, res.Reason)
				case bad && sc.faults != nil && slices.ContainsFunc(sc.faults, func(d degrade) bool {
					return d.kind == "loss" && fmt.Sprintf("h%02d", d.host) == res.Name
				}):
					// Heavy loss makes a probe slow or time out: either
					// names the host.
					if res.Verdict != Straggler && res.Verdict != Faulty {
						t.Errorf("lossy %s judged %s", res.Name, res.Verdict)
					}
				case bad && res.Verdict != v:
					t.Errorf("%s judged %s, want %s: %s", res.Name, res.Verdict, v, res.Reason)
				case bad && sc.partial && !strings.Contains(res.Reason, "cut by the deadline after"):
					t.Errorf("%s: reason %q gives no rate of what moved", res.Name, res.Reason)
				}
			}
		})
	}
}

// TestCheckerOnANodesHost runs the checker on a node's host, as DLRover
// runs its check. Every link is shaped to 400 Mbit/s, so that loopback is
// far faster than any of them: the probe to the agent beside the checker
// must not become the baseline that every real link falls short of. A
// transfer takes some 40 ms, and a node at 10 Mbit/s (40×) takes 1.7 s:
// a busy machine has made a healthy probe 3× slower than its link, so
// that a contrast of 10× fell inside the ratio of 5.
func TestCheckerOnANodesHost(t *testing.T) {
	needNetns(t)
	f := newFabric(t, 3, false)
	for i := range f.hosts {
		f.shape(i, "400mbit")
	}
	type check struct {
		name  string
		n     int
		floor float64 // Policy.MinBandwidth
		want  string  // verdicts in node order, one letter each
	}
	run := func(checks ...check) {
		t.Helper()
		var reqs []checkRequest
		for _, c := range checks {
			reqs = append(reqs, checkRequest{Nodes: f.nodes()[:c.n], Bytes: 1 << 20, Repeats: 1,
				Policy: Policy{ProbeTimeout: 6 * time.Second, StragglerRatio: 5, MinBandwidth: c.floor}})
		}
		for i, rep := range f.checkFrom(0, reqs...) {
			var text, got strings.Builder
			rep.WriteText(&text)
			for _, n := range rep.Nodes {
				got.WriteByte(string(n.Verdict)[0])
			}
			if got.String() != checks[i].want {
				t.Errorf("%s: verdicts %s, want %s\n%s", checks[i].name, got.String(), checks[i].want, text.String())
			}
			if rep.Reference != nil || len(rep.Notes) == 0 || !strings.HasPrefix(rep.Notes[0], "no reference: the checker runs on the host of h00") {
				t.Errorf("%s: reference %+v, notes %q", checks[i].name, rep.Reference, rep.Notes)
			}
		}
	}
	run(
		// One probe, and the checker would only measure h00's link
		// again: nothing to compare with, so unknown, not blamed...
		check{name: "N=2 healthy", n: 2, want: "uu"},
		// ...unless a floor says what a healthy link does: 2 MB/s, a
		// 25th of the link's rate, since a machine whose CPUs are all
		// taken has measured a healthy probe at 7.3 MB/s.
		check{name: "N=2 healthy, a floor", n: 2, floor: 2e6, want: "hh"},
		check{name: "N=3 healthy", n: 3, want: "hhh"},
	)
	f.shape(0, "10mbit")
	run(check{name: "N=3 the checker's node slow", n: 3, want: "shh"})
}
