package hang

import (
	"fmt"
	"strings"
	"time"
)

// FaultKind is what went wrong. Kinds are bits so that Config.StopOn can
// name several.
type FaultKind uint8

// Fault kinds.
const (
	// FaultHang: an op ran past its timeout.
	FaultHang FaultKind = 1 << iota
	// FaultOpError: an op reported an error (Timing.Fail).
	FaultOpError
	// FaultHeartbeat: a heartbeat stayed silent past HeartbeatTimeout.
	FaultHeartbeat

	faultKindsAll = FaultHang | FaultOpError | FaultHeartbeat
)

// String returns "hang", "op_error", "heartbeat", or the kinds of a set
// joined by "|".
func (k FaultKind) String() string {
	var names []string
	for _, x := range []struct {
		k    FaultKind
		name string
	}{{FaultHang, "hang"}, {FaultOpError, "op_error"}, {FaultHeartbeat, "heartbeat"}} {
		if k&x.k != 0 {
			names = append(names, x.name)
		}
	}
	if rest := k &^ faultKindsAll; rest != 0 {
		names = append(names, fmt.Sprintf("%#x", uint8(rest)))
	}
	if len(names) == 0 {
		return "none"
	}
	return strings.Join(names, "|")
}

// Fault is one detected fault.
type Fault struct {
	Kind FaultKind
	Rank int
	// Op, Group and Stream name the op, for FaultHang and FaultOpError.
	Op     string
	Group  string
	Stream int
	// Heartbeat names the silent heartbeat, for FaultHeartbeat.
	Heartbeat string
	// Elapsed is how long the op had run, or how long the heartbeat had
	// been silent, when the fault was detected.
	Elapsed time.Duration
	// Timeout is the limit that was passed (FaultHang, FaultHeartbeat).
	Timeout time.Duration
	// Err is the op's error, for FaultOpError.
	Err error
	// Time is when the fault was detected.
	Time time.Time
}

// String describes the fault in one line, e.g. "rank 3: hang: op
// HcclAllReduce (group dp, stream 2) running 12.1s, timeout 10s".
func (f Fault) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "rank %d: %s: ", f.Rank, f.Kind)
	switch f.Kind {
	case FaultHeartbeat:
		fmt.Fprintf(&b, "heartbeat %q silent for %v, timeout %v", f.Heartbeat, f.Elapsed.Round(time.Millisecond), f.Timeout)
	default:
		fmt.Fprintf(&b, "op %s", f.Op)
		if f.Group != "" {
			fmt.Fprintf(&b, " (group %s, stream %d)", f.Group, f.Stream)
		} else {
			fmt.Fprintf(&b, " (stream %d)", f.Stream)
		}
		if f.Kind == FaultOpError {
			fmt.Fprintf(&b, " failed after %v: %v", f.Elapsed.Round(time.Millisecond), f.Err)
		} else {
			fmt.Fprintf(&b, " running %v, timeout %v", f.Elapsed.Round(time.Millisecond), f.Timeout)
		}
	}
	return b.String()
}
