package rescheduling_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/faultline-ml/faultline/rescheduling"
)

// A process killed from outside is restarted in place and not counted; a
// device failure moves the node's pods elsewhere; a repeat of the device
// failure during the same event gets no decision of its own.
func ExamplePolicy_Decide() {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	policy, err := rescheduling.NewPolicy(rescheduling.Config{Now: func() time.Time { return now }})
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	for _, f := range []rescheduling.Fault{
		{Kind: rescheduling.KindExit, ExitCode: 137, Node: "n1", Pod: "worker-1", Process: "rank-8"},
		{Kind: rescheduling.KindExit, ExitCode: 201, Node: "n2", Pod: "worker-2", Process: "rank-16"},
		{Kind: rescheduling.KindNode, Node: "n2", Reason: "NotReady"},
	} {
		d := policy.Decide(ctx, f)
		fmt.Println(d.Action, "|", d.Reason)
	}
	// Output:
	// restart_processes | exit code 137 [killed]: restart process rank-8 of pod worker-1 on node n1 in place (not counted)
	// recreate_pods | exit code 201 [hardware]: recreate every pod of the job on node n2, keeping the job off node n2 (attempt 1 of 3)
	// none | node fault "NotReady" [node]: no action, covered by #2 (recreate_pods)
}

// Budgets run out level by level: in place, then the pod, then the job,
// then the policy gives up.
func ExamplePolicy_Decide_budgets() {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	policy, err := rescheduling.NewPolicy(rescheduling.Config{
		MaxRestarts: 1, PodRestarts: 1, JobRestarts: 1,
		Now: func() time.Time { return now },
	})
	if err != nil {
		panic(err)
	}
	for range 4 {
		now = now.Add(time.Hour) // far apart: no recurrence
		d := policy.Decide(context.Background(), rescheduling.Fault{Kind: rescheduling.KindHang, Node: "n1", Pod: "worker-1"})
		fmt.Println(d.Action, d.Attempt, d.Budget)
	}
	// Output:
	// restart_processes 1 1
	// recreate_pods 1 1
	// restart_job 1 1
	// give_up 0 0
}

// Nodes join an elastic job of 2 to 4 nodes in units of 2; the round
// completes when no node has joined for the last call.
func ExampleRendezvous() {
	r, err := rescheduling.NewRendezvous(rescheduling.RendezvousConfig{
		MinNodes: 2, MaxNodes: 4, NodeUnit: 2, LastCallTimeout: 30 * time.Second,
	})
	if err != nil {
		panic(err)
	}
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, n := range []string{"a", "b", "c"} {
		r.Join(n, t0)
	}
	deadline, _ := r.Deadline()
	fmt.Println("due after", deadline.Sub(t0))
	round, ok := r.Step(deadline)
	fmt.Println(ok, round.Number, round.Nodes, round.Trigger, "waiting", r.Waiting())
	// Output:
	// due after 30s
	// true 1 [a b] last_call waiting [c]
}

// A training log whose last lines hold a device failure.
func ExampleLogMatcher() {
	dir, err := os.MkdirTemp("", "log")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "rank-0.log")
	os.WriteFile(path, []byte("step 1 loss 2.3\nstep 2 loss 2.1\nRuntimeError: CUDA error: uncorrectable ECC error encountered\n"), 0o644)

	m, err := rescheduling.NewLogMatcher(rescheduling.LogConfig{})
	if err != nil {
		panic(err)
	}
	match, ok, err := m.Scan(path)
	if err != nil || !ok {
		panic(err)
	}
	f := match.Fault()
	fmt.Println(match.Rule, rescheduling.Classify(f), match.Offset)
	// Output:
	// device-failure hardware 32
}
