package main

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/taskd"
)

func TestCallbacksUnregistered(t *testing.T) {
	c := newCallbacks()
	if _, err := c.call(context.Background(), eventPause, "{}"); !errors.Is(err, taskd.ErrUnsupported) {
		t.Errorf("pause without a callback: %v, want taskd.ErrUnsupported", err)
	}
	if err := c.set(0, nil); !errors.Is(err, errBadArgument) {
		t.Errorf("event 0: %v", err)
	}
	if err := c.set(numEvents, nil); !errors.Is(err, errBadArgument) {
		t.Errorf("event %d: %v", numEvents, err)
	}
	if c.anyRecovery() {
		t.Error("recovery callbacks without any registered")
	}
	c.set(eventProfilingSwitch, func(string) (string, error) { return "", nil })
	if c.anyRecovery() {
		t.Error("the profiling-switch callback counted as recovery")
	}
	c.set(eventStop, func(string) (string, error) { return "", nil })
	if !c.anyRecovery() {
		t.Error("a stop callback is not recovery")
	}
}

// TestCallbackDeadline checks that a call returns at its context's end
// while the callback, which cannot be interrupted, runs on, and that the
// next call of the event waits for it.
func TestCallbackDeadline(t *testing.T) {
	c := newCallbacks()
	release := make(chan struct{})
	entered := make(chan struct{}, 2)
	c.set(eventPause, func(string) (string, error) {
		entered <- struct{}{}
		<-release
		return `{"step":3}`, nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := c.call(ctx, eventPause, "{}")
		errc <- err
	}()
	<-entered
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("call after its context ended: %v", err)
	}
	// A second call waits for the first callback to finish.
	ctx2, cancel2 := context.WithCancel(context.Background())
	go func() {
		_, err := c.call(ctx2, eventPause, "{}")
		errc <- err
	}()
	cancel2()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("second call while the first runs: %v", err)
	}
	close(release)
	out, err := c.call(context.Background(), eventPause, "{}")
	if err != nil || out != `{"step":3}` {
		t.Errorf("third call: %q, %v", out, err)
	}
}

func TestTrainerAdapter(t *testing.T) {
	c := newCallbacks()
	tr := trainer{cbs: c}
	var args []string
	record := func(reply string, err error) callback {
		return func(arg string) (string, error) {
			args = append(args, arg)
			return reply, err
		}
	}
	c.set(eventPause, record(`{"step":41}`, nil))
	c.set(eventResume, record("", nil))
	c.set(eventStop, record("", nil))
	c.set(eventSwitchLink, record("", errors.New("link down")))
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()

	if step, err := tr.Pause(ctx); err != nil || step != 41 {
		t.Errorf("pause: %d, %v", step, err)
	}
	if err := tr.Resume(context.Background(), taskd.ResumeRequest{Step: 7, Strategy: taskd.StrategyRecover, Restarted: []int{2}}); err != nil {
		t.Error(err)
	}
	if err := tr.Stop(context.Background(), "bye"); err != nil {
		t.Error(err)
	}
	if err := tr.SwitchLink(context.Background(), taskd.LinkRequest{Node: 1, Devices: []int{0}, Target: taskd.LinkStandby}); err == nil || err.Error() != "link down" {
		t.Errorf("switch link: %v", err)
	}
	if err := tr.RetryStep(context.Background()); !errors.Is(err, taskd.ErrUnsupported) {
		t.Errorf("retry without a callback: %v", err)
	}
	if err := tr.StressTest(context.Background(), taskd.StressRequest{Ranks: []int{1}, Test: "hbm"}); !errors.Is(err, taskd.ErrUnsupported) {
		t.Errorf("stress test without a callback: %v", err)
	}
	// The pause's argument carries the time left; the others the request.
	var pause map[string]int64
	if err := json.Unmarshal([]byte(args[0]), &pause); err != nil || pause["timeout_ms"] < 3500e3 {
		t.Errorf("pause argument %q", args[0])
	}
	want := []string{
		`{"restarted":[2],"step":7,"strategy":"recover"}`,
		`{"reason":"bye"}`,
		`{"devices":[0],"node":1,"target":"standby"}`,
	}
	if !slices.Equal(args[1:], want) {
		t.Errorf("arguments %q, want %q", args[1:], want)
	}
	// Without a strategies callback, what the registered ones allow.
	got, err := tr.Strategies(context.Background(), taskd.FaultNotice{})
	if w := []taskd.Strategy{taskd.StrategyRecoverInPlace, taskd.StrategyRecover, taskd.StrategyDump, taskd.StrategyExit}; err != nil || !slices.Equal(got, w) {
		t.Errorf("default strategies %v, %v; want %v", got, err, w)
	}
	c.set(eventStrategies, record(`["retry","exit"]`, nil))
	got, err = tr.Strategies(context.Background(), taskd.FaultNotice{Faults: []taskd.Fault{{Kind: taskd.FaultHang}}})
	if err != nil || !slices.Equal(got, []taskd.Strategy{taskd.StrategyRetry, taskd.StrategyExit}) {
		t.Errorf("strategies %v, %v", got, err)
	}
	c.set(eventStrategies, record(`"retry"`, nil))
	if _, err := tr.Strategies(context.Background(), taskd.FaultNotice{}); err == nil {
		t.Error("a reply that is not an array was taken")
	}
	c.set(eventPause, record(`{"step":"x"}`, nil))
	if _, err := tr.Pause(context.Background()); err == nil {
		t.Error("a bad pause reply was taken")
	}
	c.set(eventPause, record("", nil))
	if step, err := tr.Pause(context.Background()); err != nil || step != -1 {
		t.Errorf("pause without a reply: %d, %v", step, err)
	}
}
