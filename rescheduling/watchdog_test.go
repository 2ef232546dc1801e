package rescheduling

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// recorder is an Executor that records calls and fails as told. It
// stands for the real executors (tested in their own packages) so that
// the watchdog's own logic is tested alone.
type recorder struct {
	mu     sync.Mutex
	calls  []string
	events []string           // "start " or "end " and the call, in order
	fail   map[string][]error // by method: errors returned in turn
	block  chan struct{}      // if set, RestartProcesses waits on it
}

func (r *recorder) do(ctx context.Context, method string, d Decision) error {
	call := fmt.Sprintf("%s #%d %s/%s/%s", method, d.ID, d.Node, d.Pod, d.Process)
	defer func() {
		r.mu.Lock()
		r.events = append(r.events, "end "+call)
		r.mu.Unlock()
	}()
	r.mu.Lock()
	r.calls = append(r.calls, call)
	r.events = append(r.events, "start "+call)
	var err error
	if errs := r.fail[method]; len(errs) > 0 {
		err, r.fail[method] = errs[0], errs[1:]
	}
	block := r.block
	r.mu.Unlock()
	if block != nil && method == "RestartProcesses" {
		select {
		case <-block:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return err
}

func (r *recorder) RestartProcesses(ctx context.Context, d Decision) error {
	return r.do(ctx, "RestartProcesses", d)
}
func (r *recorder) RecreatePods(ctx context.Context, d Decision) error {
	return r.do(ctx, "RecreatePods", d)
}
func (r *recorder) RestartJob(ctx context.Context, d Decision) error {
	return r.do(ctx, "RestartJob", d)
}
func (r *recorder) AvoidNode(ctx context.Context, d Decision) error {
	return r.do(ctx, "AvoidNode", d)
}

func (r *recorder) Calls() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.calls...)
}

func (r *recorder) Events() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.events...)
}

// harness runs a watchdog over a real-time policy and collects outcomes.
type harness struct {
	faults   chan Fault
	outcomes chan Outcome
	w        *Watchdog
	policy   *Policy
	done     chan error
}

func startWatchdog(t *testing.T, pcfg Config, wcfg WatchdogConfig) *harness {
	t.Helper()
	if pcfg.Backoff.Initial == 0 {
		pcfg.Backoff.Initial = time.Millisecond
	}
	p, err := NewPolicy(pcfg)
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{faults: make(chan Fault, 100), outcomes: make(chan Outcome, 100), policy: p, done: make(chan error, 1)}
	wcfg.Policy, wcfg.Faults = p, h.faults
	wcfg.OnOutcome = func(o Outcome) { h.outcomes <- o }
	if wcfg.RetryBackoff.Initial == 0 {
		wcfg.RetryBackoff.Initial = time.Millisecond
	}
	h.w, err = NewWatchdog(wcfg)
	if err != nil {
		t.Fatal(err)
	}
	go func() { h.done <- h.w.Run(context.Background()) }()
	t.Cleanup(func() { h.w.Close() })
	return h
}

func (h *harness) next(t *testing.T) Outcome {
	t.Helper()
	select {
	case o := <-h.outcomes:
		return o
	case err := <-h.done:
		h.done <- err // for wait
		select {
		case o := <-h.outcomes: // reported before Run returned
			return o
		default:
		}
		t.Fatalf("Run returned %v while an outcome was awaited", err)
	case <-time.After(30 * time.Second):
		t.Fatal("no outcome within 30 s")
	}
	return Outcome{}
}

func (h *harness) wait(t *testing.T) error {
	t.Helper()
	select {
	case err := <-h.done:
		return err
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return within 30 s")
	}
	return nil
}

func TestWatchdogRestarts(t *testing.T) {
	ex := &recorder{}
	reg := prometheus.NewRegistry()
	h := startWatchdog(t, Config{}, WatchdogConfig{Executor: ex, Registerer: reg})
	at := time.Now()
	h.faults <- Fault{Kind: KindExit, ExitCode: 9, Node: "n1", Pod: "p1", Process: "0", Time: at}
	o := h.next(t)
	if o.Result != ResultOK || o.Decision.Action != RestartProcesses || o.Err != nil {
		t.Fatalf("outcome %+v", o)
	}
	if o.Recovery <= 0 || o.Recovery != o.Finished.Sub(at) || o.Started.After(o.Finished) {
		t.Errorf("recovery %v, started %v, finished %v", o.Recovery, o.Started, o.Finished)
	}
	h.faults <- Fault{Kind: KindNode, Node: "n2", Reason: "NotReady", Time: time.Now()}
	o = h.next(t)
	if o.Result != ResultOK || o.Decision.Action != RecreatePods {
		t.Fatalf("outcome %+v", o)
	}
	close(h.faults)
	if err := h.wait(t); err != nil {
		t.Fatalf("Run = %v after Faults closed", err)
	}
	want := []string{"RestartProcesses #1 n1/p1/0", "AvoidNode #2 n2//", "RecreatePods #2 n2//"}
	if diff := cmp.Diff(want, ex.Calls()); diff != "" {
		t.Errorf("calls (-want +got):\n%s", diff)
	}
	m := gather(t, reg)
	if m[`faultline_rescheduling_executions_total{action="restart_processes",result="ok"}`] != 1 ||
		m[`faultline_rescheduling_recovery_seconds{action="recreate_pods"}`] != 1 {
		t.Errorf("metrics %v", m)
	}
}

