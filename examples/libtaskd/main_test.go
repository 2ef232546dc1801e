package main

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// built is the library, compiled once per test binary: a c-shared build
// links for many seconds.
var built struct {
	once sync.Once
	dir  string
	path string
	err  error
}

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.Cleanup(func(code int) {
		if built.dir != "" {
			os.RemoveAll(built.dir)
		}
		os.Exit(code)
	}))
}

func goTool() (string, error) {
	p := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := os.Stat(p); err == nil {
		return p, nil
	}
	return exec.LookPath("go")
}

// cCompiler returns the compiler cgo would use.
func cCompiler() (string, bool) {
	if cc := os.Getenv("CC"); cc != "" {
		p, err := exec.LookPath(strings.Fields(cc)[0])
		return p, err == nil
	}
	for _, name := range []string{"gcc", "cc", "clang"} {
		if p, err := exec.LookPath(name); err == nil {
			return p, true
		}
	}
	return "", false
}

// library returns libtaskd.so, building it on first use, or the library
// $LIBTASKD_TEST_LIBRARY names (built beforehand, say by CI, to skip the
// link here). It skips the test where python3 or a C compiler is missing.
func library(t testing.TB) string {
	t.Helper()
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("python3 not found (Debian package python3): the library's tests drive it from Python")
	}
	if p := os.Getenv("LIBTASKD_TEST_LIBRARY"); p != "" {
		return p
	}
	if _, ok := cCompiler(); !ok {
		t.Skip("no C compiler (gcc, cc or clang; Debian package gcc): libtaskd.so is a cgo build")
	}
	built.once.Do(func() {
		gt, err := goTool()
		if err != nil {
			built.err = fmt.Errorf("go tool: %w", err)
			return
		}
		if built.dir, built.err = os.MkdirTemp("", "libtaskd-test-"); built.err != nil {
			return
		}
		built.path = filepath.Join(built.dir, "libtaskd.so")
		// -s -w: no symbol table or DWARF, which halves the link.
		cmd := exec.Command(gt, "build", "-buildmode=c-shared", "-ldflags=-s -w", "-o", built.path, ".")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=1")
		if out, err := cmd.CombinedOutput(); err != nil {
			built.err = fmt.Errorf("go build -buildmode=c-shared: %v\n%s", err, out)
		}
	})
	if built.err != nil {
		t.Fatal(built.err)
	}
	return built.path
}

// python is a trainer.py process.
type python struct {
	t     testing.TB
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string
	errMu sync.Mutex
	errb  bytes.Buffer
	done  chan struct{}
	err   error
}

// startPython runs testdata/trainer.py in mode with env added to the
// environment; the process is killed at the end of the test if still
// running.
func startPython(t testing.TB, lib, mode string, env ...string) *python {
	t.Helper()
	here, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	p := &python{t: t, lines: make(chan string, 1<<16), done: make(chan struct{})}
	p.cmd = exec.Command("python3", filepath.Join(here, "testdata", "trainer.py"), mode)
	p.cmd.Env = append(os.Environ(), "PYTHONPATH="+here, "FAULTLINE_LIBTASKD="+lib, "PYTHONUNBUFFERED=1", "PYTHONDONTWRITEBYTECODE=1")
	p.cmd.Env = append(p.cmd.Env, env...)
	p.cmd.Stderr = writerFunc(func(b []byte) (int, error) {
		p.errMu.Lock()
		defer p.errMu.Unlock()
		return p.errb.Write(b)
	})
	out, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if p.stdin, err = p.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			select {
			case p.lines <- sc.Text():
			default: // a test that stopped reading does not stall the trainer
			}
		}
		p.err = p.cmd.Wait()
		close(p.lines)
		close(p.done)
	}()
	t.Cleanup(func() {
		p.stdin.Close()
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			p.cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }

func (p *python) stderr() string {
	p.errMu.Lock()
	defer p.errMu.Unlock()
	return p.errb.String()
}

// expect reads lines until one starts with prefix and returns it.
func (p *python) expect(prefix string, within time.Duration) string {
	p.t.Helper()
	timer := time.NewTimer(within)
	defer timer.Stop()
	for {
		select {
		case line, ok := <-p.lines:
			if !ok {
				<-p.done
				p.t.Fatalf("trainer exited (%v) before %q\nstderr:\n%s", p.err, prefix, p.stderr())
			}
			if strings.HasPrefix(line, prefix) {
				return line
			}
		case <-timer.C:
			p.t.Fatalf("no %q from the trainer within %v\nstderr:\n%s", prefix, within, p.stderr())
		}
	}
}

// drain drops the lines the trainer printed so far, so that what is read
// next was printed from now on.
func (p *python) drain() {
	for {
		select {
		case _, ok := <-p.lines:
			if !ok {
				return
			}
		default:
			return
		}
	}
}

// expectAll reads lines until one starts with each of prefixes, in any
// order (lines from the worker's threads race the main thread's), and
// returns the first line of each.
func (p *python) expectAll(within time.Duration, prefixes ...string) map[string]string {
	p.t.Helper()
	got := make(map[string]string, len(prefixes))
	timer := time.NewTimer(within)
	defer timer.Stop()
	for len(got) < len(prefixes) {
		select {
		case line, ok := <-p.lines:
			if !ok {
				<-p.done
				p.t.Fatalf("trainer exited (%v) before %q (got %q)\nstderr:\n%s", p.err, prefixes, got, p.stderr())
			}
			for _, pre := range prefixes {
				if _, seen := got[pre]; !seen && strings.HasPrefix(line, pre) {
					got[pre] = line
					break
				}
			}
		case <-timer.C:
			p.t.Fatalf("not all of %q from the trainer within %v (got %q)\nstderr:\n%s", prefixes, within, got, p.stderr())
		}
	}
	return got
}

// send writes a command line to the trainer.
func (p *python) send(line string) {
	p.t.Helper()
	if _, err := io.WriteString(p.stdin, line+"\n"); err != nil {
		p.t.Fatalf("write to trainer: %v", err)
	}
}

// wait waits for the trainer to exit and fails the test unless it exited 0.
func (p *python) wait(within time.Duration) {
	p.t.Helper()
	select {
	case <-p.done:
	case <-time.After(within):
		p.cmd.Process.Kill()
		<-p.done
		p.t.Fatalf("trainer did not exit within %v\nstderr:\n%s", within, p.stderr())
	}
	if p.err != nil {
		p.t.Fatalf("trainer: %v\nstderr:\n%s", p.err, p.stderr())
	}
}
