package taskd

import (
	"context"
	"errors"
	"fmt"
	"slices"
)

// Trainer is the training loop's side of orchestration: what a training
// process implements so that the manager can stop and resume it. The
// Worker calls it (WorkerConfig.Trainer) when the manager asks, one call
// at a time, each with a context that ends at the manager's deadline for
// it; a call returns when the work is done.
//
// A trainer begins paused. The worker calls Resume with Step -1 once it has
// registered, so that training starts; when the process replaces one that
// failed while a recovery holds the job, the recovery's Resume starts it
// instead, together with the other ranks and from the step they agree on.
//
// What else a trainer can do, it says by implementing the optional
// interfaces, which the worker discovers by type assertion:
// StrategyLister (which recovery strategies it supports now), StepRetrier
// (strategy retry), LinkSwitcher (link switch) and StressTester (online
// stress test). Without StrategyLister a trainer supports every strategy
// that its methods can carry out: retry when it is a StepRetrier, and
// recover-in-place, recover, dump and exit. Without the others, the call
// fails with ErrUnsupported: recovery then takes the next strategy, and a
// link switch or a stress test fails on that rank.
//
// A method that the trainer cannot carry out returns an error wrapping
// ErrUnsupported.
type Trainer interface {
	// Pause stops the step loop at the next step boundary and returns once
	// it has stopped, with the last step completed (-1 before the first).
	// Pausing a paused trainer returns at once.
	Pause(ctx context.Context) (step int64, err error)
	// Resume starts or continues the step loop, first loading r.Step when
	// it is not -1. Resuming a running trainer with Step -1 changes
	// nothing.
	Resume(ctx context.Context, r ResumeRequest) error
	// Stop ends training for good (strategy exit); the process may exit.
	Stop(ctx context.Context, reason string) error
}

// StrategyLister is a Trainer that says which recovery strategies it
// supports.
type StrategyLister interface {
	// Strategies says which recovery strategies the trainer supports now,
	// given the job's faults. The trainer is paused.
	Strategies(ctx context.Context, n FaultNotice) ([]Strategy, error)
}

// StepRetrier is a Trainer that can run a step again (strategy retry).
type StepRetrier interface {
	// RetryStep repairs what a transient fault broke (say, a communicator)
	// and runs the interrupted step again from the state kept in memory;
	// the trainer stays paused after it.
	RetryStep(ctx context.Context) error
}

// LinkSwitcher is a Trainer that can move its traffic to another link.
type LinkSwitcher interface {
	// SwitchLink moves the trainer's traffic on l.Devices to l.Target (the
	// standby link, or back to the primary). The trainer is paused.
	SwitchLink(ctx context.Context, l LinkRequest) error
}

// StressTester is a Trainer that can run online stress tests.
type StressTester interface {
	// StressTest runs the online stress test s.Test on the trainer's
	// devices and returns an error when they fail it. The trainer is
	// paused.
	StressTest(ctx context.Context, s StressRequest) error
}

// strategiesOf returns what t supports: its StrategyLister's answer, or,
// without one, every strategy that its methods can carry out.
func strategiesOf(ctx context.Context, t Trainer, n FaultNotice) ([]Strategy, error) {
	if l, ok := t.(StrategyLister); ok {
		return l.Strategies(ctx, n)
	}
	var s []Strategy
	if _, ok := t.(StepRetrier); ok {
		s = append(s, StrategyRetry)
	}
	return append(s, StrategyRecoverInPlace, StrategyRecover, StrategyDump, StrategyExit), nil
}

// ErrUnsupported is wrapped by a Trainer's error for a call it cannot carry
// out, and by the worker's for a call of an optional interface that the
// trainer does not implement.
var ErrUnsupported = errors.New("taskd: not supported by this trainer")

// Strategy is a way to recover from a fault. Recovery tries them in the
// order of the constants, skipping those that do not apply or that a rank
// does not support.
type Strategy string

// Strategies, cheapest first.
const (
	// StrategyRetry runs the failed step again on every rank, from memory,
	// without restarting anything: only for transient device and
	// communication faults (FaultOpError).
	StrategyRetry Strategy = "retry"
	// StrategyRecoverInPlace restarts the faulty processes on their nodes;
	// every rank then resumes from the newest intact checkpoint.
	StrategyRecoverInPlace Strategy = "recover-in-place"
	// StrategyRecover replaces the faulty nodes' processes (recreates their
	// pods) through the rescheduling Executor; every rank then resumes from
	// the newest intact checkpoint.
	StrategyRecover Strategy = "recover"
	// StrategyDump persists the newest intact checkpoint, then exits.
	StrategyDump Strategy = "dump"
	// StrategyExit stops every trainer: the job ends and its scheduler
	// decides what follows.
	StrategyExit Strategy = "exit"
)

