package trainertest_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/ckpt/layout"
	"github.com/faultline-ml/faultline/internal/freeport"
	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/rescheduling"
	"github.com/faultline-ml/faultline/rescheduling/local"
	"github.com/faultline-ml/faultline/taskd"
)

// job is a training job of real processes on loopback: the test process
// is its manager and, for every node, its launcher (a local.Supervisor,
// which is also the recovery's executor) and checkpoint agent (one
// ckpt.Owner for all shards); each node's proxy and each rank's worker
// with a fake trainer are processes of their own.
type job struct {
	cfg     jobConfig
	dir     string
	owner   *ckpt.Owner
	m       *taskd.Manager
	policy  *rescheduling.Policy // the manager's orchestration's: closed after it
	reg     *prometheus.Registry
	proxies []*exec.Cmd
	sups    []*local.Supervisor
	out     []*testkit.Output // by rank
	trans   chan transition
	cancel  context.CancelFunc
	wg      sync.WaitGroup
}

type jobConfig struct {
	nodes, ppn int
	stepTime   time.Duration
	switchTime time.Duration
	saveEvery  int64
	hangAfter  time.Duration
	timeouts   taskd.Timeouts
}

type transition struct {
	o taskd.Orchestration
	t taskd.Transition
}

func freeAddr(t testing.TB) string {
	p, err := freeport.Find(1)
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(p))
}

