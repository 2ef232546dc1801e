package main

import (
	"context"
	"errors"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/faultline-ml/faultline/trace"
)

func TestParseMarker(t *testing.T) {
	for _, tc := range []struct {
		name, domain string
		want         marker
		bad          bool
	}{
		{name: "step 12", want: marker{kind: trace.Step, step: 12}},
		{name: "step 0", domain: "default", want: marker{kind: trace.Step}},
		{name: "forward", want: marker{kind: trace.FP, name: "forward"}},
		{name: "dataloader", want: marker{kind: trace.DataLoader, name: "dataloader"}},
		{name: "save_checkpoint", want: marker{kind: trace.SaveCheckpoint, name: "save_checkpoint"}},
		{name: `{"opName":"HcclAllReduce"}`, domain: "communication", want: marker{kind: trace.CommunicationOperator}},
		{name: "step", bad: true},
		{name: "step -1", bad: true},
		{name: "step 1x", bad: true},
		{name: "backward", bad: true},
		{name: "", bad: true},
		{name: "", domain: "communication", bad: true},
		{name: "forward", domain: "other", bad: true},
	} {
		got, err := parseMarker(tc.name, tc.domain)
		if tc.bad {
			if !errors.Is(err, errBadMarker) {
				t.Errorf("parseMarker(%q, %q) = %+v, %v; want errBadMarker", tc.name, tc.domain, got, err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("parseMarker(%q, %q) = %+v, %v; want %+v", tc.name, tc.domain, got, err, tc.want)
		}
	}
}

// FuzzParseMarker checks that every marker taken maps to the kind that
// trace.KindOf gives its name, and that nothing panics.
func FuzzParseMarker(f *testing.F) {
	for _, s := range [][2]string{{"step 3", ""}, {"forward", "default"}, {"x", "communication"}, {"step 18446744073709551616", ""}, {"dataloader", "nope"}} {
		f.Add(s[0], s[1])
	}
	f.Fuzz(func(t *testing.T, name, domain string) {
		m, err := parseMarker(name, domain)
		if err != nil {
			if !errors.Is(err, errBadMarker) {
				t.Fatalf("error %v does not wrap errBadMarker", err)
			}
			return
		}
		d := domain
		if d == "" {
			d = trace.DomainDefault
		}
		if k, ok := trace.KindOf(name, d); !ok || k != m.kind {
			t.Fatalf("parseMarker(%q, %q) = %v, KindOf = %v %v", name, domain, m.kind, k, ok)
		}
		if m.kind == trace.Step {
			n := strings.TrimPrefix(name, trace.StepMarkerPrefix)
			if strings.TrimLeft(n, "0") != strings.TrimLeft(strconv.FormatUint(m.step, 10), "0") {
				t.Fatalf("step %q parsed as %d", name, m.step)
			}
		}
	})
}

func newTestRecorder(t testing.TB, sw trace.Switch) (*trace.Recorder, string) {
	t.Helper()
	root := t.TempDir()
	rec, err := trace.NewRecorder(trace.RecorderConfig{Root: root, Job: "j", Rank: 1, Switch: sw})
	if err != nil {
		t.Fatal(err)
	}
	go rec.Run(context.Background())
	t.Cleanup(func() { rec.Close() })
	return rec, filepath.Join(root, "j", "1")
}

func TestRangeTable(t *testing.T) {
	rec, dir := newTestRecorder(t, trace.Switch{Step: true, CommunicationOperator: true})
	rt := newRangeTable(rec, 7)
	step, err := rt.start("step 4", "")
	if err != nil || step == 0 {
		t.Fatalf("step: %d, %v", step, err)
	}
	fwd, err := rt.start("forward", "default")
	if err != nil || fwd != 0 {
		t.Fatalf("forward while FP is off: %d, %v", fwd, err)
	}
	comm, err := rt.start(`{"opName":"HcclAllReduce","groupName":"tp"}`, "communication")
	if err != nil || comm == 0 {
		t.Fatalf("comm: %d, %v", comm, err)
	}
	if err := rt.mark("save_checkpoint", ""); err != nil {
		t.Fatal(err)
	}
	if _, err := rt.start("backward", ""); !errors.Is(err, errBadMarker) {
		t.Errorf("backward: %v", err)
	}
	if err := rt.mark("backward", ""); !errors.Is(err, errBadMarker) {
		t.Errorf("mark backward: %v", err)
	}
	for _, id := range []uint64{comm, step, fwd} {
		if err := rt.end(id); err != nil {
			t.Errorf("end %d: %v", id, err)
		}
	}
	if err := rt.end(step); !errors.Is(err, errUnknownRange) {
		t.Errorf("second end: %v", err)
	}
	if n := rt.openRanges(); n != 0 {
		t.Errorf("%d ranges open", n)
	}
	if err := rec.Close(); err != nil {
		t.Fatal(err)
	}
	r, err := trace.OpenRankReader(dir, trace.ReaderConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	var p trace.Pairer
	var got []string
	r.Read(func(rec *trace.Record) error {
		if rg, ok := p.Add(rec); ok {
			if rg.DeviceID != 7 {
				t.Errorf("range %+v on device %d", rg, rg.DeviceID)
			}
			got = append(got, rg.Domain+":"+rg.Name)
		}
		return nil
	})
	want := `communication:{"opName":"HcclAllReduce","groupName":"tp"} default:step 4`
	if strings.Join(got, " ") != want {
		t.Errorf("ranges %q, want %q", got, want)
	}
}

func TestRangeTableBound(t *testing.T) {
	rec, _ := newTestRecorder(t, trace.Switch{FP: true})
	rt := newRangeTable(rec, 0)
	var first uint64
	for i := range maxOpenRanges {
		id, err := rt.start("forward", "")
		if err != nil {
			t.Fatalf("range %d: %v", i, err)
		}
		if i == 0 {
			first = id
		}
		if id == 0 { // the recorder's buffer filled: nothing recorded, nothing held
			rt.mu.Lock()
			rt.open[uint64(1<<62+i)] = trace.Span{}
			rt.mu.Unlock()
		}
	}
	if _, err := rt.start("forward", ""); !errors.Is(err, errTooManyOpen) {
		t.Fatalf("range past the bound: %v", err)
	}
	if err := rt.end(first); err != nil {
		t.Fatal(err)
	}
	if _, err := rt.start("forward", ""); err != nil {
		t.Errorf("range after one ended: %v", err)
	}
}
