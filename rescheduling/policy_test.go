package rescheduling

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

func newTestPolicy(t testing.TB, clk *fakeClock, cfg Config) *Policy {
	t.Helper()
	cfg.Now = clk.Now
	if cfg.Backoff.Jitter == 0 {
		cfg.Backoff.Jitter = -1 // exact waits
	}
	p, err := NewPolicy(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func exitFault(node, pod, proc string, code int, at time.Time) Fault {
	return Fault{Kind: KindExit, Node: node, Pod: pod, Process: proc, ExitCode: code, Time: at}
}

// summary is what the table tests compare of a decision.
type summary struct {
	Action              Action
	Node, Pod, Process  string
	AvoidNode           string
	Attempt, Budget     int
	Backoff             time.Duration
	Covered, Supersedes uint64
}

func sum(d Decision) summary {
	return summary{d.Action, d.Node, d.Pod, d.Process, d.AvoidNode, d.Attempt, d.Budget, d.Backoff, d.Covered, d.Supersedes}
}

func TestFirstDecisionPerClass(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name string
		f    Fault
		want summary
	}{
		{"killed: in place, uncounted", Fault{Kind: KindExit, ExitCode: 137, Node: "n1", Pod: "p1", Process: "3"},
			summary{Action: RestartProcesses, Node: "n1", Pod: "p1", Process: "3"}},
		{"oom: recreate the pod", Fault{Kind: KindExit, ExitCode: 247, Node: "n1", Pod: "p1", Process: "3"},
			summary{Action: RecreatePods, Node: "n1", Pod: "p1", Attempt: 1, Budget: 3}},
		{"fatal: in place, counted", Fault{Kind: KindExit, ExitCode: 1, Node: "n1", Pod: "p1", Process: "3"},
			summary{Action: RestartProcesses, Node: "n1", Pod: "p1", Process: "3", Attempt: 1, Budget: DefaultMaxRestarts}},
		{"hardware: every pod of the node elsewhere", Fault{Kind: KindExit, ExitCode: 201, Node: "n1", Pod: "p1", Process: "3"},
			summary{Action: RecreatePods, Node: "n1", AvoidNode: "n1", Attempt: 1, Budget: 3}},
		{"unknown exit code: in place", Fault{Kind: KindExit, ExitCode: 77, Node: "n1", Pod: "p1", Process: "3"},
			summary{Action: RestartProcesses, Node: "n1", Pod: "p1", Process: "3", Attempt: 1, Budget: DefaultMaxRestarts}},
		{"hang: in place", Fault{Kind: KindHang, Node: "n1", Pod: "p1", Process: "3"},
			summary{Action: RestartProcesses, Node: "n1", Pod: "p1", Process: "3", Attempt: 1, Budget: DefaultMaxRestarts}},
		{"slow node: move off it", Fault{Kind: KindSlow, Node: "n1"},
			summary{Action: RecreatePods, Node: "n1", AvoidNode: "n1", Attempt: 1, Budget: 3}},
		{"lost heartbeat: move off the node", Fault{Kind: KindHeartbeat, Node: "n1", Pod: "p1"},
			summary{Action: RecreatePods, Node: "n1", AvoidNode: "n1", Attempt: 1, Budget: 3}},
		{"node NotReady", Fault{Kind: KindNode, Node: "n1", Reason: "NotReady"},
			summary{Action: RecreatePods, Node: "n1", AvoidNode: "n1", Attempt: 1, Budget: 3}},
		{"log pattern oom", Fault{Kind: KindLog, Class: ClassOOM, Pod: "p1"},
			summary{Action: RecreatePods, Pod: "p1", Attempt: 1, Budget: 3}},
		{"membership: every process, uncounted", Fault{Kind: KindMembership},
			summary{Action: RestartProcesses}},
		{"exit 0: nothing", Fault{Kind: KindExit, ExitCode: 0, Node: "n1"},
			summary{Action: NoAction}},
		{"zero fault: the job's processes", Fault{},
			summary{Action: RestartProcesses, Attempt: 1, Budget: DefaultMaxRestarts}},
		{"oom without node or pod: the job", Fault{Kind: KindExit, ExitCode: 247, Process: "3"},
			summary{Action: RestartJob, Attempt: 1, Budget: 3}},
	}
	for _, tt := range tests {
		p := newTestPolicy(t, newClock(), Config{})
		d := p.Decide(ctx, tt.f)
		if diff := cmp.Diff(tt.want, sum(d)); diff != "" {
			t.Errorf("%s: decision (-want +got):\n%s\nreason: %s", tt.name, diff, d.Reason)
		}
		if d.Reason == "" || d.ID != 1 {
			t.Errorf("%s: reason %q, id %d", tt.name, d.Reason, d.ID)
		}
	}
}

// TestEscalationBySpentBudgets: faults far apart (no recurrence) walk up
// the levels only as budgets run out, then the policy gives up for good.
func TestEscalationBySpentBudgets(t *testing.T) {
	ctx := context.Background()
	clk := newClock()
	p := newTestPolicy(t, clk, Config{MaxRestarts: 2, PodRestarts: 2, JobRestarts: 1})
	var got []string
	for range 8 {
		now := clk.Advance(time.Hour)
		d := p.Decide(ctx, exitFault("n1", "p1", "0", 9, now))
		got = append(got, fmt.Sprintf("%s %d/%d", d.Action, d.Attempt, d.Budget))
	}
	want := []string{
		"restart_processes 1/2", "restart_processes 2/2",
		"recreate_pods 1/2", "recreate_pods 2/2",
		"restart_job 1/1",
		"give_up 0/0",
		"none 0/0", "none 0/0",
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("actions (-want +got):\n%s", diff)
	}
	// Another node is given up too: the job is over.
	if d := p.Decide(ctx, exitFault("n2", "p2", "0", 9, clk.Advance(time.Hour))); d.Action != NoAction || d.Covered != 6 {
		t.Errorf("after give up: %+v", sum(d))
	}
}

// TestBudgetsAreSeparate: each process and each pod has its own budget;
// the job's is shared.
func TestBudgetsAreSeparate(t *testing.T) {
	ctx := context.Background()
	clk := newClock()
	p := newTestPolicy(t, clk, Config{MaxRestarts: 1})
	for _, proc := range []string{"0", "1", "2"} {
		d := p.Decide(ctx, exitFault("n1", "p1", proc, 9, clk.Advance(time.Hour)))
		if d.Action != RestartProcesses || d.Attempt != 1 {
			t.Errorf("process %s: %+v", proc, sum(d))
		}
	}
	d := p.Decide(ctx, exitFault("n1", "p1", "0", 9, clk.Advance(time.Hour)))
	if d.Action != RecreatePods || !strings.Contains(strings.Join(d.Evidence, " "), "budget_spent=restart_processes 1/1") {
		t.Errorf("spent process budget: %+v %v", sum(d), d.Evidence)
	}
}

func TestFatalGivesUpWhenProcessBudgetSpent(t *testing.T) {
	ctx := context.Background()
	clk := newClock()
	p := newTestPolicy(t, clk, Config{MaxRestarts: 2})
	var got []Action
	for range 3 {
		got = append(got, p.Decide(ctx, exitFault("n1", "p1", "0", 1, clk.Advance(time.Hour))).Action)
	}
	if diff := cmp.Diff([]Action{RestartProcesses, RestartProcesses, GiveUp}, got); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
}

// TestKilledIsNotCounted: exit code 137 consumes no budget, even a spent
// one; membership changes neither.
func TestKilledIsNotCounted(t *testing.T) {
	ctx := context.Background()
	clk := newClock()
	p := newTestPolicy(t, clk, Config{MaxRestarts: -1, PodRestarts: -1, JobRestarts: -1})
	for i := range 5 {
		d := p.Decide(ctx, exitFault("n1", "p1", "0", 137, clk.Advance(time.Hour)))
		if d.Action != RestartProcesses || d.Attempt != 0 || !strings.Contains(d.Reason, "not counted") {
			t.Fatalf("killed #%d: %+v %s", i, sum(d), d.Reason)
		}
		clk.Advance(time.Hour)
		if d := p.Decide(ctx, Round{Number: i + 1, Nodes: []string{"n1"}}.Fault()); d.Action != RestartProcesses || d.Attempt != 0 {
			t.Fatalf("membership #%d: %+v", i, sum(d))
		}
	}
	// Spent budgets: a counted fault has nowhere to go.
	if d := p.Decide(ctx, exitFault("n1", "p1", "0", 9, clk.Advance(time.Hour))); d.Action != GiveUp {
		t.Errorf("counted fault with no budget: %+v", sum(d))
	}
}

// TestMembershipKeepsBudgets: membership restarts leave the budgets whole.
func TestMembershipKeepsBudgets(t *testing.T) {
	ctx := context.Background()
	clk := newClock()
	p := newTestPolicy(t, clk, Config{JobRestarts: 1})
	for i := range 10 {
		p.Decide(ctx, Round{Number: i + 1}.Fault())
		clk.Advance(time.Hour)
	}
	d := p.Decide(ctx, Fault{Kind: KindExit, ExitCode: 9, Time: clk.Now()})
	if d.Action != RestartProcesses || d.Attempt != 1 {
		t.Errorf("after membership changes: %+v", sum(d))
	}
}

// TestRecurrenceEscalates: a fault soon after a restart means the restart
// failed: the next decision goes one level up (to the rule's Last) and
// backs off exponentially.
func TestRecurrenceEscalates(t *testing.T) {
	ctx := context.Background()
	clk := newClock()
	p := newTestPolicy(t, clk, Config{JobRestarts: 10, PodRestarts: 10})
	var got []string
	for range 6 {
		d := p.Decide(ctx, exitFault("n1", "p1", "0", 9, clk.Now()))
		if d.Backoff > 0 {
			clk.Advance(d.Backoff)
		}
		p.Executing(d, clk.Now())
		got = append(got, fmt.Sprintf("%s %v", d.Action, d.Backoff))
		clk.Advance(10 * time.Second) // recurs within FailWindow
	}
	want := []string{
		"restart_processes 0s",
		"recreate_pods 1s",
		"restart_job 2s",
		"restart_job 4s",
		"restart_job 8s",
		"restart_job 16s",
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	// After a quiet period the fault starts afresh at the first level,
	// without backoff.
	clk.Advance(2 * DefaultFailWindow)
	if d := p.Decide(ctx, exitFault("n1", "p1", "0", 9, clk.Now())); d.Action != RestartProcesses || d.Backoff != 0 {
		t.Errorf("after a quiet period: %+v", sum(d))
	}
}

// TestRecurrenceStopsAtLast: a fatal error recurring stays in place.
func TestRecurrenceStopsAtLast(t *testing.T) {
	ctx := context.Background()
	clk := newClock()
	p := newTestPolicy(t, clk, Config{})
	for i := range 5 {
		d := p.Decide(ctx, exitFault("n1", "p1", "0", 1, clk.Now()))
		if d.Action != RestartProcesses || d.Attempt != i+1 {
			t.Fatalf("#%d: %+v", i, sum(d))
		}
		p.Executing(d, clk.Advance(d.Backoff))
		clk.Advance(time.Second)
	}
}

func TestRecurrenceOff(t *testing.T) {
	ctx := context.Background()
	clk := newClock()
	p := newTestPolicy(t, clk, Config{FailWindow: -1})
	for i := range 5 {
		d := p.Decide(ctx, exitFault("n1", "p1", "0", 9, clk.Now()))
		if d.Action != RestartProcesses || d.Backoff != 0 {
			t.Fatalf("#%d: %+v", i, sum(d))
		}
		p.Executing(d, clk.Now())
		clk.Advance(time.Second)
	}
}

func TestBackoffJitterBounds(t *testing.T) {
	ctx := context.Background()
	clk := newClock()
	p := newTestPolicy(t, clk, Config{Backoff: Backoff{Initial: time.Second, Jitter: 0.5, Max: 4 * time.Second}, JobRestarts: 100})
	base := []time.Duration{0, time.Second, 2 * time.Second, 4 * time.Second, 4 * time.Second, 4 * time.Second}
	for i, b := range base {
		d := p.Decide(ctx, exitFault("n1", "p1", "0", 9, clk.Now()))
		lo, hi := b/2, b*3/2
		if d.Backoff < lo || d.Backoff > hi {
			t.Errorf("#%d: backoff %v, want %v..%v", i, d.Backoff, lo, hi)
		}
		p.Executing(d, clk.Advance(d.Backoff))
		clk.Advance(time.Second)
	}
}

// TestStormOneDecisionPerNode: a storm of faults from one node's pod
// within the dedupe window gets one decision; other nodes get theirs.
func TestStormOneDecisionPerNode(t *testing.T) {
	ctx := context.Background()
	clk := newClock()
	p := newTestPolicy(t, clk, Config{})
	t0 := clk.Now()
	decided := map[string]int{}
	for i := range 300 {
		node := fmt.Sprintf("n%d", i%3)
		f := exitFault(node, "pod-"+node, fmt.Sprint(i%8), []int{9, 1, 137, 139}[i%4], t0.Add(time.Duration(i)*10*time.Millisecond))
		if i%5 == 0 {
			f = Fault{Kind: KindHang, Node: node, Pod: "pod-" + node, Time: f.Time}
		}
		clk.Advance(5 * time.Millisecond)
		d := p.Decide(ctx, f)
		if d.Action != NoAction {
			decided[node]++
		} else if d.Covered == 0 {
			t.Fatalf("fault %d not covered: %+v", i, sum(d))
		}
	}
	if diff := cmp.Diff(map[string]int{"n0": 1, "n1": 1, "n2": 1}, decided); diff != "" {
		t.Errorf("decisions per node (-want +got):\n%s", diff)
	}
}

// TestConflictingFaults: a fault that needs more than the decision for
// its event supersedes it; one that needs less is covered.
func TestConflictingFaults(t *testing.T) {
	ctx := context.Background()
	clk := newClock()
	p := newTestPolicy(t, clk, Config{})
	t0 := clk.Now()
	d1 := p.Decide(ctx, exitFault("n1", "p1", "0", 9, t0))
	d2 := p.Decide(ctx, Fault{Kind: KindNode, Node: "n1", Reason: "NotReady", Time: t0.Add(time.Second)})
	d3 := p.Decide(ctx, exitFault("n1", "p1", "5", 1, t0.Add(2*time.Second)))
	d4 := p.Decide(ctx, Fault{Kind: KindExit, ExitCode: 247, Node: "n1", Pod: "p1", Time: t0.Add(3 * time.Second)})
	d5 := p.Decide(ctx, Fault{Kind: KindHeartbeat, Node: "n1", Time: t0.Add(4 * time.Second)})
	got := []summary{sum(d1), sum(d2), sum(d3), sum(d4), sum(d5)}
	want := []summary{
		{Action: RestartProcesses, Node: "n1", Pod: "p1", Process: "0", Attempt: 1, Budget: DefaultMaxRestarts},
		{Action: RecreatePods, Node: "n1", AvoidNode: "n1", Attempt: 1, Budget: 3},
		{Action: NoAction, Covered: 2},
		{Action: NoAction, Covered: 2},
		{Action: NoAction, Covered: 2},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	if got := p.Suspects(); !cmp.Equal(got, []string{"n1"}) {
		t.Errorf("suspects %v", got)
	}
	// A job restart covers every node.
	d6 := p.Decide(ctx, exitFault("n1", "p1", "0", 9, clk.Advance(time.Hour)))
	p.Escalate(ctx, d6, errors.New("boom"))                                                             // recreate_pods
	j := p.Escalate(ctx, Decision{ID: 99, Action: RecreatePods, Fault: d6.Fault, Class: d6.Class}, nil) // restart_job
	if j.Action != RestartJob {
		t.Fatalf("escalated twice: %+v", sum(j))
	}
	for _, n := range []string{"n2", "n3"} {
		if d := p.Decide(ctx, Fault{Kind: KindNode, Node: n, Time: clk.Now()}); d.Action != NoAction || d.Covered != j.ID {
			t.Errorf("%s during a job restart: %+v", n, sum(d))
		}
	}
}

// TestSupersedesPendingDecision: a stronger decision for the same scope
// says which pending one it replaces.
func TestSupersedesPendingDecision(t *testing.T) {
	ctx := context.Background()
	clk := newClock()
	p := newTestPolicy(t, clk, Config{})
	t0 := clk.Now()
	d1 := p.Decide(ctx, exitFault("n1", "p1", "0", 9, t0))
	d2 := p.Decide(ctx, Fault{Kind: KindExit, ExitCode: 247, Node: "n1", Pod: "p1", Time: t0.Add(time.Second)})
	if d2.Action != RecreatePods || d2.Supersedes != d1.ID {
		t.Errorf("d2 %+v", sum(d2))
	}
}

// TestDuplicatesAndNewEvents: once a decision's execution has started, a
// fault that happened before it is covered, one after it is a new event
// (here a recurrence); a fault without a time within the window is
// covered.
func TestDuplicatesAndNewEvents(t *testing.T) {
	ctx := context.Background()
	clk := newClock()
	p := newTestPolicy(t, clk, Config{})
	t0 := clk.Now()
	d1 := p.Decide(ctx, exitFault("n1", "p1", "0", 9, t0))
	start := clk.Advance(100 * time.Millisecond)
	p.Executing(d1, start)
	clk.Advance(time.Second)
	late := p.Decide(ctx, exitFault("n1", "p1", "3", 9, t0.Add(50*time.Millisecond)))
	untimed := p.Decide(ctx, Fault{Kind: KindExit, ExitCode: 9, Node: "n1", Pod: "p1", Process: "4"})
	fresh := p.Decide(ctx, exitFault("n1", "p1", "0", 9, start.Add(time.Millisecond)))
	got := []summary{sum(late), sum(untimed), sum(fresh)}
	want := []summary{
		{Action: NoAction, Covered: 1},
		{Action: NoAction, Covered: 1},
		{Action: RecreatePods, Node: "n1", Pod: "p1", Attempt: 1, Budget: 3, Backoff: time.Second},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
}

// TestCrashLoopIsNotSwallowed: a process that crashes at once after each
// restart gets a decision every time.
func TestCrashLoopIsNotSwallowed(t *testing.T) {
	ctx := context.Background()
	clk := newClock()
	p := newTestPolicy(t, clk, Config{Rules: map[Class]Rule{ClassUnknown: {First: RestartProcesses, Last: RestartProcesses}}})
	for i := range 20 {
		d := p.Decide(ctx, exitFault("n1", "p1", "0", 9, clk.Now()))
		if d.Action != RestartProcesses {
			t.Fatalf("#%d: %+v", i, sum(d))
		}
		p.Executing(d, clk.Advance(d.Backoff))
		clk.Advance(time.Millisecond)
	}
}

func TestEscalate(t *testing.T) {
	ctx := context.Background()
	clk := newClock()
	p := newTestPolicy(t, clk, Config{})
	d := p.Decide(ctx, exitFault("n1", "p1", "0", 1, clk.Now())) // fatal: Last is restart_processes
	e := p.Escalate(ctx, d, fmt.Errorf("executor: %w", ErrUnsupported))
	if e.Action != RecreatePods || e.Supersedes != d.ID || e.Pod != "p1" {
		t.Fatalf("escalated: %+v", sum(e))
	}
	if ev := strings.Join(e.Evidence, " "); !strings.Contains(ev, "escalated_from=#1") || !strings.Contains(ev, "not supported") {
		t.Errorf("evidence %q", ev)
	}
	e2 := p.Escalate(ctx, e, errors.New("api down"))
	e3 := p.Escalate(ctx, e2, errors.New("api down"))
	if e2.Action != RestartJob || e3.Action != GiveUp {
		t.Errorf("e2 %s, e3 %s", e2.Action, e3.Action)
	}
	if e4 := p.Escalate(ctx, e2, nil); e4.Action != NoAction || e4.Covered != e3.ID {
		t.Errorf("after give up: %+v", sum(e4))
	}
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		cfg   Config
		field string
	}{
		{Config{Rules: map[Class]Rule{ClassOOM: {First: NoAction, Last: RestartJob}}}, "Rules[oom].First"},
		{Config{Rules: map[Class]Rule{ClassOOM: {First: RestartJob, Last: RecreatePods}}}, "Rules[oom].Last"},
		{Config{Rules: map[Class]Rule{ClassOOM: {First: RestartProcesses, Last: GiveUp}}}, "Rules[oom].Last"},
		{Config{Rules: map[Class]Rule{ClassNone: {First: RestartProcesses, Last: RestartJob}}}, "Rules has a rule for class none"},
		{Config{Rules: map[Class]Rule{Unclassified: {First: RestartProcesses, Last: RestartJob}}}, "class unclassified"},
		{Config{Backoff: Backoff{Initial: -1}}, "Backoff.Initial"},
		{Config{Backoff: Backoff{Max: -1}}, "Backoff.Max"},
		{Config{Backoff: Backoff{Initial: time.Minute, Max: time.Second}}, "Backoff.Max"},
		{Config{Backoff: Backoff{Multiplier: 0.5}}, "Backoff.Multiplier"},
		{Config{Backoff: Backoff{Jitter: 1}}, "Backoff.Jitter"},
		{Config{DedupeWindow: -time.Second}, "DedupeWindow"},
	}
	for _, tt := range tests {
		err := tt.cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("Validate(%+v) = %v, want an error naming %s", tt.cfg, err, tt.field)
		}
		if _, err := NewPolicy(tt.cfg); err == nil {
			t.Errorf("NewPolicy(%+v) succeeded", tt.cfg)
		}
	}
	if err := (Config{}).Validate(); err != nil {
		t.Errorf("zero config: %v", err)
	}
}

// TestObservability: a decision is logged, counted and traced.
func TestObservability(t *testing.T) {
	var logs bytes.Buffer
	reg := prometheus.NewRegistry()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())
	clk := newClock()
	p := newTestPolicy(t, clk, Config{
		Logger:         slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		Registerer:     reg,
		TracerProvider: tp,
	})
	ctx := context.Background()
	p.Decide(ctx, Fault{Kind: KindNode, Node: "n7", Reason: "NotReady", Time: clk.Now()})
	p.Decide(ctx, Fault{Kind: KindHeartbeat, Node: "n7", Time: clk.Now()}) // covered

	for _, want := range []string{`"action":"recreate_pods"`, `"avoid_node":"n7"`, `"reason":"node fault \"NotReady\" [node]: recreate every pod of the job on node n7, keeping the job off node n7 (attempt 1 of 3)"`, `"covered":1`} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("log lacks %s:\n%s", want, logs.String())
		}
	}
	metrics := gather(t, reg)
	for name, want := range map[string]float64{
		`faultline_rescheduling_decisions_total{action="recreate_pods"}`: 1,
		`faultline_rescheduling_decisions_total{action="none"}`:          1,
		`faultline_rescheduling_faults_total{class="node"}`:              1,
		`faultline_rescheduling_faults_total{class="heartbeat"}`:         1,
		`faultline_rescheduling_faults_deduplicated_total`:               1,
		`faultline_rescheduling_suspect_nodes`:                           1,
	} {
		if metrics[name] != want {
			t.Errorf("%s = %v, want %v", name, metrics[name], want)
		}
	}
	spans := rec.Ended()
	if len(spans) != 2 || spans[0].Name() != "rescheduling.Decide" {
		t.Fatalf("spans: %v", spans)
	}
	attrs := map[string]string{}
	for _, kv := range spans[0].Attributes() {
		attrs[string(kv.Key)] = kv.Value.Emit()
	}
	if attrs["rescheduling.action"] != "recreate_pods" || attrs["rescheduling.avoid_node"] != "n7" {
		t.Errorf("span attributes %v", attrs)
	}
}

