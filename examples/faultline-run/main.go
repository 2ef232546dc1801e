// Command faultline-run runs one node's ranks of a training job the way
// torchrun does, and is that node's agent: it owns the ranks' checkpoint
// segments (memory outlives every rank), times their collectives for hangs,
// watches their dotting for slowness, and when a rank fails, stops every
// rank, keeps their stacks, restarts them (from interpreters that have
// imported torch already) and has them resume from the newest step every
// rank holds in memory.
//
//	faultline-run --standalone --nproc-per-node 4 train.py [args...]
//	faultline-run --nnodes 2 --node-rank 0 --master-addr HOST --master-port 29500 \
//	    --nproc-per-node 8 train.py [args...]
//
// Node 0 serves the ranks' store at --master-port and the job's manager
// at the next port, both on every interface, as torchrun's store; with
// several nodes, a --master-addr that resolves to loopback is refused.
//
// The flags torchrun users know keep their meaning: --standalone,
// --nnodes N or MIN:MAX, --nproc-per-node (also --nproc_per_node; auto and cpu count
// the processors), --node-rank, --master-addr, --master-port,
// --max-restarts (restarts of the whole job, default 0), --monitor-interval
// (seconds), --no-python, -m, --rdzv-id (the job id; default
// $MINDX_TASK_ID, else a fresh one). Each rank gets torchrun's environment
// (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
// MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS,
// TORCHELASTIC_RUN_ID) and a PYTHONPATH on which "import faultline" works;
// its output passes through, each line prefixed with its rank.
//
// Faultline's own:
//
//	--python PATH             the interpreter (default python3)
//	--collective-timeout D    a collective running longer is a hang (default: learned from the job's own)
//	--out DIR                 where diagnoses go (default faultline-out): incidents.jsonl, slownode.json,
//	                          incident-N/ with the stacks, flame graphs and verdict of a hang; a new job
//	                          moves an earlier job's there to previous/<its id>/, one started again with
//	                          its --rdzv-id goes on in them
//	--manager ADDR[,ADDR...]  the job's taskd manager when it runs apart (taskd-manager --agents), or its
//	                          managers, the one leading followed (default: node 0's faultline-run, on
//	                          --master-addr at --master-port + 1)
//	--token-file F            the control plane's shared token (default $TASKD_TOKEN); a job of one node
//	                          makes its own, a job of several needs one, or --insecure
//	--no-spares               start each rank afresh instead of from a warm interpreter
//	--heartbeat-deadline D    silence of a rank's worker after which node 0's manager declares it lost and
//	                          recovers the job (default 10s; heartbeats every sixth of it)
//	--grace-period D          after SIGTERM or SIGINT, the time to end in (default 30s; keep it under a
//	                          pod's terminationGracePeriodSeconds)
//	--node-timeout D          how long the job waits, once a node is lost (silent past --heartbeat-deadline),
//	                          for a node with its --node-rank to join on any host and take its ranks, which
//	                          resume from their copies in the other nodes' memory (default 10m); and how
//	                          long a node waits for the job's manager once it lost it (one not yet joined
//	                          waits at least 2m). Past it the job ends: the nodes left persist the newest
//	                          step their ranks hold with the replicas they hold of the lost node's ranks
//	                          (with 2 nodes, the survivor holds them all), so that the step commits
//	--join-timeout D          with --nnodes MIN:MAX: once MIN nodes are there, how long the job waits for
//	                          more before it starts with those there (default 30s). Such a job goes on
//	                          with fewer nodes, down to MIN, where lost nodes are not replaced within
//	                          --node-timeout: the nodes left are renumbered in their order and each
//	                          launcher runs its node again in the new shape, the ranks resuming from
//	                          the newest step they hold in memory. A node started after, with the job's
//	                          flags and any --node-rank but 0, waits to join it, and the job takes in
//	                          the nodes that came, up to MAX, at the next step its ranks save once they
//	                          bring it to MAX or --join-timeout after the last came
//	--replicas K              how many other nodes hold a copy of each rank's newest memory step (default 1
//	                          with several nodes; -1: none); --replica-port P is the first of the node's
//	                          replica servers' ports, one per local rank
//	--topology FILE           DLRover's node-topology-config (asw psw ip lines, the IPs the nodes reach
//	                          each other at): each rank's replicas go first to nodes under another
//	                          access switch, so that a switch lost loses no step
//	--metrics-listen ADDR     serve the agent's Prometheus metrics on ADDR (/metrics): each rank's
//	                          checkpoint, dotting and hang metrics, labelled by rank, node 0's manager's,
//	                          and faultline_agent_async_saves_abandoned_total
//
// SIGTERM, SIGINT, SIGHUP and SIGQUIT end the job as torchrun's agent
// ends it (torch 1.13: it sends the same signal to each rank, waits 30s,
// SIGKILLs those left and exits 1 with a SignalException): the signal is
// sent to each rank's process group, so that the ranks' own handlers run;
// ranks still running after three quarters of --grace-period are killed,
// and the newest step every rank of the node holds in memory is persisted
// to disk within the rest. A second signal kills the ranks at once.
//
// Exit status: 0 when every rank finished, 1 when the job was stopped
// (its restart budget spent, or a fault no restart repairs) or ended by
// a signal (as torchrun), 2 for bad usage.
package main

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/faultline-ml/faultline/agent"
	"github.com/faultline-ml/faultline/internal/freeport"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/topology"
	"github.com/faultline-ml/faultline/trace"
)