// AllStrategies returns every strategy, cheapest first.
func AllStrategies() []Strategy {
	return []Strategy{StrategyRetry, StrategyRecoverInPlace, StrategyRecover, StrategyDump, StrategyExit}
}

func (s Strategy) valid() bool { return slices.Contains(AllStrategies(), s) }

// ResumeRequest says how a trainer continues.
type ResumeRequest struct {
	// Step is the checkpoint step to load before continuing, the same on
	// every rank; -1 continues from the trainer's own state: where it
	// paused, or, when it has just started, its own newest checkpoint.
	Step int64 `json:"step"`
	// Strategy is what repaired the job, "" when the trainer starts or
	// continues after a link switch or stress test.
	Strategy Strategy `json:"strategy,omitempty"`
	// Restarted lists the ranks whose processes were restarted or replaced:
	// communicators with them must be built again.
	Restarted []int `json:"restarted,omitempty"`
	// Released is set when the worker resumes its trainer on its own: the
	// orchestration that paused it (or left it unstarted) ended with its
	// manager, and the manager serving now holds nothing, so no resume
	// would come. Nothing was repaired and no step was agreed: the
	// trainer continues from its own state (Step is -1), and one whose
	// peers may have been restarted meanwhile rebuilds its communicators
	// or reloads its newest checkpoint.
	Released bool `json:"released,omitempty"`
}

// FaultNotice tells every rank of the job's faults while it is paused: one
// fault for each faulty rank.
type FaultNotice struct {
	Faults []Fault `json:"faults"`
}

// Ranks returns the faulty ranks, sorted.
func (n FaultNotice) Ranks() []int {
	out := make([]int, 0, len(n.Faults))
	for _, f := range n.Faults {
		out = append(out, f.Position.Rank)
	}
	return sortedUnique(out)
}

// LinkTarget is the link that a switch moves traffic to.
type LinkTarget string

// Link targets.
const (
	LinkStandby LinkTarget = "standby" // borrow the standby link
	LinkPrimary LinkTarget = "primary" // switch back
)

// LinkRequest asks to move the traffic of a node's devices to a link.
type LinkRequest struct {
	// Node is the node whose links move.
	Node int `json:"node"`
	// Devices are the accelerators (local indices) whose links move.
	Devices []int `json:"devices"`
	// Target is LinkStandby or LinkPrimary.
	Target LinkTarget `json:"target"`
	// Ranks, when set, are the workers that switch; default every worker
	// of Node.
	Ranks []int `json:"ranks,omitempty"`
}

// Validate reports the first field that is wrong.
func (l LinkRequest) Validate() error {
	switch {
	case l.Node < 0:
		return fmt.Errorf("taskd: LinkRequest.Node: %d is negative", l.Node)
	case len(l.Devices) == 0:
		return errors.New("taskd: LinkRequest.Devices: empty")
	case l.Target != LinkStandby && l.Target != LinkPrimary:
		return fmt.Errorf("taskd: LinkRequest.Target: %q, want %q or %q", l.Target, LinkStandby, LinkPrimary)
	}
	for i, d := range l.Devices {
		if d < 0 {
			return fmt.Errorf("taskd: LinkRequest.Devices[%d]: %d is negative", i, d)
		}
	}
	for i, r := range l.Ranks {
		if r < 0 {
			return fmt.Errorf("taskd: LinkRequest.Ranks[%d]: %d is negative", i, r)
		}
	}
	return nil
}

// StressRequest asks for an online stress test: the job pauses, the
// workers of Nodes and Ranks run Test, and the job continues.
type StressRequest struct {
	Nodes []int `json:"nodes,omitempty"`
	Ranks []int `json:"ranks,omitempty"`
	// Test names the test, as the trainer knows it ("hbm", "p2p", ...).
	Test string `json:"test"`
}

// Validate reports the first field that is wrong.
func (s StressRequest) Validate() error {
	switch {
	case len(s.Nodes) == 0 && len(s.Ranks) == 0:
		return errors.New("taskd: StressRequest: no Nodes and no Ranks")
	case s.Test == "":
		return errors.New("taskd: StressRequest.Test: empty")
	}
	for i, n := range s.Nodes {
		if n < 0 {
			return fmt.Errorf("taskd: StressRequest.Nodes[%d]: %d is negative", i, n)
		}
	}
	for i, r := range s.Ranks {
		if r < 0 {
			return fmt.Errorf("taskd: StressRequest.Ranks[%d]: %d is negative", i, r)
		}
	}
	return nil
}
