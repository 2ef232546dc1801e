package local

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/rescheduling"
)

// The tests run this test binary again as the supervised process, in a
// role.
func TestMain(m *testing.M) {
	if role := testkit.Role(); role != "" {
		os.Exit(runChild(role))
	}
	goleak.VerifyTestMain(m)
}

// runChild plays a role: "run" (until a signal), "exit:N", "ignore-term"
// (survives SIGTERM), "crash:FILE:K:N" (exits N the first K times, counted
// in FILE, then runs), "spawn:FILE" (starts a grandchild, writes its pid
// to FILE, exits 3 on SIGUSR1, else runs). It prints "ready" once set up.
func runChild(role string) int {
	f := strings.Split(role, ":")
	switch f[0] {
	case "exit":
		n, _ := strconv.Atoi(f[1])
		return n
	case "ignore-term":
		signal.Ignore(syscall.SIGTERM)
	case "crash":
		k, _ := strconv.Atoi(f[2])
		n, _ := strconv.Atoi(f[3])
		b, _ := os.ReadFile(f[1])
		count := len(b)
		if count < k {
			os.WriteFile(f[1], append(b, 'x'), 0o644)
			return n
		}
	case "spawn":
		self, _ := os.Executable()
		c := exec.Command(self)
		c.Env = append(os.Environ(), testkit.RoleEnv("run"))
		if err := c.Start(); err != nil {
			return 3
		}
		os.WriteFile(f[1], []byte(strconv.Itoa(c.Process.Pid)), 0o644)
		// An exit of its own: a signal that ends it could be one its
		// starter ignores (SIGHUP under nohup), which the child inherits.
		usr1 := make(chan os.Signal, 1)
		signal.Notify(usr1, syscall.SIGUSR1)
		fmt.Println("ready")
		<-usr1
		return 3
	case "run":
	default:
		return 2
	}
	fmt.Println("ready")
	select {} // until a signal ends it
}

// readyWriter closes ready at the first "ready" line written to it.
type readyWriter struct {
	once  sync.Once
	ready chan struct{}
	mu    sync.Mutex
	buf   bytes.Buffer
}

func newReady() *readyWriter { return &readyWriter{ready: make(chan struct{})} }

func (w *readyWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	w.buf.Write(p)
	ok := strings.Contains(w.buf.String(), "ready")
	w.buf.Reset()
	w.mu.Unlock()
	if ok {
		w.once.Do(func() { close(w.ready) })
	}
	return len(p), nil
}

func waitReady(t *testing.T, w *readyWriter) {
	t.Helper()
	select {
	case <-w.ready:
	case <-time.After(30 * time.Second):
		t.Fatal("child not ready within 30 s")
	}
}

func child(t testing.TB, name, role string) Command {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	return Command{Name: name, Path: self, Args: []string{"-test.run=^$"}, Env: []string{testkit.RoleEnv(role)}}
}

// running starts s.Run and stops it when the test ends.
func running(t *testing.T, s *Supervisor) chan error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- s.Run(context.Background()) }()
	t.Cleanup(func() { s.Close() })
	return done
}

func nextFault(t *testing.T, s *Supervisor) rescheduling.Fault {
	t.Helper()
	select {
	case f, ok := <-s.Faults():
		if !ok {
			t.Fatal("Faults closed")
		}
		return f
	case <-time.After(30 * time.Second):
		t.Fatal("no fault within 30 s")
	}
	return rescheduling.Fault{}
}

func alive(pid int) bool {
	return syscall.Kill(pid, 0) == nil
}

