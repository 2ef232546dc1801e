package hang

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// ErrCapture is wrapped by Capture's error when no stack at all could be
// taken.
var ErrCapture = errors.New("hang: no stacks captured")

// maxToolOutput bounds what one capture tool may print.
const maxToolOutput = 64 << 20

// Capture takes the stacks of process pid.
//
// For this process (pid 0 or os.Getpid()) it takes the goroutine stacks
// from the Go runtime (KindGo). For another process it takes its Python
// stacks with `py-spy dump --json` when py-spy is on PATH and the process
// runs Python, and its native stacks with eu-stack, else gdb in batch mode
// (KindNative). What it used and what failed is in the Dump's Notes.
//
// Every tool runs under ctx: when ctx ends the tool is killed. The tools
// stop the target while they read it (ptrace); the kernel detaches when
// they exit or are killed, and Capture then sends SIGCONT if the target
// is left stopped and was not stopped before, so it never leaves the
// target stopped.
//
// The returned Dump has Pid, Host, Time, State, Notes and Threads set;
// the caller sets Rank, World and Reason. The error wraps ErrCapture when
// no stack at all was taken (the Dump still says why), or os.ErrNotExist
// when there is no such process.
func Capture(ctx context.Context, pid int) (*Dump, error) {
	self := os.Getpid()
	if pid == 0 {
		pid = self
	}
	d := &Dump{Pid: pid, Time: time.Now().UTC()}
	d.Host, _ = os.Hostname()
	state, err := procState(pid)
	if err != nil {
		return nil, fmt.Errorf("hang: capture pid %d: %w", pid, err)
	}
	d.State = state
	if pid == self {
		d.Threads = CaptureGoroutines()
		d.Notes = append(d.Notes, "go: runtime stacks")
		return d, nil
	}

	var errs []error
	note := func(kind Kind, tool string, err error) {
		if err != nil {
			d.Notes = append(d.Notes, fmt.Sprintf("%s: %s: %v", kind, tool, err))
			errs = append(errs, fmt.Errorf("%s: %w", tool, err))
		} else {
			d.Notes = append(d.Notes, fmt.Sprintf("%s: %s", kind, tool))
		}
	}
	if path, err := exec.LookPath("py-spy"); err != nil {
		if runsPython(pid) {
			note(KindPython, "py-spy", errors.New("not installed"))
		}
	} else if runsPython(pid) {
		threads, err := capturePySpy(ctx, path, pid, state)
		d.Threads = append(d.Threads, threads...)
		note(KindPython, "py-spy", err)
	}

	native := false
	if path, err := exec.LookPath("eu-stack"); err == nil {
		threads, err := captureEUStack(ctx, path, pid, state)
		d.Threads = append(d.Threads, threads...)
		native = len(threads) > 0
		note(KindNative, "eu-stack", err)
	}
	if !native {
		if path, err := exec.LookPath("gdb"); err == nil {
			threads, err := captureGDB(ctx, path, pid, state)
			d.Threads = append(d.Threads, threads...)
			native = len(threads) > 0
			note(KindNative, "gdb", err)
		} else {
			note(KindNative, "gdb", errors.New("neither eu-stack nor gdb is installed"))
		}
	}
	if len(d.Threads) == 0 {
		return d, fmt.Errorf("%w: pid %d: %w", ErrCapture, pid, errors.Join(errs...))
	}
	return d, nil
}

// CaptureGoroutines returns the stacks of every goroutine of this process.
func CaptureGoroutines() []Thread {
	buf := make([]byte, 1<<16)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) || len(buf) >= maxToolOutput {
			return parseGoroutines(buf[:n])
		}
		buf = make([]byte, 2*len(buf))
	}
}

// procState returns a process's state as /proc/<pid>/status says it,
// e.g. "S (sleeping)".
func procState(pid int) (string, error) {
	data, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return "", fmt.Errorf("no process %d: %w", pid, os.ErrNotExist)
		}
		return "", err
	}
	for line := range bytes.SplitSeq(data, []byte("\n")) {
		if v, ok := bytes.CutPrefix(line, []byte("State:")); ok {
			return string(bytes.TrimSpace(v)), nil
		}
	}
	return "unknown", nil
}

