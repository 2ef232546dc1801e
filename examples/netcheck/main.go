// Command netcheck runs network checks that name the faulty node.
//
//	netcheck agent [--listen ADDR] [--metrics ADDR]
//	netcheck run --nodes name=addr,... [--rounds N] [--format json|text]
//	             [--bytes N] [--repeats N] [--timeout D] [--ratio F]
//	             [--min-bandwidth RATE] [--max-rtt D] [--topology FILE]
//	             [--no-reference]
//	netcheck switchbox [--pairs "0:1 2:4 3:5 6:7"] [--min-bandwidth RATE]
//	             [--min-channels N] [--timeout D] [--format json|text]
//
// agent serves the probe endpoint on a node until interrupted. run probes
// the nodes' agents pairwise from here and reports each node healthy,
// faulty, straggler or unknown, with the evidence; --topology FILE (a
// node-topology-config) first orders the nodes by switch, so that round 0
// pairs neighbours under one ASW. switchbox checks the device links of this
// node; no accelerator backend is built in yet, so every pair fails as a
// missing device.
//
// A probe makes up to --repeats transfers, each moving --bytes up and then
// --bytes down, and keeps the fastest; one that its --timeout cuts short
// reports the rate of what it moved. A RATE is written as tc and iperf3
// write one: 400Mbit (bits per second) or 50MB (bytes per second).
//
// run takes part itself as the reference, a witness apart from the nodes,
// unless --no-reference: run it off the nodes' hosts, on a link at least as
// fast as theirs. Run on a node's host, it takes no part and says so. Two
// nodes with no reference have nothing to compare their one probe with;
// --min-bandwidth then says what a healthy link does.
//
// Exit status: 0 when every node (or the switchbox) passes, 1 when one does
// not (faulty, straggler, or unknown: no verdict could be had), 2 on bad
// usage or when the check could not run.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/faultline-ml/faultline/netcheck"
	"github.com/faultline-ml/faultline/topology"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

const usageText = `usage:
  netcheck agent [--listen ADDR] [--metrics ADDR]
  netcheck run --nodes name=addr,... [flags]
  netcheck switchbox [flags]
Run "netcheck COMMAND -h" for the flags of a command.
`

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usageText)
		return 2
	}
	switch args[0] {
	case "agent":
		return agent(ctx, args[1:], stdout, stderr)
	case "run":
		return check(ctx, args[1:], stdout, stderr)
	case "switchbox":
		return switchbox(ctx, args[1:], stdout, stderr)
	}
	fmt.Fprintf(stderr, "netcheck: unknown command %q\n%s", args[0], usageText)
	return 2
}

func flags(name string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("netcheck "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	return fs
}

// fail prints an error that the check met, with the package's prefix once.
func fail(stderr io.Writer, err error) {
	fmt.Fprintln(stderr, "netcheck:", strings.TrimPrefix(err.Error(), "netcheck: "))
}

// rate is a flag of bytes per second, written as netcheck.ParseBandwidth
// reads it.
type rate float64

func (r *rate) String() string {
	if r == nil || *r == 0 {
		return "0"
	}
	return strconv.FormatFloat(float64(*r)/1e6, 'f', -1, 64) + "MB"
}

func (r *rate) Set(s string) error {
	v, err := netcheck.ParseBandwidth(s)
	if err != nil {
		return errors.New(strings.TrimPrefix(err.Error(), "netcheck: "))
	}
	*r = rate(v)
	return nil
}

func agent(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flags("agent", stderr)
	listen := fs.String("listen", netcheck.DefaultAgentAddr, "TCP address to serve probes on")
	metrics := fs.String("metrics", "", "serve Prometheus metrics at http://ADDR/metrics")
	if err := fs.Parse(args); err != nil || fs.NArg() > 0 {
		return 2
	}
	reg := prometheus.NewRegistry()
	a, err := netcheck.NewAgent(netcheck.AgentConfig{Listen: *listen, Registerer: reg})
	if err != nil {
		fail(stderr, err)
		return 2
	}
	defer a.Close()
	if *metrics != "" {
		ln, err := net.Listen("tcp", *metrics)
		if err != nil {
			fail(stderr, fmt.Errorf("--metrics: %w", err))
			return 2
		}
		srv := &http.Server{Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{}), ReadHeaderTimeout: 10 * time.Second}
		go srv.Serve(ln)
		defer srv.Close()
		fmt.Fprintf(stdout, "metrics on http://%s/metrics\n", ln.Addr())
	}
	fmt.Fprintf(stdout, "listening on %s\n", a.Addr())
	if err := a.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		fail(stderr, err)
		return 2
	}
	return 0
}

