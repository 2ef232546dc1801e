package trainertest_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/ckpt/layout"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/taskd/trainertest"
)

// running starts tr's loop and returns a func that stops it and waits.
func running(t *testing.T, tr *trainertest.Trainer) func() {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- tr.Run(ctx) }()
	stop := func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	}
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		default:
		}
	})
	return stop
}

func waitStep(t *testing.T, tr *trainertest.Trainer, step int64) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for tr.Step() < step {
		if time.Now().After(deadline) {
			t.Fatalf("step %d not reached; at %d", step, tr.Step())
		}
		time.Sleep(time.Millisecond)
	}
}

// The trainer is in-memory and its steps are timers: the tests run in a
// synctest bubble, where a pause that must hold for some steps' time is
// held for exactly that time, at once.

func TestPauseStopsTheLoop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var mu sync.Mutex
		var saved []int64
		tr := trainertest.New(trainertest.Config{StepTime: 2 * time.Millisecond, SaveEvery: 3, Save: func(_ context.Context, step int64) error {
			mu.Lock()
			defer mu.Unlock()
			saved = append(saved, step)
			return nil
		}})
		stop := running(t, tr)
		ctx := context.Background()
		time.Sleep(10 * 2 * time.Millisecond) // ten steps' time
		if tr.Step() != -1 || tr.Running() {
			t.Fatalf("a new trainer stepped: %d", tr.Step())
		}
		if err := tr.Resume(ctx, taskd.ResumeRequest{Step: -1}); err != nil {
			t.Fatal(err)
		}
		waitStep(t, tr, 7)
		paused, err := tr.Pause(ctx)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * 2 * time.Millisecond)
		if got := tr.Step(); got != paused {
			t.Fatalf("paused after step %d, now at %d", paused, got)
		}
		if again, _ := tr.Pause(ctx); again != paused {
			t.Fatalf("a second pause: %d", again)
		}
		tr.Resume(ctx, taskd.ResumeRequest{Step: -1})
		waitStep(t, tr, paused+3)
		if err := tr.Stop(ctx, "done"); err != nil {
			t.Fatal(err)
		}
		stop()
		mu.Lock()
		defer mu.Unlock()
		for i, s := range saved {
			if s != int64(3*i) {
				t.Fatalf("saved %v", saved)
			}
		}
	})
}

func TestHangAndFailNext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		tr := trainertest.New(trainertest.Config{StepTime: time.Millisecond})
		stop := running(t, tr)
		ctx := context.Background()
		tr.Resume(ctx, taskd.ResumeRequest{Step: -1})
		waitStep(t, tr, 2)
		tr.Hang()
		short, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
		defer cancel()
		if _, err := tr.Pause(short); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("pause of a hung trainer: %v", err)
		}
		tr.Unhang()
		if _, err := tr.Pause(ctx); err != nil {
			t.Fatal(err)
		}
		nic := errors.New("NIC down")
		tr.FailNext("SwitchLink", nic)
		l := taskd.LinkRequest{Node: 0, Devices: []int{1, 2}, Target: taskd.LinkStandby}
		if err := tr.SwitchLink(ctx, l); !errors.Is(err, nic) {
			t.Fatalf("switch: %v", err)
		}
		if err := tr.SwitchLink(ctx, l); err != nil || len(tr.Links()) != 2 {
			t.Fatalf("switch again: %v %v", err, tr.Links())
		}
		l.Target = taskd.LinkPrimary
		tr.SwitchLink(ctx, l)
		if len(tr.Links()) != 0 {
			t.Fatalf("after switchback: %v", tr.Links())
		}
		if err := tr.RetryStep(ctx); err != nil || tr.Retries() != 1 {
			t.Fatalf("retry: %v", err)
		}
		s, _ := tr.Strategies(ctx, taskd.FaultNotice{})
		if !slices.Equal(s, taskd.AllStrategies()) {
			t.Fatalf("strategies %v", s)
		}
		if err := tr.Resume(ctx, taskd.ResumeRequest{Step: 5}); !errors.Is(err, taskd.ErrUnsupported) {
			t.Fatalf("resume from step 5 without a Load: %v", err)
		}
		tr.Stop(ctx, "done")
		stop()
	})
}

func TestCkptState(t *testing.T) {
	dir := t.TempDir()
	shm := filepath.Join(dir, "shm")
	if err := os.Mkdir(shm, 0o755); err != nil {
		t.Fatal(err)
	}
	o, err := ckpt.NewOwner(ckpt.OwnerConfig{ShmDir: shm, Shards: []int{0}, Capacity: layout.StepSize([]string{"state"}, []int64{64}), Dir: filepath.Join(dir, "disk"), PollInterval: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); o.Run(ctx) }()
	defer func() { cancel(); <-done; o.Close() }()
	w, err := ckpt.NewWriter(ckpt.WriterConfig{Path: o.SegmentPath(0)})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	st := &trainertest.CkptState{Writer: w, Path: o.SegmentPath(0), Dir: filepath.Join(dir, "disk"), Shard: 0, PersistEvery: 2}
	if step, err := st.Load(ctx, -1); err != nil || step != -1 {
		t.Fatalf("empty: %d %v", step, err)
	}
	for s := int64(0); s <= 40; s += 10 {
		if err := st.Save(ctx, s); err != nil {
			t.Fatalf("save %d: %v", s, err)
		}
		if s%20 != 10 {
			continue
		}
		// Every second save asks for a persist, which the owner takes up at
		// its next poll; a later save over that half before then would
		// replace the step (a save never waits for a persist).
		deadline := time.Now().Add(20 * time.Second)
		for {
			if _, err := ckpt.LoadDiskStep(filepath.Join(dir, "disk"), s, 0); err == nil {
				break
			} else if time.Now().After(deadline) {
				t.Fatalf("step %d never reached the disk: %v", s, err)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	for _, tc := range []struct{ ask, want int64 }{{-1, 40}, {40, 40}, {30, 30}} {
		if got, err := st.Load(ctx, tc.ask); err != nil || got != tc.want {
			t.Errorf("load %d: %d %v", tc.ask, got, err)
		}
	}
	if got, err := st.Load(ctx, 10); err != nil || got != 10 { // only on disk now
		t.Fatalf("load 10 from disk: %d %v", got, err)
	}
	if _, err := st.Load(ctx, 20); !errors.Is(err, ckpt.ErrNoStep) {
		t.Fatalf("load a step never persisted: %v", err)
	}
}
