package taskd

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/faultline-ml/faultline/internal/freeport"
	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/taskd/lease"
	"github.com/faultline-ml/faultline/trace"
)

// The test binary runs as a manager, proxy or worker process when
// testkit.Role names the role; childArgsEnv holds its childArgs as JSON.
const childArgsEnv = "TASKD_TEST_ARGS"

type childArgs struct {
	Job      string
	Listen   string
	Upstream string
	Node     int
	Rank     int
	StateDir string
	TLSDir   string
	Token    string
	Interval time.Duration
	Deadline time.Duration
	Ack      time.Duration
	// A manager with LeaseFile is one of the job's managers that Lead
	// runs, named Name, of a job of Nodes×PPN ranks, trying the lease
	// every LeaseRetry (default 20 ms).
	LeaseFile  string
	Name       string
	Nodes, PPN int
	LeaseRetry time.Duration
	MaxFaults  int
}

func (a childArgs) security() Security {
	if a.TLSDir != "" {
		sec := SecurityFromDir(a.TLSDir)
		sec.Token = a.Token
		return sec
	}
	return Security{Insecure: true, Token: a.Token}
}

// runChild runs one role until SIGTERM or SIGKILL. It prints "ready ADDR"
// once serving; a worker prints "connected"/"disconnected" as that changes
// and "switch DOC" for each switch applied, and takes "fault ID KIND"
// lines and "close" (Worker.Close, after which the child exits 0) on
// stdin.
func runChild(role string) int {
	var a childArgs
	if err := json.Unmarshal([]byte(os.Getenv(childArgsEnv)), &a); err != nil {
		fmt.Fprintln(os.Stderr, "child args:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	var out sync.Mutex
	say := func(format string, args ...any) {
		out.Lock()
		fmt.Printf(format+"\n", args...)
		out.Unlock()
	}
	var err error
	switch role {
	case "manager":
		cfg := ManagerConfig{Job: a.Job, Listen: a.Listen, Security: a.security(), StateDir: a.StateDir, Nodes: a.Nodes, ProcsPerNode: a.PPN,
			HeartbeatInterval: a.Interval, HeartbeatDeadline: a.Deadline, AckTimeout: a.Ack, MaxFaults: a.MaxFaults, ProxyToken: testProxyToken, Logger: log}
		if a.LeaseFile != "" {
			var l *lease.File
			l, err = lease.NewFile(lease.FileConfig{Path: a.LeaseFile, Candidate: lease.Candidate{Job: a.Job, Config: "test", Name: a.Name},
				RetryPeriod: orDefault(a.LeaseRetry, 20*time.Millisecond)})
			if err == nil {
				say("standby")
				err = Lead(ctx, l, cfg, func(m *Manager) { say("ready %s %d", m.Addr(), m.cfg.Term.Token()) })
			}
			break
		}
		var m *Manager
		m, err = NewManager(cfg)
		if err == nil {
			say("ready %s", m.Addr())
			err = m.Run(ctx)
		}
	case "proxy":
		var p *Proxy
		p, err = NewProxy(ProxyConfig{Job: a.Job, Node: a.Node, Upstream: a.Upstream, Listen: a.Listen, Security: a.security(), UpstreamToken: testProxyToken, AckTimeout: a.Ack, ReconnectMax: time.Second, Logger: log})
		if err == nil {
			say("ready %s", p.Addr())
			err = p.Run(ctx)
		}
	case "worker":
		var w *Worker
		w, err = NewWorker(WorkerConfig{Job: a.Job, Node: a.Node, Rank: a.Rank, Upstream: a.Upstream, Security: a.security(), AckTimeout: a.Ack, ReconnectMax: time.Second, Logger: log,
			OnSwitch: func(sw trace.Switch) error { say("switch %s", sw); return nil }})
		if err != nil {
			break
		}
		go func() {
			was := false
			for ctx.Err() == nil {
				if now := w.Connected(); now != was {
					was = now
					if now {
						say("connected")
					} else {
						say("disconnected")
					}
				}
				time.Sleep(20 * time.Millisecond)
			}
		}()
		go func() {
			sc := bufio.NewScanner(os.Stdin)
			for sc.Scan() {
				f := strings.Fields(sc.Text())
				if len(f) == 1 && f[0] == "close" {
					w.Close()
					continue
				}
				if len(f) == 3 && f[0] == "fault" {
					if err := w.ReportFault(Fault{ID: f[1], Kind: FaultKind(f[2])}); err != nil {
						say("error %v", err)
					} else {
						say("queued %s", f[1])
					}
				}
			}
		}()
		say("ready")
		err = w.Run(ctx)
	case "echo": // a bare gRPC health server, the benchmarks' baseline
		var lis net.Listener
		lis, err = net.Listen("tcp", a.Listen)
		if err != nil {
			break
		}
		srv := grpc.NewServer()
		healthpb.RegisterHealthServer(srv, health.NewServer())
		go func() { <-ctx.Done(); srv.Stop() }()
		say("ready %s", lis.Addr())
		err = srv.Serve(lis)
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, role+":", err)
		return 1
	}
	return 0
}

// child is a role running in a process of its own.
type child struct {
	t     testing.TB
	role  string
	args  childArgs
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *testkit.Output
	done  chan struct{}
}

func startChild(t testing.TB, role string, a childArgs) *child {
	t.Helper()
	b, _ := json.Marshal(a)
	cmd := testkit.Command(t, role, childArgsEnv+"="+string(b))
	cmd.Stderr = &prefixWriter{t: t, prefix: fmt.Sprintf("%s %d/%d: ", role, a.Node, a.Rank)}
	out := testkit.NewOutput(fmt.Sprintf("%s %d/%d", role, a.Node, a.Rank), false)
	cmd.Stdout = out
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{t: t, role: role, args: a, cmd: cmd, stdin: stdin, out: out, done: make(chan struct{})}
	go func() {
		cmd.Wait()
		out.Close()
		close(c.done)
	}()
	t.Cleanup(c.kill)
	return c
}

// expect waits for a line starting with prefix after the first from lines,
// returning the line and its index.
func (c *child) expect(from int, prefix string, d time.Duration) (string, int) {
	c.t.Helper()
	i := c.out.Wait(c.t, from, prefix, d)
	return c.out.From(i)[0], i
}

func (c *child) nlines() int { return c.out.Len() }

func (c *child) signal(sig syscall.Signal) {
	if err := c.cmd.Process.Signal(sig); err != nil {
		c.t.Errorf("%s: signal %v: %v", c.role, sig, err)
	}
}

func (c *child) kill() {
	c.cmd.Process.Signal(syscall.SIGCONT)
	c.cmd.Process.Kill()
	<-c.done
}

func (c *child) send(line string) {
	if _, err := io.WriteString(c.stdin, line+"\n"); err != nil {
		c.t.Errorf("%s: write stdin: %v", c.role, err)
	}
}

type prefixWriter struct {
	t      testing.TB
	prefix string
}

func (w *prefixWriter) Write(b []byte) (int, error) {
	if testing.Verbose() {
		os.Stderr.Write([]byte(w.prefix + string(b)))
	}
	return len(b), nil
}

// freeAddr returns a loopback address with a port free now, so that a
// process restarted later can listen on the same one.
func freeAddr(t testing.TB) string {
	p, err := freeport.Find(1)
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(p))
}
