package main

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestSignal: SIGTERM to faultline-run reaches each rank's own handler;
// the rank that ignores it then is killed at the end of the grace
// period; the step the ranks saved to memory after the signal is
// persisted to disk; and faultline-run exits 1, as torchrun does, leaving
// neither processes nor shared memory behind.
func TestSignal(t *testing.T) {
	needTorch(t)
	dir := t.TempDir()
	ckpt := filepath.Join(dir, "ckpt")
	id := "signal-" + randomHex(3)
	j := startScript(t, filepath.Join(dir, "out"), []string{"--standalone", "--nproc-per-node", "2", "--no-spares", "--rdzv-id", id, "--grace-period", "4s"},
		filepath.Join("testdata", "terminate.py"), ckpt)
	j.waitLine("[rank1]: step 3", 2*time.Minute)
	j.cmd.Process.Signal(syscall.SIGTERM)
	err := j.wait(time.Minute)
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != exitStopped {
		t.Fatalf("exit %v, want %d as torchrun\nstdout:\n%s\nstderr:\n%s", err, exitStopped, j.stdout(), j.errText())
	}
	stdout, stderr := j.stdout(), j.errText()
	for _, want := range []string{"[rank0]: rank 0 got signal 15", "[rank1]: rank 1 got signal 15", "[rank1]: saved step"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("no %q in the output:\n%s", want, stdout)
		}
	}
	for _, want := range []string{"SIGTERM: rank 0 exited with code 0; rank 1 was killed, still running after", "terminated by SIGTERM"} {
		if !strings.Contains(stderr, want) {
			t.Errorf("no %q in faultline-run's output:\n%s", want, stderr)
		}
	}
	if strings.Contains(stdout+stderr, "AgentError") {
		t.Errorf("a rank lost its agent before it ended:\n%s\n%s", stdout, stderr)
	}
	m := regexp.MustCompile(`\[rank0\]: saved step (\d+) after the signal`).FindStringSubmatch(stdout)
	if m == nil {
		t.Fatalf("rank 0 saved no step after the signal:\n%s", stdout)
	}
	if got := readHash(t, filepath.Join(ckpt, "dlrover_latest.txt")); got != m[1] {
		t.Errorf("the newest step on disk is %s; want %s, saved to memory after the signal\n%s", got, m[1], stderr)
	}
	if !strings.Contains(stderr, "step "+m[1]+", the newest in memory, is persisted") {
		t.Errorf("no word of step %s persisted:\n%s", m[1], stderr)
	}
	shm, _ := filepath.Glob("/dev/shm/faultline-" + id + "*")
	if len(shm) > 0 {
		t.Errorf("left in /dev/shm: %v", shm)
		for _, f := range shm {
			os.Remove(f)
		}
	}
	if out, _ := exec.Command("pgrep", "-f", ckpt).Output(); len(out) > 0 {
		t.Errorf("ranks outlived faultline-run: pids %s", out)
	}
}