// Exit codes.
const (
	exitStopped = 1
	exitUsage   = 2
)

func main() {
	cfg, err := parse(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "faultline-run:", err)
		os.Exit(exitUsage)
	}
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGQUIT)
	if err := run(context.Background(), cfg, sigs); err != nil {
		fmt.Fprintln(os.Stderr, "faultline-run:", err)
		os.Exit(exitStopped)
	}
}

// run runs the node's agent until the job ends, again with the job's new
// shape each time an elastic job goes on with other nodes. The first of
// sigs terminates the job within the grace period; a second kills its
// ranks at once.
func run(ctx context.Context, opts options, sigs <-chan os.Signal) error {
	cfg := opts.Config
	// One registry an agent: the next one registers the same collectors.
	var reg atomic.Pointer[prometheus.Registry]
	if opts.metricsListen != "" {
		ln, err := net.Listen("tcp", opts.metricsListen)
		if err != nil {
			return fmt.Errorf("--metrics-listen: %w", err)
		}
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			promhttp.HandlerFor(reg.Load(), promhttp.HandlerOpts{}).ServeHTTP(w, r)
		})
		srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
		go srv.Serve(ln)
		defer srv.Close()
	}
	if !cfg.NoPython {
		dir, err := pythonPath()
		if err != nil {
			return err
		}
		cfg.PythonPath = dir
	}
	for {
		if opts.metricsListen != "" {
			r := prometheus.NewRegistry()
			reg.Store(r)
			cfg.Registerer = r
		}
		sig, err := runAgent(ctx, cfg, sigs)
		var rz *agent.Resized
		if !errors.As(err, &rz) {
			return err
		}
		if sig != 0 {
			// Taken as the run ended: the job ends here, its ranks stopped
			// and their segments kept (renumbered) for a run started again.
			glob := filepath.Join(cmp.Or(cfg.ShmDir, "/dev/shm"), "faultline-"+cfg.Job+"-*")
			if rz.Joining || rz.Waited {
				return fmt.Errorf("%w by %s as this node waited to join the job", agent.ErrTerminated, unix.SignalName(sig))
			}
			if rz.From == rz.To {
				// A spare that was to take a lost node's place.
				fmt.Fprintf(os.Stderr, "faultline-run: kept the replicas %s that spare node %d holds of node %d's ranks; remove them unless a node %d is started here (rm %s)\n", glob, rz.Node, rz.NodeRank, rz.NodeRank, glob)
				return fmt.Errorf("%w by %s as this spare was to take node %d's place", agent.ErrTerminated, unix.SignalName(sig), rz.NodeRank)
			}
			fmt.Fprintf(os.Stderr, "faultline-run: kept the checkpoint segments %s, renumbered for the job's new shape; remove them unless the job is run again (rm %s)\n", glob, glob)
			return fmt.Errorf("%w by %s as the job went on with %d nodes", agent.ErrTerminated, unix.SignalName(sig), rz.To)
		}
		switch {
		case rz.Joining: // the next run says that it waits
		case rz.Waited: // it joins, or takes a lost node's place
			fmt.Fprintf(os.Stderr, "faultline-run: %s\n", strings.TrimPrefix(rz.Error(), "agent: "))
		default:
			fmt.Fprintf(os.Stderr, "faultline-run: node %d goes on as node %d of %d: %s\n", rz.Node, rz.NodeRank, rz.To, rz.Why)
		}
		cfg = rz.Next(cfg)
	}
}

