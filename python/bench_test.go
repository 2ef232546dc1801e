package python_test

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/agent"
	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/trace"
)

// runBench runs a Python benchmark script once and decodes its JSON line.
func runBench(b *testing.B, py string, env []string, out any, args ...string) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, py, args...)
	cmd.Env = env
	cmd.Stderr = os.Stderr
	stdout, err := cmd.Output()
	if err != nil {
		b.Fatalf("%v: %v", args, err)
	}
	if err := json.Unmarshal(stdout, out); err != nil {
		b.Fatalf("%v: %v: %s", args, err, stdout)
	}
}

// shmDir is a folder in /dev/shm, where rings and segments live, removed
// when b ends; elsewhere, a temporary folder.
func shmDir(b *testing.B) string {
	dir, err := os.MkdirTemp("/dev/shm", "faultline-bench-")
	if err != nil {
		return b.TempDir()
	}
	b.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// BenchmarkSpan times `with faultline.span("forward"): pass` in Python
// with the ring's switch on (drained here, as the agent does) and off,
// beside a time.perf_counter_ns() pair measured in the same rounds, and
// the floor of a span written in Python (x-pair-floor), and of one that
// writes its records (x-pair-floor-write).
// Targets: x-pair-on <= 8, x-pair-off <= 3.
func BenchmarkSpan(b *testing.B) {
	py := requirePython(b, false)
	pkg := extracted(b)
	dir := shmDir(b)
	on, err := agent.CreateRing(filepath.Join(dir, "on"), 16<<20)
	if err != nil {
		b.Fatal(err)
	}
	defer on.Close()
	on.SetSwitch(trace.AllOn())
	off, err := agent.CreateRing(filepath.Join(dir, "off"), agent.RingMinCapacity)
	if err != nil {
		b.Fatal(err)
	}
	defer off.Close()

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // the agent's drain
		defer wg.Done()
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				on.Drain(func(*agent.RingRecord) {})
			}
		}
	}()
	defer func() { cancel(); wg.Wait() }()

	var r struct{ Pair, On, Off, Floor, FloorWrite float64 }
	for b.Loop() {
		runBench(b, py, pyEnv(pkg), &r, "testdata/bench_span.py", on.Path(), off.Path())
	}
	b.ReportMetric(r.Pair, "ns/pair")
	b.ReportMetric(r.On, "ns/span-on")
	b.ReportMetric(r.Off, "ns/span-off")
	b.ReportMetric(r.On/r.Pair, "x-pair-on")
	b.ReportMetric(r.Off/r.Pair, "x-pair-off")
	// The floor of any span written in Python: the call of span(), the
	// with statement's two calls and the two clock reads.
	b.ReportMetric(r.Floor/r.Pair, "x-pair-floor")
	// And of one that also writes the range's records: the same and one
	// pack of them, into a buffer of its own.
	b.ReportMetric(r.FloorWrite/r.Pair, "x-pair-floor-write")
	if on.Dropped() != 0 {
		b.Fatalf("%d records dropped: the figures would flatter the producer", on.Dropped())
	}
}

// BenchmarkCheckpoint saves and loads a state_dict of
// FAULTLINE_PY_BENCH_MIB MiB (default 64) in float32 tensors of
// FAULTLINE_PY_BENCH_TENSOR_KIB KiB each (default 16384: a few large ones;
// 4 gives many small ones) through a real ckpt.Owner, beside
// tensor.copy_ of the same bytes into and out of preallocated shared-memory
// tensors and torch.save to a file, all measured in the same run.
// Targets (1024 MiB): x-copy-save >= 0.9, x-torchsave >= 10,
// x-copy-load >= 0.8 (x-prealloc-load-into: a load into the tensors of a
// state of the same shape, beside the copy into preallocated tensors). A
// save with blocking=False blocks for
// save-async-blocking-s (x-torchsave-async: torch.save over that) while
// its copy goes on in a thread (x-copy-save-async: the copy over the whole
// of such a save, its end included).
//
// Nothing seals the saves here and the stand-in agent answers load without
// reading the blobs, so that save-s and load-s are the rank's own work:
// sealing and verifying are the agent's, off the rank's path.
func BenchmarkCheckpoint(b *testing.B) {
	py := requirePython(b, true)
	mib := 64
	if s := os.Getenv("FAULTLINE_PY_BENCH_MIB"); s != "" {
		var err error
		if mib, err = strconv.Atoi(s); err != nil || mib <= 0 {
			b.Fatalf("FAULTLINE_PY_BENCH_MIB=%q: want a positive number of MiB", s)
		}
	}
	kib := 16 << 10
	if s := os.Getenv("FAULTLINE_PY_BENCH_TENSOR_KIB"); s != "" {
		var err error
		if kib, err = strconv.Atoi(s); err != nil || kib <= 0 {
			b.Fatalf("FAULTLINE_PY_BENCH_TENSOR_KIB=%q: want a positive number of KiB", s)
		}
	}
	pkg := extracted(b)
	shm := shmDir(b)
	disk := b.TempDir()
	owner, err := ckpt.NewOwner(ckpt.OwnerConfig{ShmDir: shm, Name: "bench", Shards: []int{0},
		Capacity: int64(mib+mib/8+1) << 20, Dir: disk}) // the rank asks for 1/16 more than it needs
	if err != nil {
		b.Fatal(err)
	}
	defer owner.Remove()
	a := startAgent(b, owner, disk, false)
	a.quickLoad = true

	var r struct {
		Bytes            int64
		Save, Copy, Load float64
		TorchSave        float64 `json:"torch_save"`
		TorchSaveFsync   float64 `json:"torch_save_fsync"`
		CopyBack         float64 `json:"copy_back"`
		CopyBackPrealloc float64 `json:"copy_back_prealloc"`
		LoadInto         float64 `json:"load_into"`
		SaveAsync        float64 `json:"save_async"`
		SaveAsyncTotal   float64 `json:"save_async_total"`
	}
	for b.Loop() {
		runBench(b, py, pyEnv(pkg, "FAULTLINE_AGENT="+a.sock), &r, "testdata/bench_ckpt.py", strconv.Itoa(mib), shm, disk, strconv.Itoa(kib))
	}
	b.ReportMetric(float64(r.Bytes)/(1<<20), "MiB")
	b.ReportMetric(r.Save, "save-s")
	b.ReportMetric(r.Copy, "copy-s")
	b.ReportMetric(r.Copy/r.Save, "x-copy-save")
	b.ReportMetric(r.TorchSave, "torchsave-s")
	b.ReportMetric(r.TorchSave/r.Save, "x-torchsave")
	b.ReportMetric(r.SaveAsync, "save-async-blocking-s")
	b.ReportMetric(r.TorchSave/r.SaveAsync, "x-torchsave-async")
	b.ReportMetric(r.Copy/r.SaveAsyncTotal, "x-copy-save-async")
	b.ReportMetric(r.TorchSaveFsync/r.Save, "x-torchsave-fsync")
	b.ReportMetric(r.Load, "load-s")
	b.ReportMetric(r.CopyBack, "copyback-s")
	b.ReportMetric(r.CopyBack/r.Load, "x-copy-load")
	b.ReportMetric(r.CopyBackPrealloc/r.Load, "x-prealloc-load")
	b.ReportMetric(r.CopyBackPrealloc/r.LoadInto, "x-prealloc-load-into")
}
