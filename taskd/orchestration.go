package taskd

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/rescheduling"
)

// State is a state of an orchestration.
type State string

// States of a recovery.
const (
	StateIdle       State = "idle"       // no orchestration runs
	StateStopping   State = "stopping"   // pausing every live rank
	StateNotifying  State = "notifying"  // telling every rank of the faults, asking its strategies
	StateDeciding   State = "deciding"   // asking the rescheduling policy how to repair
	StateRetrying   State = "retrying"   // strategy retry: every rank runs the step again
	StateRestarting State = "restarting" // strategy recover-in-place: restarting the faulty processes
	StateReplacing  State = "replacing"  // strategy recover: replacing the faulty nodes' processes
	StateLoading    State = "loading"    // readying the newest intact checkpoint
	StateResuming   State = "resuming"   // resuming every rank
	StateDumping    State = "dumping"    // strategy dump: persisting the newest intact checkpoint
	StateExiting    State = "exiting"    // strategy exit: stopping every rank
	StateRecovered  State = "recovered"  // terminal: training resumed
	StateExited     State = "exited"     // terminal: training stopped for good
)

// States of a link switch, switchback or stress test.
const (
	StatePausing    State = "pausing"    // pausing every live rank
	StateSwitching  State = "switching"  // the affected ranks move their links
	StateTesting    State = "testing"    // the affected ranks run the stress test
	StateContinuing State = "continuing" // resuming every rank
	StateSwitched   State = "switched"   // terminal: links moved, training continued
	StatePassed     State = "passed"     // terminal: the stress test passed, training continued
	StateFailed     State = "failed"     // terminal: handed over to a recovery
)

// Terminal reports whether s ends an orchestration.
func (s State) Terminal() bool {
	switch s {
	case StateRecovered, StateExited, StateSwitched, StatePassed, StateFailed:
		return true
	}
	return false
}

// OrchestrationKind says what an orchestration does.
type OrchestrationKind string

// Kinds of orchestration.
const (
	KindRecovery   OrchestrationKind = "recovery"
	KindLinkSwitch OrchestrationKind = "link-switch" // to the standby link
	KindSwitchback OrchestrationKind = "switchback"  // back to the primary link
	KindStressTest OrchestrationKind = "stress-test"
)

// Transition is one change of an orchestration's state.
type Transition struct {
	From, To State
	Time     time.Time
	Reason   string
}

// Orchestration is the record of one run of a state machine: its state,
// every transition, and the figures it measured. At most one runs at a
// time.
type Orchestration struct {
	ID    uint64
	Kind  OrchestrationKind
	State State
	Done  bool
	Start time.Time
	End   time.Time // zero until done
	// Round counts the passes through stopping: faults that arrive while
	// the job is being repaired or resumed start another.
	Round int
	// Restored counts the managers that took it over from the state a
	// manager before them left in StateDir (it restarted, or a standby
	// took the lease); each took it over with a transition from its
	// state to that state.
	Restored int
	// Strategy is the recovery strategy taken last.
	Strategy Strategy
	// Faults are the faults it handled, in the order they arrived, those
	// it raised itself (a rank that did not pause, a link that did not
	// switch) included.
	Faults []Fault
	// FaultyRanks are the ranks that faulted, sorted.
	FaultyRanks []int
	// ResumedStep is the checkpoint step every rank resumed from, -1 when
	// they continued where they paused.
	ResumedStep int64
	// Detected, Stopped and Resumed are the times from the first fault
	// (for a link switch or stress test, from the request) to the
	// manager taking it in, to training paused, and to training resumed;
	// zero when not reached.
	Detected, Stopped, Resumed time.Duration
	Transitions                []Transition
	// Outcome says in a sentence how it ended.
	Outcome string
	// HandedOverTo is the recovery a failed link switch or stress test
	// handed over to; HandedOverFrom is, for that recovery, the
	// orchestration it took over from.
	HandedOverTo, HandedOverFrom uint64
	Link                         *LinkRequest   // link switch and switchback
	Stress                       *StressRequest // stress test
}

func (o Orchestration) clone() Orchestration {
	o.Faults = slices.Clone(o.Faults)
	for i := range o.Faults {
		o.Faults[i] = o.Faults[i].clone()
	}
	o.FaultyRanks = slices.Clone(o.FaultyRanks)
	o.Transitions = slices.Clone(o.Transitions)
	if o.Link != nil {
		l := *o.Link
		l.Devices, l.Ranks = slices.Clone(l.Devices), slices.Clone(l.Ranks)
		o.Link = &l
	}
	if o.Stress != nil {
		s := *o.Stress
		s.Nodes, s.Ranks = slices.Clone(s.Nodes), slices.Clone(s.Ranks)
		o.Stress = &s
	}
	return o
}

