package hang

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/internal/testkit"
)

const childDirEnv = "FAULTLINE_HANG_TEST_DIR"

// runChild is the re-executed test binary: a Go trainer that times its
// collectives with a Watchdog, then blocks on a channel inside one.
func runChild(role string) int {
	if role != "go-hang" {
		fmt.Fprintln(os.Stderr, "unknown child role", role)
		return 2
	}
	log := slog.New(slog.NewTextHandler(os.Stdout, nil))
	w, err := New(Config{Rank: 1, World: 4, DumpDir: os.Getenv(childDirEnv), LearnTimeouts: true,
		LearnFactor: 1, LearnFloor: 300 * time.Millisecond, LearnMinSamples: 20, Tick: 20 * time.Millisecond, Logger: log})
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	go w.Run(context.Background())
	allreduce := w.Op("AllReduce", "dp")
	for range 30 { // quick ops: the timeout learned is LearnFloor
		allreduce.Start(0).End()
	}
	w.Check() // learn the timeout now, not on Run's next tick
	fmt.Println("ready", os.Getpid(), allreduce.Timeout())
	allreduce.Start(0)
	blockedInCollective(make(chan struct{}))
	return 0
}

//go:noinline
func blockedInCollective(ch chan struct{}) { <-ch }

func TestGoProcessHangDumpsItsGoroutines(t *testing.T) {
	dir := t.TempDir()
	cmd := testkit.Command(t, "go-hang", childDirEnv+"="+dir)
	lines := testkit.Start(t, cmd)
	testkit.WaitLine(t, lines, "ready")
	testkit.WaitLine(t, lines, "hang: stacks written")

	d, err := ReadStackFile(filepath.Join(dir, FileName(1, 4)))
	if err != nil {
		t.Fatal(err)
	}
	if d.Pid != cmd.Process.Pid || !strings.Contains(d.Reason, "op AllReduce") {
		t.Errorf("pid %d reason %q", d.Pid, d.Reason)
	}
	found := false
	for _, th := range d.Threads {
		if th.Kind != KindGo || !strings.HasPrefix(th.State, "chan receive") {
			continue
		}
		for _, f := range th.Frames {
			if strings.HasSuffix(f.Func, ".blockedInCollective") && strings.HasSuffix(f.File, "process_test.go") && f.Line > 0 {
				found = true
			}
		}
	}
	if !found {
		t.Errorf("no goroutine in chan receive inside blockedInCollective:\n%s", mustMarshal(t, d))
	}

	// The same process from outside, with each native tool there is.
	for _, tool := range []struct {
		name string
		fn   func(context.Context, string, int, string) ([]Thread, error)
	}{{"eu-stack", captureEUStack}, {"gdb", captureGDB}} {
		t.Run(tool.name, func(t *testing.T) {
			path, err := exec.LookPath(tool.name)
			if err != nil {
				t.Skipf("%s not installed (Debian package %s)", tool.name, map[string]string{"eu-stack": "elfutils", "gdb": "gdb"}[tool.name])
			}
			pid := cmd.Process.Pid
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			threads, err := tool.fn(ctx, path, pid, "S (sleeping)")
			if err != nil {
				t.Fatal(err)
			}
			// go test strips the symbol table, so frames may be bare
			// addresses; every OS thread of the process must be there.
			tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
			if err != nil {
				t.Fatal(err)
			}
			if len(threads) != len(tasks) {
				t.Errorf("%d threads captured, the process has %d", len(threads), len(tasks))
			}
			for _, th := range threads {
				if th.Kind != KindNative || len(th.Frames) == 0 || th.ID == 0 {
					t.Errorf("thread %+v: want a native thread with an id and frames", th)
				}
			}
			assertRunning(t, pid)
		})
	}
}