func check(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flags("run", stderr)
	nodesFlag := fs.String("nodes", "", "the nodes to check, as name=host:port,... in rank order; required")
	rounds := fs.Int("rounds", 0, "most rounds of probes (default 8)")
	format := fs.String("format", "text", "output: text or json")
	bytes := fs.Int64("bytes", 16<<20, "bytes one transfer of a probe sends each way")
	repeats := fs.Int("repeats", 3, "transfers a probe makes at most, keeping the fastest (1 to 100)")
	timeout := fs.Duration("timeout", 10*time.Second, "deadline of one probe")
	ratio := fs.Float64("ratio", 2, "a probe slower than this times the median of the nodes' best times is slow")
	var minBW rate
	fs.Var(&minBW, "min-bandwidth", "`RATE` below which a probe is slow, as 400Mbit or 50MB (0: no floor)")
	maxRTT := fs.Duration("max-rtt", 0, "round trip above which a probe is slow (0: no ceiling)")
	topoFile := fs.String("topology", "", "node-topology-config: probe in switch order")
	noRef := fs.Bool("no-reference", false, "do not take part as the reference")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	usage := func(msg string) int {
		fmt.Fprintln(stderr, "netcheck run:", msg)
		fs.Usage()
		return 2
	}
	if fs.NArg() > 0 {
		return usage("unexpected arguments: " + strings.Join(fs.Args(), " "))
	}
	switch {
	case *format != "text" && *format != "json":
		return usage("--format must be text or json")
	case *rounds < 0:
		return usage(fmt.Sprintf("--rounds %d: must not be negative", *rounds))
	case *bytes <= 0:
		return usage(fmt.Sprintf("--bytes %d: want at least 1", *bytes))
	case *repeats < 1 || *repeats > 100:
		return usage(fmt.Sprintf("--repeats %d: want 1 to 100", *repeats))
	case *bytes > netcheck.DefaultAgentMaxBytes/int64(*repeats):
		return usage(fmt.Sprintf("--bytes %d × --repeats %d: more than the %d bytes an agent moves for one probe",
			*bytes, *repeats, netcheck.DefaultAgentMaxBytes))
	case *timeout <= 0:
		return usage(fmt.Sprintf("--timeout %v: want a positive duration", *timeout))
	case !(*ratio >= 1) || math.IsInf(*ratio, 0):
		return usage(fmt.Sprintf("--ratio %v: want at least 1", *ratio))
	case *maxRTT < 0:
		return usage(fmt.Sprintf("--max-rtt %v: must not be negative", *maxRTT))
	}
	reference := netcheck.DefaultReference
	if *noRef {
		reference = ""
	}
	nodes, err := parseNodes(*nodesFlag, reference)
	if err != nil {
		return usage(err.Error())
	}
	if *topoFile != "" {
		topo, err := topology.ReadFile(*topoFile)
		if err != nil {
			fail(stderr, err)
			return 2
		}
		nodes = inSwitchOrder(topo, nodes)
	}
	c, err := netcheck.NewChecker(netcheck.Config{
		Prober: &netcheck.TCPProber{Bytes: *bytes, Repeats: *repeats},
		Policy: netcheck.Policy{
			StragglerRatio: *ratio,
			MinBandwidth:   float64(minBW),
			MaxRTT:         *maxRTT,
			ProbeTimeout:   *timeout,
			MaxRounds:      *rounds,
		},
		NoReference: *noRef,
	})
	if err != nil {
		fail(stderr, err)
		return 2
	}
	defer c.Close()
	rep, err := c.Check(ctx, nodes)
	if err != nil {
		fail(stderr, err)
		return 2
	}
	if *format == "json" {
		out, err := rep.Marshal()
		if err != nil {
			fail(stderr, err)
			return 2
		}
		stdout.Write(out)
	} else {
		rep.WriteText(stdout)
	}
	if !rep.OK() {
		return 1
	}
	return 0
}

