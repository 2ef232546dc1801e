package trainertest_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/taskd/trainertest"
)

// The test binary runs as a manager, proxy or worker process when
// testkit.Role names the role; childArgsEnv holds its childArgs as JSON.
const childArgsEnv = "TRAINERTEST_ARGS"

// proxyToken is the proxies' token of the tests' managers and proxies:
// without one, a manager takes no proxy.
const proxyToken = "proxies-token-0123456789abcdef"

type childArgs struct {
	Job      string
	Node     int
	Rank     int
	Listen   string // proxy
	Upstream string
	// Worker: its segment and the owner's disk tier, its pace, and after
	// how long a step that does not finish is reported as a hang.
	Segment    string
	CkptDir    string
	StepTime   time.Duration
	SwitchTime time.Duration
	SaveEvery  int64
	HangAfter  time.Duration
	// Manager: the job's shape, its StateDir, its timeouts, the node
	// agents' address (its executor and checkpoints), and a file listing
	// states, one a line: entering the first, it removes that line and
	// kills itself with SIGKILL.
	Nodes, PPN int
	StateDir   string
	Timeouts   taskd.Timeouts
	Agent      string
	KillFile   string
}

func childLogger() *slog.Logger {
	if os.Getenv("TRAINERTEST_LOG") == "" {
		return nil
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// runChild runs one role until SIGTERM. A proxy or manager prints "ready
// ADDR", a manager "transition ID KIND FROM TO" for each transition; a
// worker prints "event KIND STEP [DETAIL]" for each event of its trainer,
// and takes signals: SIGUSR1 hangs its step loop, SIGUSR2 makes its next
// link switch fail, SIGHUP reports an op error.
func runChild(role string) int {
	var a childArgs
	if err := json.Unmarshal([]byte(os.Getenv(childArgsEnv)), &a); err != nil {
		fmt.Fprintln(os.Stderr, "child args:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	sec := taskd.Security{Insecure: true}
	var out sync.Mutex
	say := func(format string, args ...any) {
		out.Lock()
		fmt.Printf(format+"\n", args...)
		out.Unlock()
	}
	var err error
	switch role {
	case "proxy":
		var p *taskd.Proxy
		p, err = taskd.NewProxy(taskd.ProxyConfig{Job: a.Job, Node: a.Node, Upstream: a.Upstream, Listen: a.Listen, Security: sec, UpstreamToken: proxyToken, AckTimeout: time.Second, ReconnectMax: 200 * time.Millisecond, Logger: childLogger()})
		if err == nil {
			say("ready %s", p.Addr())
			err = p.Run(ctx)
		}
	case "worker":
		err = runWorker(ctx, a, say)
	case "manager":
		err = runManager(ctx, a, say)
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, role+":", err)
		return 1
	}
	return 0
}

func runWorker(ctx context.Context, a childArgs, say func(string, ...any)) error {
	wr, err := ckpt.NewWriter(ckpt.WriterConfig{Path: a.Segment, Workers: 1})
	if err != nil {
		return err
	}
	defer wr.Close()
	state := &trainertest.CkptState{Writer: wr, Path: a.Segment, Dir: a.CkptDir, Shard: a.Rank, PersistEvery: 4}
	tr := trainertest.New(trainertest.Config{
		StepTime: a.StepTime, SwitchTime: a.SwitchTime, SaveEvery: a.SaveEvery, Save: state.Save, Load: state.Load,
		OnEvent: func(e trainertest.Event) { say("event %s", e) },
	})
	w, err := taskd.NewWorker(taskd.WorkerConfig{Job: a.Job, Node: a.Node, Rank: a.Rank, Upstream: a.Upstream, Security: taskd.Security{Insecure: true},
		AckTimeout: time.Second, ReconnectMax: 200 * time.Millisecond, Trainer: tr, Logger: childLogger()})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Add(3)
	go func() { defer wg.Done(); w.Run(ctx) }()
	go func() { defer wg.Done(); injectFaults(ctx, tr, w) }()
	go func() { defer wg.Done(); detectHang(ctx, tr, w, a.HangAfter) }()
	err = tr.Run(ctx)
	say("exit")
	return err
}

// injectFaults turns signals into faults.
func injectFaults(ctx context.Context, tr *trainertest.Trainer, w *taskd.Worker) {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGUSR1, syscall.SIGUSR2, syscall.SIGHUP)
	defer signal.Stop(sigs)
	for {
		select {
		case <-ctx.Done():
			return
		case sig := <-sigs:
			switch sig {
			case syscall.SIGUSR1:
				tr.Hang()
			case syscall.SIGUSR2:
				tr.FailNext("SwitchLink", errors.New("NIC down"))
			case syscall.SIGHUP:
				w.ReportFault(taskd.Fault{Kind: taskd.FaultOpError, Code: 7, Message: "HCCL op failed"})
			}
		}
	}
}

// detectHang reports a hang when a running trainer's step has not moved
// for after, once per stuck step: what a hang detector in the training
// process does.
func detectHang(ctx context.Context, tr *trainertest.Trainer, w *taskd.Worker, after time.Duration) {
	if after <= 0 {
		return
	}
	tick := time.NewTicker(after / 10)
	defer tick.Stop()
	last, since, reported := tr.Step(), time.Now(), false
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		step := tr.Step()
		if step != last || !tr.Running() {
			last, since, reported = step, time.Now(), false
			continue
		}
		if !reported && time.Since(since) > after {
			reported = true
			w.ReportFault(taskd.Fault{Kind: taskd.FaultHang, Message: fmt.Sprintf("step %d stuck for %v", step+1, time.Since(since).Round(time.Millisecond))})
		}
	}
}

// newLines returns the output of a process, across its restarts, echoed
// to standard error with -v and TRAINERTEST_LOG set.
func newLines(label string) *testkit.Output {
	return testkit.NewOutput(label, testing.Verbose() && os.Getenv("TRAINERTEST_LOG") != "")
}
