package rescheduling

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Action is what a decision asks an Executor to do. The restart actions
// are ordered from the cheapest to the most expensive, and escalation
// moves up that order.
type Action uint8

// Actions.
const (
	// NoAction: nothing to do; the fault is covered by an earlier decision,
	// is not a fault, or the job was given up.
	NoAction Action = iota
	// RestartProcesses restarts processes in place (seconds).
	RestartProcesses
	// RecreatePods deletes and recreates only the failed pods
	// (MindCluster's pod-level rescheduling), on another node when the
	// node is suspect.
	RecreatePods
	// RestartJob recreates every pod of the job (job-level rescheduling).
	RestartJob
	// GiveUp: every budget that could help is spent; the job fails.
	GiveUp
)

var actionNames = [...]string{"none", "restart_processes", "recreate_pods", "restart_job", "give_up"}

// String returns the action's snake-case name, used as a metric label.
func (a Action) String() string {
	if int(a) < len(actionNames) {
		return actionNames[a]
	}
	return "action(" + strconv.Itoa(int(a)) + ")"
}

// Rule says how a class of fault is recovered.
type Rule struct {
	// First is the cheapest action tried: RestartProcesses, RecreatePods
	// or RestartJob.
	First Action
	// Last is the most expensive action that a recurring fault escalates
	// to; when Last's budget is spent the policy gives up. An action that
	// fails to execute escalates past Last (a Kubernetes executor cannot
	// restart processes in place, so RecreatePods follows).
	Last Action
	// Uncounted faults consume no budget (a process killed from outside
	// is not the job's fault).
	Uncounted bool
	// AvoidNode marks the node suspect: its pods are recreated elsewhere
	// and the executor keeps the job off it (taint, cordon or
	// anti-affinity).
	AvoidNode bool
}

// DefaultRules returns the rule of every class, as the zero Config uses
// them:
//
//	class       first              last               counted  avoid node
//	killed      restart_processes  restart_job        no       no
//	oom         recreate_pods      restart_job        yes      no
//	fatal       restart_processes  restart_processes  yes      no
//	hardware    recreate_pods      restart_job        yes      yes
//	unknown     restart_processes  restart_job        yes      no
//	hang        restart_processes  restart_job        yes      no
//	slow        recreate_pods      restart_job        yes      yes
//	heartbeat   recreate_pods      restart_job        yes      yes
//	node        recreate_pods      restart_job        yes      yes
//	membership  restart_processes  restart_processes  no       no
//
// A fatal error (exit code 1 or 134) is the program's own: a new pod or a
// new job would fail the same way, so it is restarted in place until the
// process budget is spent, then given up, as DLRover does. An OOM kill is
// not restarted in the same pod, whose memory limit killed it.
func DefaultRules() map[Class]Rule {
	return map[Class]Rule{
		ClassKilled:     {First: RestartProcesses, Last: RestartJob, Uncounted: true},
		ClassOOM:        {First: RecreatePods, Last: RestartJob},
		ClassFatal:      {First: RestartProcesses, Last: RestartProcesses},
		ClassHardware:   {First: RecreatePods, Last: RestartJob, AvoidNode: true},
		ClassUnknown:    {First: RestartProcesses, Last: RestartJob},
		ClassHang:       {First: RestartProcesses, Last: RestartJob},
		ClassSlow:       {First: RecreatePods, Last: RestartJob, AvoidNode: true},
		ClassHeartbeat:  {First: RecreatePods, Last: RestartJob, AvoidNode: true},
		ClassNode:       {First: RecreatePods, Last: RestartJob, AvoidNode: true},
		ClassMembership: {First: RestartProcesses, Last: RestartProcesses, Uncounted: true},
	}
}

func (r Rule) validate(c Class) error {
	switch {
	case r.First < RestartProcesses || r.First > RestartJob:
		return fmt.Errorf("rescheduling: Config.Rules[%s].First is %s, want restart_processes, recreate_pods or restart_job", c, r.First)
	case r.Last < r.First || r.Last > RestartJob:
		return fmt.Errorf("rescheduling: Config.Rules[%s].Last is %s, want %s..restart_job", c, r.Last, r.First)
	}
	return nil
}

// Decision is what the policy decided for one fault, with why.
//
// The target fields say what the executor acts on; an empty field widens
// the scope: RestartProcesses with Process "" restarts every process of
// the pod (or node), RecreatePods with Pod "" recreates every pod of the
// job on Node, and a decision naming no node and no pod acts on the
// whole job.
type Decision struct {
	// ID numbers the policy's decisions from 1.
	ID     uint64
	Action Action
	Class  Class
	// Fault is the fault decided on.
	Fault Fault
	// Time is when the decision was made (the policy's clock).
	Time time.Time

	Node    string
	Pod     string
	Process string
	// AvoidNode is a suspect node to keep the job off, "" if none.
	AvoidNode string

	// Attempt counts the attempts of Action on this target, this one
	// included; Budget is the most allowed (0 when uncounted).
	Attempt int
	Budget  int
	// Backoff is how long to wait before executing: zero for the first
	// attempt after a quiet period, then growing exponentially with
	// jitter while faults recur.
	Backoff time.Duration
	// Covered is, for NoAction, the earlier decision that already covers
	// the fault (0 if none).
	Covered uint64
	// Supersedes is an earlier decision, not yet executed, that this one
	// replaces (a conflicting fault needs a stronger action); 0 if none.
	Supersedes uint64

	// Reason says in one sentence what was decided and why.
	Reason string
	// Evidence lists the facts behind the decision, as key=value.
	Evidence []string
}

// String returns the decision's reason prefixed with its number.
func (d Decision) String() string {
	return "#" + strconv.FormatUint(d.ID, 10) + " " + d.Reason
}

// what describes in words what d does to its target.
func (d *Decision) what() string {
	var b strings.Builder
	where := func() {
		if d.Pod != "" {
			b.WriteString(" of pod " + d.Pod)
		}
		if d.Node != "" {
			b.WriteString(" on node " + d.Node)
		}
		if d.Pod == "" && d.Node == "" {
			b.WriteString(" of the job")
		}
	}
	switch d.Action {
	case RestartProcesses:
		b.WriteString("restart ")
		if d.Process != "" {
			b.WriteString("process " + d.Process)
		} else {
			b.WriteString("every process")
		}
		where()
		b.WriteString(" in place")
	case RecreatePods:
		if d.Pod != "" {
			b.WriteString("recreate pod " + d.Pod)
			if d.Node != "" {
				b.WriteString(" of node " + d.Node)
			}
		} else {
			b.WriteString("recreate every pod of the job on node " + d.Node)
		}
	case RestartJob:
		b.WriteString("restart the job")
	}
	return b.String()
}
