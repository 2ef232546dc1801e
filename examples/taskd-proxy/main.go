// Command taskd-proxy runs a node's proxy: the node's workers connect to it
// on loopback, and it relays them to the job's manager, sends the node's
// heartbeat, and ships the node's dotting and stack files on request.
//
//	taskd-proxy --upstream HOST:9601 --listen 127.0.0.1:9602 --job ID --node N \
//	    [--tls-dir D] [--dotting-root R] [--stack-root S]
//
// With standby managers (taskd-manager --lease), --upstream is a Service
// that reaches the leader, or every manager's address separated by
// commas: only the leader listens, and the proxy follows it.
//
// The workers' shared token is read from --token-file or TASKD_TOKEN; the
// proxies' token, which the manager asks of a proxy
// (ManagerConfig.ProxyToken, taskd-manager --proxy-token-file), from
// --proxy-token-file or TASKD_PROXY_TOKEN: a manager takes no proxy
// without it. An empty token file is refused.
//
// --metrics-listen serves /metrics over plain HTTP, without
// authentication: keep it on loopback or a cluster-internal address.
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
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/faultline-ml/faultline/taskd"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "taskd-proxy:", err)
		os.Exit(1)
	}
}

func run() error {
	node, _ := strconv.Atoi(os.Getenv("NODE_RANK"))
	var (
		upstream  = flag.String("upstream", "", "the manager's address, HOST:9601; with standby managers, a Service's, or every manager's separated by commas")
		listen    = flag.String("listen", taskd.DefaultProxyAddr, "address the node's workers connect to")
		job       = flag.String("job", os.Getenv("MINDX_TASK_ID"), "job identifier (default $MINDX_TASK_ID)")
		nodeRank  = flag.Int("node", node, "this node's rank (default $NODE_RANK)")
		tlsDir    = flag.String("tls-dir", "", "directory with ca.crt, tls.crt and tls.key for mutual TLS")
		tokenFile = flag.String("token-file", "", "file holding the workers' shared token (default $TASKD_TOKEN)")
		proxyFile = flag.String("proxy-token-file", "", "file holding the proxies' token for the manager (default $TASKD_PROXY_TOKEN)")
		plaintext = flag.Bool("insecure", false, "allow plaintext connections (no TLS)")
		dotting   = flag.String("dotting-root", taskd.DefaultDottingRoot, "root of the node's dotting files")
		stacks    = flag.String("stack-root", "", "root of the node's stack files")
		metrics   = flag.String("metrics-listen", "", "address to serve Prometheus metrics on (/metrics)")
	)
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	sec, err := security(*tlsDir, *tokenFile, *plaintext)
	if err != nil {
		return err
	}
	proxyToken, err := readToken("--proxy-token-file", *proxyFile, "TASKD_PROXY_TOKEN")
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	p, err := taskd.NewProxy(taskd.ProxyConfig{
		Job: *job, Node: *nodeRank, Upstream: *upstream, Listen: *listen, Security: sec, UpstreamToken: proxyToken,
		DottingRoot: *dotting, StackRoot: *stacks, Registerer: reg, Logger: log,
	})
	if err != nil {
		return err
	}
	defer p.Close()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if *metrics != "" {
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		srv := &http.Server{Addr: *metrics, Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() {
			if err := srv.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.Error("metrics server", "err", err)
			}
		}()
		defer srv.Close()
	}
	log.Info("taskd-proxy serving", "addr", p.Addr().String(), "upstream", *upstream, "node", *nodeRank)
	return p.Run(ctx)
}

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
