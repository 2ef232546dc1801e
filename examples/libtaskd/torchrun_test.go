package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestREADMEUnderTorchrun runs the README's Python lines as written under
// torch.distributed.run (torchrun), with no MINDX_TASK_ID and no control
// plane: init_taskd_worker takes torchrun's run id and both calls return
// True; with a switch given, the ranges land in files of that job.
func TestREADMEUnderTorchrun(t *testing.T) {
	lib := library(t)
	const py = "/usr/bin/python3"
	if err := exec.Command(py, "-c", "import torch.distributed.run").Run(); err != nil {
		t.Skipf("needs torch importable from %s (Debian package python3-torch): %v", py, err)
	}
	here, _ := os.Getwd()
	dir := t.TempDir()
	root := filepath.Join(dir, "profiling")
	script := filepath.Join(dir, "train.py")
	// The README's lines, then a check of what they returned.
	src := `import os, sys
from faultline_taskd import init_taskd_worker, start_taskd_worker, span, last_error
import faultline_taskd

ok = init_taskd_worker(rank_id=int(os.environ["RANK"]), upper_limit_of_disk_in_mb=5000, framework="pt",
                       config={"root": sys.argv[1], "switch": {"Step": "on", "FP": "on", "DataLoader": "on"}})
if not ok:
    sys.exit("init_taskd_worker: " + last_error())
if not start_taskd_worker():
    sys.exit("start_taskd_worker: " + last_error())
for step in range(3):
    with span(f"step {step}"):
        with span("dataloader"):
            batch = step
faultline_taskd.destroy_taskd_worker()
print("done", os.environ["RANK"], os.environ["TORCHELASTIC_RUN_ID"], flush=True)
`
	if err := os.WriteFile(script, []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(py, filepath.Join(here, "..", "faultline-run", "testdata", "torchrun.py"),
		"--standalone", "--nproc_per_node", "2", "--rdzv_id", "readme-job", script, root)
	cmd.Env = append(os.Environ(), "PYTHONPATH="+here, "FAULTLINE_LIBTASKD="+lib, "MINDX_TASK_ID=", "TASKD_UPSTREAM=",
		"TASKD_TOKEN=", "TASKD_INSECURE=", "TASKD_TLS_DIR=", "OMP_NUM_THREADS=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("torchrun: %v\n%s", err, out)
	}
	if bytes.Count(out, []byte("done ")) != 2 {
		t.Fatalf("not both ranks done:\n%s", out)
	}
	jobs, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, j := range jobs {
		names = append(names, j.Name())
	}
	if len(names) == 0 {
		t.Fatalf("no job folder under %s:\n%s", root, out)
	}
	for _, rank := range []string{"0", "1"} {
		files, _ := os.ReadDir(filepath.Join(root, names[0], rank))
		if len(files) == 0 {
			t.Errorf("rank %s wrote no record file under %s (jobs %v)", rank, root, names)
		}
	}
}
