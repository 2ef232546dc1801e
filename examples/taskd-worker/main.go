// Command taskd-worker is a stand-in for a training process's end of the
// control plane, for tests and the demo: it registers a rank, prints each
// profiling switch it is sent, and reports what it reads on stdin.
//
//	taskd-worker --upstream 127.0.0.1:9602 --job ID --node N --rank R [--tls-dir D] [--fake-trainer [--step-time D]]
//
// --fake-trainer runs a fake training loop (taskd/trainertest) that the
// manager's orchestration pauses, retries, switches and resumes; it prints
// "event KIND STEP [DETAIL]" for what it does.
//
// Stdin lines:
//
//	finish                    this rank ran its last step: its leave on exit says so
//	fault KIND [MESSAGE...]   report a fault (process_exit, op_error, hang, ...)
//	msg KIND [PAYLOAD...]     send an application message to the manager
//	hang                      hang the fake trainer's step loop
//	fail METHOD               make the fake trainer's next METHOD call fail (SwitchLink, StressTest, ...)
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/taskd/trainertest"
	"github.com/faultline-ml/faultline/trace"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "taskd-worker:", err)
		os.Exit(1)
	}
}

func run() error {
	node, _ := strconv.Atoi(os.Getenv("NODE_RANK"))
	rank, _ := strconv.Atoi(os.Getenv("RANK"))
	var (
		upstream  = flag.String("upstream", taskd.DefaultProxyAddr, "the node's proxy, or the manager (standby managers: every manager's address, separated by commas)")
		job       = flag.String("job", os.Getenv("MINDX_TASK_ID"), "job identifier (default $MINDX_TASK_ID)")
		nodeRank  = flag.Int("node", node, "node rank (default $NODE_RANK)")
		procRank  = flag.Int("rank", rank, "global process rank (default $RANK)")
		tlsDir    = flag.String("tls-dir", "", "directory with ca.crt, tls.crt and tls.key for mutual TLS")
		tokenFile = flag.String("token-file", "", "file holding the shared token (default $TASKD_TOKEN)")
		plaintext = flag.Bool("insecure", false, "allow plaintext connections (no TLS)")
		fake      = flag.Bool("fake-trainer", false, "run a fake training loop that orchestration controls")
		stepTime  = flag.Duration("step-time", 100*time.Millisecond, "how long a step of the fake trainer takes")
	)
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	var sec taskd.Security
	if *tlsDir != "" {
		sec = taskd.SecurityFromDir(*tlsDir)
	}
	sec.Insecure = *plaintext
	sec.Token = strings.TrimSpace(os.Getenv("TASKD_TOKEN"))
	if *tokenFile != "" {
		b, err := os.ReadFile(*tokenFile)
		if err != nil {
			return err
		}
		if sec.Token = strings.TrimSpace(string(b)); sec.Token == "" {
			return fmt.Errorf("--token-file %s: empty; put the token in it, or leave the flag out", *tokenFile)
		}
	}
	var tr *trainertest.Trainer
	var trainer taskd.Trainer
	if *fake {
		tr = trainertest.New(trainertest.Config{StepTime: *stepTime, OnEvent: func(e trainertest.Event) { fmt.Println("event", e) }})
		trainer = tr
	}
	w, err := taskd.NewWorker(taskd.WorkerConfig{
		Trainer: trainer,
		Job:     *job, Node: *nodeRank, Rank: *procRank, Upstream: *upstream, Security: sec, Logger: log,
		OnSwitch: func(sw trace.Switch) error {
			fmt.Println("switch", sw)
			return nil
		},
		OnMessage: func(m taskd.Message) error {
			fmt.Printf("message %s %q\n", m.Kind, m.Payload)
			return nil
		},
	})
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	go func() {
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			if len(f) == 1 && f[0] == "hang" && tr != nil {
				tr.Hang()
				continue
			}
			if len(f) == 1 && f[0] == "finish" {
				w.Finish()
				continue
			}
			if len(f) < 2 {
				continue
			}
			rest := strings.Join(f[2:], " ")
			var err error
			switch f[0] {
			case "fault":
				err = w.ReportFault(taskd.Fault{Kind: taskd.FaultKind(f[1]), Message: rest})
			case "msg":
				err = w.Send(f[1], []byte(rest))
			case "fail":
				if tr == nil {
					err = errors.New("no fake trainer")
					break
				}
				tr.FailNext(f[1], fmt.Errorf("%s failed on request", f[1]))
			default:
				err = fmt.Errorf("unknown command %q", f[0])
			}
			if err != nil {
				fmt.Fprintln(os.Stderr, "taskd-worker:", err)
			}
		}
	}()
	if tr == nil {
		return w.Run(ctx)
	}
	go w.Run(ctx)
	defer w.Close()
	return tr.Run(ctx) // until the manager stops the job, or a signal
}
