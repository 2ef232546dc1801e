package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/ckpt/layout"
	"github.com/faultline-ml/faultline/internal/testkit"
)

// The checkpoints of real PyTorch jobs, through the faultline package's
// Checkpointer: saves with blocking=False in a training loop, DISK steps
// at the end of a job and across launchers, load_checkpoint called again.

// shmOf lists what /dev/shm holds of job.
func shmOf(t *testing.T, job string) []string {
	t.Helper()
	got, err := filepath.Glob(filepath.Join("/dev/shm", "*faultline-"+job+"-*"))
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// committedSteps lists the committed steps of the disk tier dir, oldest
// first, and the step directories that hold no commit.
func committedSteps(t *testing.T, dir string) (committed, uncommitted []int64) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		n, err := strconv.ParseInt(e.Name(), 10, 64)
		if err != nil || !e.IsDir() {
			continue
		}
		if _, err := os.Stat(filepath.Join(dir, e.Name(), layout.CommitFile)); err == nil {
			committed = append(committed, n)
		} else {
			uncommitted = append(uncommitted, n)
		}
	}
	slices.Sort(committed)
	slices.Sort(uncommitted)
	return committed, uncommitted
}

// TestAsyncSavesKept: the bug report's loop, saving every step with
// blocking=False before the next step's optimizer.step(): the saves are
// kept as soon as their copy is done, so that after rank 1 kills itself
// both ranks resume from a step they saved, not from nothing.
func TestAsyncSavesKept(t *testing.T) {
	needTorch(t)
	for _, model := range []string{"linear", "bn"} {
		t.Run(model, func(t *testing.T) {
			dir := t.TempDir()
			id := "flrun-async-" + randomHex(3)
			args := []string{filepath.Join(dir, "ckpt")}
			if model == "bn" {
				args = append(args, "bn")
			}
			j := startScript(t, filepath.Join(dir, "out"), []string{"--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--rdzv-id", id},
				"testdata/async_save.py", args...)
			if err := j.wait(3 * time.Minute); err != nil {
				t.Fatalf("%v\nstdout:\n%s\nstderr:\n%s", err, j.stdout(), j.errText())
			}
			var resumed []int
			for r := range 2 {
				for _, l := range strings.Split(j.stdout(), "\n") {
					if v, ok := strings.CutPrefix(l, fmt.Sprintf("[rank%d]: restart 1 resumed from ", r)); ok {
						n, err := strconv.Atoi(v)
						if err != nil {
							t.Fatalf("rank %d resumed from %q after the restart: the async saves were not kept\nstdout:\n%s", r, v, j.stdout())
						}
						resumed = append(resumed, n)
					}
				}
			}
			if len(resumed) != 2 || resumed[0] != resumed[1] || resumed[0] < 10 {
				t.Fatalf("resumed from %v, want one step of 10..14 on both ranks\nstdout:\n%s\nstderr:\n%s", resumed, j.stdout(), j.errText())
			}
			// Every tensor here is small, so copied before the save
			// returns: none can change during its copy.
			if strings.Contains(j.errText(), "was abandoned") {
				t.Errorf("saves abandoned, where every tensor is copied before the next forward:\n%s", j.errText())
			}
			if left := shmOf(t, id); len(left) > 0 {
				t.Errorf("the job left %v in /dev/shm", left)
			}
		})
	}
}

// TestDiskStepsCommittedAtTheEnd: two ranks save with StorageType.DISK
// at steps 0, 1 and 2 and exit at once: step 2 is persisted on both
// shards and committed before the launcher exits, and the job's segments
// are gone.
func TestDiskStepsCommittedAtTheEnd(t *testing.T) {
	needTorch(t)
	dir := t.TempDir()
	ckptDir := filepath.Join(dir, "ckpt")
	id := "flrun-end-" + randomHex(3)
	j := startScript(t, filepath.Join(dir, "out"), []string{"--standalone", "--nproc-per-node", "2", "--rdzv-id", id},
		"testdata/disk_saves.py", ckptDir, "64", "3", "1")
	if err := j.wait(3 * time.Minute); err != nil {
		t.Fatalf("%v\nstderr:\n%s", err, j.errText())
	}
	if got := strings.TrimSpace(readFile(t, filepath.Join(ckptDir, layout.DLRoverTrackerFile))); got != "2" {
		t.Fatalf("%s says %q at the end, want 2\nstderr:\n%s", layout.DLRoverTrackerFile, got, j.errText())
	}
	if committed, _ := committedSteps(t, ckptDir); !slices.Contains(committed, 2) {
		t.Fatalf("committed steps %v, want 2 among them", committed)
	}
	if left := shmOf(t, id); len(left) > 0 {
		t.Errorf("a finished job left %v in /dev/shm", left)
	}
}