// runAgent runs one agent of the node until it ends, and returns the
// signal that terminated it, if one came.
func runAgent(ctx context.Context, cfg agent.Config, sigs <-chan os.Signal) (syscall.Signal, error) {
	a, err := agent.New(cfg)
	if err != nil {
		return 0, err
	}
	defer a.Close()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done, ended := make(chan struct{}), make(chan struct{})
	var got atomic.Int32
	go func() {
		defer close(ended)
		select {
		case sig := <-sigs:
			got.Store(int32(sig.(syscall.Signal)))
			a.Terminate(sig.(syscall.Signal))
		case <-done:
			return
		}
		select {
		case sig := <-sigs:
			fmt.Fprintf(os.Stderr, "faultline-run: %s again: killing the ranks now\n", unix.SignalName(sig.(syscall.Signal)))
			cancel()
		case <-done:
		}
	}()
	err = a.Run(ctx)
	close(done)
	<-ended // a signal it took as Run ended is in got
	return syscall.Signal(got.Load()), err
}

// errUsage is wrapped by every command-line error.
var errUsage = errors.New("usage")

// options are the agent's configuration and what the launcher itself
// does: serve its metrics.
type options struct {
	agent.Config
	metricsListen string // serve /metrics there
}

// parse reads the command line into an agent's configuration.
func parse(args []string) (options, error) {
	fs := flag.NewFlagSet("faultline-run", flag.ContinueOnError)
	var (
		standalone  = fs.Bool("standalone", false, "a job of one node on this machine, on a free port")
		nnodes      = fs.String("nnodes", "1", "number of nodes, N or MIN:MAX (elastic: the job starts with MIN to MAX nodes and goes on with fewer, down to MIN, when nodes are lost)")
		joinTimeout = fs.Duration("join-timeout", 30*time.Second, "an elastic job's wait for more nodes, up to MAX, once MIN are there, and for more once a node came to join it")
		nproc       = fs.String("nproc-per-node", "1", "ranks on this node: a number, auto or cpu")
		nodeRank    = fs.Int("node-rank", 0, "this node's rank")
		spareNodes  = fs.Int("spare-nodes", 0, "nodes beyond --nnodes (its MAX) that run no rank, keep warm interpreters and the replicas they are sent, and take a lost node's place at once: started with --node-rank NNODES and up")
		masterAddr  = fs.String("master-addr", "127.0.0.1", "address of node 0 (rank 0's store, the manager)")
		masterPort  = fs.Int("master-port", 29500, "port of rank 0's store; the manager listens on the next one")
		maxRestarts = fs.Int("max-restarts", 0, "restarts of the job's ranks allowed")
		monitor     = fs.Float64("monitor-interval", 0.02, "seconds between looks at the ranks' rings")
		noPython    = fs.Bool("no-python", false, "run the command itself, not through Python")
		module      = fs.Bool("m", false, "run a module, as python -m")
		pythonExe   = fs.String("python", "python3", "the Python interpreter")
		collTimeout = fs.Duration("collective-timeout", 0, "a collective running longer is a hang (0: learned)")
		out         = fs.String("out", "faultline-out", "folder for every diagnosis")
		runID       = fs.String("rdzv-id", os.Getenv("MINDX_TASK_ID"), "the job id (default $MINDX_TASK_ID, else a fresh one)")
		manager     = fs.String("manager", "", "address of the taskd manager running apart (taskd-manager --agents), or the managers' separated by commas")
		tokenFile   = fs.String("token-file", "", "file holding the control plane's token (default $TASKD_TOKEN)")
		insecure    = fs.Bool("insecure", false, "allow a multi-node control plane in plaintext without a token")
		noSpares    = fs.Bool("no-spares", false, "start each rank afresh, not from a warm interpreter")
		heartbeat   = fs.Duration("heartbeat-deadline", 10*time.Second, "silence of a rank's worker after which node 0's manager declares it lost (heartbeats every sixth of it)")
		grace       = fs.Duration("grace-period", 30*time.Second, "after SIGTERM or SIGINT, the time to end in: the ranks have three quarters of it to exit, the persist of the newest step in memory the rest")
		verbose     = fs.Bool("v", false, "log the agent's and the control plane's work")
		metrics     = fs.String("metrics-listen", "", "address to serve the agent's Prometheus metrics on (/metrics)")
		nodeTimeout = fs.Duration("node-timeout", 10*time.Minute, "how long the job waits for a node that replaces a lost one (same --node-rank, any host), and a node for the job's manager it lost (one not yet joined waits at least 2m); the job then ends, its newest step persisted with the lost node's replicas where the survivors hold them")
		replicas    = fs.Int("replicas", 0, "other nodes that hold a copy of each rank's newest memory step (default 1 with several nodes; -1: none)")
		topo        = fs.String("topology", "", "DLRover's node-topology-config (asw psw ip lines): replicas go to nodes under another access switch first")
		replicaPort = fs.Int("replica-port", 0, "first port of the node's replica servers, one per local rank (default --master-port + 2 + node rank x ranks per node)")
	)
	// torchrun's underscore spellings.
	for _, alias := range []struct{ old, new string }{{"nproc_per_node", "nproc-per-node"}, {"node_rank", "node-rank"},
		{"master_addr", "master-addr"}, {"master_port", "master-port"}, {"max_restarts", "max-restarts"},
		{"monitor_interval", "monitor-interval"}, {"no_python", "no-python"}, {"rdzv_id", "rdzv-id"}, {"run-id", "rdzv-id"}, {"module", "m"}} {
		f := fs.Lookup(alias.new)
		fs.Var(f.Value, alias.old, "same as --"+alias.new)
	}
	if err := fs.Parse(args); err != nil {
		return options{}, fmt.Errorf("%w: %v", errUsage, err)
	}
	cmd := fs.Args()
	if len(cmd) == 0 {
		return options{}, fmt.Errorf("%w: name the training script (or, with --no-python, the program) and its arguments", errUsage)
	}
	opts := options{metricsListen: *metrics}
	cfg := &opts.Config
	*cfg = agent.Config{Command: cmd, NodeRank: *nodeRank, MasterAddr: *masterAddr, MasterPort: *masterPort,
		MaxRestarts: *maxRestarts, NoPython: *noPython, Module: *module, Python: *pythonExe, CollectiveTimeout: *collTimeout,
		Out: *out, Manager: *manager, NoSpares: *noSpares, GracePeriod: *grace, HeartbeatDeadline: *heartbeat,
		NodeTimeout: *nodeTimeout, Replicas: *replicas, ReplicaPort: *replicaPort, JoinTimeout: *joinTimeout, SpareNodes: *spareNodes}
	var err error
	if cfg.MinNodes, cfg.Nodes, err = parseNodes(*nnodes); err != nil {
		return opts, err
	}
	if *joinTimeout <= 0 {
		return opts, fmt.Errorf("%w: --join-timeout %v: give a positive duration", errUsage, *joinTimeout)
	}
	if cfg.MinNodes < cfg.Nodes && *manager != "" {
		return opts, fmt.Errorf("%w: --nnodes %s with --manager: an elastic job's manager is node 0's faultline-run, whose shape changes with the job's; drop --manager, or give a fixed --nnodes", errUsage, *nnodes)
	}
	switch {
	case *standalone && *spareNodes != 0:
		return opts, fmt.Errorf("%w: --standalone with --spare-nodes: a standalone job is one node; drop --spare-nodes", errUsage)
	case *spareNodes < 0:
		return opts, fmt.Errorf("%w: --spare-nodes %d: negative", errUsage, *spareNodes)
	case *spareNodes > 0 && cfg.Nodes < 2:
		return opts, fmt.Errorf("%w: --spare-nodes %d with --nnodes %s: a spare takes the place of a lost node other than node 0, whose loss ends the job; give a job of at least 2 nodes", errUsage, *spareNodes, *nnodes)
	case *spareNodes > 0 && *manager != "":
		return opts, fmt.Errorf("%w: --spare-nodes with --manager: node 0's faultline-run hands a lost node's place to a spare; drop --manager", errUsage)
	case *nodeRank < 0 || *nodeRank >= cfg.Nodes+*spareNodes:
		spares := ""
		if *spareNodes > 0 {
			spares = fmt.Sprintf(" and --spare-nodes %d", *spareNodes)
		}
		return opts, fmt.Errorf("%w: --node-rank %d: outside [0, %d) for --nnodes %s%s", errUsage, *nodeRank, cfg.Nodes+*spareNodes, *nnodes, spares)
	}
	if cfg.ProcsPerNode, err = parseNproc(*nproc); err != nil {
		return opts, err
	}
	if *topo != "" {
		data, err := os.ReadFile(*topo)
		if err != nil {
			return opts, fmt.Errorf("%w: --topology: %v", errUsage, err)
		}
		if cfg.Topology, err = topology.Parse(data); err != nil {
			return opts, fmt.Errorf("%w: --topology %s: %v", errUsage, *topo, err)
		}
	}
	if *heartbeat <= 0 {
		return opts, fmt.Errorf("%w: --heartbeat-deadline %v: give a positive duration", errUsage, *heartbeat)
	}
	if *grace <= 0 {
		return opts, fmt.Errorf("%w: --grace-period %v: give a positive duration", errUsage, *grace)
	}
	if *monitor <= 0 {
		return opts, fmt.Errorf("%w: --monitor-interval %v: give a positive number of seconds", errUsage, *monitor)
	}
	cfg.MonitorInterval = time.Duration(*monitor * float64(time.Second))
	if !*noPython {
		if _, err := exec.LookPath(*pythonExe); err != nil {
			return opts, fmt.Errorf("%w: --python %s: %v; name an interpreter that imports torch (Debian's is /usr/bin/python3)", errUsage, *pythonExe, err)
		}
	}
	if *standalone {
		if cfg.MinNodes < cfg.Nodes {
			return opts, fmt.Errorf("%w: --standalone with --nnodes %s: a standalone job is one node; drop the range", errUsage, *nnodes)
		}
		cfg.Nodes, cfg.MinNodes, cfg.NodeRank, cfg.MasterAddr = 1, 1, 0, "127.0.0.1"
		if cfg.MasterPort, err = freeport.Find(1); err != nil {
			return opts, err
		}
		// No one looks for the manager at a port chosen in advance: one of
		// the kernel's choosing, which no other program can take between
		// a check and the bind. The store's is passed to the ranks.
		cfg.ManagerListen = "127.0.0.1:0"
	}
	cfg.Job = *runID
	if cfg.Job == "" {
		if cfg.Nodes > 1 {
			return opts, fmt.Errorf("%w: a job of %d nodes needs one id on every node: give --rdzv-id or set MINDX_TASK_ID", errUsage, cfg.Nodes)
		}
		cfg.Job = "faultline-" + time.Now().Format("20060102-150405") + "-" + randomHex(3)
	}
	if err := trace.ValidateJob(cfg.Job); err != nil {
		return opts, fmt.Errorf("%w: --rdzv-id %q: %v", errUsage, cfg.Job, err)
	}
	if err := checkMaster(cfg.MasterAddr, cfg.Nodes); err != nil {
		return opts, err
	}
	if cfg.Security, err = security(*tokenFile, *insecure, cfg.Nodes, cfg.Manager); err != nil {
		return opts, err
	}
	if *verbose {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	} else {
		cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	}
	if err := cfg.Validate(); err != nil {
		return opts, fmt.Errorf("%w: %v", errUsage, err)
	}
	return opts, nil
}

