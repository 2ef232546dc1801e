package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/hang"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/trace"
)

// The demo runs its proxies and workers as this program again: envRole
// names the role and envArgs holds its childArgs as JSON.
const (
	envRole = "FAULTLINE_DEMO_ROLE"
	envArgs = "FAULTLINE_DEMO_ARGS"
)

// Application messages between the launcher and the workers.
const (
	msgInject = "demo/inject" // launcher -> worker: an injection
	msgDump   = "demo/dump"   // launcher -> worker: write your stack file now
	msgHang   = "demo/hang"   // worker -> launcher: the watchdog flagged a hang
)

// childArgs is what a proxy or a worker process is told.
type childArgs struct {
	Job      string
	Node     int
	Host     string // the node's address: a proxy listens on it
	Upstream string // the manager (proxy) or the node's proxy (worker)

	// Proxy only: the proxies' token, which the manager asks of a proxy.
	ProxyToken string

	// Worker only.
	Rank, World, ProcsPerNode int
	Fabric                    string
	DottingRoot, StackDir     string
	Segment, CkptDir          string
	StepTime, HangTimeout     time.Duration
	SaveEvery, PersistEvery   int64
	SwitchTime, PauseGrace    time.Duration
}

// hangReport is what a worker sends the launcher when its watchdog flags
// a hang (message kind msgHang).
type hangReport struct {
	Rank    int           `json:"rank"`
	Fault   string        `json:"fault"` // hang.Fault.String()
	Op      string        `json:"op"`
	Group   string        `json:"group"`
	Elapsed time.Duration `json:"elapsed"`
	Timeout time.Duration `json:"timeout"`
	Time    time.Time     `json:"time"` // when the watchdog flagged it
	Step    int64         `json:"step"` // last completed step
}

