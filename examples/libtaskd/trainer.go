package main

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/faultline-ml/faultline/taskd"
)

// trainer is the taskd.Trainer of a process whose training loop lives in C
// or Python: each call runs the callback registered for its event with
// the request as JSON, and reads the reply back.
type trainer struct {
	cbs  *callbacks
	stop *stopTrack // nil: not tracked
}

// stopTrack lets closing the worker wait for a Stop call in progress: a
// trainer typically exits as soon as its stop callback has stopped the
// loop, before the call returns, and the call's acknowledgement is sent
// by taskd.Worker.Close only once the call has ended.
type stopTrack struct {
	call chan struct{} // held during a Stop call
}

func newStopTrack() *stopTrack { return &stopTrack{call: make(chan struct{}, 1)} }

// wait waits up to within for a Stop call in progress.
func (s *stopTrack) wait(within time.Duration) {
	timer := time.NewTimer(within)
	defer timer.Stop()
	select {
	case s.call <- struct{}{}:
		<-s.call
	case <-timer.C:
	}
}

// trainer implements every optional interface of taskd.Trainer: whether it
// can carry a call out depends on the callbacks registered at the time.
var (
	_ taskd.Trainer        = trainer{}
	_ taskd.StrategyLister = trainer{}
	_ taskd.StepRetrier    = trainer{}
	_ taskd.LinkSwitcher   = trainer{}
	_ taskd.StressTester   = trainer{}
)

// argument returns req as a JSON object with "timeout_ms" added, the
// milliseconds left before ctx's deadline, so that a callback that waits
// knows how long it may.
func argument(ctx context.Context, req any) (string, error) {
	obj := map[string]json.RawMessage{}
	if req != nil {
		b, err := json.Marshal(req)
		if err != nil {
			return "", err
		}
		if err := json.Unmarshal(b, &obj); err != nil {
			return "", err
		}
	}
	if d, ok := ctx.Deadline(); ok {
		ms := max(time.Until(d).Milliseconds(), 0)
		obj["timeout_ms"] = json.RawMessage(fmt.Sprint(ms))
	}
	b, err := json.Marshal(obj)
	return string(b), err
}

// run calls e's callback with req and returns its reply.
func (t trainer) run(ctx context.Context, e event, req any) (string, error) {
	arg, err := argument(ctx, req)
	if err != nil {
		return "", err
	}
	return t.cbs.call(ctx, e, arg)
}

// Pause runs the pause callback; its reply {"step": n} gives the last step
// completed, and an empty reply means -1.
func (t trainer) Pause(ctx context.Context) (int64, error) {
	out, err := t.run(ctx, eventPause, nil)
	if err != nil || out == "" {
		return -1, err
	}
	var r struct {
		Step *int64 `json:"step"`
	}
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		return -1, fmt.Errorf("pause callback reply %q: %w", out, err)
	}
	if r.Step == nil {
		return -1, nil
	}
	return *r.Step, nil
}

// Resume runs the resume callback with r.
func (t trainer) Resume(ctx context.Context, r taskd.ResumeRequest) error {
	_, err := t.run(ctx, eventResume, r)
	return err
}

// Strategies runs the strategies callback with n; its reply is a JSON
// array of strategy names. Without a callback, the strategies that the
// registered callbacks can carry out: retry with a retry_step callback,
// recover-in-place and recover with a resume callback (the healthy ranks
// load the agreed checkpoint), dump and exit with a stop callback.
func (t trainer) Strategies(ctx context.Context, n taskd.FaultNotice) ([]taskd.Strategy, error) {
	if !t.cbs.registered(eventStrategies) {
		var s []taskd.Strategy
		if t.cbs.registered(eventRetryStep) {
			s = append(s, taskd.StrategyRetry)
		}
		if t.cbs.registered(eventResume) {
			s = append(s, taskd.StrategyRecoverInPlace, taskd.StrategyRecover)
		}
		if t.cbs.registered(eventStop) {
			s = append(s, taskd.StrategyDump, taskd.StrategyExit)
		}
		return s, nil
	}
	out, err := t.run(ctx, eventStrategies, n)
	if err != nil {
		return nil, err
	}
	var s []taskd.Strategy
	if err := json.Unmarshal([]byte(out), &s); err != nil {
		return nil, fmt.Errorf("strategies callback reply %q: want a JSON array of strategy names: %w", out, err)
	}
	return s, nil
}

// RetryStep runs the retry_step callback.
func (t trainer) RetryStep(ctx context.Context) error {
	_, err := t.run(ctx, eventRetryStep, nil)
	return err
}

// SwitchLink runs the switch_link callback with l.
func (t trainer) SwitchLink(ctx context.Context, l taskd.LinkRequest) error {
	_, err := t.run(ctx, eventSwitchLink, l)
	return err
}

// StressTest runs the stress_test callback with s.
func (t trainer) StressTest(ctx context.Context, s taskd.StressRequest) error {
	_, err := t.run(ctx, eventStressTest, s)
	return err
}

// Stop runs the stop callback with {"reason": reason}.
func (t trainer) Stop(ctx context.Context, reason string) error {
	if t.stop != nil {
		t.stop.call <- struct{}{}
		defer func() { <-t.stop.call }()
	}
	_, err := t.run(ctx, eventStop, struct {
		Reason string `json:"reason"`
	}{reason})
	return err
}
