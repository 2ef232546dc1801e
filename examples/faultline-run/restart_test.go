package main

import (
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestFinishedRankRestarted: a rank that finished before its peer failed
// is restarted with it, as torchrun restarts its whole worker group, and
// the job gets through the barrier that the restarted peer alone would
// wait at for ever.
func TestFinishedRankRestarted(t *testing.T) {
	needTorch(t)
	dir := t.TempDir()
	j := startScript(t, filepath.Join(dir, "out"), []string{"--standalone", "--nproc-per-node", "2", "--no-spares", "--max-restarts", "1"},
		filepath.Join("testdata", "finish.py"))
	if err := j.wait(2 * time.Minute); err != nil {
		t.Fatalf("faultline-run: %v\nstdout:\n%s\nstderr:\n%s", err, j.stdout(), j.errText())
	}
	out := j.stdout()
	for _, want := range []string{"[rank0]: rank 0 through the barrier", "[rank1]: rank 1 through the barrier"} {
		if !strings.Contains(out, want) {
			t.Errorf("no %q in the output:\n%s", want, out)
		}
	}
}