// runChild runs a proxy or a worker until SIGTERM and returns its exit
// code. It prints what the launcher follows on standard output, one line
// each, and logs to standard error.
func runChild(role string) int {
	var a childArgs
	if err := json.Unmarshal([]byte(os.Getenv(envArgs)), &a); err != nil {
		fmt.Fprintln(os.Stderr, "demo: child arguments:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	var mu sync.Mutex
	say := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Printf(format+"\n", args...)
	}
	var err error
	switch role {
	case "proxy":
		err = runProxy(ctx, a, log, say)
	case "worker":
		err = runWorker(ctx, a, log, say)
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if err != nil {
		log.Error("demo: "+role+" failed", "err", err)
		return 1
	}
	return 0
}

// serveMetrics serves reg on /metrics at a free port of host until ctx
// ends.
func serveMetrics(ctx context.Context, host string, reg *prometheus.Registry, wg *sync.WaitGroup) (string, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return "", err
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	wg.Go(func() { srv.Serve(ln) })
	wg.Go(func() {
		<-ctx.Done()
		srv.Close()
	})
	return "http://" + ln.Addr().String() + "/metrics", nil
}

// runProxy is a node's proxy: it prints "ready <addr> <metrics URL>".
func runProxy(ctx context.Context, a childArgs, log *slog.Logger, say func(string, ...any)) error {
	reg := prometheus.NewRegistry()
	p, err := taskd.NewProxy(taskd.ProxyConfig{
		Job: a.Job, Node: a.Node, Upstream: a.Upstream, Listen: net.JoinHostPort(a.Host, "0"),
		Security: taskd.Security{Insecure: true}, UpstreamToken: a.ProxyToken, AckTimeout: time.Second, ReconnectMax: 200 * time.Millisecond,
		DottingRoot: a.DottingRoot, StackRoot: a.StackDir, Registerer: reg, Logger: log,
	})
	if err != nil {
		return err
	}
	defer p.Close()
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	url, err := serveMetrics(ctx, a.Host, reg, &wg)
	if err != nil {
		return err
	}
	say("ready %s %s", p.Addr(), url)
	return p.Run(ctx)
}

// runWorker is one rank: a trainer with its recorder, watchdog,
// checkpoint writer and fabric link, under a taskd worker. It prints
// "ready <metrics URL>", then "step <n>" after each step and "event ..."
// lines for what its trainer does.
func runWorker(ctx context.Context, a childArgs, log *slog.Logger, say func(string, ...any)) error {
	reg := prometheus.NewRegistry()
	rec, err := trace.NewRecorder(trace.RecorderConfig{
		Root: a.DottingRoot, Job: a.Job, Rank: a.Rank, FlushInterval: 500 * time.Millisecond, Registerer: reg, Logger: log,
	})
	if err != nil {
		return err
	}
	go rec.Run(ctx)
	defer rec.Close()
	g := groupsOf(a.Rank, a.World, a.ProcsPerNode)
	if err := rec.WriteParallelGroups(g.parallelGroups(a.Rank)); err != nil {
		return err
	}

	hangs := make(chan hang.Fault, 16)
	wd, err := hang.New(hang.Config{
		Rank: a.Rank, World: a.World, Host: a.Host, Timeout: a.HangTimeout, DumpDir: a.StackDir,
		OnFault: func(f hang.Fault) {
			select {
			case hangs <- f:
			default:
			}
		},
		Registerer: reg, Logger: log,
	})
	if err != nil {
		return err
	}
	defer wd.Close()

	wr, err := ckpt.NewWriter(ckpt.WriterConfig{Path: a.Segment, Workers: 1, Registerer: reg, Logger: log})
	if err != nil {
		return err
	}
	defer wr.Close()
	fab, err := dialFabric(a.Fabric, a.Rank)
	if err != nil {
		return err
	}
	defer fab.Close()

	tr := newTrainer(trainerConfig{
		Rank: a.Rank, Local: a.Rank % a.ProcsPerNode, Groups: g, StepTime: a.StepTime,
		SaveEvery: a.SaveEvery, PersistEvery: a.PersistEvery, SwitchTime: a.SwitchTime, PauseGrace: a.PauseGrace,
		Segment: a.Segment, CkptDir: a.CkptDir,
	}, rec, wd, fab, wr, say)

	w, err := taskd.NewWorker(taskd.WorkerConfig{
		Job: a.Job, Node: a.Node, Rank: a.Rank, Upstream: a.Upstream, Security: taskd.Security{Insecure: true},
		OnSwitch: func(sw trace.Switch) error { tr.setSwitch(sw); return nil },
		OnMessage: func(m taskd.Message) error {
			switch m.Kind {
			case msgInject:
				return tr.inject(m.Payload)
			case msgDump:
				_, err := wd.Dump(ctx, "asked by the node agent: "+string(m.Payload))
				return err
			}
			return fmt.Errorf("unknown message %q", m.Kind)
		},
		Trainer: tr, AckTimeout: time.Second, ReconnectMax: 200 * time.Millisecond, Registerer: reg, Logger: log,
	})
	if err != nil {
		return err
	}
	defer w.Close()

	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	url, err := serveMetrics(ctx, "127.0.0.1", reg, &wg)
	if err != nil {
		return err
	}
	wg.Go(func() { w.Run(ctx) })
	wg.Go(func() {
		if err := wd.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
			log.Error("demo: watchdog", "err", err)
		}
	})
	// A hang goes to the node agent (the launcher), which gathers every
	// rank's stacks before it names the culprit to the manager.
	wg.Go(func() {
		for {
			select {
			case <-ctx.Done():
				return
			case f := <-hangs:
				if f.Kind != hang.FaultHang {
					continue
				}
				b, _ := json.Marshal(hangReport{Rank: a.Rank, Fault: f.String(), Op: f.Op, Group: f.Group,
					Elapsed: f.Elapsed, Timeout: f.Timeout, Time: f.Time, Step: tr.Step()})
				if err := w.Send(msgHang, b); err != nil {
					log.Error("demo: hang not reported", "err", err)
				}
			}
		}
	})
	say("ready %s", url)
	return tr.Run(ctx)
}
