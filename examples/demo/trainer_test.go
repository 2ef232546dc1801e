package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/ckpt/layout"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/trace"
)

// errFirst stops a rank's Read at its first record.
var errFirst = errors.New("first record")

// TestWorkerDotsItsFirstStep runs a rank as the demo does, under a manager
// whose profiling switch is on before the rank registers: the worker
// starts its trainer as soon as it registers and the switch comes down
// the stream that opens after, yet the rank's dotting begins with the
// start of step 1.
func TestWorkerDotsItsFirstStep(t *testing.T) {
	dir := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))

	m, err := taskd.NewManager(taskd.ManagerConfig{Job: jobID, Listen: "127.0.0.1:0", Nodes: 1, ProcsPerNode: 1,
		Security: taskd.Security{Insecure: true}, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() { m.Run(ctx) })
	if _, err := m.SetSwitch(trace.AllOn()); err != nil {
		t.Fatal(err)
	}
	fab, err := newFabric()
	if err != nil {
		t.Fatal(err)
	}
	defer fab.Close()
	shm := filepath.Join(dir, "shm")
	if err := os.Mkdir(shm, 0o700); err != nil {
		t.Fatal(err)
	}
	owner, err := ckpt.NewOwner(ckpt.OwnerConfig{ShmDir: shm, Name: "ckpt", Shards: []int{0},
		Capacity: layout.StepSize([]string{"model"}, []int64{modelBytes}), Dir: filepath.Join(dir, "ckpt"),
		Committer: &ckpt.LocalCommitter{Dir: filepath.Join(dir, "ckpt")}, Workers: 1, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer owner.Remove()
	wg.Go(func() { owner.Run(ctx) })

	a := childArgs{Job: jobID, Host: "127.0.0.1", Upstream: m.Addr().String(), World: 1, ProcsPerNode: 1,
		Fabric: fab.Addr(), DottingRoot: filepath.Join(dir, "profiling"), StackDir: filepath.Join(dir, "stacks"),
		Segment: owner.SegmentPath(0), CkptDir: filepath.Join(dir, "ckpt"), StepTime: 10 * time.Millisecond,
		HangTimeout: time.Minute, SaveEvery: 1000, PersistEvery: 1, SwitchTime: time.Millisecond, PauseGrace: time.Second}
	wctx, stop := context.WithCancel(ctx)
	twoSteps := make(chan struct{})
	var once sync.Once
	say := func(format string, args ...any) {
		if format == "step %d" && args[0] == int64(2) {
			once.Do(func() { close(twoSteps) })
		}
	}
	done := make(chan error, 1)
	go func() { done <- runWorker(wctx, a, log, say) }()
	select {
	case <-twoSteps:
	case err := <-done:
		t.Fatalf("the worker ended before its second step: %v", err)
	}
	stop()
	if err := <-done; err != nil {
		t.Fatalf("worker: %v", err)
	}

	rd, err := trace.OpenRankReader(filepath.Join(a.DottingRoot, jobID, strconv.Itoa(a.Rank)), trace.ReaderConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Close()
	var first trace.Record
	if err := rd.Read(func(r *trace.Record) error { first = *r; return errFirst }); !errors.Is(err, errFirst) {
		t.Fatalf("no record: %v", err)
	}
	if first.Name != trace.StepMarkerPrefix+"1" || !first.Flag.IsStart() {
		t.Errorf("the rank's dotting begins with %q (flag %d), want the start of %q", first.Name, first.Flag, trace.StepMarkerPrefix+"1")
	}
}