func TestPythonProcessHangDetectedAndCaptured(t *testing.T) {
	py := python(t)
	dir := t.TempDir()
	cmd := exec.Command(py, "-u", "-c", `
import time
def collective():
    print("start allreduce", flush=True)
    time.sleep(0.002)
    print("end allreduce", flush=True)
for _ in range(30):
    collective()
print("learned?", flush=True)
input()
def sleep_loop():
    while True:
        time.sleep(0.05)
print("start allreduce", flush=True)
sleep_loop()
`)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	lines := testkit.Start(t, cmd)

	logs := make(chan string, 16)
	faults := make(chan Fault, 16)
	// LearnFactor 1: the learned timeout stays at the floor unless an op
	// is seen to take 300ms, which a loaded machine's scheduling of the
	// line reader alone should not make it.
	w, err := New(Config{Rank: 2, World: 4, Pid: cmd.Process.Pid, DumpDir: dir, LearnTimeouts: true,
		LearnFactor: 1, LearnFloor: 300 * time.Millisecond, LearnMinSamples: 20, Tick: 20 * time.Millisecond,
		Logger:  slog.New(&chanHandler{ch: logs}),
		OnFault: func(f Fault) { faults <- f }})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { w.Run(ctx) })
	defer wg.Wait()
	defer cancel()

	op := w.Op("allreduce", "dp")
	var cur Timing
	go func() {
		for l := range lines {
			switch l {
			case "start allreduce":
				cur = op.Start(0)
			case "end allreduce":
				cur.End()
			case "learned?":
				// Learn from the 30 ops now rather than on Run's next tick,
				// so that the op that hangs gets the learned timeout.
				w.Check()
				if got := op.Timeout(); got != 300*time.Millisecond {
					t.Errorf("learned timeout %v, want the floor of 300ms", got)
				}
				io.WriteString(stdin, "go\n")
			}
		}
	}()

	select {
	case f := <-faults:
		if f.Kind != FaultHang || f.Op != "allreduce" || f.Timeout != 300*time.Millisecond {
			t.Errorf("fault %v, want a hang of allreduce at the learned floor of 300ms", f)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("no hang detected within 60s")
	}
	waitLog(t, logs, "hang: stacks written")

	d, err := ReadStackFile(filepath.Join(dir, FileName(2, 4)))
	if err != nil {
		t.Fatal(err)
	}
	if !hasFrame(d.Threads, KindNative, "sleep") {
		t.Errorf("no native sleep frame:\n%s", mustMarshal(t, d))
	}
	if _, err := exec.LookPath("py-spy"); err == nil && !hasFrame(d.Threads, KindPython, "sleep_loop") {
		t.Errorf("py-spy is installed but no Python frame sleep_loop:\n%s", mustMarshal(t, d))
	}
	assertRunning(t, cmd.Process.Pid)
}

func TestCapturePySpy(t *testing.T) {
	path, err := exec.LookPath("py-spy")
	if err != nil {
		t.Skip("py-spy not installed: Debian does not package it (pip install py-spy)")
	}
	py := python(t)
	cmd := exec.Command(py, "-u", "-c", "import time\ndef sleep_loop():\n    print('ready', flush=True)\n    while True:\n        time.sleep(0.05)\nsleep_loop()\n")
	lines := testkit.Start(t, cmd)
	testkit.WaitLine(t, lines, "ready")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	threads, err := capturePySpy(ctx, path, cmd.Process.Pid, "S (sleeping)")
	if err != nil {
		t.Fatal(err)
	}
	if !hasFrame(threads, KindPython, "sleep_loop") {
		t.Errorf("no sleep_loop frame: %+v", threads)
	}
	assertRunning(t, cmd.Process.Pid)
}

func TestCaptureDeadlineLeavesTargetRunning(t *testing.T) {
	gdb, err := exec.LookPath("gdb")
	if err != nil {
		t.Skip("gdb not installed (Debian package gdb)")
	}
	py := python(t)
	cmd := exec.Command(py, "-u", "-c", "import time\nprint('ready', flush=True)\nwhile True:\n    time.sleep(0.05)\n")
	lines := testkit.Start(t, cmd)
	testkit.WaitLine(t, lines, "ready")
	// A deadline that expires while gdb is attached or reading symbols.
	for _, d := range []time.Duration{time.Millisecond, 50 * time.Millisecond, 150 * time.Millisecond} {
		ctx, cancel := context.WithTimeout(context.Background(), d)
		_, err := captureGDB(ctx, gdb, cmd.Process.Pid, "S (sleeping)")
		cancel()
		t.Logf("deadline %v: %v", d, err)
		assertRunning(t, cmd.Process.Pid)
	}
}

func TestCaptureSelfAndMissing(t *testing.T) {
	d, err := Capture(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	if d.Pid != os.Getpid() || !hasFrame(d.Threads, KindGo, "TestCaptureSelfAndMissing") {
		t.Errorf("self capture lacks this test's frame: %+v", d.Threads)
	}
	// A pid that exited: reaped, so no such process.
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Skip(err)
	}
	if _, err := Capture(context.Background(), cmd.Process.Pid); err == nil || !strings.Contains(err.Error(), "no process") {
		t.Errorf("capture of an exited pid: %v", err)
	}
}

