package rescheduling

import (
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Kind says what observed a fault.
type Kind uint8

// Kinds of fault.
const (
	KindExit       Kind = iota + 1 // a process or container exited
	KindHang                       // a hang verdict: a kernel or collective past its timeout
	KindSlow                       // a slow-node verdict
	KindHeartbeat                  // heartbeats stopped arriving
	KindNode                       // a node fault: NotReady, a device error
	KindLog                        // a log pattern matched (see LogMatcher)
	KindMembership                 // elastic membership changed: a rendezvous round completed
)

var kindNames = [...]string{"invalid", "exit", "hang", "slow", "heartbeat", "node", "log", "membership"}

// String returns the kind's lower-case name.
func (k Kind) String() string {
	if int(k) < len(kindNames) {
		return kindNames[k]
	}
	return "kind(" + strconv.Itoa(int(k)) + ")"
}

// Class is what a fault means for recovery. Each class has a Rule.
type Class uint8

// Classes of fault. The exit-code classes follow DLRover's table.
const (
	// Unclassified is the zero Class: Classify decides from the other
	// fields of the Fault.
	Unclassified Class = iota
	// ClassKilled: killed from outside (exit code 137 or 143, SIGKILL,
	// SIGTERM), as by a preemption or an operator. Not counted against
	// budgets.
	ClassKilled
	// ClassOOM: out of memory (exit code 247, or reason OOMKilled).
	ClassOOM
	// ClassFatal: the program failed (exit code 1, 134 or SIGABRT).
	ClassFatal
	// ClassHardware: a device failed (exit codes 201 GPU driver error,
	// 202 GPU pod residue, 14 GPU InfoROM corrupted).
	ClassHardware
	// ClassUnknown: any other exit code or signal, or a fault of unknown
	// kind.
	ClassUnknown
	// ClassHang: a hang verdict.
	ClassHang
	// ClassSlow: a slow-node verdict.
	ClassSlow
	// ClassHeartbeat: heartbeats were lost.
	ClassHeartbeat
	// ClassNode: a node fault (NotReady, device errors reported by the
	// node).
	ClassNode
	// ClassMembership: the elastic membership changed; every process
	// restarts with the new world, which consumes no budget.
	ClassMembership
	// ClassNone: not a fault (a process that exited with code 0).
	ClassNone

	numClasses
)

var classNames = [...]string{
	"unclassified", "killed", "oom", "fatal", "hardware", "unknown",
	"hang", "slow", "heartbeat", "node", "membership", "none",
}

// String returns the class's lower-case name, used as a metric label.
func (c Class) String() string {
	if int(c) < len(classNames) {
		return classNames[c]
	}
	return "class(" + strconv.Itoa(int(c)) + ")"
}

// Fault is one observation that something went wrong: a process exit, a
// verdict, a lost heartbeat, a node condition or a log line. Node, Pod and
// Process name what failed; empty fields are unknown.
type Fault struct {
	Kind Kind
	// Class, when set, overrides Classify (a LogMatcher sets it from the
	// rule that matched).
	Class Class
	// Time is when the fault happened (for a lost heartbeat: the last
	// heartbeat seen), not when it was noticed, so that a late report of
	// an event that a restart already covered is recognised as such.
	// Zero means the policy's clock at Decide.
	Time    time.Time
	Node    string
	Pod     string
	Process string // a process within the pod or node: a rank, a local rank, a name
	// ExitCode is the exit status of a KindExit fault: 128+n for a
	// process ended by signal n, as shells and the kubelet report it.
	ExitCode int
	// Signal is the signal that ended the process, 0 if none or unknown.
	Signal syscall.Signal
	// Reason is a short cause: a Kubernetes termination reason
	// ("OOMKilled", "Error"), a node condition ("NotReady"), a verdict or
	// the name of the log rule that matched.
	Reason string
	// Evidence holds what supports the fault: log lines, timings, ratios.
	Evidence []string
}

// Classify returns the class of f: f.Class when set, else what f.Kind and,
// for a process exit, the exit code, signal and reason say:
//
//	reason OOMKilled, exit code 247         ClassOOM
//	exit code 0 without a signal            ClassNone
//	exit code 137, 143; SIGKILL, SIGTERM    ClassKilled
//	exit code 1, 134; SIGABRT               ClassFatal
//	exit code 201, 202, 14                  ClassHardware
//	anything else                           ClassUnknown
//
// The reason is checked first because the kubelet reports an OOM kill as
// exit code 137 with reason OOMKilled; a signal, when known, is checked
// before the exit code.
func Classify(f Fault) Class {
	if f.Class != Unclassified && f.Class < numClasses {
		return f.Class
	}
	switch f.Kind {
	case KindExit:
		return classifyExit(f)
	case KindHang:
		return ClassHang
	case KindSlow:
		return ClassSlow
	case KindHeartbeat:
		return ClassHeartbeat
	case KindNode:
		return ClassNode
	case KindMembership:
		return ClassMembership
	}
	return ClassUnknown // KindLog without a class, or an invalid kind
}

func classifyExit(f Fault) Class {
	if f.ExitCode == 247 || strings.EqualFold(f.Reason, "OOMKilled") {
		return ClassOOM
	}
	switch f.Signal {
	case 0:
	case syscall.SIGKILL, syscall.SIGTERM:
		return ClassKilled
	case syscall.SIGABRT:
		return ClassFatal
	default:
		return ClassUnknown
	}
	switch f.ExitCode {
	case 0:
		return ClassNone
	case 137, 143:
		return ClassKilled
	case 1, 134:
		return ClassFatal
	case 201, 202, 14:
		return ClassHardware
	}
	return ClassUnknown
}

// describe says in a few words what f is, for a decision's reason.
func describe(f Fault, c Class) string {
	var b strings.Builder
	b.Grow(32 + len(f.Reason))
	switch f.Kind {
	case KindExit:
		b.WriteString("exit code ")
		b.WriteString(strconv.Itoa(f.ExitCode))
		if f.Signal != 0 {
			b.WriteString(" (")
			b.WriteString(f.Signal.String())
			b.WriteString(")")
		}
	case KindLog:
		b.WriteString("log pattern")
	default:
		b.WriteString(f.Kind.String())
		b.WriteString(" fault")
	}
	if f.Reason != "" {
		b.WriteString(" ")
		b.WriteString(strconv.Quote(f.Reason))
	}
	b.WriteString(" [")
	b.WriteString(c.String())
	b.WriteString("]")
	return b.String()
}