// TestWatchdogEscalatesUnsupported: an executor that cannot restart
// processes in place gets the pod-level decision at once, not retried.
func TestWatchdogEscalatesUnsupported(t *testing.T) {
	ex := &recorder{fail: map[string][]error{"RestartProcesses": {fmt.Errorf("k8s: %w", ErrUnsupported)}}}
	h := startWatchdog(t, Config{}, WatchdogConfig{Executor: ex})
	h.faults <- Fault{Kind: KindExit, ExitCode: 1, Node: "n1", Pod: "p1", Process: "0", Time: time.Now()}
	o1, o2 := h.next(t), h.next(t)
	if o1.Result != ResultFailed || !errors.Is(o1.Err, ErrUnsupported) {
		t.Errorf("first outcome %+v", o1)
	}
	if o2.Result != ResultOK || o2.Decision.Action != RecreatePods || o2.Decision.Supersedes != o1.Decision.ID {
		t.Errorf("second outcome %+v", o2)
	}
	want := []string{"RestartProcesses #1 n1/p1/0", "RecreatePods #2 n1/p1/"}
	if diff := cmp.Diff(want, ex.Calls()); diff != "" {
		t.Errorf("calls (-want +got):\n%s", diff)
	}
}

// TestWatchdogRetriesTransientErrors: a transient error is retried with
// backoff; a pod that no longer exists is recorded, not escalated.
func TestWatchdogRetriesTransientErrors(t *testing.T) {
	transient := errors.New("connection refused")
	gone := fmt.Errorf("pod p9: %w", ErrTargetGone)
	ex := &recorder{fail: map[string][]error{"RecreatePods": {transient, transient, nil, gone}}}
	h := startWatchdog(t, Config{}, WatchdogConfig{Executor: ex, Retries: 3})
	h.faults <- Fault{Kind: KindExit, ExitCode: 247, Node: "n1", Pod: "p1", Time: time.Now()}
	if o := h.next(t); o.Result != ResultOK {
		t.Fatalf("outcome %+v", o)
	}
	h.faults <- Fault{Kind: KindExit, ExitCode: 247, Node: "n9", Pod: "p9", Time: time.Now()}
	if o := h.next(t); o.Result != ResultGone || !errors.Is(o.Err, ErrTargetGone) {
		t.Fatalf("outcome %+v", o)
	}
	close(h.faults)
	if err := h.wait(t); err != nil {
		t.Fatal(err)
	}
	if n := len(ex.Calls()); n != 4 {
		t.Errorf("%d calls, want 4: %v", n, ex.Calls())
	}
}

// TestWatchdogGivesUp: when every level fails, Run returns ErrGaveUp.
func TestWatchdogGivesUp(t *testing.T) {
	boom := errors.New("boom")
	ex := &recorder{fail: map[string][]error{
		"RestartProcesses": {boom, boom},
		"RecreatePods":     {boom, boom},
		"RestartJob":       {boom, boom},
	}}
	h := startWatchdog(t, Config{}, WatchdogConfig{Executor: ex, Retries: 1})
	h.faults <- Fault{Kind: KindExit, ExitCode: 9, Node: "n1", Pod: "p1", Process: "0", Time: time.Now()}
	var results []string
	for range 4 {
		o := h.next(t)
		results = append(results, o.Decision.Action.String()+" "+o.Result)
	}
	want := []string{"restart_processes failed", "recreate_pods failed", "restart_job failed", "give_up gave_up"}
	if diff := cmp.Diff(want, results); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	if err := h.wait(t); !errors.Is(err, ErrGaveUp) || !strings.Contains(err.Error(), "give up") {
		t.Errorf("Run = %v, want ErrGaveUp", err)
	}
}

// TestWatchdogSupersedes: a node fault arriving while a process restart
// on that node waits out its backoff replaces it.
func TestWatchdogSupersedes(t *testing.T) {
	ex := &recorder{}
	h := startWatchdog(t, Config{Backoff: Backoff{Initial: time.Hour, Jitter: -1}}, WatchdogConfig{Executor: ex})
	now := time.Now()
	// A first restart, then a recurrence that must back off for an hour.
	h.faults <- Fault{Kind: KindExit, ExitCode: 9, Node: "n1", Pod: "p1", Process: "0", Time: now}
	if o := h.next(t); o.Result != ResultOK {
		t.Fatalf("outcome %+v", o)
	}
	h.faults <- Fault{Kind: KindExit, ExitCode: 9, Node: "n1", Pod: "p1", Process: "0", Time: time.Now()}
	h.faults <- Fault{Kind: KindNode, Node: "n1", Reason: "NotReady", Time: time.Now()}
	o1, o2 := h.next(t), h.next(t)
	if o1.Decision.ID > o2.Decision.ID {
		o1, o2 = o2, o1
	}
	if o1.Result != ResultSuperseded || o1.Decision.Action != RecreatePods || o1.Decision.Backoff != time.Hour {
		t.Errorf("superseded outcome %+v", o1)
	}
	if o2.Result != ResultOK || o2.Decision.AvoidNode != "n1" {
		t.Errorf("superseding outcome %+v", o2)
	}
}

