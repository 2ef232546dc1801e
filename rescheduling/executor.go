package rescheduling

import (
	"context"
	"errors"
)

// Executor carries out decisions on the vendor's scheduler or on the local
// machine. Each method acts on the decision's target (Node, Pod, Process;
// see Decision) and returns when the target has been restarted or its
// replacement requested.
//
// An executor returns an error wrapping ErrUnsupported for what it cannot
// do (a Kubernetes executor cannot restart a process in place), so the
// watchdog escalates to the next action, and one wrapping ErrTargetGone
// when the target no longer exists, so nothing is escalated. A fault
// source must not report terminations that an executor caused.
type Executor interface {
	// RestartProcesses restarts the named process and every other
	// process of the target that is not running, in place.
	RestartProcesses(ctx context.Context, d Decision) error
	// RecreatePods deletes and recreates the target's pods: Pod, or every
	// pod of the job on Node when Pod is "".
	RecreatePods(ctx context.Context, d Decision) error
	// RestartJob recreates every pod (or process) of the job.
	RestartJob(ctx context.Context, d Decision) error
	// AvoidNode keeps the job off d.AvoidNode from now on (taint,
	// cordon, anti-affinity). It is called before RecreatePods or
	// RestartJob when d.AvoidNode is set.
	AvoidNode(ctx context.Context, d Decision) error
}

// ErrUnsupported is wrapped by an Executor's error for an action it cannot
// carry out; the watchdog escalates to the next action.
var ErrUnsupported = errors.New("rescheduling: not supported by this executor")

// ErrTargetGone is wrapped by an Executor's error when the decision's
// target no longer exists (a pod already deleted, a process unknown); the
// watchdog records it and escalates nothing.
var ErrTargetGone = errors.New("rescheduling: target no longer exists")
