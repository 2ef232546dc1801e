package taskd

import (
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// The payloads of orchestration messages round-trip to what the trainer
// is called with.
func TestOrchMessageRoundTrip(t *testing.T) {
	ctx := context.Background()
	link := LinkRequest{Node: 2, Devices: []int{0, 3}, Target: LinkStandby, Ranks: []int{16, 17}}
	stress := StressRequest{Nodes: []int{1}, Test: "hbm"}
	resume := ResumeRequest{Step: 120, Strategy: StrategyRecover, Restarted: []int{3, 9}}
	for _, tc := range []struct {
		kind string
		msg  orchMsg
		want string
	}{
		{kindPause, orchMsg{TimeoutMS: 5}, "pause"},
		{kindNotice, orchMsg{Notice: &FaultNotice{Faults: []Fault{{Kind: FaultHang, Position: Position{1, 9}}, {Kind: FaultLost, Position: Position{0, 2}}}}}, "strategies [2 9]"},
		{kindRetry, orchMsg{}, "retry"},
		{kindResume, orchMsg{Resume: &resume}, "resume 120 recover [3 9]"},
		{kindResume, orchMsg{Resume: &ResumeRequest{Step: -1, Released: true}}, "resume -1  [] released"},
		{kindSwitch, orchMsg{Link: &link}, "switch 2 [0 3] standby"},
		{kindStress, orchMsg{Stress: &stress}, "stress hbm"},
		{kindStop, orchMsg{Reason: "budget spent"}, "stop budget spent"},
	} {
		b, err := json.Marshal(tc.msg)
		if err != nil {
			t.Fatal(err)
		}
		tr := &callTrainerRecorder{}
		reply, err := callTrainer(ctx, tr, tc.kind, b)
		if err != nil {
			t.Fatalf("%s: %v", tc.kind, err)
		}
		if got := tr.Calls(); len(got) != 1 || got[0] != tc.want {
			t.Errorf("%s: calls %q, want %q", tc.kind, got, tc.want)
		}
		rep, err := parseReply(reply)
		if err != nil {
			t.Fatalf("%s: reply %q: %v", tc.kind, reply, err)
		}
		again, _ := json.Marshal(rep)
		if rep2, err := parseReply(again); err != nil || !cmp.Equal(rep, rep2) {
			t.Errorf("%s: reply does not round-trip: %+v %+v %v", tc.kind, rep, rep2, err)
		}
	}
	if _, err := callTrainer(ctx, &callTrainerRecorder{}, kindSwitch, []byte(`{}`)); err == nil {
		t.Error("a switch without a link")
	}
	if _, err := callTrainer(ctx, &callTrainerRecorder{}, orchPrefix+"dance", nil); err == nil {
		t.Error("an unknown kind")
	}
}

// minimalTrainer implements Trainer and none of the optional interfaces.
type minimalTrainer struct{}

func (minimalTrainer) Pause(context.Context) (int64, error)        { return 7, nil }
func (minimalTrainer) Resume(context.Context, ResumeRequest) error { return nil }
func (minimalTrainer) Stop(context.Context, string) error          { return nil }

// retryingTrainer adds StepRetrier to minimalTrainer.
type retryingTrainer struct{ minimalTrainer }

func (retryingTrainer) RetryStep(context.Context) error { return nil }

// A trainer without an optional interface supports every strategy that
// its methods can carry out, and refuses the calls it lacks with
// ErrUnsupported.
func TestOptionalTrainerInterfaces(t *testing.T) {
	ctx := context.Background()
	notice := mustJSON(t, orchMsg{Notice: &FaultNotice{}})
	for _, tc := range []struct {
		tr   Trainer
		want []Strategy
	}{
		{minimalTrainer{}, []Strategy{StrategyRecoverInPlace, StrategyRecover, StrategyDump, StrategyExit}},
		{retryingTrainer{}, AllStrategies()},
	} {
		reply, err := callTrainer(ctx, tc.tr, kindNotice, notice)
		if err != nil {
			t.Fatalf("%T: notice: %v", tc.tr, err)
		}
		rep, err := parseReply(reply)
		if err != nil || !cmp.Equal(rep.Strategies, tc.want) {
			t.Errorf("%T: strategies %v (%v), want %v", tc.tr, rep.Strategies, err, tc.want)
		}
	}
	for kind, payload := range map[string]orchMsg{
		kindRetry:  {},
		kindSwitch: {Link: &LinkRequest{Node: 0, Devices: []int{0}, Target: LinkStandby}},
		kindStress: {Stress: &StressRequest{Nodes: []int{0}, Test: "hbm"}},
	} {
		if _, err := callTrainer(ctx, minimalTrainer{}, kind, mustJSON(t, payload)); !errors.Is(err, ErrUnsupported) {
			t.Errorf("%s on a trainer without it: %v, want ErrUnsupported", kind, err)
		}
	}
	if _, err := callTrainer(ctx, retryingTrainer{}, kindRetry, nil); err != nil {
		t.Errorf("retry on a StepRetrier: %v", err)
	}
}

// FuzzOrchMessage feeds arbitrary payloads to a worker's trainer and
// arbitrary replies to the manager: an error, never a panic.
func FuzzOrchMessage(f *testing.F) {
	f.Add(kindPause, []byte(`{"timeout_ms":5}`), []byte(`{"step":41}`))
	f.Add(kindResume, []byte(`{"resume":{"step":7,"strategy":"retry","restarted":[1,2]}}`), []byte(`{}`))
	f.Add(kindResume, []byte(`{"resume":{"step":-1,"released":true}}`), []byte(`{}`))
	f.Add(kindNotice, []byte(`{"notice":{"faults":[{"kind":"hang","position":{"Node":0,"Rank":3}}]}}`), []byte(`{"strategies":["retry","exit"]}`))
	f.Add(kindSwitch, []byte(`{"link":{"node":1,"devices":[0],"target":"standby"}}`), []byte(``))
	f.Add(kindStress, []byte(`{"stress":null}`), []byte(`null`))
	f.Add(kindStop, []byte(`{"timeout_ms":-1,"reason":"x"}`), []byte(`{"step":"x"}`))
	f.Fuzz(func(t *testing.T, kind string, payload, reply []byte) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		callTrainer(ctx, &callTrainerRecorder{}, kind, payload)
		parseReply(reply)
	})
}