// parseNodes reads --nnodes: N, or MIN:MAX as torchrun reads it (an
// elastic job, with MIN < MAX).
func parseNodes(s string) (lo, hi int, err error) {
	a, b, ranged := strings.Cut(s, ":")
	lo, err = strconv.Atoi(a)
	if err != nil || lo < 1 {
		return 0, 0, fmt.Errorf("%w: --nnodes %q: give a positive number of nodes, or MIN:MAX with MIN at least 1", errUsage, s)
	}
	if !ranged {
		return lo, lo, nil
	}
	hi, err = strconv.Atoi(b)
	switch {
	case err != nil || hi < 1:
		return 0, 0, fmt.Errorf("%w: --nnodes %q: MAX must be a positive number", errUsage, s)
	case lo > hi:
		return 0, 0, fmt.Errorf("%w: --nnodes %q: MIN %d is more than MAX %d", errUsage, s, lo, hi)
	}
	return lo, hi, nil
}

// checkMaster refuses, for a job of several nodes, a master address that
// resolves to loopback only: the other nodes cannot reach node 0's store
// and manager there. One that does not resolve (yet: a Kubernetes
// service) passes.
func checkMaster(addr string, nodes int) error {
	if nodes < 2 {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip", addr)
	if err != nil || len(ips) == 0 || slices.ContainsFunc(ips, func(ip netip.Addr) bool { return !ip.IsLoopback() }) {
		return nil
	}
	for i, ip := range ips {
		ips[i] = ip.Unmap()
	}
	return fmt.Errorf("%w: --master-addr %q resolves to %v, a loopback address, where the job's other nodes cannot reach node 0: give an address of node 0 that they can reach (its IP, or a name their DNS maps to it; Debian's /etc/hosts maps the host's own name to 127.0.1.1)",
		errUsage, addr, ips)
}

// parseNproc reads --nproc-per-node: a number, or auto and cpu (the
// processors of this machine; no accelerator is counted here).
func parseNproc(s string) (int, error) {
	switch s {
	case "auto", "cpu":
		return runtime.NumCPU(), nil
	case "gpu":
		return 0, fmt.Errorf("%w: --nproc-per-node gpu: give the number of ranks", errUsage)
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		return 0, fmt.Errorf("%w: --nproc-per-node %q: give a positive number, auto or cpu", errUsage, s)
	}
	return n, nil
}

// security is the control plane's: a job of one node whose manager runs
// here makes a token of its own; others take --token-file or
// $TASKD_TOKEN, or plaintext with --insecure.
func security(tokenFile string, insecure bool, nodes int, manager string) (taskd.Security, error) {
	token := os.Getenv("TASKD_TOKEN")
	if tokenFile != "" {
		b, err := os.ReadFile(tokenFile)
		if err != nil {
			return taskd.Security{}, fmt.Errorf("%w: --token-file: %v", errUsage, err)
		}
		if token = strings.TrimSpace(string(b)); token == "" {
			return taskd.Security{}, fmt.Errorf("%w: --token-file %s holds no token", errUsage, tokenFile)
		}
	}
	switch {
	case token != "":
		return taskd.Security{Token: token, Insecure: true}, nil
	case nodes == 1 && manager == "":
		return taskd.Security{Token: randomHex(32), Insecure: true}, nil
	case insecure:
		return taskd.Security{Insecure: true}, nil
	}
	return taskd.Security{}, fmt.Errorf("%w: a job of %d nodes needs the control plane's token on every node: --token-file or TASKD_TOKEN (or --insecure for plaintext)", errUsage, nodes)
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}
