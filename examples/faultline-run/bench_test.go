package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// BenchmarkRecovery measures, side by side on the same job, the time
// from a rank's SIGKILL to the job back at the step where it died: under
// faultline-run (memory checkpoints every step, warm spares) and under
// torch.distributed.run (--max_restarts 3, torch.save every 10 steps, as
// a torchrun job checkpoints). The job: train.py, 4 ranks, 100 ms a
// step, rank 2 killed at step 60, once faultline-run's spare interpreters
// have had the seconds they take to import torch. Run it with
//
//	go test -run '^$' -bench Recovery -benchtime 1x ./examples/faultline-run/
//
// It reports both times and their ratio (faultline-run's over torchrun's).
func BenchmarkRecovery(b *testing.B) {
	if err := exec.Command(torchPython, "-c", "import torch.distributed.run").Run(); err != nil {
		b.Skipf("needs torch importable from %s (Debian package python3-torch): %v", torchPython, err)
	}
	bin := binary(b)
	train, _ := filepath.Abs("train.py")
	torchrun, _ := filepath.Abs(filepath.Join("testdata", "torchrun.py"))
	args := []string{"--steps", "80", "--step-ms", "100", "--kill-rank", "2", "--kill-step", "60"}
	var fl, tr time.Duration
	for range b.N {
		dir := b.TempDir()
		port, err := freePorts()
		if err != nil {
			b.Fatal(err)
		}
		fl += recoveryTime(b, exec.Command(bin, append([]string{"--standalone", "--nproc-per-node", "4", "--max-restarts", "3",
			"--python", torchPython, "--out", filepath.Join(dir, "fl-out"), train, "--ckpt", filepath.Join(dir, "fl-ckpt")}, args...)...))
		tr += recoveryTime(b, exec.Command(torchPython, append([]string{torchrun, "--nnodes", "1", "--nproc_per_node", "4", "--max_restarts", "3",
			"--master_port", strconv.Itoa(port), train, "--baseline", "--ckpt", filepath.Join(dir, "tr-ckpt")}, args...)...))
	}
	b.ReportMetric(fl.Seconds()/float64(b.N), "faultline-s")
	b.ReportMetric(tr.Seconds()/float64(b.N), "torchrun-s")
	b.ReportMetric(fl.Seconds()/tr.Seconds(), "x-torchrun")
}

// BenchmarkDDPHook measures a DDP job's step time under
// faultline.torch.init() beside plain DDP's, in the same job under
// faultline-run: testdata/ddp_bench.py, 2 gloo ranks, 100 Linear(64, 64)
// layers. Each rank trains one copy of the model wrapped by DDP before
// ft.init() (DDP's own all-reduce) and one wrapped after it (faultline's
// comm hook, which keeps DDP's buckets and times each), one step of each
// in turn, 200 on each side. Run it with
//
//	go test -run '^$' -bench DDPHook -benchtime 1x ./examples/faultline-run/
//
// It reports each side's median milliseconds a step and x-plain, the
// median over the pairs of steps of faultline's time over plain DDP's.
// Goal: x-plain <= 1.03.
func BenchmarkDDPHook(b *testing.B) {
	if testing.Short() {
		b.Skip("real PyTorch jobs take seconds each; not under -short")
	}
	if err := exec.Command(torchPython, "-c", "import torch.distributed").Run(); err != nil {
		b.Skipf("needs torch importable from %s (Debian package python3-torch): %v", torchPython, err)
	}
	bin := binary(b)
	script, _ := filepath.Abs(filepath.Join("testdata", "ddp_bench.py"))
	var plain, fl, ratio float64
	for range b.N {
		cmd := exec.Command(bin, "--standalone", "--nproc-per-node", "2", "--no-spares", "--python", torchPython,
			"--out", filepath.Join(b.TempDir(), "out"), script)
		cmd.Env = append(os.Environ(), "OMP_NUM_THREADS=1")
		out, err := cmd.CombinedOutput()
		if err != nil {
			b.Fatalf("%s: %v\n%s", script, err, out)
		}
		_, line, ok := strings.Cut(string(out), "ddp-bench ")
		line, _, _ = strings.Cut(line, "\n")
		var r struct {
			Plain     float64 `json:"plain_ms"`
			Faultline float64 `json:"faultline_ms"`
			Ratio     float64 `json:"ratio"`
		}
		if err := json.Unmarshal([]byte(line), &r); !ok || err != nil {
			b.Fatalf("%s: no ddp-bench line (%v)\n%s", script, err, out)
		}
		plain += r.Plain
		fl += r.Faultline
		ratio += r.Ratio
	}
	n := float64(b.N)
	b.ReportMetric(plain/n, "plain-ms/step")
	b.ReportMetric(fl/n, "faultline-ms/step")
	b.ReportMetric(ratio/n, "x-plain")
}

// recoveryTime runs a job that kills a rank and returns the time from the
// rank's last words to the first line, after the restart, of the job
// completing the step it died in.
func recoveryTime(b *testing.B, cmd *exec.Cmd) time.Duration {
	b.Helper()
	cmd.Env = append(os.Environ(), "OMP_NUM_THREADS=1", "PYTHONUNBUFFERED=1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	var killed, back time.Time
	var step string
	resumed := false
	var log strings.Builder
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		line, now := sc.Text(), time.Now()
		fmt.Fprintln(&log, line)
		switch {
		case killed.IsZero() && strings.Contains(line, "killing myself at step "):
			killed = now
			step = line[strings.LastIndex(line, " ")+1:]
		case !killed.IsZero() && strings.Contains(line, "resumed from step"):
			resumed = true
		case resumed && back.IsZero() && strings.Contains(line, "step "+step+" loss"):
			back = now
		}
	}
	io.Copy(io.Discard, out)
	if err := cmd.Wait(); err != nil || back.IsZero() {
		b.Fatalf("%s: %v; killed %v, back %v\n%s", cmd.Args[0], err, killed, back, log.String())
	}
	return back.Sub(killed)
}