// States returns the states it went through, its first included.
func (o Orchestration) States() []State {
	out := make([]State, 0, len(o.Transitions))
	for _, t := range o.Transitions {
		out = append(out, t.To)
	}
	return out
}

// LinkState is a device link that a switch moved off its primary.
type LinkState struct {
	Node, Device int
	Target       LinkTarget
}

// OrchestrationStatus is what the manager reports of orchestration.
type OrchestrationStatus struct {
	// Current is the orchestration running now, nil when idle.
	Current *Orchestration
	// History holds the finished ones, oldest first.
	History []Orchestration
	// Links are the device links on their standby now.
	Links []LinkState
}

// Errors of the orchestration requests.
var (
	// ErrBusy refuses a request while another orchestration runs.
	ErrBusy = errors.New("taskd: another orchestration is running")
	// ErrOrchestrationOff refuses a request to a manager built without
	// ManagerConfig.Orchestration.
	ErrOrchestrationOff = errors.New("taskd: orchestration is off on this manager")
	// ErrOrchestrationFailed is wrapped by the error of a link switch or
	// stress test that ended other than as asked.
	ErrOrchestrationFailed = errors.New("taskd: orchestration failed")
)

// Checkpoints is the job's checkpoint store as recovery sees it: on resume
// recovery asks it to ready the newest step that every shard holds intact,
// and the dump strategy asks it to persist that step. OwnerCheckpoints
// adapts a ckpt.Owner; a job spread over nodes implements it over its node
// agents (pick one step, then ckpt.Owner.LoadStep on each).
type Checkpoints interface {
	// LoadNewest readies the newest step every shard holds intact for the
	// trainers to load, restoring replicas into memory where needed, and
	// returns it.
	LoadNewest(ctx context.Context) (step int64, err error)
	// PersistNewest writes the newest intact step to durable storage and
	// returns it.
	PersistNewest(ctx context.Context) (step int64, err error)
}

// OwnerCheckpoints is the Checkpoints of a job whose shards one ckpt.Owner
// holds (one machine, or a shared memory tier).
type OwnerCheckpoints struct {
	Owner *ckpt.Owner
	// Shards are the shards the trainers load; all of them one step.
	Shards []int
}

// LoadNewest loads the first shard's newest intact step, by the owner's
// preference (memory, replica, disk), and then that step of every other
// shard, so that each tier that must restore a replica does so.
func (c OwnerCheckpoints) LoadNewest(ctx context.Context) (int64, error) {
	if len(c.Shards) == 0 {
		return -1, errors.New("taskd: OwnerCheckpoints.Shards: empty")
	}
	_, rep, err := c.Owner.Load(ctx, c.Shards[0])
	if err != nil {
		return -1, fmt.Errorf("taskd: load newest checkpoint: %w", err)
	}
	for _, s := range c.Shards[1:] {
		if _, _, err := c.Owner.LoadStep(ctx, s, rep.Step); err != nil {
			return -1, fmt.Errorf("taskd: load checkpoint step %d of shard %d: %w", rep.Step, s, err)
		}
	}
	return rep.Step, nil
}

// PersistNewest persists the newest step every shard holds intact in
// memory.
func (c OwnerCheckpoints) PersistNewest(ctx context.Context) (int64, error) {
	return c.Owner.PersistNewest(ctx)
}

// Timeouts bound each state of the orchestrations. A zero field means its
// default.
type Timeouts struct {
	Pause   time.Duration // stopping and pausing: every rank paused (default 30 s)
	Notify  time.Duration // notifying: every rank told and answered (default 10 s)
	Decide  time.Duration // deciding: the policy answered (default 10 s)
	Retry   time.Duration // retrying: every rank ran the step again (default 60 s)
	Restart time.Duration // restarting: processes restarted and registered again (default 2 min)
	Replace time.Duration // replacing: processes replaced and registered again (default 10 min)
	Load    time.Duration // loading: the checkpoint readied (default 2 min)
	Resume  time.Duration // resuming and continuing: every rank resumed (default 60 s)
	Dump    time.Duration // dumping: the checkpoint persisted (default 10 min)
	Exit    time.Duration // exiting: every rank stopped (default 30 s)
	Switch  time.Duration // switching: every affected rank moved its links (default 60 s)
	Stress  time.Duration // testing: the stress test ran (default 10 min)
}

