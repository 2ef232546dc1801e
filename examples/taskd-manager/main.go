// Command taskd-manager runs the control plane's manager for one job: it
// takes registrations and heartbeats from the job's proxies and workers,
// declares silent ones lost, keeps the fault log, and fans the profiling
// switch out to every worker.
//
//	taskd-manager --listen :9601 --job ID --nodes N --procs-per-node P \
//	    [--switch-file F] [--tls-dir D] [--state-dir S] [--collect-dir C] \
//	    [--orchestrate | --agents] [--pause-timeout D] \
//	    [--lease file --lease-file F | --lease kubernetes --lease-name L]
//
// --tls-dir holds ca.crt, tls.crt and tls.key (a Kubernetes TLS secret);
// without it --insecure must be given. The members' shared token is read
// from --token-file or TASKD_TOKEN, the operators' (which the Admin and
// TrainingDataTrace services take, and nothing else) from
// --admin-token-file or TASKD_ADMIN_TOKEN, and the proxies' from
// --proxy-token-file or TASKD_PROXY_TOKEN: without it the proxy role is
// closed, and workers attach to the manager directly; give the same token
// to each taskd-proxy. The line logged at start says which roles are
// open and to whom. A token file must hold a token of 16 bytes or more
// (openssl rand -hex 16); an empty one is refused. --switch-file follows a
// profilingSwitch file such as a mounted ConfigMap; the switch can also be
// changed through the TrainingDataTrace gRPC service on the same port.
//
// --metrics-listen serves /metrics over plain HTTP, without
// authentication: bind it to loopback or a cluster-internal address, and
// let the network policy say who may scrape it.
//
// --orchestrate turns on online recovery, link switches and stress tests
// (the Admin service's SwitchLink, StressTest and GetOrchestration) for
// workers with a trainer. Alone, this command has no executor and no
// checkpoint store, so its recoveries retry a step or stop the job; an
// embedder that can restart processes builds the manager with its own
// taskd.OrchestrationConfig. --agents is that configuration for a job
// whose nodes run faultline-run with --manager pointing here: its agents
// restart the ranks and resume them from the newest checkpoint step every
// node holds (agent.Orchestration); it needs --nodes. --pause-timeout
// (default 30s) bounds how long an orchestration waits for every rank to
// pause; it needs --orchestrate or --agents.
//
// A job may have several managers, one leading and the others standing by
// (taskd.Lead): --lease file keeps the lease in --lease-file, on one
// machine or a shared filesystem whose locks work (a filesystem without
// them is refused at start); --lease kubernetes in the coordination.k8s.io
// Lease --lease-name of the pod's namespace ($POD_NAMESPACE), through the
// pod's ServiceAccount. A manager is named by $POD_NAME, else its host and
// process id. Only the leader listens; proxies and workers given every
// manager's address (or a Service) follow it, and a deposed leader's
// commands are fenced. Managers of one job must be started alike (job,
// shape, heartbeats, orchestration): one whose configuration differs from
// the leader's is refused. With --orchestrate or --agents, --lease needs
// one --state-dir shared by every manager: the standby that takes over
// finishes the recovery in progress from it. SIGTERM resigns the lease,
// so that a standby leads at once.
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/faultline-ml/faultline/agent"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/taskd/lease"
	leasek8s "github.com/faultline-ml/faultline/taskd/lease/kubernetes"
	"github.com/faultline-ml/faultline/trace"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "taskd-manager:", err)
		os.Exit(1)
	}
}

