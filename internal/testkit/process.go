package testkit

import (
	"bufio"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// roleEnv names the role of a test binary that Command started again.
const roleEnv = "FAULTLINE_TEST_ROLE"

// Deadline bounds WaitFor and WaitLine: generous, for a loaded two-core
// machine running the race detector; a test that meets it has failed.
const Deadline = 60 * time.Second

// Role returns the role this test binary was started in by Command, or ""
// when it runs the tests.
func Role() string { return os.Getenv(roleEnv) }

// RoleEnv is the environment entry that gives a child process role.
func RoleEnv(role string) string { return roleEnv + "=" + role }

// Command returns a command that runs this test binary again in role,
// running no test, with env added to the environment and its standard
// error the test's.
func Command(t testing.TB, role string, env ...string) *exec.Cmd {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), append([]string{RoleEnv(role)}, env...)...)
	cmd.Stderr = os.Stderr
	return cmd
}

// Start starts cmd and returns its standard output line by line; the
// channel is closed at the end of the output. Its standard error is the
// test's unless set. When the test ends the process is killed (SIGKILL)
// and reaped.
func Start(t testing.TB, cmd *exec.Cmd) <-chan string {
	t.Helper()
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if cmd.Stderr == nil {
		cmd.Stderr = os.Stderr
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := Lines(out)
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		for range lines {
		}
	})
	return lines
}

// Lines reads r line by line into the returned channel, which is closed
// at the end of r.
func Lines(r io.Reader) <-chan string {
	ch := make(chan string, 1024)
	go func() {
		defer close(ch)
		sc := bufio.NewScanner(r)
		sc.Buffer(make([]byte, 64<<10), 16<<20)
		for sc.Scan() {
			ch <- sc.Text()
		}
	}()
	return ch
}

// WaitLine returns the first line of lines that holds want, failing the
// test at the end of the output or after Deadline.
func WaitLine(t testing.TB, lines <-chan string, want string) string {
	t.Helper()
	deadline := time.After(Deadline)
	for {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("the output ended before a line with %q", want)
			}
			if strings.Contains(l, want) {
				return l
			}
		case <-deadline:
			t.Fatalf("no line with %q within %v", want, Deadline)
		}
	}
}

// WaitFor polls cond until it holds, failing the test after Deadline. It
// is for what other processes and the file system bring about, where
// there is no event to wait on.
func WaitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	WaitForWithin(t, Deadline, what, cond)
}

// WaitForWithin is WaitFor with a deadline of d, for a benchmark's setup
// that takes longer than Deadline (a thousand processes registering).
func WaitForWithin(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
