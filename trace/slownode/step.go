package slownode

import (
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/faultline-ml/faultline/trace"
)

// Figures is a bit set naming the figures of a Step that its rank's
// markers made available.
type Figures uint16

// The figures of a step. FigStep is always set on a Step the detector
// derived; the others need their markers.
const (
	FigStep       Figures = 1 << iota // step time: a "step <n>" range
	FigForward                        // forward time: "forward" ranges
	FigDataLoader                     // dataloader time: "dataloader" ranges
	FigCheckpoint                     // checkpoint-save time: "save_checkpoint" ranges
	FigComm                           // communication time: communication-domain ranges
	FigTrajectory                     // iteration gap, forward+backward and trailing: forward and communication ranges
	FigCompute                        // busy compute: some of the step not covered by communication (see Step.Compute)
	FigSend                           // send time: send ops among the communication ranges
)

var figureNames = []struct {
	f    Figures
	name string
}{
	{FigStep, "step"},
	{FigCompute, "compute"},
	{FigForward, "forward"},
	{FigDataLoader, "dataloader"},
	{FigCheckpoint, "checkpoint"},
	{FigComm, "communication"},
	{FigSend, "send"},
	{FigTrajectory, "trajectory"},
}

// Names returns the names of the figures in f, in a fixed order.
func (f Figures) Names() []string {
	var out []string
	for _, n := range figureNames {
		if f&n.f != 0 {
			out = append(out, n.name)
		}
	}
	return out
}

// allFigures is the set a rank with every marker kind provides.
const allFigures = FigStep | FigForward | FigDataLoader | FigCheckpoint | FigComm | FigTrajectory | FigCompute | FigSend

// Step is what one rank did in one training step. Durations come from one
// rank's clock only: they are differences of that rank's own timestamps,
// so clock skew between hosts does not enter them.
type Step struct {
	Number     int64         // n of the "step <n>" marker
	Time       time.Duration // step range
	Forward    time.Duration // sum of forward ranges
	DataLoader time.Duration // sum of dataloader ranges
	Checkpoint time.Duration // sum of save_checkpoint ranges

	// The iteration trajectory, as cluster profiling splits a step. Gap
	// is the wait before the first forward (data wait), FPBP runs from
	// the first forward to the start of the trailing communication (the
	// last run of back-to-back communication ops), and Trailing from there
	// to the step's end. Without communication ranges Trailing is 0 and
	// FPBP runs to the step's end.
	Gap, FPBP, Trailing time.Duration

	// Compute is busy compute: FPBP less the communication inside it, or,
	// without forward markers, Time less communication, dataloader and
	// checkpoint. Communication overlapped with compute on another stream
	// makes it a lower bound, and where communication ranges cover all of
	// forward and backward it comes to 0, which says nothing: FigCompute
	// is set only when it is above 0. Without communication markers it is
	// the forward time: waiting in a collective then looks like compute,
	// and only collectives outside forward (data parallelism) leave it
	// clean.
	Compute time.Duration

	// Comm is the communication time per communicator and op.
	Comm []CommTime

	Have Figures // which figures the markers provided
}

// CommTime is the time one rank spent in one communication op of one
// communicator during a step.
type CommTime struct {
	Group string        // communicator: the op's groupName
	Op    string        // HcclAllReduce, ncclSend, ...
	Time  time.Duration // sum of the op's ranges
	Count int           // ranges
}

// isSend reports whether op is a point-to-point send (HcclSend,
// ncclSend, ...), which pipeline stages use to pass activations.
func isSend(op string) bool {
	// Only ASCII letters lower to those of "send", so the last four bytes
	// decide, compared without allocating a lowered copy.
	return len(op) >= 4 && strings.EqualFold(op[len(op)-4:], "send")
}

type spanKind uint8

const (
	spanForward spanKind = iota
	spanDataLoader
	spanCheckpoint
	spanComm
)

// span is a range of a rank, reduced to what step assembly needs.
type span struct {
	kind       spanKind
	op         int32 // commOps index for spanComm
	start, end uint64
}

// commOp is an interned (communicator, op) pair.
type commOp struct {
	group string
	op    string
	send  bool
	gi    int32 // the communicator's index, -1 for none, or unresolved
}

// unresolved marks a commOp whose communicator is not looked up yet.
const unresolved = -2

// assembler turns one rank's ranges into Steps. Ranges end in time order
// within a rank, and a step's range ends after those inside it, so the
// ranges that ended since the previous step's end make up the next step.
type assembler struct {
	pending []span
	last    int64 // number of the last step, -1 before the first
	device  uint8 // bit per spanKind (and 1<<7 for steps): a device-clock range was seen
	have    Figures
}

// stepBit marks the step kind in assembler.device.
const stepBit = 1 << 7