func isStopped(state string) bool {
	return strings.HasPrefix(state, "T") || strings.HasPrefix(state, "t")
}

// resume sends SIGCONT to pid when a tool left it stopped and it was not
// stopped before the tool ran.
func resume(pid int, before string) {
	if isStopped(before) {
		return
	}
	// The kernel detaches a dead tracer's tracees at once, but a tracee
	// can linger in a stop the tracer's SIGSTOP put it in.
	for range 50 {
		now, err := procState(pid)
		if err != nil || !isStopped(now) {
			return
		}
		syscall.Kill(pid, syscall.SIGCONT)
		time.Sleep(10 * time.Millisecond)
	}
}

// runsPython reports whether pid's executable or mapped libraries are
// CPython's.
func runsPython(pid int) bool {
	dir := filepath.Join("/proc", strconv.Itoa(pid))
	if exe, err := os.Readlink(filepath.Join(dir, "exe")); err == nil && strings.HasPrefix(filepath.Base(exe), "python") {
		return true
	}
	maps, err := os.ReadFile(filepath.Join(dir, "maps"))
	return err == nil && bytes.Contains(maps, []byte("libpython"))
}

// runTool runs a capture tool in its own process group, killing the group
// when ctx ends, and returns its standard output.
func runTool(ctx context.Context, path string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 2 * time.Second
	stdout := &capped{max: maxToolOutput}
	stderr := &capped{max: 4 << 10}
	cmd.Stdout, cmd.Stderr = stdout, stderr
	err := cmd.Run()
	if ctx.Err() != nil {
		return stdout.Bytes(), fmt.Errorf("%w (stopped after %s)", ctx.Err(), filepath.Base(path))
	}
	if err != nil {
		msg := strings.TrimSpace(stderr.String())
		if i := strings.LastIndexByte(msg, '\n'); i >= 0 {
			msg = msg[i+1:]
		}
		if msg != "" {
			err = fmt.Errorf("%w: %s", err, msg)
		}
	}
	return stdout.Bytes(), err
}

// capped is a buffer that drops what is written past max.
type capped struct {
	bytes.Buffer
	max int
}

func (c *capped) Write(p []byte) (int, error) {
	if room := c.max - c.Len(); room > 0 {
		c.Buffer.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}

func capturePySpy(ctx context.Context, path string, pid int, state string) ([]Thread, error) {
	defer resume(pid, state)
	out, err := runTool(ctx, path, "dump", "--pid", strconv.Itoa(pid), "--json")
	if err != nil {
		return nil, err
	}
	threads, _, err := ParsePySpyJSON(out)
	return threads, err
}

func captureEUStack(ctx context.Context, path string, pid int, state string) ([]Thread, error) {
	defer resume(pid, state)
	// -i: inlined frames, -s: source lines, -m: module names.
	out, err := runTool(ctx, path, "-p", strconv.Itoa(pid), "-i", "-s", "-m")
	threads := parseEUStack(out)
	for i := range threads {
		threads[i].Name = threadName(pid, threads[i].ID)
	}
	if err != nil && len(threads) > 0 {
		// eu-stack exits non-zero when it cannot unwind some frame (Go's
		// stacks, JIT code) but still prints what it could.
		err = nil
	}
	return threads, err
}

func captureGDB(ctx context.Context, path string, pid int, state string) ([]Thread, error) {
	defer resume(pid, state)
	out, err := runTool(ctx, path, "--batch", "-nx", "-iex", "set auto-load off",
		"-p", strconv.Itoa(pid),
		"-ex", "set pagination off", "-ex", "set width 0", "-ex", "set confirm off",
		"-ex", "set print frame-arguments none", "-ex", "thread apply all bt")
	threads := parseGDB(out)
	if err == nil && len(threads) == 0 {
		err = errors.New("no thread in its output")
	}
	if err != nil && len(threads) > 0 {
		err = nil
	}
	return threads, err
}

func threadName(pid int, tid uint64) string {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "task", strconv.FormatUint(tid, 10), "comm"))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}