// escalated reports whether d's evidence shows it moved past its rule's
// first action.
func escalated(d Decision) bool {
	for _, e := range d.Evidence {
		for _, k := range []string{"recurred=", "budget_spent=", "no_pod=", "escalated_from="} {
			if strings.HasPrefix(e, k) {
				return true
			}
		}
	}
	return false
}

// gather returns the registry's samples by name{labels}.
func gather(t testing.TB, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			name := mf.GetName()
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			if len(labels) > 0 {
				name += "{" + strings.Join(labels, ",") + "}"
			}
			switch {
			case m.Counter != nil:
				out[name] = m.GetCounter().GetValue()
			case m.Gauge != nil:
				out[name] = m.GetGauge().GetValue()
			case m.Histogram != nil:
				out[name] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return out
}

// TestPolicyRandomWalk drives the policy with random faults, times,
// executions and escalations (fixed seeds) and checks its invariants:
// no budget is ever exceeded, nothing is decided after giving up, every
// covered fault names an earlier decision, a rule's First bounds every
// counted first decision from below, and Decide never panics on garbage.
func TestPolicyRandomWalk(t *testing.T) {
	ctx := context.Background()
	for seed := range uint64(40) {
		rng := rand.New(rand.NewPCG(seed, 7))
		clk := newClock()
		cfg := Config{
			MaxRestarts: 1 + rng.IntN(4),
			PodRestarts: 1 + rng.IntN(3),
			JobRestarts: 1 + rng.IntN(3),
		}
		p := newTestPolicy(t, clk, cfg)
		procs, pods := map[string]int{}, map[string]int{}
		jobs := 0
		var gaveUp uint64
		var last []Decision
		for step := range 400 {
			var f Fault
			switch rng.IntN(10) {
			case 0:
				f = Fault{Kind: Kind(rng.IntN(12)), Class: Class(rng.IntN(16)), ExitCode: rng.IntN(600) - 100}
			case 1:
				f = Fault{Kind: KindNode, Node: fmt.Sprint("n", rng.IntN(4))}
			default:
				n := rng.IntN(4)
				f = exitFault(fmt.Sprint("n", n), fmt.Sprint("p", n), fmt.Sprint(rng.IntN(3)), []int{0, 1, 9, 137, 247, 201}[rng.IntN(6)], time.Time{})
			}
			if rng.IntN(2) == 0 {
				f.Time = clk.Now().Add(-time.Duration(rng.IntN(3000)) * time.Millisecond)
			}
			d := p.Decide(ctx, f)
			if rng.IntN(3) == 0 && d.Action >= RestartProcesses && d.Action <= RestartJob {
				d = p.Escalate(ctx, d, errors.New("failed"))
			}
			if d.ID == 0 || (len(last) > 0 && d.ID <= last[len(last)-1].ID) {
				t.Fatalf("seed %d step %d: id %d after %d", seed, step, d.ID, last[len(last)-1].ID)
			}
			if gaveUp != 0 && d.Action != NoAction {
				t.Fatalf("seed %d step %d: %s after giving up", seed, step, d.Action)
			}
			switch d.Action {
			case GiveUp:
				gaveUp = d.ID
			case NoAction:
				if d.Covered >= d.ID {
					t.Fatalf("seed %d step %d: covered by later decision %d", seed, step, d.Covered)
				}
			}
			if d.Budget > 0 {
				switch d.Action {
				case RestartProcesses:
					procs[d.Node+"/"+d.Pod+"/"+d.Process]++
					if procs[d.Node+"/"+d.Pod+"/"+d.Process] > cfg.MaxRestarts {
						t.Fatalf("seed %d step %d: process budget exceeded: %+v", seed, step, sum(d))
					}
				case RecreatePods:
					k := d.Pod
					if k == "" {
						k = "node/" + d.Node
					}
					pods[k]++
					if pods[k] > cfg.PodRestarts {
						t.Fatalf("seed %d step %d: pod budget exceeded: %+v", seed, step, sum(d))
					}
				case RestartJob:
					if jobs++; jobs > cfg.JobRestarts {
						t.Fatalf("seed %d step %d: job budget exceeded", seed, step)
					}
				}
				if d.Attempt < 1 || d.Attempt > d.Budget {
					t.Fatalf("seed %d step %d: attempt %d of %d", seed, step, d.Attempt, d.Budget)
				}
			}
			if d.Action != NoAction && d.Action != GiveUp && !escalated(d) {
				if r := p.rules[d.Class]; d.Action < r.First {
					t.Fatalf("seed %d step %d: %s below the rule's first %s", seed, step, d.Action, r.First)
				}
			}
			if d.Action >= RestartProcesses && d.Action <= RestartJob && rng.IntN(2) == 0 {
				p.Executing(d, clk.Advance(d.Backoff))
			}
			clk.Advance(time.Duration(rng.IntN(20000)) * time.Millisecond)
			last = append(last, d)
		}
	}
}

func TestDecisionEvidence(t *testing.T) {
	clk := newClock()
	p := newTestPolicy(t, clk, Config{})
	f := Fault{Kind: KindExit, ExitCode: 137, Signal: 9, Reason: "OOMKilled", Node: "n1", Pod: "p1", Evidence: []string{"memory=80Gi/80Gi"}}
	d := p.Decide(context.Background(), f)
	want := []string{"kind=exit", "exit_code=137", "signal=killed", "reason=OOMKilled", "memory=80Gi/80Gi"}
	if diff := cmp.Diff(want, d.Evidence); diff != "" || d.Class != ClassOOM {
		t.Errorf("class %s, evidence (-want +got):\n%s", d.Class, diff)
	}
	if !strings.HasPrefix(d.String(), "#1 exit code 137 (killed) \"OOMKilled\" [oom]: recreate pod p1 of node n1") {
		t.Errorf("String() = %q", d.String())
	}
}

// Faults that name a node but no pod recreate that node's pods; each node
// has a pod budget of its own.
func TestPodBudgetPerNodeWithoutPodNames(t *testing.T) {
	ctx := context.Background()
	clk := newClock()
	p := newTestPolicy(t, clk, Config{MaxRestarts: 1, PodRestarts: 1})
	for _, node := range []string{"n1", "n2"} {
		hang := func() Fault { return Fault{Kind: KindHang, Node: node, Process: "0", Time: clk.Advance(time.Hour)} }
		if d := p.Decide(ctx, hang()); d.Action != RestartProcesses {
			t.Fatalf("%s, first fault: %+v", node, sum(d))
		}
		d := p.Decide(ctx, hang())
		if d.Action != RecreatePods || d.Node != node || d.Attempt != 1 {
			t.Errorf("%s, second fault: %+v %v", node, sum(d), d.Evidence)
		}
	}
}