// useSource reports whether a range of bit's kind, a device range or a
// host one, should be counted: a marker may come as a host and a device
// range under one Id, and only one of them may count. Device ranges win
// once seen.
func (a *assembler) useSource(bit uint8, device bool) bool {
	if device {
		a.device |= bit
		return true
	}
	return a.device&bit == 0
}

// parseStepNumber returns n of "step <n>", or ok false.
func parseStepNumber(name string) (int64, bool) {
	s, ok := strings.CutPrefix(name, trace.StepMarkerPrefix)
	if !ok {
		return 0, false
	}
	// Plain digits, as writers write them, are read here: each rank has a
	// step name per step, and two readers of it.
	if len(s) > 0 && len(s) <= 18 {
		var n int64
		for i := 0; i < len(s); i++ {
			c := s[i] - '0'
			if c > 9 {
				n = -1
				break
			}
			n = n*10 + int64(c)
		}
		if n >= 0 {
			return n, true
		}
	}
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	return n, err == nil && n >= 0
}

// finish derives the Step that ends with the range [start, end] named
// number, from the pending spans, and clears them. The Comm slice of st
// is reused, and *stOps gets the op index of each of st.Comm.
func (a *assembler) finish(st *Step, stOps *[]int32, number int64, start, end uint64, ops []commOp, trailingGap uint64) {
	*st = Step{Number: number, Comm: st.Comm[:0], Have: FigStep}
	*stOps = (*stOps)[:0]
	st.Time = time.Duration(end - start)
	spans := a.pending
	slices.SortFunc(spans, func(x, y span) int {
		switch {
		case x.start < y.start:
			return -1
		case x.start > y.start:
			return 1
		}
		return 0
	})
	var firstFwd, lastFwd uint64
	haveFwd, haveComm := false, false
	for _, s := range spans {
		d := time.Duration(s.end - s.start)
		switch s.kind {
		case spanForward:
			st.Forward += d
			if !haveFwd || s.start < firstFwd {
				firstFwd = s.start
			}
			lastFwd = max(lastFwd, s.end)
			haveFwd = true
		case spanDataLoader:
			st.DataLoader += d
		case spanCheckpoint:
			st.Checkpoint += d
		case spanComm:
			haveComm = true
			// An op index stands for its (communicator, op) pair.
			i := slices.Index(*stOps, s.op)
			if i < 0 {
				o := ops[s.op]
				st.Comm = append(st.Comm, CommTime{Group: o.group, Op: o.op})
				*stOps = append(*stOps, s.op)
				i = len(st.Comm) - 1
			}
			st.Comm[i].Time += d
			st.Comm[i].Count++
		}
	}
	st.Have |= a.have &^ (FigCompute | FigSend) // figures of this step only

	// The trailing run: walk back from the latest-ending op while the ops
	// follow each other with gaps below trailingGap.
	runStart := end
	if haveComm {
		last := -1
		for i, s := range spans {
			if s.kind == spanComm && (last < 0 || s.end > spans[last].end) {
				last = i
			}
		}
		runStart = spans[last].start
		for i := len(spans) - 1; i >= 0; i-- {
			s := spans[i]
			if s.kind != spanComm || s.start >= runStart {
				continue
			}
			if s.end+trailingGap >= runStart {
				runStart = s.start
			}
		}
		runStart = max(runStart, lastFwd, start)
		runStart = min(runStart, end)
	}
	commIn := func(lo, hi uint64) uint64 { // union of communication inside [lo, hi]
		var sum, curLo, curHi uint64
		open := false
		for _, s := range spans {
			if s.kind != spanComm {
				continue
			}
			l, h := max(s.start, lo), min(s.end, hi)
			if l >= h {
				continue
			}
			switch {
			case !open:
				curLo, curHi, open = l, h, true
			case l > curHi:
				sum += curHi - curLo
				curLo, curHi = l, h
			default:
				curHi = max(curHi, h)
			}
		}
		if open {
			sum += curHi - curLo
		}
		return sum
	}
	if haveFwd && a.have&FigComm == 0 {
		// Without communication markers, waits in collectives cannot be
		// told from compute except where no collective runs: forward in
		// data parallelism.
		st.Compute = st.Forward
	}
	if haveFwd {
		firstFwd = max(firstFwd, start)
		if firstFwd > runStart {
			firstFwd = runStart
		}
		st.Gap = time.Duration(firstFwd - start)
		st.FPBP = time.Duration(runStart - firstFwd)
		st.Trailing = time.Duration(end - runStart)
		if a.have&FigComm != 0 {
			st.Compute = time.Duration(runStart - firstFwd - commIn(firstFwd, runStart))
		}
	} else {
		busy := int64(end-start) - int64(commIn(start, end)) - int64(st.DataLoader) - int64(st.Checkpoint)
		st.Compute = time.Duration(max(busy, 0))
	}
	if st.Compute > 0 {
		st.Have |= FigCompute
	}
	a.pending = a.pending[:0]
}
