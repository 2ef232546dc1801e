package slownode

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// realJob is a run of testdata/ddp.py, a 4-rank data-parallel PyTorch job
// on gloo that dots its steps in MindCluster's record format, and what
// should be found in it.
type realJob struct {
	name        string
	args        []string
	compute, io []int // ranks made slow to compute, to load data
}

// realSteps is how long the real jobs run; the slow ones slow down from
// realOnset on.
const realSteps, realOnset = 60, 30

// slowRealJob returns a job with rank cr computing factor times slower
// and rank ior loading each batch ioFactor times slower (-1: none of
// either).
func slowRealJob(name string, cr int, factor float64, ior int, ioFactor float64) realJob {
	j := realJob{name: name}
	onset := strconv.Itoa(realOnset)
	if cr >= 0 {
		j.args = append(j.args, "--slow-rank", strconv.Itoa(cr), "--slow-from", onset,
			"--slow-factor", strconv.FormatFloat(factor, 'f', -1, 64))
		j.compute = []int{cr}
	}
	if ior >= 0 {
		j.args = append(j.args, "--slow-io", strconv.Itoa(ior), "--slow-io-from", onset,
			"--slow-io-factor", strconv.FormatFloat(ioFactor, 'f', -1, 64))
		j.io = []int{ior}
	}
	return j
}

// torchPython returns a Python interpreter that has torch with gloo,
// skipping the test where there is none.
func torchPython(t testing.TB) string {
	t.Helper()
	p := findTorchPython()
	if p == "" {
		t.Skip("no python3 with torch and gloo (Debian package python3-torch): the real-job tests run a PyTorch job")
	}
	return p
}

// findTorchPython returns a Python interpreter that has torch with gloo,
// "" if none: FAULTLINE_TORCH_PYTHON, else python3 on PATH, then Debian's.
func findTorchPython() string {
	cands := []string{"python3", "/usr/bin/python3"}
	if p := os.Getenv("FAULTLINE_TORCH_PYTHON"); p != "" {
		cands = []string{p}
	}
	for _, c := range cands {
		if _, err := exec.LookPath(c); err != nil {
			continue
		}
		if exec.Command(c, "-c", "import torch.distributed as d; assert d.is_gloo_available()").Run() == nil {
			return c
		}
	}
	return ""
}

// runRealJob runs j under root with python, killing the job's processes
// if it outlives two minutes.
func runRealJob(t testing.TB, python, root string, j realJob) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	args := append([]string{filepath.Join("testdata", "ddp.py"), "--root", root, "--job", j.name,
		"--steps", strconv.Itoa(realSteps)}, j.args...)
	cmd := exec.CommandContext(ctx, python, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", j.name, err, out)
	}
	return filepath.Join(root, j.name)
}

// TestRealDDPJob runs a real PyTorch job twice, healthy and with one rank
// computing three times as slowly and another loading its batches ten
// times as slowly, both from step 30 of 60: the healthy one gives no
// finding and the other names those two ranks and nothing else, however
// loaded the machine (the job's four ranks share its cores with whatever
// else runs: their figures jump by whole time slices from step to step,
// and the slowdowns, as a device's or a disk's would, scale with what the
// load made of the work they slow).
//
// The job is judged with MinEffect 0.1 and Consecutive 4: each slowdown
// costs the job a seventh of a step or more for 30 steps, while a healthy
// rank that shares a core with other work can be a few percent of a step
// slower than its peers for seconds, or starved for three steps in a row,
// which the defaults (2%, 3) rightly name.
func TestRealDDPJob(t *testing.T) {
	python := torchPython(t)
	root := t.TempDir()
	for _, j := range []realJob{{name: "healthy"}, slowRealJob("slow", 1, 3, 3, 10)} {
		dir := runRealJob(t, python, root, j)
		r, err := Analyze(context.Background(), dir, Config{MinEffect: 0.1, Consecutive: 4})
		if err != nil {
			t.Fatal(err)
		}
		var text strings.Builder
		WriteText(&text, r)
		if !slices.Equal(r.SlowCalculateRanks, j.compute) || !slices.Equal(r.SlowIORanks, j.io) ||
			len(r.SlowHostNodes)+len(r.SlowCommunicationDomains)+len(r.SlowCommunicationRanks) > 0 {
			t.Errorf("%s: want slow compute %v and IO %v only, got:\n%s", j.name, j.compute, j.io, text.String())
		} else {
			t.Logf("%s:\n%s", j.name, text.String())
		}
	}
}