func testLogger(t testing.TB) *slog.Logger {
	if os.Getenv("TRAINERTEST_LOG") == "" {
		return nil
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

func startJob(t testing.TB, cfg jobConfig) *job {
	t.Helper()
	world := cfg.nodes * cfg.ppn
	j := &job{cfg: cfg, dir: t.TempDir(), reg: prometheus.NewRegistry(), trans: make(chan transition, 4096)}
	ctx, cancel := context.WithCancel(context.Background())
	j.cancel = cancel
	t.Cleanup(j.stop)

	if err := os.MkdirAll(filepath.Join(j.dir, "shm"), 0o755); err != nil {
		t.Fatal(err)
	}
	shards := make([]int, world)
	for r := range shards {
		shards[r] = r
	}
	owner, err := ckpt.NewOwner(ckpt.OwnerConfig{ShmDir: filepath.Join(j.dir, "shm"), Shards: shards, Capacity: layout.StepSize([]string{"state"}, []int64{64}),
		Dir: filepath.Join(j.dir, "ckpt"), PollInterval: 10 * time.Millisecond, Workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	j.owner = owner
	j.run(func() { owner.Run(ctx) })

	// The policy never escalates on recurrence: the scenarios break the
	// same nodes one after the other within seconds.
	policy, err := rescheduling.NewPolicy(rescheduling.Config{FailWindow: -1, DedupeWindow: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	j.policy = policy
	sups := make(local.Nodes, cfg.nodes)
	m, err := taskd.NewManager(taskd.ManagerConfig{
		Job: "job-r", Listen: "127.0.0.1:0", Nodes: cfg.nodes, ProcsPerNode: cfg.ppn, Security: taskd.Security{Insecure: true}, ProxyToken: proxyToken,
		HeartbeatInterval: 200 * time.Millisecond, HeartbeatDeadline: 3 * time.Second, AckTimeout: time.Second,
		Registerer: j.reg, Logger: testLogger(t),
		Orchestration: &taskd.OrchestrationConfig{
			Policy: policy, Executor: sups, Checkpoints: taskd.OwnerCheckpoints{Owner: owner, Shards: shards},
			Timeouts:     cfg.timeouts,
			OnTransition: func(o taskd.Orchestration, tr taskd.Transition) { j.trans <- transition{o, tr} },
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	j.m = m
	j.run(func() { m.Run(ctx) })

	proxyAddrs := make([]string, cfg.nodes)
	for n := range cfg.nodes {
		proxyAddrs[n] = freeAddr(t)
		j.proxies = append(j.proxies, j.startProxy(t, n, proxyAddrs[n]))
	}
	for n := range cfg.nodes {
		var cmds []local.Command
		for r := n * cfg.ppn; r < (n+1)*cfg.ppn; r++ {
			out := newLines(fmt.Sprintf("rank %d", r))
			j.out = append(j.out, out)
			args, _ := json.Marshal(childArgs{Job: "job-r", Node: n, Rank: r, Upstream: proxyAddrs[n], Segment: owner.SegmentPath(r), CkptDir: filepath.Join(j.dir, "ckpt"),
				StepTime: cfg.stepTime, SwitchTime: cfg.switchTime, SaveEvery: cfg.saveEvery, HangAfter: cfg.hangAfter})
			cmds = append(cmds, local.Command{Name: fmt.Sprintf("rank-%d", r), Path: os.Args[0], Args: []string{"-test.run=^$"},
				Env: []string{testkit.RoleEnv("worker"), childArgsEnv + "=" + string(args)}, Stdout: out, Stderr: stderrOf(t, fmt.Sprintf("rank %d", r))})
		}
		s, err := local.New(local.Config{Commands: cmds, Node: fmt.Sprintf("node-%d", n), StopTimeout: 2 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		sups[n] = s
		j.sups = append(j.sups, s)
		j.run(func() { s.Run(ctx) })
		j.run(func() { j.reportExits(n, s) })
	}
	for r := range world {
		j.out[r].Wait(t, 0, "event start", 120*time.Second)
	}
	return j
}

func stderrOf(t testing.TB, label string) *testkit.Output {
	if testing.Verbose() && os.Getenv("TRAINERTEST_LOG") != "" {
		return newLines(label + " stderr")
	}
	return nil
}

func (j *job) run(f func()) {
	j.wg.Add(1)
	go func() {
		defer j.wg.Done()
		f()
	}()
}

func (j *job) startProxy(t testing.TB, node int, addr string) *exec.Cmd {
	args, _ := json.Marshal(childArgs{Job: "job-r", Node: node, Listen: addr, Upstream: j.m.Addr().String()})
	cmd := testkit.Command(t, "proxy", childArgsEnv+"="+string(args))
	cmd.Stderr = nil
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := testkit.Lines(stdout)
	testkit.WaitLine(t, lines, "ready")
	go func() {
		for range lines {
		}
	}()
	return cmd
}

// reportExits reports each unexpected exit the supervisor sees, as a
// node agent does.
func (j *job) reportExits(node int, s *local.Supervisor) {
	for f := range s.Faults() {
		rank, _ := strconv.Atoi(strings.TrimPrefix(f.Process, "rank-"))
		attrs := map[string]string{}
		if f.Signal != 0 {
			attrs["signal"] = unix.SignalName(f.Signal)
		}
		j.m.ReportFault(taskd.Fault{Kind: taskd.FaultProcessExit, Position: taskd.Position{Node: node, Rank: rank}, Code: f.ExitCode, Attrs: attrs,
			Message: fmt.Sprintf("exit code %d", f.ExitCode), Time: f.Time})
	}
}

func (j *job) stop() {
	for _, s := range j.sups {
		s.Close()
	}
	for _, p := range j.proxies {
		p.Process.Kill()
		p.Wait()
	}
	j.cancel()
	if j.m != nil {
		j.m.Close()
	}
	if j.policy != nil {
		j.policy.Close()
	}
	j.wg.Wait()
	if j.owner != nil {
		j.owner.Close()
	}
}

// kill sends sig to rank's process; unlike signal, it may be called from
// any goroutine.
func (j *job) kill(rank int, sig syscall.Signal) error {
	name := fmt.Sprintf("rank-%d", rank)
	for _, st := range j.sups[rank/j.cfg.ppn].State() {
		if st.Name == name {
			return syscall.Kill(st.PID, sig)
		}
	}
	return fmt.Errorf("rank %d: no process", rank)
}

// onEnter runs f once, when the next transition into state arrives, and
// returns a channel closed once f ran. Transitions read meanwhile are
// dropped. It stops at the end of t, so that it never takes transitions
// from what follows.
func (j *job) onEnter(t testing.TB, state taskd.State, f func() error) <-chan struct{} {
	done, stop := make(chan struct{}), make(chan struct{})
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		for {
			select {
			case tr := <-j.trans:
				if tr.t.To == state {
					if err := f(); err != nil {
						t.Errorf("on entering %s: %v", state, err)
					}
					close(done)
					return
				}
			case <-stop:
				return
			}
		}
	}()
	t.Cleanup(func() { close(stop); <-ended })
	return done
}

// waitClosed waits up to two minutes for ch to close.
func waitClosed(t testing.TB, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(2 * time.Minute):
		t.Fatalf("no %s within 2 minutes", what)
	}
}

// signal sends sig to rank's process, failing t if it cannot.
func (j *job) signal(t testing.TB, rank int, sig syscall.Signal) {
	t.Helper()
	if err := j.kill(rank, sig); err != nil {
		t.Fatalf("rank %d: %v: %v", rank, sig, err)
	}
}

// marks returns where each rank's output is now.
func (j *job) marks() []int { return marks(j.out) }

func marks(out []*testkit.Output) []int {
	m := make([]int, len(out))
	for r, l := range out {
		m[r] = l.Len()
	}
	return m
}

// committed returns the step the disk tier's tracker names, -1 if none.
func (j *job) committed() int64 { return committed(filepath.Join(j.dir, "ckpt")) }

func committed(dir string) int64 {
	b, err := os.ReadFile(filepath.Join(dir, "dlrover_latest.txt"))
	if err != nil {
		return -1
	}
	step, err := layout.ParseStepText(b)
	if err != nil {
		return -1
	}
	return step
}

// next returns the next orchestration of kind to end, skipping others.
func (j *job) next(t testing.TB, kind taskd.OrchestrationKind) taskd.Orchestration {
	t.Helper()
	timeout := time.After(120 * time.Second)
	for {
		select {
		case tr := <-j.trans:
			if tr.t.To.Terminal() && tr.o.Kind == kind {
				return tr.o
			}
		case <-timeout:
			t.Fatalf("no %s ended within 120 s; now %+v", kind, j.m.Orchestrations(0).Current)
		}
	}
}

func event(line string) (kind string, step int64, detail string, ok bool) {
	f := strings.Fields(line)
	if len(f) < 3 || f[0] != "event" {
		return "", 0, "", false
	}
	step, err := strconv.ParseInt(f[2], 10, 64)
	if err != nil {
		return "", 0, "", false
	}
	return f[1], step, strings.Join(f[3:], " "), true
}

// lastSaveBefore returns the last step rank saved before the first of
// its output lines from index from on that starts with stop.
func (j *job) lastSaveBefore(rank, from int, stop string) int64 {
	return lastSaveBefore(j.out[rank], from, stop)
}

func lastSaveBefore(out *testkit.Output, from int, stop string) int64 {
	last := int64(-1)
	for i, line := range out.From(0) {
		if i >= from && strings.HasPrefix(line, stop) {
			break
		}
		if k, step, detail, ok := event(line); ok && k == "save" && detail == "" {
			last = step
		}
	}
	return last
}

// checkResumed checks a recovery that resumed from a checkpoint: every
// rank resumed at its step S, which is no older than the step committed
// to disk before the fault and no newer than what the faulty rank had
// saved; and each rank went on from S, its next save the next one after
// S: no step lost beyond the newest intact checkpoint, none skipped.
func (j *job) checkResumed(t testing.TB, rec taskd.Orchestration, from []int, committed, lastSaved int64) {
	t.Helper()
	checkResumed(t, j.out, j.cfg.saveEvery, rec, from, committed, lastSaved)
}

func checkResumed(t testing.TB, out []*testkit.Output, every int64, rec taskd.Orchestration, from []int, committed, lastSaved int64) {
	t.Helper()
	s := rec.ResumedStep
	if s < 0 || s < committed || s > lastSaved+every || s%every != 0 {
		t.Fatalf("resumed from step %d: committed before the fault %d, last saved by the faulty rank %d, saves every %d", s, committed, lastSaved, every)
	}
	for r, l := range out {
		i := from[r]
		// A rank's saves go on: the resume must come before a deadline.
		deadline := time.Now().Add(30 * time.Second)
		for ; ; i++ {
			if time.Now().After(deadline) {
				t.Fatalf("rank %d: no resume by %s within 30 s: %q", r, rec.Strategy, l.From(from[r]))
			}
			i = l.Wait(t, i, "event ", 30*time.Second)
			k, step, detail, _ := event(l.From(i)[0])
			if (k == "resume" || k == "start") && detail == string(rec.Strategy) {
				if step != s {
					t.Fatalf("rank %d resumed from %d, want %d", r, step, s)
				}
				break
			}
		}
		for i++; ; i++ {
			i = l.Wait(t, i, "event save", 30*time.Second)
			if _, step, detail, _ := event(l.From(i)[0]); detail == "" {
				if step != s+every {
					t.Fatalf("rank %d: first save after resuming from %d is %d, want %d", r, s, step, s+every)
				}
				break
			}
		}
	}
}

func wantStates(t testing.TB, rec taskd.Orchestration, want ...taskd.State) {
	t.Helper()
	if got := rec.States(); !slices.Equal(got, want) {
		var why []string
		for _, tr := range rec.Transitions {
			why = append(why, fmt.Sprintf("%s->%s: %s", tr.From, tr.To, tr.Reason))
		}
		t.Fatalf("%s #%d went through %v, want %v:\n  %s", rec.Kind, rec.ID, got, want, strings.Join(why, "\n  "))
	}
}