func TestHeartbeatStopKillsProcess(t *testing.T) {
	py := python(t)
	cmd := exec.Command(py, "-u", "-c", `
import time
for _ in range(10):
    print("beat", flush=True)
    time.sleep(0.05)
while True:
    time.sleep(0.05)
`)
	lines := testkit.Start(t, cmd)
	faults := make(chan Fault, 4)
	// A heartbeat timeout well above the 50ms between beats, so that a
	// loaded machine's stall does not end the child before its 10 beats;
	// detection within 1s is checked with a fake clock in TestHeartbeat.
	w, err := New(Config{Pid: cmd.Process.Pid, HeartbeatTimeout: 2 * time.Second, StopOn: FaultHeartbeat | FaultOpError,
		OnFault: func(f Fault) { faults <- f }})
	if err != nil {
		t.Fatal(err)
	}
	hb := w.Heartbeat("trainer")
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { w.Run(ctx) })
	defer wg.Wait()
	defer cancel()

	var last time.Time
	beats := 0
	deadline := time.After(60 * time.Second)
	for beats < 10 {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("child output ended after %d beats", beats)
			}
			if l == "beat" {
				hb.Beat()
				last = time.Now()
				beats++
			}
		case <-deadline:
			t.Fatal("no 10 beats within 60s")
		}
	}
	select {
	case f := <-faults:
		if f.Kind != FaultHeartbeat || f.Heartbeat != "trainer" {
			t.Errorf("fault %v", f)
		}
		// Informative only: a loaded machine may be late, the logic
		// itself is checked with a fake clock.
		t.Logf("heartbeat loss reported %v after the last beat", time.Since(last).Round(time.Millisecond))
	case <-time.After(60 * time.Second):
		t.Fatal("no heartbeat fault within 60s")
	}
	for range lines {
	}
	err = cmd.Wait()
	ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus)
	if !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Errorf("child ended with %v, want killed by SIGKILL", err)
	}
}

// python returns the path of the real python3 interpreter (not a shim
// that would stay the parent of the process we watch), skipping the test
// when there is none.
func python(t *testing.T) string {
	t.Helper()
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("python3 not installed (Debian package python3)")
	}
	out, err := exec.Command("python3", "-c", "import sys; print(sys.executable)").Output()
	if err != nil {
		t.Skipf("python3 does not run: %v", err)
	}
	return strings.TrimSpace(string(out))
}

func hasFrame(threads []Thread, k Kind, fn string) bool {
	for _, th := range threads {
		if th.Kind != k {
			continue
		}
		for _, f := range th.Frames {
			if strings.Contains(f.Func, fn) {
				return true
			}
		}
	}
	return false
}

// assertRunning checks that pid is not left stopped by a capture.
func assertRunning(t *testing.T, pid int) {
	t.Helper()
	state, err := procState(pid)
	if err != nil {
		t.Fatal(err)
	}
	if isStopped(state) {
		t.Errorf("pid %d left in state %q", pid, state)
	}
}

func mustMarshal(t *testing.T, d *Dump) string {
	t.Helper()
	b, err := d.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// chanHandler is a slog.Handler that sends each message to a channel, so
// that a test waits for a log line instead of sleeping.
type chanHandler struct{ ch chan string }

func (h *chanHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *chanHandler) Handle(_ context.Context, r slog.Record) error {
	select {
	case h.ch <- r.Message:
	default:
	}
	return nil
}
func (h *chanHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *chanHandler) WithGroup(string) slog.Handler      { return h }

func waitLog(t *testing.T, logs <-chan string, want string) {
	t.Helper()
	deadline := time.After(60 * time.Second)
	for {
		select {
		case m := <-logs:
			if m == want {
				return
			}
		case <-deadline:
			t.Fatalf("no log %q within 60s", want)
		}
	}
}

func slogTo(ch chan string) *slog.Logger { return slog.New(&chanHandler{ch: ch}) }

// newSleeper starts a process that sleeps until killed.
func newSleeper(t *testing.T) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("sleep", "600")
	if err := cmd.Start(); err != nil {
		t.Skip(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	return cmd
}
