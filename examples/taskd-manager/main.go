// Command taskd-manager runs the control plane's manager for one job: it
// takes registrations and heartbeats from the job's proxies and workers,
// declares silent ones lost, keeps the fault log, and fans the profiling
// switch out to every worker.
//
//	taskd-manager --listen :9601 --job ID --nodes N --procs-per-node P \
//	    [--switch-file F] [--tls-dir D] [--state-dir S] [--collect-dir C] \
//	    [--orchestrate [--pause-timeout D]]
//
// --tls-dir holds ca.crt, tls.crt and tls.key (a Kubernetes TLS secret);
// without it --insecure must be given. The members' shared token is read
// from --token-file or TASKD_TOKEN, the operators' (which the Admin and
// TrainingDataTrace services take, and nothing else) from
// --admin-token-file or TASKD_ADMIN_TOKEN, and the proxies' (without
// which any member may register as a proxy) from --proxy-token-file or
// TASKD_PROXY_TOKEN. A token file must hold a token of 16 bytes or more
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
// workers with a trainer. This command has no executor and no checkpoint
// store, so its recoveries retry a step or stop the job; an embedder that
// can restart processes builds the manager with its own
// taskd.OrchestrationConfig.
package main

import (
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

	"github.com/faultline-ml/faultline/taskd"
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
		pause       = flag.Duration("pause-timeout", 0, "how long orchestration waits for every rank to pause (default 30s)")
	)
	flag.Parse()
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
	if *orchestrate {
		cfg.Orchestration = &taskd.OrchestrationConfig{Timeouts: taskd.Timeouts{Pause: *pause}}
	}
	if *switchFile != "" {
		cfg.SwitchSource = taskd.SwitchFile(trace.SwitchWatcherConfig{Path: *switchFile, Registerer: reg, Logger: log})
	}
	m, err := taskd.NewManager(cfg)
	if err != nil {
		return err
	}
	defer m.Close()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if *metrics != "" {
		srv := serveMetrics(*metrics, reg, log)
		defer srv.Close()
	}
	log.Info("taskd-manager serving", "addr", m.Addr().String(), "job", *job)
	return m.Run(ctx)
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
