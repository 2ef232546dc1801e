// Command netcheck runs network checks that name the faulty node.
//
//	netcheck agent [--listen ADDR] [--metrics ADDR]
//	netcheck run --nodes name=addr,... [--rounds N] [--format json|text]
//	             [--bytes N] [--timeout D] [--ratio F] [--min-bandwidth MB/s]
//	             [--max-rtt D] [--topology FILE] [--no-reference]
//	netcheck switchbox [--pairs "0:1 2:4 3:5 6:7"] [--min-bandwidth MB/s]
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
// Exit status: 0 when every node (or the switchbox) passes, 1 when one does
// not, 2 on bad usage or when the check could not run.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
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
		fmt.Fprintln(stderr, "netcheck:", err)
		return 2
	}
	defer a.Close()
	if *metrics != "" {
		ln, err := net.Listen("tcp", *metrics)
		if err != nil {
			fmt.Fprintln(stderr, "netcheck:", err)
			return 2
		}
		srv := &http.Server{Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{}), ReadHeaderTimeout: 10 * time.Second}
		go srv.Serve(ln)
		defer srv.Close()
		fmt.Fprintf(stdout, "metrics on http://%s/metrics\n", ln.Addr())
	}
	fmt.Fprintf(stdout, "listening on %s\n", a.Addr())
	if err := a.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		fmt.Fprintln(stderr, "netcheck:", err)
		return 2
	}
	return 0
}

func check(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flags("run", stderr)
	nodesFlag := fs.String("nodes", "", "the nodes to check, as name=host:port,... in rank order; required")
	rounds := fs.Int("rounds", 0, "most rounds of probes (default 8)")
	format := fs.String("format", "text", "output: text or json")
	bytes := fs.Int64("bytes", 16<<20, "bytes each probe sends each way")
	timeout := fs.Duration("timeout", 10*time.Second, "deadline of one probe")
	ratio := fs.Float64("ratio", 2, "a probe slower than this times the median of the nodes' best times is slow")
	minBW := fs.Float64("min-bandwidth", 0, "MB/s below which a probe is slow (0: no floor)")
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
	if *format != "text" && *format != "json" {
		return usage("--format must be text or json")
	}
	nodes, err := parseNodes(*nodesFlag)
	if err != nil {
		return usage(err.Error())
	}
	if *topoFile != "" {
		topo, err := topology.ReadFile(*topoFile)
		if err != nil {
			fmt.Fprintln(stderr, "netcheck:", err)
			return 2
		}
		nodes = inSwitchOrder(topo, nodes)
	}
	c, err := netcheck.NewChecker(netcheck.Config{
		Prober: &netcheck.TCPProber{Bytes: *bytes},
		Policy: netcheck.Policy{
			StragglerRatio: *ratio,
			MinBandwidth:   *minBW * 1e6,
			MaxRTT:         *maxRTT,
			ProbeTimeout:   *timeout,
			MaxRounds:      *rounds,
		},
		NoReference: *noRef,
	})
	if err != nil {
		return usage(err.Error())
	}
	rep, err := c.Check(ctx, nodes)
	if err != nil {
		fmt.Fprintln(stderr, "netcheck:", err)
		return 2
	}
	if *format == "json" {
		out, err := rep.Marshal()
		if err != nil {
			fmt.Fprintln(stderr, "netcheck:", err)
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

// parseNodes reads name=host:port,...
func parseNodes(s string) ([]netcheck.Node, error) {
	if s == "" {
		return nil, errors.New("--nodes is required")
	}
	var nodes []netcheck.Node
	for _, f := range strings.Split(s, ",") {
		name, addr, ok := strings.Cut(strings.TrimSpace(f), "=")
		if !ok || name == "" {
			return nil, fmt.Errorf("--nodes: %q: want name=host:port", f)
		}
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return nil, fmt.Errorf("--nodes: %q: %v", f, err)
		}
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
	minBW := fs.Float64("min-bandwidth", 10000, "MB/s a pair must exceed")
	minCh := fs.Int("min-channels", 2, "pairs that must pass")
	timeout := fs.Duration("timeout", 10*time.Second, "deadline of the whole check")
	format := fs.String("format", "text", "output: text or json")
	if err := fs.Parse(args); err != nil || fs.NArg() > 0 {
		return 2
	}
	ps, err := netcheck.ParseDevicePairs(*pairs)
	if err != nil {
		fmt.Fprintln(stderr, "netcheck switchbox:", err)
		return 2
	}
	s, err := netcheck.NewSwitchbox(netcheck.SwitchboxConfig{
		Pairs: ps, MinBandwidth: *minBW * 1e6, MinChannels: *minCh, Timeout: *timeout, Prober: noBackend{},
	})
	if err != nil {
		fmt.Fprintln(stderr, "netcheck switchbox:", err)
		return 2
	}
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