// TestDamagedDiskStep: a committed step whose shard of rank 1 was cut
// short is loaded by no rank: both resume from the step before it, and the
// launcher says which shard is damaged. Nothing on disk is removed.
func TestDamagedDiskStep(t *testing.T) {
	needTorch(t)
	dir := t.TempDir()
	ckptDir := filepath.Join(dir, "ckpt")
	flags := []string{"--standalone", "--nproc-per-node", "2"}
	j := startScript(t, filepath.Join(dir, "out"), flags, "testdata/disk_saves.py", ckptDir, "1", "2", "1")
	if err := j.wait(3 * time.Minute); err != nil {
		t.Fatalf("%v\nstderr:\n%s", err, j.errText())
	}
	shard := filepath.Join(layout.StepDir(ckptDir, 1), layout.ShardFile(1))
	if err := os.Truncate(shard, 1000); err != nil {
		t.Fatal(err)
	}
	j = startScript(t, filepath.Join(dir, "out"), flags, "testdata/disk_saves.py", ckptDir, "1", "0", "1")
	if err := j.wait(3 * time.Minute); err != nil {
		t.Fatalf("%v\nstderr:\n%s", err, j.errText())
	}
	for r := range 2 {
		if want := fmt.Sprintf("[rank%d]: resumed from 0", r); !strings.Contains(j.stdout(), want) {
			t.Errorf("no %q: a rank loaded the damaged step, or none loaded the one before\nstdout:\n%s\nstderr:\n%s", want, j.stdout(), j.errText())
		}
	}
	if want := "step 1 on disk cannot be loaded by rank 1"; !strings.Contains(j.errText(), want) {
		t.Errorf("no %q on the launcher's output:\n%s", want, j.errText())
	}
	if _, err := os.Stat(shard); err != nil {
		t.Errorf("the damaged shard was removed: %v", err)
	}
}

// TestDiskStepsAsked: two launchers on one host share a checkpoint
// folder and save with StorageType.DISK every 5 steps of 40: the steps
// committed are the ones asked for (the newest three kept), never those
// that happened to be newest when an owner looked.
func TestDiskStepsAsked(t *testing.T) {
	needTorch(t)
	dir := t.TempDir()
	ckptDir := filepath.Join(dir, "ckpt")
	port, err := freePorts()
	if err != nil {
		t.Fatal(err)
	}
	host := testkit.HostAddr(t)
	t.Setenv("TASKD_TOKEN", randomHex(16))
	id := "flrun-asked-" + randomHex(3)
	var jobs []*job
	for node := range 2 {
		jobs = append(jobs, startScript(t, filepath.Join(dir, fmt.Sprintf("out-%d", node)),
			[]string{"--nnodes", "2", "--node-rank", strconv.Itoa(node), "--nproc-per-node", "1", "--master-addr", host, "--master-port", strconv.Itoa(port), "--rdzv-id", id},
			"testdata/disk_saves.py", ckptDir, "16", "40", "5"))
	}
	for node, j := range jobs {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstderr:\n%s", node, err, j.errText())
		}
	}
	committed, uncommitted := committedSteps(t, ckptDir)
	if want := []int64{29, 34, 39}; !slices.Equal(committed, want) || len(uncommitted) > 0 {
		t.Fatalf("committed steps %v (uncommitted step folders %v), want %v: the steps asked for", committed, uncommitted, want)
	}
	if left := shmOf(t, id); len(left) > 0 {
		t.Errorf("the job left %v in /dev/shm", left)
	}
}

// TestLoadAgain: load_checkpoint called after each save of a run
// returns that save, never an older step and never nothing.
func TestLoadAgain(t *testing.T) {
	needTorch(t)
	dir := t.TempDir()
	j := startScript(t, filepath.Join(dir, "out"), []string{"--standalone", "--nproc-per-node", "2", "--rdzv-id", "flrun-again-" + randomHex(3)},
		"testdata/load_again.py", filepath.Join(dir, "ckpt"), "64")
	if err := j.wait(3 * time.Minute); err != nil {
		t.Fatalf("%v\nstderr:\n%s", err, j.errText())
	}
	out := j.stdout()
	for r := range 2 {
		for step := range 6 {
			if want := fmt.Sprintf("[rank%d]: after save %d: loaded %d ok", r, step, step); !strings.Contains(out, want) {
				t.Fatalf("no %q\nstdout:\n%s", want, out)
			}
		}
	}
}

func readFile(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestAbandonedSaveCounted: a save with blocking=False torn by an update
// is abandoned, warned about with its step, and counted in the metrics
// faultline-run serves with --metrics-listen.
func TestAbandonedSaveCounted(t *testing.T) {
	needTorch(t)
	dir := t.TempDir()
	port, err := freePorts()
	if err != nil {
		t.Fatal(err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	j := startScript(t, filepath.Join(dir, "out"), []string{"--standalone", "--nproc-per-node", "1", "--metrics-listen", addr, "--grace-period", "5s"},
		"testdata/torn_save.py", filepath.Join(dir, "ckpt"))
	j.waitLine("[rank0]: kept False; warned: ['faultline: the save of step 1 (blocking=False) was abandoned", time.Minute)
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	if want := `faultline_agent_async_saves_abandoned_total{rank="0"} 1`; !strings.Contains(string(b), want) {
		t.Fatalf("no %q in /metrics:\n%s", want, b)
	}
	j.cmd.Process.Signal(syscall.SIGTERM)
	j.wait(time.Minute)
}