// parseNodes reads name=host:port,... in which every name and address is
// unique and no name is the reference's.
func parseNodes(s, reference string) ([]netcheck.Node, error) {
	if s == "" {
		return nil, errors.New("--nodes is required")
	}
	var nodes []netcheck.Node
	names, addrs := map[string]bool{}, map[string]string{}
	for _, f := range strings.Split(s, ",") {
		name, addr, ok := strings.Cut(strings.TrimSpace(f), "=")
		if !ok || name == "" {
			return nil, fmt.Errorf("--nodes: %q: want name=host:port", f)
		}
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return nil, fmt.Errorf("--nodes: %q: %v", f, err)
		}
		key := strings.ToLower(addr)
		if ap, err := netip.ParseAddrPort(addr); err == nil {
			key = netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()).String()
		}
		switch {
		case names[name]:
			return nil, fmt.Errorf("--nodes: name %q is given twice", name)
		case addrs[key] != "":
			return nil, fmt.Errorf("--nodes: %s and %s have one address, %s: each node needs its own agent", addrs[key], name, addr)
		case name == reference:
			return nil, fmt.Errorf("--nodes: %q is the name the checker takes as the reference: name the node otherwise, or give --no-reference", name)
		}
		names[name], addrs[key] = true, name
		nodes = append(nodes, netcheck.Node{Name: name, Addr: addr})
	}
	return nodes, nil
}

// inSwitchOrder orders nodes by the switches their hosts hang from, so that
// the planner's first round pairs nodes under one ASW.
func inSwitchOrder(topo *topology.Topology, nodes []netcheck.Node) []netcheck.Node {
	hosts := make([]string, len(nodes))
	for i, n := range nodes {
		hosts[i], _, _ = net.SplitHostPort(n.Addr)
	}
	at := make(map[string][]int, len(nodes)) // host -> its nodes, in order
	for i, h := range hosts {
		at[h] = append(at[h], i)
	}
	out := make([]netcheck.Node, 0, len(nodes))
	for _, h := range topo.Order(hosts) {
		out = append(out, nodes[at[h][0]])
		at[h] = at[h][1:]
	}
	return out
}

// noBackend is the device prober of this build: the accelerator backend
// is not linked in, so every device is missing.
type noBackend struct{}

func (noBackend) ProbeDevices(context.Context, int, int) (float64, error) {
	return 0, errors.New("no accelerator backend in this build: device not found")
}

func switchbox(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flags("switchbox", stderr)
	pairs := fs.String("pairs", netcheck.DefaultDevicePairs, "device pairs to check")
	minBW := rate(10000e6)
	fs.Var(&minBW, "min-bandwidth", "`RATE` a pair must exceed, as 80Gbit or 10000MB")
	minCh := fs.Int("min-channels", 2, "pairs that must pass")
	timeout := fs.Duration("timeout", 10*time.Second, "deadline of the whole check")
	format := fs.String("format", "text", "output: text or json")
	if err := fs.Parse(args); err != nil || fs.NArg() > 0 {
		return 2
	}
	usage := func(msg string) int {
		fmt.Fprintln(stderr, "netcheck switchbox:", msg)
		return 2
	}
	ps, err := netcheck.ParseDevicePairs(*pairs)
	switch {
	case err != nil:
		return usage("--pairs: " + strings.TrimPrefix(err.Error(), "netcheck: "))
	case minBW <= 0:
		return usage("--min-bandwidth 0: want a rate above 0")
	case *minCh < 1 || *minCh > len(ps):
		return usage(fmt.Sprintf("--min-channels %d: want 1 to the %d pairs of --pairs", *minCh, len(ps)))
	case *timeout <= 0:
		return usage(fmt.Sprintf("--timeout %v: want a positive duration", *timeout))
	}
	s, err := netcheck.NewSwitchbox(netcheck.SwitchboxConfig{
		Pairs: ps, MinBandwidth: float64(minBW), MinChannels: *minCh, Timeout: *timeout, Prober: noBackend{},
	})
	if err != nil {
		fail(stderr, err)
		return 2
	}
	defer s.Close()
	res := s.Check(ctx)
	if *format == "json" {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		enc.Encode(res)
	} else {
		res.WriteText(stdout)
	}
	if !res.Pass {
		return 1
	}
	return 0
}