// waitState polls until cond holds of the supervisor's state.
func waitState(t *testing.T, s *Supervisor, cond func([]ProcessState) bool) []ProcessState {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		st := s.State()
		if cond(st) {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("state %+v", st)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestExitCodesBecomeFaults(t *testing.T) {
	for _, tt := range []struct {
		code  int
		class rescheduling.Class
	}{
		{1, rescheduling.ClassFatal},
		{247, rescheduling.ClassOOM},
		{201, rescheduling.ClassHardware},
		{42, rescheduling.ClassUnknown},
	} {
		s, err := New(Config{Commands: []Command{child(t, "w0", fmt.Sprintf("exit:%d", tt.code))}, Node: "n1", Pod: "p1"})
		if err != nil {
			t.Fatal(err)
		}
		running(t, s)
		f := nextFault(t, s)
		if f.Kind != rescheduling.KindExit || f.ExitCode != tt.code || f.Signal != 0 || f.Process != "w0" || f.Node != "n1" || f.Pod != "p1" || f.Time.IsZero() {
			t.Errorf("exit %d: fault %+v", tt.code, f)
		}
		if c := rescheduling.Classify(f); c != tt.class {
			t.Errorf("exit %d: class %s, want %s", tt.code, c, tt.class)
		}
		s.Close()
	}
}

func TestSIGKILLIsAKilledFault(t *testing.T) {
	ready := newReady()
	c := child(t, "w0", "run")
	c.Stdout = ready
	s, err := New(Config{Commands: []Command{c}})
	if err != nil {
		t.Fatal(err)
	}
	running(t, s)
	waitReady(t, ready)
	pid := s.State()[0].PID
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	f := nextFault(t, s)
	if f.ExitCode != 137 || f.Signal != syscall.SIGKILL || rescheduling.Classify(f) != rescheduling.ClassKilled {
		t.Errorf("fault %+v", f)
	}
	if st := s.State()[0]; st.Running || st.ExitCode != 137 {
		t.Errorf("state %+v", st)
	}
}

// TestRestartProcesses: the named process and every other crashed one
// restart; a running one is left alone; the stops cause no fault.
func TestRestartProcesses(t *testing.T) {
	dir := t.TempDir()
	readies := []*readyWriter{newReady(), newReady(), newReady()}
	var cmds []Command
	for i, role := range []string{"crash:" + filepath.Join(dir, "a") + ":1:9", "crash:" + filepath.Join(dir, "b") + ":1:1", "run"} {
		c := child(t, fmt.Sprint("w", i), role)
		c.Stdout = readies[i]
		cmds = append(cmds, c)
	}
	s, err := New(Config{Commands: cmds, Node: "n1"})
	if err != nil {
		t.Fatal(err)
	}
	running(t, s)
	waitReady(t, readies[2])
	got := map[string]int{}
	for range 2 {
		f := nextFault(t, s)
		got[f.Process] = f.ExitCode
	}
	if got["w0"] != 9 || got["w1"] != 1 {
		t.Fatalf("faults %v", got)
	}
	before := s.State()
	d := rescheduling.Decision{Action: rescheduling.RestartProcesses, Node: "n1", Process: "w0"}
	if err := s.RestartProcesses(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	waitReady(t, readies[0])
	waitReady(t, readies[1])
	after := s.State()
	for i, want := range []int{1, 1, 0} {
		if after[i].Restarts != want || !after[i].Running {
			t.Errorf("%s: %+v, want %d restarts, running", after[i].Name, after[i], want)
		}
	}
	if after[2].PID != before[2].PID {
		t.Errorf("w2 restarted: pid %d -> %d", before[2].PID, after[2].PID)
	}
	// Restarting everything stops the running ones without a fault: the
	// next fault is the one that killing a new incarnation causes.
	if err := s.RestartJob(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	renewed := s.State()
	for _, st := range renewed {
		if !st.Running || st.PID == after[2].PID {
			t.Errorf("after RestartJob: %+v", st)
		}
	}
	if alive(after[2].PID) {
		t.Errorf("old pid %d still alive", after[2].PID)
	}
	if err := syscall.Kill(renewed[2].PID, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if f := nextFault(t, s); f.Process != "w2" || f.Signal != syscall.SIGKILL || !slices.Contains(f.Evidence, "pid="+strconv.Itoa(renewed[2].PID)) {
		t.Errorf("fault %+v: want the kill of w2's new pid %d, and none for the stops", f, renewed[2].PID)
	}
}

// TestStopEscalatesAndKillsTheGroup: a process that ignores SIGTERM is
// SIGKILLed after StopTimeout, and what it started dies with it.
func TestStopEscalatesAndKillsTheGroup(t *testing.T) {
	pidFile := filepath.Join(t.TempDir(), "grandchild")
	r0, r1 := newReady(), newReady()
	c0 := child(t, "stubborn", "ignore-term")
	c0.Stdout = r0
	c1 := child(t, "parent", "spawn:"+pidFile)
	c1.Stdout = r1
	s, err := New(Config{Commands: []Command{c0, c1}, StopTimeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	done := running(t, s)
	waitReady(t, r0)
	waitReady(t, r1)
	b, err := os.ReadFile(pidFile)
	if err != nil {
		t.Fatal(err)
	}
	grandchild, _ := strconv.Atoi(string(b))
	pids := []int{s.State()[0].PID, s.State()[1].PID, grandchild}
	start := time.Now()
	s.Close()
	if err := <-done; err != nil {
		t.Errorf("Run after Close = %v", err)
	}
	if time.Since(start) < 100*time.Millisecond {
		t.Errorf("the stubborn process stopped before StopTimeout")
	}
	// The grandchild is reparented to init, which reaps it; give it time.
	deadline := time.Now().Add(30 * time.Second)
	for _, pid := range pids {
		for alive(pid) && !zombie(pid) {
			if time.Now().After(deadline) {
				t.Fatalf("pid %d alive after Close", pid)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	if _, ok := <-s.Faults(); ok {
		t.Error("Faults not closed after Run")
	}
}

// zombie reports whether pid has exited and awaits its reaping.
func zombie(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	i := bytes.LastIndexByte(b, ')')
	return i >= 0 && i+2 < len(b) && b[i+2] == 'Z'
}

func TestRunEndsWhenEveryProcessSucceeds(t *testing.T) {
	s, err := New(Config{Commands: []Command{child(t, "a", "exit:0"), child(t, "b", "exit:0")}})
	if err != nil {
		t.Fatal(err)
	}
	done := running(t, s)
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run = %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return")
	}
	if _, ok := <-s.Faults(); ok {
		t.Error("a fault for exit code 0")
	}
}

func TestRunCanceled(t *testing.T) {
	ready := newReady()
	c := child(t, "w0", "run")
	c.Stdout = ready
	s, err := New(Config{Commands: []Command{c}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	waitReady(t, ready)
	pid := s.State()[0].PID
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v", err)
	}
	if alive(pid) && !zombie(pid) {
		t.Errorf("pid %d alive after Run", pid)
	}
	if err := s.RestartJob(context.Background(), rescheduling.Decision{}); !errors.Is(err, ErrNotRunning) {
		t.Errorf("RestartJob after Run = %v", err)
	}
	if err := s.Run(context.Background()); err == nil {
		t.Error("second Run succeeded")
	}
}

func TestRunStartError(t *testing.T) {
	s, err := New(Config{Commands: []Command{{Name: "x", Path: filepath.Join(t.TempDir(), "missing")}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Run(context.Background()); err == nil || !strings.Contains(err.Error(), `start "x"`) {
		t.Errorf("Run = %v", err)
	}
}

func TestExecutorErrors(t *testing.T) {
	ready := newReady()
	c := child(t, "w0", "run")
	c.Stdout = ready
	s, err := New(Config{Commands: []Command{c}, Node: "n1", Pod: "p1"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := s.RecreatePods(ctx, rescheduling.Decision{Node: "n1"}); !errors.Is(err, ErrNotRunning) {
		t.Errorf("before Run: %v", err)
	}
	running(t, s)
	waitReady(t, ready)
	for _, tt := range []struct {
		err  error
		call func() error
	}{
		{rescheduling.ErrTargetGone, func() error { return s.RestartProcesses(ctx, rescheduling.Decision{Node: "n1", Process: "nope"}) }},
		{rescheduling.ErrTargetGone, func() error { return s.RestartProcesses(ctx, rescheduling.Decision{Node: "n2", Process: "w0"}) }},
		{rescheduling.ErrTargetGone, func() error { return s.RecreatePods(ctx, rescheduling.Decision{Node: "n1", Pod: "p2"}) }},
		{rescheduling.ErrUnsupported, func() error { return s.AvoidNode(ctx, rescheduling.Decision{AvoidNode: "n1"}) }},
	} {
		if err := tt.call(); !errors.Is(err, tt.err) {
			t.Errorf("got %v, want %v", err, tt.err)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	ok := Command{Name: "a", Path: "/bin/true"}
	for _, tt := range []struct {
		cfg   Config
		field string
	}{
		{Config{}, "Commands is empty"},
		{Config{Commands: []Command{{Path: "/bin/true"}}}, "Commands[0].Name"},
		{Config{Commands: []Command{ok, ok}}, `Commands[1].Name "a" is used twice`},
		{Config{Commands: []Command{{Name: "b"}}}, `Commands[0] ("b"): Path`},
		{Config{Commands: []Command{ok}, StopTimeout: -1}, "StopTimeout"},
		{Config{Commands: []Command{ok}, FaultBuffer: -1}, "FaultBuffer"},
	} {
		if _, err := New(tt.cfg); err == nil || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("New(%+v) = %v, want an error naming %s", tt.cfg, err, tt.field)
		}
	}
}

// TestWatchdogRecoversRealProcesses ties it together: a process crashes
// twice with exit code 1 and is restarted in place each time; another is
// SIGKILLed and restarted without consuming budget; the watchdog measures
// the time from fault to restarted.
func TestWatchdogRecoversRealProcesses(t *testing.T) {
	dir := t.TempDir()
	rCrash, rRun := newReady(), newReady()
	crash := child(t, "w0", "crash:"+filepath.Join(dir, "count")+":2:1")
	crash.Stdout = rCrash
	run := child(t, "w1", "run")
	run.Stdout = rRun
	s, err := New(Config{Commands: []Command{crash, run}, Node: "n1"})
	if err != nil {
		t.Fatal(err)
	}
	policy, err := rescheduling.NewPolicy(rescheduling.Config{MaxRestarts: 5, Backoff: rescheduling.Backoff{Initial: 10 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	outcomes := make(chan rescheduling.Outcome, 10)
	w, err := rescheduling.NewWatchdog(rescheduling.WatchdogConfig{
		Policy: policy, Executor: s, Faults: s.Faults(),
		OnOutcome: func(o rescheduling.Outcome) { outcomes <- o },
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sdone, wdone := make(chan error, 1), make(chan error, 1)
	go func() { sdone <- s.Run(ctx) }()
	go func() { wdone <- w.Run(context.Background()) }()

	next := func() rescheduling.Outcome {
		t.Helper()
		select {
		case o := <-outcomes:
			return o
		case <-time.After(30 * time.Second):
			t.Fatal("no outcome within 30 s")
		}
		return rescheduling.Outcome{}
	}
	for i := range 2 {
		o := next()
		d := o.Decision
		if o.Result != rescheduling.ResultOK || d.Action != rescheduling.RestartProcesses || d.Process != "w0" || d.Attempt != i+1 || o.Recovery <= 0 {
			t.Fatalf("crash %d: %+v", i, o)
		}
		t.Logf("crash %d: %s; recovered in %v", i, d.Reason, o.Recovery)
	}
	waitReady(t, rCrash)
	waitReady(t, rRun)
	victim := s.State()[1].PID
	if err := syscall.Kill(victim, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	o := next()
	if o.Result != rescheduling.ResultOK || o.Decision.Class != rescheduling.ClassKilled || o.Decision.Attempt != 0 {
		t.Fatalf("kill: %+v", o)
	}
	t.Logf("kill: %s; recovered in %v", o.Decision.Reason, o.Recovery)
	st := waitState(t, s, func(st []ProcessState) bool { return st[0].Running && st[1].Running && st[1].PID != victim })
	if st[0].Restarts < 2 || st[1].Restarts < 1 {
		t.Errorf("state %+v", st)
	}
	cancel()
	if err := <-sdone; !errors.Is(err, context.Canceled) {
		t.Errorf("supervisor Run = %v", err)
	}
	if err := <-wdone; err != nil { // Faults closed
		t.Errorf("watchdog Run = %v", err)
	}
}

// TestLeftoversDieWithTheirProcess: when a process exits on its own, what
// it started is killed and the exit is still reported at once.
func TestLeftoversDieWithTheirProcess(t *testing.T) {
	pidFile := filepath.Join(t.TempDir(), "grandchild")
	ready := newReady()
	c := child(t, "parent", "spawn:"+pidFile)
	c.Stdout = ready
	s, err := New(Config{Commands: []Command{c}})
	if err != nil {
		t.Fatal(err)
	}
	running(t, s)
	waitReady(t, ready)
	b, err := os.ReadFile(pidFile)
	if err != nil {
		t.Fatal(err)
	}
	grandchild, _ := strconv.Atoi(string(b))
	syscall.Kill(s.State()[0].PID, syscall.SIGUSR1) // it exits 3
	f := nextFault(t, s)
	if f.ExitCode != 3 || f.Signal != 0 || rescheduling.Classify(f) != rescheduling.ClassUnknown {
		t.Errorf("fault %+v", f)
	}
	deadline := time.Now().Add(30 * time.Second)
	for alive(grandchild) && !zombie(grandchild) {
		if time.Now().After(deadline) {
			t.Fatalf("grandchild %d outlived its parent", grandchild)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestNodes routes each decision to the supervisor of its node, and a job
// restart to every one.
func TestNodes(t *testing.T) {
	var ns Nodes
	for _, node := range []string{"node-0", "node-1"} {
		c := child(t, "w", "run")
		r := newReady()
		c.Stdout = r
		s, err := New(Config{Commands: []Command{c}, Node: node})
		if err != nil {
			t.Fatal(err)
		}
		running(t, s)
		waitReady(t, r)
		ns = append(ns, s)
	}
	ctx := context.Background()
	pids := func() [2]int { return [2]int{ns[0].State()[0].PID, ns[1].State()[0].PID} }
	before := pids()
	if err := ns.RestartProcesses(ctx, rescheduling.Decision{Node: "node-1", Process: "w"}); err != nil {
		t.Fatal(err)
	}
	after := pids()
	if after[0] != before[0] || after[1] == before[1] || ns[1].State()[0].Restarts != 1 {
		t.Errorf("restart on node-1: pids %v -> %v", before, after)
	}
	if err := ns.RestartJob(ctx, rescheduling.Decision{}); err != nil {
		t.Fatal(err)
	}
	for i, st := range []ProcessState{ns[0].State()[0], ns[1].State()[0]} {
		if st.PID == after[i] || !st.Running {
			t.Errorf("node-%d after RestartJob: %+v", i, st)
		}
	}
	for _, tt := range []struct {
		err  error
		call func() error
	}{
		{rescheduling.ErrTargetGone, func() error { return ns.RestartProcesses(ctx, rescheduling.Decision{Node: "node-2", Process: "w"}) }},
		{rescheduling.ErrTargetGone, func() error { return ns.RecreatePods(ctx, rescheduling.Decision{}) }},
		{rescheduling.ErrUnsupported, func() error { return ns.AvoidNode(ctx, rescheduling.Decision{AvoidNode: "node-0"}) }},
	} {
		if err := tt.call(); !errors.Is(err, tt.err) {
			t.Errorf("got %v, want %v", err, tt.err)
		}
	}
}