func (t *Timeouts) setDefaults() {
	t.Pause = orDefault(t.Pause, 30*time.Second)
	t.Notify = orDefault(t.Notify, 10*time.Second)
	t.Decide = orDefault(t.Decide, 10*time.Second)
	t.Retry = orDefault(t.Retry, time.Minute)
	t.Restart = orDefault(t.Restart, 2*time.Minute)
	t.Replace = orDefault(t.Replace, 10*time.Minute)
	t.Load = orDefault(t.Load, 2*time.Minute)
	t.Resume = orDefault(t.Resume, time.Minute)
	t.Dump = orDefault(t.Dump, 10*time.Minute)
	t.Exit = orDefault(t.Exit, 30*time.Second)
	t.Switch = orDefault(t.Switch, time.Minute)
	t.Stress = orDefault(t.Stress, 10*time.Minute)
}

func (t Timeouts) validate() error {
	return negativeDuration("OrchestrationConfig.Timeouts", "Pause", t.Pause, "Notify", t.Notify, "Decide", t.Decide, "Retry", t.Retry,
		"Restart", t.Restart, "Replace", t.Replace, "Load", t.Load, "Resume", t.Resume, "Dump", t.Dump, "Exit", t.Exit,
		"Switch", t.Switch, "Stress", t.Stress)
}

// RescheduleTarget names what a rank is to the rescheduling Executor.
type RescheduleTarget struct {
	Node, Pod, Process string
}

// OrchestrationConfig turns on the manager's orchestration: process-level
// recovery from the faults it takes in, and link switches and stress tests
// on request. The zero value of each field is its documented default.
type OrchestrationConfig struct {
	// Triggers are the fault kinds that start a recovery; default
	// FaultProcessExit, FaultLost, FaultHang and FaultOpError. Faults of a
	// whole node (Rank -1) start none: its workers' own faults do.
	Triggers []FaultKind
	// Retryable are the fault kinds that step retry can clear; default
	// FaultOpError.
	Retryable []FaultKind
	// Strategies are the strategies recovery may take; default all.
	Strategies []Strategy
	// Policy decides between restarting processes in place and replacing
	// them, and keeps the budgets; default a rescheduling.Policy with its
	// defaults, which the manager closes in Close. A policy given here is
	// the caller's to close, after the manager.
	Policy *rescheduling.Policy
	// Executor restarts and replaces processes (rescheduling/local on one
	// machine, rescheduling/kubernetes); nil makes recover-in-place and
	// recover unavailable.
	Executor rescheduling.Executor
	// Target names a rank for the Executor; default node "node-<n>", no
	// pod, process "rank-<r>".
	Target func(Position) RescheduleTarget
	// Checkpoints is told to ready the newest intact step on resume and to
	// persist it on dump; nil: ranks resume from their own state and dump
	// is unavailable.
	Checkpoints Checkpoints
	Timeouts    Timeouts
	// MaxRounds bounds the rounds of one recovery before it dumps and
	// exits (default 3).
	MaxRounds int
	// MaxHistory bounds the finished orchestrations kept (default 100).
	MaxHistory int
	// OnTransition, if set, is called after each transition, in order,
	// with the orchestration as it is then. It must not block.
	OnTransition func(Orchestration, Transition)
}

func (c OrchestrationConfig) validate() error {
	for i, s := range c.Strategies {
		if !s.valid() {
			return fmt.Errorf("taskd: OrchestrationConfig.Strategies[%d]: unknown strategy %q", i, s)
		}
	}
	for i, k := range c.Triggers {
		if k == "" {
			return fmt.Errorf("taskd: OrchestrationConfig.Triggers[%d]: empty", i)
		}
	}
	switch {
	case c.MaxRounds < 0:
		return fmt.Errorf("taskd: OrchestrationConfig.MaxRounds: %d is negative", c.MaxRounds)
	case c.MaxHistory < 0:
		return fmt.Errorf("taskd: OrchestrationConfig.MaxHistory: %d is negative", c.MaxHistory)
	}
	return c.Timeouts.validate()
}

func defaultTarget(p Position) RescheduleTarget {
	return RescheduleTarget{Node: fmt.Sprintf("node-%d", p.Node), Process: fmt.Sprintf("rank-%d", p.Rank)}
}
