package agent

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/faultline-ml/faultline/taskd"
)

// outAgent builds an agent of job with two ranks running script in out.
func outAgent(t *testing.T, job, out, script string) (*Agent, *os.File, error) {
	t.Helper()
	dir := t.TempDir()
	log, err := os.Create(filepath.Join(dir, "output"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { log.Close() })
	a, err := New(Config{Job: job, ProcsPerNode: 2, MaxRestarts: 1, Command: []string{"sh", "-c", script}, NoPython: true,
		Out: out, ShmDir: dir, ManagerListen: "127.0.0.1:0", Security: taskd.Security{Token: "0123456789abcdef0123456789abcdef", Insecure: true},
		Env: append(os.Environ(), "WORK="+dir), Stdout: log, Stderr: log})
	if err == nil {
		t.Cleanup(func() { a.Close() })
	}
	return a, log, err
}

// TestOutOfAnotherJob: a job started in the Out of another moves that
// job's results aside, saying so, and runs; one started again with the
// same id goes on there, numbering its incidents on; two agents at once
// in one Out are refused.
func TestOutOfAnotherJob(t *testing.T) {
	out := filepath.Join(t.TempDir(), "out")
	// Rank 1 fails once: an incident, and the manager's state.
	const failOnce = `if [ "$RANK" = 1 ] && [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then exit 3; fi`
	for i, job := range []string{"job-a", "job-b", "job-b"} {
		a, log, err := outAgent(t, job, out, failOnce)
		if err != nil {
			t.Fatalf("run %d, %s: New: %v", i, job, err)
		}
		if err := run(t, a); err != nil {
			t.Fatalf("run %d, %s: %v\n%s", i, job, err, output(t, log))
		}
		got := output(t, log)
		moved := strings.Contains(got, "held the results of job")
		if want := i == 1; moved != want {
			t.Errorf("run %d, %s: moved the previous results: %v, want %v\n%s", i, job, moved, want, got)
		}
		a.Close()
	}
	if b, err := os.ReadFile(filepath.Join(out, JobFile)); err != nil || strings.TrimSpace(string(b)) != "job-b" {
		t.Errorf("%s: %q, %v; want job-b", JobFile, b, err)
	}
	for _, f := range []string{IncidentsFile, "manager/manager.json"} {
		if _, err := os.Stat(filepath.Join(out, PreviousDir, "job-a", f)); err != nil {
			t.Errorf("job-a's results: %v", err)
		}
	}
	var ids []int
	for _, c := range incidentsOf(t, filepath.Dir(out)) {
		ids = append(ids, c.ID)
	}
	if len(ids) != 2 || ids[0] != 1 || ids[1] != 2 {
		t.Errorf("job-b's incidents are numbered %v, want [1 2]", ids)
	}

	first, _, err := outAgent(t, "job-c", out, "exit 0")
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := outAgent(t, "job-d", out, "exit 0"); !errors.Is(err, errOutInUse) || !strings.Contains(err.Error(), `job "job-c"`) {
		t.Errorf("a second agent in the Out of a live one: New = %v, want errOutInUse naming job-c", err)
	}
	first.Close()
	if _, err := os.Stat(filepath.Join(out, PreviousDir, "job-b")); err != nil {
		t.Errorf("job-b's results were not moved aside for job-c: %v", err)
	}
}
