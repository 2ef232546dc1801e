package slownode

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/faultline-ml/faultline/trace"
)

const msNs = uint64(time.Millisecond)

func commName(op, group string) string {
	c := trace.CommOp{OpName: op, GroupName: group, Count: 1, DataType: "fp16"}
	return string(c.AppendJSON(nil))
}

// rng is a device range of a rank in ms from an arbitrary clock origin.
func rng(name, domain string, from, to uint64) trace.Range {
	base := uint64(1_700_000_000) * 1e9
	return trace.Range{Name: name, Domain: domain, Start: base + from*msNs, End: base + to*msNs, SourceKind: trace.SourceKindDevice}
}

// TestStepFigures checks the trajectory of one step:
//
//	0   dataloader 0–10, forward 12–40 with a TP all-reduce 30–35 inside,
//	    backward (unmarked) 40–80 with an all-reduce 60–62,
//	    gradient all-reduces 80–90 and 90.1–95 (the trailing run),
//	    optimizer 95–100; step 0–100.
func TestStepFigures(t *testing.T) {
	var got Step
	d, _ := New(Config{})
	d.stepHook = func(rank int, st *Step) { got = *st; got.Comm = append([]CommTime(nil), st.Comm...) }
	tp, dp := commName("HcclAllReduce", "tp0"), commName("HcclAllReduce", "dp0")
	for _, r := range []trace.Range{
		rng(trace.MarkerDataLoader, trace.DomainDefault, 0, 10),
		rng(tp, trace.DomainCommunication, 30, 35),
		rng(trace.MarkerForward, trace.DomainDefault, 12, 40),
		rng(tp, trace.DomainCommunication, 60, 62),
		rng(dp, trace.DomainCommunication, 80, 90),
		{Name: dp, Domain: trace.DomainCommunication, Start: rng("", "", 90, 95).Start + 100_000, End: rng("", "", 90, 95).End, SourceKind: trace.SourceKindDevice},
		rng("step 7", trace.DomainDefault, 0, 100),
	} {
		d.Add(3, r)
	}
	want := Step{Number: 7, Time: 100 * time.Millisecond, Forward: 28 * time.Millisecond, DataLoader: 10 * time.Millisecond,
		Gap: 12 * time.Millisecond, FPBP: 68 * time.Millisecond, Trailing: 20 * time.Millisecond,
		Compute: (68 - 5 - 2) * time.Millisecond,
		Comm: []CommTime{
			{Group: "tp0", Op: "HcclAllReduce", Time: 7 * time.Millisecond, Count: 2},
			{Group: "dp0", Op: "HcclAllReduce", Time: 15*time.Millisecond - 100*time.Microsecond, Count: 2},
		},
		Have: FigStep | FigForward | FigDataLoader | FigComm | FigTrajectory | FigCompute}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("step (-want +got):\n%s", diff)
	}
}

func TestStepWithoutForwardMarkers(t *testing.T) {
	var got Step
	d, _ := New(Config{})
	d.stepHook = func(rank int, st *Step) { got = *st }
	d.Add(0, rng(trace.MarkerDataLoader, trace.DomainDefault, 0, 10))
	d.Add(0, rng(commName("ncclAllReduce", "g"), trace.DomainCommunication, 70, 80))
	d.Add(0, rng(commName("ncclAllReduce", "g"), trace.DomainCommunication, 75, 85)) // overlaps on another stream
	d.Add(0, rng("step 1", trace.DomainDefault, 0, 100))
	if got.Compute != 75*time.Millisecond || got.Have&FigTrajectory != 0 || got.FPBP != 0 {
		t.Fatalf("compute %v have %v fpbp %v: want 100-10-15 = 75ms busy, no trajectory", got.Compute, got.Have.Names(), got.FPBP)
	}
}

func TestHostAndDeviceRangesCountOnce(t *testing.T) {
	var got []Step
	d, _ := New(Config{})
	d.stepHook = func(rank int, st *Step) { got = append(got, *st) }
	host := func(r trace.Range) trace.Range { r.SourceKind = trace.SourceKindHost; return r }
	for n := uint64(0); n < 3; n++ {
		o := n * 100
		d.Add(0, host(rng(trace.MarkerForward, trace.DomainDefault, o+10, o+49)))
		d.Add(0, rng(trace.MarkerForward, trace.DomainDefault, o+11, o+50))
		d.Add(0, host(rng("step "+string(rune('0'+n)), trace.DomainDefault, o, o+99)))
		d.Add(0, rng("step "+string(rune('0'+n)), trace.DomainDefault, o, o+100))
	}
	// The first host step counts before the device one is seen (which
	// then repeats step 0 and is dropped); from then on device ranges
	// alone count.
	if len(got) != 4 || d.Stats().RepeatedSteps != 1 {
		t.Fatalf("%d steps derived, %d repeated; want 4 and 1", len(got), d.Stats().RepeatedSteps)
	}
	for _, st := range got[2:] {
		if st.Time != 100*time.Millisecond || st.Forward != 39*time.Millisecond {
			t.Errorf("step %d: time %v forward %v, want the device ranges' 100ms and 39ms", st.Number, st.Time, st.Forward)
		}
	}
}

func TestBadRangesAreCountedNotFatal(t *testing.T) {
	d, _ := New(Config{MaxPendingRanges: 4})
	d.Add(-1, rng("step 1", "", 0, 1))
	d.Add(0, trace.Range{Name: "forward", Start: 10, End: 5})
	d.Add(0, rng("{not an op", trace.DomainCommunication, 0, 1))
	d.Add(0, rng("something else", trace.DomainDefault, 0, 1))
	for range 6 {
		d.Add(0, rng(trace.MarkerForward, "", 0, 1))
	}
	d.Add(0, rng("step x", "", 0, 10))  // no number: follows the last (none: 0)
	d.Add(0, rng("step 0", "", 10, 20)) // repeated
	st := d.Stats()
	want := Stats{Ranges: 11, Steps: 2, Evaluated: 1, IgnoredRanges: 2, IgnoredRanks: 1, BadRanges: 1, BadCommOps: 1, DroppedRanges: 2, RepeatedSteps: 1}
	if diff := cmp.Diff(want, st); diff != "" {
		t.Fatalf("stats (-want +got):\n%s", diff)
	}
}

// TestParseStepNumber checks the plain-digits path against strconv.
func TestParseStepNumber(t *testing.T) {
	for _, name := range []string{"step 0", "step 12", "step 007", "step  3", "step 3 ", "step +3", "step -1",
		"step 999999999999999999", "step 9223372036854775807", "step 9223372036854775808", "step 1_0",
		"step ", "step", "stepx 1", "forward", "step 1e3", "step \t42\n"} {
		want, wantOK := int64(0), false
		if s, ok := strings.CutPrefix(name, trace.StepMarkerPrefix); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
			want, wantOK = n, err == nil && n >= 0
		}
		n, ok := parseStepNumber(name)
		if ok != wantOK || (ok && n != want) {
			t.Errorf("parseStepNumber(%q) = %d, %v; want %d, %v", name, n, ok, want, wantOK)
		}
	}
}