func run() error {
	var (
		listen      = flag.String("listen", taskd.DefaultManagerAddr, "address to serve the job on")
		job         = flag.String("job", os.Getenv("MINDX_TASK_ID"), "job identifier (default $MINDX_TASK_ID)")
		nodes       = flag.Int("nodes", 0, "number of nodes in the job (0: unknown)")
		ppn         = flag.Int("procs-per-node", 0, "training processes per node (0: unknown)")
		switchFile  = flag.String("switch-file", "", "profilingSwitch file to follow, e.g. "+trace.DefaultSwitchPath)
		tlsDir      = flag.String("tls-dir", "", "directory with ca.crt, tls.crt and tls.key for mutual TLS")
		tokenFile   = flag.String("token-file", "", "file holding the members' shared token (default $TASKD_TOKEN)")
		adminFile   = flag.String("admin-token-file", "", "file holding the operators' token (default $TASKD_ADMIN_TOKEN)")
		proxyFile   = flag.String("proxy-token-file", "", "file holding the proxies' token (default $TASKD_PROXY_TOKEN)")
		plaintext   = flag.Bool("insecure", false, "allow plaintext connections (no TLS)")
		stateDir    = flag.String("state-dir", "", "directory keeping the fault log and switch across restarts")
		collectDir  = flag.String("collect-dir", "", "directory receiving collected dotting and stack files")
		metrics     = flag.String("metrics-listen", "", "address to serve Prometheus metrics on (/metrics)")
		interval    = flag.Duration("heartbeat-interval", taskd.DefaultHeartbeatInterval, "how often members send heartbeats")
		deadline    = flag.Duration("heartbeat-deadline", taskd.DefaultHeartbeatDeadline, "silence after which a member is lost")
		orchestrate = flag.Bool("orchestrate", false, "recover from faults online, and serve link switches and stress tests")
		agents      = flag.Bool("agents", false, "the ranks run under faultline-run: orchestrate as its agents recover (implies --orchestrate)")
		pause       = flag.Duration("pause-timeout", defaultPauseTimeout, "how long orchestration waits for every rank to pause (0: the default)")
		leaseKind   = flag.String("lease", "", "file or kubernetes: one of several managers, leading while it holds the lease (default: none, this manager leads alone)")
		leaseFile   = flag.String("lease-file", "", "--lease file: the lease file, on a filesystem every manager shares")
		leaseName   = flag.String("lease-name", "", "--lease kubernetes: the coordination.k8s.io Lease, in namespace $POD_NAMESPACE")
	)
	flag.Parse()
	pauseGiven := false
	flag.Visit(func(f *flag.Flag) { pauseGiven = pauseGiven || f.Name == "pause-timeout" })
	if err := checkFlags(*orchestrate || *agents, pauseGiven, *leaseKind, *stateDir); err != nil {
		return err
	}
	*pause = cmp.Or(*pause, defaultPauseTimeout)
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	sec, err := security(*tlsDir, *tokenFile, *plaintext)
	if err != nil {
		return err
	}
	adminToken, err := readToken("--admin-token-file", *adminFile, "TASKD_ADMIN_TOKEN")
	if err != nil {
		return err
	}
	proxyToken, err := readToken("--proxy-token-file", *proxyFile, "TASKD_PROXY_TOKEN")
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	cfg := taskd.ManagerConfig{
		Job: *job, Listen: *listen, Nodes: *nodes, ProcsPerNode: *ppn, Security: sec, AdminToken: adminToken, ProxyToken: proxyToken,
		HeartbeatInterval: *interval, HeartbeatDeadline: *deadline,
		StateDir: *stateDir, CollectDir: *collectDir,
		Registerer: reg, Logger: log,
	}
	switch {
	case *agents:
		if *nodes < 1 {
			return errors.New("--agents: give the job's number of nodes with --nodes")
		}
		orch, h, err := agent.Orchestration(*nodes, log)
		if err != nil {
			return fmt.Errorf("--agents: %w", err)
		}
		defer orch.Policy.Close()
		orch.Timeouts.Pause = *pause
		cfg.Orchestration, cfg.Handlers = orch, []taskd.Handler{h}
	case *orchestrate:
		cfg.Orchestration = &taskd.OrchestrationConfig{Timeouts: taskd.Timeouts{Pause: *pause}}
	}
	if *switchFile != "" {
		cfg.SwitchSource = taskd.SwitchFile(trace.SwitchWatcherConfig{Path: *switchFile, Registerer: reg, Logger: log})
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	candidate := lease.Candidate{Job: *job, Name: os.Getenv("POD_NAME"),
		Config: leaseConfig(*job, *nodes, *ppn, *interval, *deadline, *orchestrate, *agents, *pause)}
	l, err := newLease(*leaseKind, *leaseFile, *leaseName, candidate, log, inCluster)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if *metrics != "" {
		srv := serveMetrics(*metrics, reg, log)
		defer srv.Close()
	}
	if l != nil {
		return taskd.Lead(ctx, l, cfg, func(m *taskd.Manager) {
			log.Info("taskd-manager leading and serving", "addr", m.Addr().String(), "job", *job)
		})
	}
	m, err := taskd.NewManager(cfg)
	if err != nil {
		return err
	}
	defer m.Close()
	log.Info("taskd-manager serving", "addr", m.Addr().String(), "job", *job)
	return m.Run(ctx)
}

// defaultPauseTimeout is taskd.Timeouts.Pause's default: --pause-timeout
// 0 means it, and the managers' configuration hash takes it for it.
const defaultPauseTimeout = 30 * time.Second

// checkFlags refuses flags that do not go together: orchestrates with
// --orchestrate or --agents, pauseGiven when --pause-timeout was set.
func checkFlags(orchestrates, pauseGiven bool, leaseKind, stateDir string) error {
	switch {
	case pauseGiven && !orchestrates:
		return errors.New("--pause-timeout needs --orchestrate or --agents: without them nothing pauses")
	case leaseKind != "" && orchestrates && stateDir == "":
		// The orchestration state is the standby's only way to know of
		// a recovery in progress: without it, one that takes over
		// releases ranks held mid-recovery instead of finishing it.
		return fmt.Errorf("--lease %s with --orchestrate or --agents needs --state-dir, shared by every manager: a standby that takes over finishes the recovery in progress from it", leaseKind)
	}
	return nil
}

// leaseConfig is the configuration hash of the lease's candidate: what
// the managers of one job must agree on. A pause timeout of 0 is the
// default's.
func leaseConfig(job string, nodes, ppn int, interval, deadline time.Duration, orchestrate, agents bool, pause time.Duration) string {
	return lease.ConfigHash(fmt.Appendf(nil, "job=%q nodes=%d procs-per-node=%d heartbeat-interval=%v heartbeat-deadline=%v orchestrate=%v agents=%v pause-timeout=%v",
		job, nodes, ppn, interval, deadline, orchestrate || agents, agents, cmp.Or(pause, defaultPauseTimeout)))
}

// inCluster returns a client of the API server of the pod's cluster, as
// its ServiceAccount.
func inCluster() (kubernetes.Interface, error) {
	rc, err := rest.InClusterConfig()
	if err != nil {
		return nil, fmt.Errorf("not in a pod, or its ServiceAccount is not mounted: %w", err)
	}
	return kubernetes.NewForConfig(rc)
}

// newLease returns the lease that --lease names, nil for none; client
// makes the Kubernetes client of --lease kubernetes.
func newLease(kind, file, name string, c lease.Candidate, log *slog.Logger, client func() (kubernetes.Interface, error)) (lease.Lease, error) {
	switch kind {
	case "":
		if file != "" || name != "" {
			return nil, errors.New("--lease-file and --lease-name need --lease")
		}
		return nil, nil
	case "file":
		if file == "" {
			return nil, errors.New("--lease file: give the lease file with --lease-file")
		}
		l, err := lease.NewFile(lease.FileConfig{Path: file, Candidate: c, Logger: log})
		if err != nil {
			return nil, fmt.Errorf("--lease-file %s: %w", file, err)
		}
		return l, nil
	case "kubernetes":
		if name == "" {
			return nil, errors.New("--lease kubernetes: name the Lease with --lease-name")
		}
		cl, err := client()
		if err != nil {
			return nil, fmt.Errorf("--lease kubernetes: %w", err)
		}
		l, err := leasek8s.New(leasek8s.Config{Client: cl, Namespace: os.Getenv("POD_NAMESPACE"), Name: name, Candidate: c, Logger: log})
		if err != nil {
			return nil, fmt.Errorf("--lease kubernetes --lease-name %s (namespace $POD_NAMESPACE %q): %w", name, os.Getenv("POD_NAMESPACE"), err)
		}
		return l, nil
	}
	return nil, fmt.Errorf("--lease %q: want file or kubernetes", kind)
}

// security builds the Security the flags ask for.
func security(tlsDir, tokenFile string, plaintext bool) (taskd.Security, error) {
	var sec taskd.Security
	if tlsDir != "" {
		sec = taskd.SecurityFromDir(tlsDir)
	}
	sec.Insecure = plaintext
	token, err := readToken("--token-file", tokenFile, "TASKD_TOKEN")
	if err != nil {
		return sec, err
	}
	sec.Token = token
	return sec, sec.Validate()
}

// readToken returns the token in file, else in the environment variable
// env; "" when neither is set. A file that holds nothing but white space
// (a secret never filled in) is an error, not the absence of a token.
func readToken(flagName, file, env string) (string, error) {
	if file == "" {
		return strings.TrimSpace(os.Getenv(env)), nil
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return "", fmt.Errorf("%s: %w", flagName, err)
	}
	token := strings.TrimSpace(string(b))
	if token == "" {
		return "", fmt.Errorf("%s %s: empty; put the token in it, or leave the flag out", flagName, file)
	}
	return token, nil
}

func serveMetrics(addr string, reg *prometheus.Registry, log *slog.Logger) *http.Server {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := srv.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics server", "err", err)
		}
	}()
	return srv
}
