package taskd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// callTrainerRecorder is a Trainer, with every optional interface, that
// records its calls.
type callTrainerRecorder struct {
	mu    sync.Mutex
	calls []string
	fail  map[string]error
}

func (r *callTrainerRecorder) record(call string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, call)
	return r.fail[call]
}

func (r *callTrainerRecorder) Calls() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.calls)
}

func (r *callTrainerRecorder) Pause(context.Context) (int64, error) { return 41, r.record("pause") }
func (r *callTrainerRecorder) Resume(_ context.Context, q ResumeRequest) error {
	call := fmt.Sprintf("resume %d %s %v", q.Step, q.Strategy, q.Restarted)
	if q.Released {
		call += " released"
	}
	return r.record(call)
}
func (r *callTrainerRecorder) Strategies(_ context.Context, n FaultNotice) ([]Strategy, error) {
	return AllStrategies(), r.record(fmt.Sprintf("strategies %v", n.Ranks()))
}
func (r *callTrainerRecorder) RetryStep(context.Context) error { return r.record("retry") }
func (r *callTrainerRecorder) SwitchLink(_ context.Context, l LinkRequest) error {
	return r.record(fmt.Sprintf("switch %d %v %s", l.Node, l.Devices, l.Target))
}
func (r *callTrainerRecorder) StressTest(_ context.Context, s StressRequest) error {
	return r.record("stress " + s.Test)
}
func (r *callTrainerRecorder) Stop(_ context.Context, reason string) error {
	return r.record("stop " + reason)
}

// The worker starts its trainer once registered and hands it the
// orchestration messages, answering with the trainer's replies.
func TestWorkerTrainer(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{})
	tr := &callTrainerRecorder{fail: map[string]error{"stress hbm": fmt.Errorf("hbm: %w", ErrUnsupported)}}
	w, err := NewWorker(WorkerConfig{Job: c.job, Node: 0, Rank: 3, Upstream: c.m.Addr().String(), Security: c.sec, AckTimeout: c.ack, Trainer: tr})
	if err != nil {
		t.Fatal(err)
	}
	c.run(w, w.Run)
	testkit.WaitFor(t, "the trainer started", func() bool { return slices.Contains(tr.Calls(), "resume -1  []") })
	ctx := context.Background()
	send := func(kind string, msg orchMsg) Delivery {
		t.Helper()
		ds, err := c.m.Broadcast(ctx, RankList(3), kind, mustJSON(t, msg))
		if err != nil || len(ds) != 1 {
			t.Fatalf("%s: %v %v", kind, ds, err)
		}
		return ds[0]
	}
	d := send(kindPause, orchMsg{TimeoutMS: 1000})
	rep, err := parseReply(d.reply)
	if d.Err != nil || err != nil || rep.Step == nil || *rep.Step != 41 {
		t.Fatalf("pause: %+v %v %+v", d, err, rep)
	}
	d = send(kindNotice, orchMsg{Notice: &FaultNotice{Faults: []Fault{{Kind: FaultOpError, Position: Position{0, 3}}}}})
	rep, _ = parseReply(d.reply)
	if d.Err != nil || !slices.Equal(rep.Strategies, AllStrategies()) {
		t.Fatalf("notice: %+v %+v", d, rep)
	}
	send(kindRetry, orchMsg{})
	send(kindSwitch, orchMsg{Link: &LinkRequest{Node: 0, Devices: []int{0, 1}, Target: LinkStandby}})
	if d := send(kindStress, orchMsg{Stress: &StressRequest{Ranks: []int{3}, Test: "hbm"}}); d.Err == nil {
		t.Fatal("stress test: no error")
	}
	send(kindResume, orchMsg{Resume: &ResumeRequest{Step: 7, Strategy: StrategyRecoverInPlace, Restarted: []int{1}}})
	send(kindStop, orchMsg{Reason: "bye"})
	want := []string{"resume -1  []", "pause", "strategies [3]", "retry", "switch 0 [0 1] standby", "stress hbm", "resume 7 recover-in-place [1]", "stop bye"}
	if got := tr.Calls(); !slices.Equal(got, want) {
		t.Fatalf("calls:\n got %q\nwant %q", got, want)
	}
	// A worker without a trainer refuses orchestration messages.
	plain := c.addWorker(0, 4)
	testkit.WaitFor(t, "rank 4", func() bool { return plain.Connected() })
	ds, _ := c.m.Broadcast(ctx, RankList(4), kindPause, nil)
	var de *DeliveryError
	if len(ds) != 1 || !errors.As(ds[0].Err, &de) {
		t.Fatalf("pause without a trainer: %+v", ds)
	}
}

func mustJSON(t testing.TB, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// exitingTrainer is a process that exits once stopped: its Stop returns
// only after the worker is being closed, and reports the exit on the way.
type exitingTrainer struct {
	callTrainerRecorder
	w       *Worker
	stopped chan struct{}
}

func (e *exitingTrainer) Stop(_ context.Context, reason string) error {
	close(e.stopped)
	<-e.w.closed
	return e.w.ReportFault(Fault{Kind: FaultProcessExit, Message: "exiting: " + reason})
}

// Close lets the trainer's Stop end and then sends its acknowledgement and
// the fault reported with it: the manager does not wait out its deadline
// for a trainer that exits right after stopping.
func TestWorkerCloseSendsWhatIsQueued(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{DeliveryTimeout: 20 * time.Second})
	tr := &exitingTrainer{stopped: make(chan struct{})}
	w, err := NewWorker(WorkerConfig{Job: c.job, Node: 0, Rank: 3, Upstream: c.m.Addr().String(), Security: c.sec, AckTimeout: c.ack, Trainer: tr})
	if err != nil {
		t.Fatal(err)
	}
	tr.w = w
	c.run(w, w.Run)
	testkit.WaitFor(t, "the trainer started", func() bool { return slices.Contains(tr.Calls(), "resume -1  []") })
	go func() {
		<-tr.stopped
		w.Close()
	}()
	ds, err := c.m.Broadcast(context.Background(), RankList(3), kindStop, mustJSON(t, orchMsg{Reason: "done"}))
	if err != nil || len(ds) != 1 || ds[0].Err != nil {
		t.Fatalf("stop: %+v %v", ds, err)
	}
	// The fault travels beside the acknowledgement, which may be taken in
	// first: wait for the manager to log it.
	testkit.WaitFor(t, "the stopping worker's fault in the manager's log", func() bool { return len(c.m.Faults(0)) > 0 })
	if fs := c.m.Faults(0); len(fs) != 1 || fs[0].Message != "exiting: done" {
		t.Fatalf("faults: %+v", fs)
	}
}
