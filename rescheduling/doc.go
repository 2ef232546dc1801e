// Package rescheduling decides how a training job recovers from a fault:
// restart the failed processes in place (seconds), recreate only the failed
// pods (pod-level rescheduling, MindCluster's pod-rescheduling: "on"),
// restart the whole job (job-level rescheduling, the slow default), or give
// up. It keeps the budgets of each level, escalates when a cheaper level
// failed or its budget is spent, and drives the vendor's scheduler through
// an Executor.
//
// The parts, each usable alone:
//
//   - Fault and Classify: what went wrong. Exit codes follow DLRover's
//     table (137/143 killed and not counted, 247 or OOMKilled out of
//     memory, 1/134 fatal, 201/202/14 hardware, anything else unknown);
//     hang and slow-node verdicts, lost heartbeats, node faults and log
//     patterns (LogMatcher, regular expressions over the last lines of a
//     training log) have classes of their own.
//   - Policy: a pure state machine (no I/O, no goroutine, an injected
//     clock) that turns each Fault into a Decision with its reason and
//     evidence. A Rule per class says where recovery starts, how far a
//     recurring fault escalates, whether it counts against the budgets
//     (per process MaxRestarts, default 32767 as torchrun; per pod 3; per
//     job 3) and whether the node is suspect. Faults of one node and pod
//     within a dedupe window are one event and get one decision; a fault
//     that needs a stronger action supersedes the pending decision.
//     Waits between attempts back off exponentially with jitter.
//   - Rendezvous: elastic membership (DLRover's --nnodes=min:max) as a
//     pure state machine: rounds complete when MaxNodes wait, or when at
//     least MinNodes wait and none joined for LastCallTimeout, truncated
//     to a multiple of NodeUnit. Round.Fault turns a new round into a
//     membership fault, which restarts processes without consuming
//     budgets.
//   - Executor: restart processes, recreate pods, restart the job, avoid
//     a node. Package rescheduling/kubernetes implements it with client-go
//     (kept out of this package so that an embedder of the policy does
//     not compile client-go); package rescheduling/local restarts child
//     processes on one machine.
//   - Watchdog: consumes a channel of faults, decides, waits out the
//     backoff, executes, retries and escalates failures, and measures
//     the time from fault to restarted.
//
// Decisions and outcomes are logged (slog), counted (Prometheus, on the
// Registerer given) and traced (OpenTelemetry, from the TracerProvider
// given); each is off when nil. A Registerer that another policy or
// watchdog already uses is an error from the constructor; Close
// unregisters.
//
// A minimal embedding:
//
//	policy, err := rescheduling.NewPolicy(rescheduling.Config{})
//	if err != nil {
//		return err
//	}
//	d := policy.Decide(ctx, rescheduling.Fault{
//		Kind: rescheduling.KindExit, ExitCode: 137,
//		Node: "node-3", Pod: "job-worker-3", Process: "rank-24",
//	})
//	fmt.Println(d.Action, d.Reason) // restart_processes ...
//
// or, with an executor doing the work:
//
//	w, err := rescheduling.NewWatchdog(rescheduling.WatchdogConfig{
//		Policy: policy, Executor: executor, Faults: faults,
//	})
//	...
//	err = w.Run(ctx) // until faults is closed, ctx is done or the job is given up
//
// The exhaustive rendezvous test goes one level deeper (minutes) when
// FAULTLINE_RESCHEDULING_DEEP is set, and one level shallower with -short.
package rescheduling
