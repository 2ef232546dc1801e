// Command topo-sort orders a training job's nodes by the switches they hang
// from, and writes the switch-aware rank table.
//
//	topo-sort --config FILE [--ips a,b,c] [--format text|json|hccl]
//	          [--rank-table hccl.json] [--tp N --pp N --dp N --devices-per-node N]
//	          [--host-mapping FILE] [--watch]
//
// FILE is DLRover's node-topology-config ("asw psw ip" per line). The world
// to order is --ips in rank order, else the servers of --rank-table, else
// every node of FILE. With --tp (and --pp, --dp) the order also fits tensor
// parallel groups and pipeline stages under single ASWs.
//
// Formats: text prints "rank ip asw psw" per node; json prints the order and
// the nodes; hccl prints --rank-table reordered, ranks renumbered.
// --host-mapping writes host_ips_mapping.txt for the ordered hosts.
// --watch keeps running and prints the order again whenever FILE changes
// (a mounted ConfigMap included).
//
// Exit status: 0 on success, 1 when the input is bad, 2 on bad usage.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/faultline-ml/faultline/internal/atomicfile"
	"github.com/faultline-ml/faultline/topology"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

type options struct {
	config, ips, format, rankTable, hostMapping string
	par                                         topology.Parallel
	watch                                       bool
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("topo-sort", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o options
	fs.StringVar(&o.config, "config", "", "node-topology-config file (`asw psw ip` per line); required")
	fs.StringVar(&o.ips, "ips", "", "comma-separated node IPs in rank order (default: the rank table's servers, else every node of the config)")
	fs.StringVar(&o.format, "format", "text", "output: text, json or hccl")
	fs.StringVar(&o.rankTable, "rank-table", "", "hccl.json to reorder (needed by --format hccl)")
	fs.StringVar(&o.hostMapping, "host-mapping", "", "write host_ips_mapping.txt for the ordered hosts to this file")
	fs.IntVar(&o.par.TP, "tp", 0, "tensor-parallel size: fit TP groups under single ASWs")
	fs.IntVar(&o.par.PP, "pp", 0, "pipeline-parallel size (with --tp)")
	fs.IntVar(&o.par.DP, "dp", 0, "data-parallel size (with --tp; default: what the world leaves)")
	fs.IntVar(&o.par.DevicesPerNode, "devices-per-node", 0, "ranks per node (with --tp; default 8)")
	fs.BoolVar(&o.watch, "watch", false, "keep running and print the order again when the config changes")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	usage := func(msg string) int {
		fmt.Fprintln(stderr, "topo-sort:", msg)
		fs.Usage()
		return 2
	}
	switch {
	case fs.NArg() > 0:
		return usage("unexpected arguments: " + strings.Join(fs.Args(), " "))
	case o.config == "":
		return usage("--config is required")
	case o.format != "text" && o.format != "json" && o.format != "hccl":
		return usage("--format must be text, json or hccl")
	case o.format == "hccl" && o.rankTable == "":
		return usage("--format hccl needs --rank-table")
	case o.watch && (o.format == "hccl" || o.hostMapping != ""):
		return usage("--watch prints text or json only")
	}

	var rt *topology.RankTable
	if o.rankTable != "" {
		data, err := os.ReadFile(o.rankTable)
		if err == nil {
			rt, err = topology.ParseRankTable(data)
		}
		if err != nil {
			fmt.Fprintf(stderr, "topo-sort: %s: %v\n", o.rankTable, err)
			return 1
		}
	}
	if !o.watch {
		topo, err := topology.ReadFile(o.config)
		if err != nil {
			fmt.Fprintln(stderr, "topo-sort:", err)
			return 1
		}
		if err := o.emit(stdout, topo, rt); err != nil {
			fmt.Fprintln(stderr, "topo-sort:", err)
			return 1
		}
		return 0
	}

	// --watch: print each topology as it comes; a bad one is reported and
	// the last good one stays.
	var failed error
	w, err := topology.NewWatcher(topology.WatcherConfig{
		Path:         o.config,
		PollInterval: 2 * time.Second,
		OnChange: func(topo *topology.Topology) {
			if err := o.emit(stdout, topo, rt); err != nil {
				fmt.Fprintln(stderr, "topo-sort:", err)
				failed = err
			}
		},
	})
	if err != nil {
		fmt.Fprintln(stderr, "topo-sort:", err)
		return 1
	}
	defer w.Close()
	if err := w.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		fmt.Fprintln(stderr, "topo-sort:", err)
		return 1
	}
	if failed != nil {
		return 1
	}
	return 0
}

// emit orders the world and writes it in the chosen format.
func (o *options) emit(stdout io.Writer, topo *topology.Topology, rt *topology.RankTable) error {
	var world []string
	switch {
	case o.ips != "":
		for _, ip := range strings.Split(o.ips, ",") {
			if ip = strings.TrimSpace(ip); ip != "" {
				world = append(world, ip)
			}
		}
	case rt != nil:
		world = rt.ServerIDs()
	default:
		for _, n := range topo.Nodes() {
			world = append(world, n.IP)
		}
	}
	order := topo.Order(world)
	if o.par != (topology.Parallel{}) {
		var err error
		if order, err = topo.FitParallel(world, o.par); err != nil {
			return err
		}
	}
	if o.hostMapping != "" {
		m, err := topology.NewHostMapping(order)
		if err != nil {
			return err
		}
		if err := atomicfile.WriteFile(o.hostMapping, m.Marshal(), 0o644); err != nil {
			return err
		}
	}

	switch o.format {
	case "hccl":
		re, err := rt.Reorder(order)
		if err != nil {
			return err
		}
		out, err := re.Marshal()
		if err != nil {
			return err
		}
		_, err = stdout.Write(out)
		return err
	case "json":
		type node struct {
			Rank int    `json:"rank"`
			IP   string `json:"ip"`
			ASW  string `json:"asw,omitempty"`
			PSW  string `json:"psw,omitempty"`
		}
		doc := struct {
			Order []string `json:"order"`
			Nodes []node   `json:"nodes"`
		}{Order: order, Nodes: []node{}}
		for i, ip := range order {
			n, _ := topo.Lookup(ip)
			doc.Nodes = append(doc.Nodes, node{Rank: i, IP: ip, ASW: n.ASW, PSW: n.PSW})
		}
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(doc)
	default:
		var b strings.Builder
		for i, ip := range order {
			n, ok := topo.Lookup(ip)
			if !ok {
				n.ASW, n.PSW = "-", "-"
			}
			fmt.Fprintf(&b, "%d %s %s %s\n", i, ip, n.ASW, n.PSW)
		}
		_, err := io.WriteString(stdout, b.String())
		return err
	}
}
