package testkit

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// RunNoShmLeftovers runs a package's tests (m.Run) and then fails them,
// returning 1, when /dev/shm holds files whose names start with one of
// prefixes (after an optional dot: temporary files) that were not there
// before: shared memory a test made and did not remove, or a job under
// test did not give back. It removes them, so that one run's leak does
// not fail the next. A package's TestMain calls it:
//
//	func TestMain(m *testing.M) { os.Exit(testkit.RunNoShmLeftovers(m, "faultline-")) }
//
// Where it can (as root, with unshare(1)), it first runs the test binary
// again in a mount namespace of its own with an empty /dev/shm, so that
// the tests neither see nor remove the shared memory of jobs that others
// run on the machine meanwhile, and what is left there is theirs alone.
func RunNoShmLeftovers(m *testing.M, prefixes ...string) int {
	if code, ok := runWithPrivateShm(); ok {
		return code
	}
	before := shmFiles(prefixes)
	code := m.Run()
	var left []string
	for name := range shmFiles(prefixes) {
		if !before[name] {
			left = append(left, name)
			os.Remove(name)
		}
	}
	if len(left) > 0 {
		fmt.Fprintf(os.Stderr, "FAIL: the tests left %d files in /dev/shm (now removed): %s\n", len(left), strings.Join(left, " "))
		return 1
	}
	return code
}

// privateShmEnv marks a test binary that runs with a /dev/shm of its own.
const privateShmEnv = "FAULTLINE_TEST_PRIVATE_SHM"

// runWithPrivateShm runs the test binary again, with its arguments, in a
// mount namespace whose /dev/shm is a tmpfs of its own, and returns its
// exit code; ok is false when this is that binary, or when it cannot be
// done here (not root, no unshare), and the tests are to run in place.
func runWithPrivateShm() (code int, ok bool) {
	if os.Getenv(privateShmEnv) != "" || os.Geteuid() != 0 {
		return 0, false
	}
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		return 0, false
	}
	self, err := os.Executable()
	if err != nil {
		return 0, false
	}
	script := `mount -t tmpfs -o mode=1777,size=50% tmpfs /dev/shm && exec "$0" "$@"`
	cmd := exec.Command(unshare, append([]string{"--mount", "--propagation", "private", "sh", "-c", script, self}, os.Args[1:]...)...)
	cmd.Env = append(os.Environ(), privateShmEnv+"=1")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	// unshare and sh exec the binary, so it is this child: it dies with
	// the parent, and gets the signals go test sends the parent.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGQUIT)
	defer signal.Stop(sigs)
	if err := cmd.Start(); err != nil {
		return 0, false
	}
	done := make(chan struct{})
	go func() {
		for {
			select {
			case s := <-sigs:
				cmd.Process.Signal(s)
			case <-done:
				return
			}
		}
	}()
	err = cmd.Wait()
	close(done)
	var exit *exec.ExitError
	switch {
	case err == nil:
		return 0, true
	case errors.As(err, &exit) && exit.ExitCode() >= 0:
		return exit.ExitCode(), true
	}
	fmt.Fprintf(os.Stderr, "testkit: the tests with a /dev/shm of their own: %v\n", err)
	return 1, true
}

// shmFiles lists the files of /dev/shm named with one of prefixes.
func shmFiles(prefixes []string) map[string]bool {
	out := map[string]bool{}
	ents, _ := os.ReadDir("/dev/shm")
	for _, e := range ents {
		if e.IsDir() {
			continue
		}
		name := strings.TrimPrefix(e.Name(), ".")
		for _, p := range prefixes {
			if strings.HasPrefix(name, p) {
				out[filepath.Join("/dev/shm", e.Name())] = true
			}
		}
	}
	return out
}
