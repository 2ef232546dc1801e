package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/faultline-ml/faultline/agent"
)

// TestSecondRun: a command run twice in one --out: the second job starts,
// and says where the first one's results went; a third given the second's
// id on purpose goes on in its folder. (The ranks are no Python: what is
// tested is the launcher's folder.)
func TestSecondRun(t *testing.T) {
	out := filepath.Join(t.TempDir(), "out")
	runJob := func(flags ...string) string {
		t.Helper()
		argv := append([]string{"--standalone", "--nproc-per-node", "2", "--no-python", "--out", out}, flags...)
		b, err := exec.Command(binary(t), append(argv, "true")...).CombinedOutput()
		if err != nil {
			t.Fatalf("faultline-run %s: %v\n%s", strings.Join(flags, " "), err, b)
		}
		return string(b)
	}
	jobOf := func() string {
		t.Helper()
		b, err := os.ReadFile(filepath.Join(out, agent.JobFile))
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(b))
	}
	runJob()
	first := jobOf()
	got := runJob()
	second := jobOf()
	if second == first || !strings.Contains(got, "held the results of job \""+first+"\"; moved them to "+filepath.Join(out, agent.PreviousDir, first)) {
		t.Errorf("the second job (%s after %s) did not say where the first's results went:\n%s", second, first, got)
	}
	if _, err := os.Stat(filepath.Join(out, agent.PreviousDir, first, "manager")); err != nil {
		t.Errorf("the first job's manager state: %v", err)
	}
	if got := runJob("--rdzv-id", second); strings.Contains(got, "held the results") || jobOf() != second {
		t.Errorf("the job started again with its id moved its own results aside:\n%s", got)
	}
}