// TestWatchdogSerialisesANode: a second decision for a node waits for the
// first to finish; Close cancels what is in progress. It runs in a bubble,
// so that "every goroutine is blocked" is exact: the recreation has waited
// out its backoff and can only be waiting for the node.
func TestWatchdogSerialisesANode(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ex := &recorder{block: make(chan struct{})}
		h := startWatchdog(t, Config{}, WatchdogConfig{Executor: ex})
		h.faults <- Fault{Kind: KindExit, ExitCode: 9, Node: "n1", Pod: "p1", Process: "0", Time: time.Now()}
		h.faults <- Fault{Kind: KindExit, ExitCode: 9, Node: "n2", Pod: "p2", Process: "0", Time: time.Now()}
		synctest.Wait()
		if calls := ex.Calls(); len(calls) != 2 {
			t.Fatalf("calls %v, want both restarts blocked in the executor", calls)
		}
		h.faults <- Fault{Kind: KindExit, ExitCode: 247, Node: "n1", Pod: "p1", Time: time.Now()}
		time.Sleep(time.Hour) // past any backoff: only the node can hold the recreation back
		synctest.Wait()
		if slices.ContainsFunc(ex.Events(), func(e string) bool { return strings.HasPrefix(e, "start RecreatePods") }) {
			t.Fatalf("n1's recreation started while its restart ran: %v", ex.Events())
		}
		var m dto.Metric
		if h.w.m.inFlight.Write(&m); m.GetGauge().GetValue() != 3 {
			t.Fatalf("%v executions in flight, want 3: the recreation waits", m.GetGauge().GetValue())
		}
		close(ex.block)
		var got []string
		for range 3 {
			o := h.next(t)
			got = append(got, o.Decision.Node+" "+o.Decision.Action.String()+" "+o.Result)
		}
		// n1's recreation started only after n1's restart ended.
		events := ex.Events()
		restartEnd := slices.Index(events, "end RestartProcesses #1 n1/p1/0")
		recreate := slices.Index(events, "start RecreatePods #3 n1/p1/")
		if restartEnd < 0 || recreate < restartEnd {
			t.Errorf("events %v, outcomes %v: want #3 to start after #1 ended", events, got)
		}
		h.w.Close()
		if err := h.wait(t); err != nil {
			t.Errorf("Run after Close = %v", err)
		}
	})
}

// TestWatchdogCancel: canceling Run's context cancels a blocked execution.
func TestWatchdogCancel(t *testing.T) { synctest.Test(t, testWatchdogCancel) }

func testWatchdogCancel(t *testing.T) {
	ex := &recorder{block: make(chan struct{})}
	p, err := NewPolicy(Config{})
	if err != nil {
		t.Fatal(err)
	}
	faults := make(chan Fault, 1)
	outcomes := make(chan Outcome, 10)
	w, err := NewWatchdog(WatchdogConfig{Policy: p, Executor: ex, Faults: faults, OnOutcome: func(o Outcome) { outcomes <- o }})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	faults <- Fault{Kind: KindExit, ExitCode: 9, Node: "n1", Time: time.Now()}
	synctest.Wait()
	if calls := ex.Calls(); len(calls) != 1 {
		t.Fatalf("calls %v, want the restart blocked in the executor", calls)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("Run = %v", err)
	}
	if o := <-outcomes; o.Result != ResultCanceled {
		t.Errorf("outcome %+v", o)
	}
	if err := w.Run(context.Background()); err == nil {
		t.Error("second Run succeeded")
	}
	w.Close()
	w.Close()
}

func TestWatchdogConfigValidate(t *testing.T) {
	p, _ := NewPolicy(Config{})
	ex := &recorder{}
	ch := make(chan Fault)
	tests := []struct {
		cfg   WatchdogConfig
		field string
	}{
		{WatchdogConfig{Executor: ex, Faults: ch}, "Policy"},
		{WatchdogConfig{Policy: p, Faults: ch}, "Executor"},
		{WatchdogConfig{Policy: p, Executor: ex}, "Faults"},
		{WatchdogConfig{Policy: p, Executor: ex, Faults: ch, Parallel: -1}, "Parallel"},
		{WatchdogConfig{Policy: p, Executor: ex, Faults: ch, RetryBackoff: Backoff{Initial: -1}}, "RetryBackoff.Initial"},
		{WatchdogConfig{Policy: p, Executor: ex, Faults: ch, RetryBackoff: Backoff{Jitter: 2}}, "RetryBackoff.Jitter"},
	}
	for _, tt := range tests {
		if _, err := NewWatchdog(tt.cfg); err == nil || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("NewWatchdog: %v, want an error naming %s", err, tt.field)
		}
	}
}
