package trace

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/faultline-ml/faultline/internal/testkit"
)

func newTestRecorder(t *testing.T, cfg RecorderConfig) *Recorder {
	t.Helper()
	if cfg.Root == "" {
		cfg.Root = t.TempDir()
	}
	if cfg.Job == "" {
		cfg.Job = "job"
	}
	r, err := NewRecorder(cfg)
	if err != nil {
		t.Fatal(err)
	}
	go r.Run(context.Background())
	t.Cleanup(func() { r.Close() })
	return r
}

func TestRecorderWritesWhatTheReaderPairs(t *testing.T) {
	root := t.TempDir()
	rec := newTestRecorder(t, RecorderConfig{Root: root, Rank: 3, Switch: AllOn()})
	op := CommOp{OpName: "HcclAllReduce", GroupName: "tp<0>", Count: 4096, DataType: "fp16", StreamID: 7}
	step := rec.StartStep(12, 1, 2)
	dl := rec.Start(DataLoader, MarkerDataLoader, 1, 0)
	dl.End()
	fp := rec.Start(FP, MarkerForward, 1, 2)
	fp.End()
	comm := rec.StartComm(&op, 1, 7)
	op.OpName = "changed after the call" // the recorder copied it
	comm.End()
	rec.Mark(SaveCheckpoint, MarkerSaveCheckpoint, 1, 0)
	step.End()
	if err := rec.Close(); err != nil {
		t.Fatal(err)
	}

	dir := filepath.Join(root, "job", "3")
	recs, st := readAll(t, dir)
	if st.GarbageLines != 0 || len(recs) != 9 {
		t.Fatalf("read %d records, %d garbage (%v); want 9, 0", len(recs), st.GarbageLines, st.LastGarbage)
	}
	var p Pairer
	type got struct {
		Name, Domain string
		Dev, Stream  uint32
		Instant      bool
	}
	var ranges []got
	for i := range recs {
		if r, ok := p.Add(&recs[i]); ok {
			if r.End < r.Start {
				t.Errorf("range %q ends before it starts", r.Name)
			}
			ranges = append(ranges, got{r.Name, r.Domain, r.DeviceID, r.StreamID, r.Start == r.End})
		}
	}
	wantOp := `{"opName":"HcclAllReduce","groupName":"tp\u003c0\u003e","count":"4096","dataType":"fp16","streamId":"7"}`
	want := []got{
		{"dataloader", "default", 1, 0, false},
		{"forward", "default", 1, 2, false},
		{wantOp, "communication", 1, 7, false},
		{"save_checkpoint", "default", 1, 0, true},
		{"step 12", "default", 1, 2, false},
	}
	if diff := cmp.Diff(want, ranges); diff != "" {
		t.Fatalf("ranges (-want +got):\n%s", diff)
	}
	if s := p.Stats(); s.UnmatchedEnds != 0 || s.Open != 0 {
		t.Fatalf("pairer stats %+v", s)
	}
	// Flags as MindCluster writes them.
	flags := map[string]Flag{}
	for _, r := range recs {
		if r.Name != "" {
			flags[r.Name] = r.Flag
		}
	}
	if flags["step 12"] != FlagDeviceStart || flags["dataloader"] != FlagHostStart || flags["save_checkpoint"] != FlagInstant {
		t.Errorf("flags %v", flags)
	}
	s := rec.Stats()
	if s.Written.Default != 7 || s.Written.Communication != 2 || s.Files != 1 || s.Dropped != (DomainCounts{}) {
		t.Errorf("stats %+v", s)
	}
}

func TestRecorderOffWritesNothing(t *testing.T) {
	root := t.TempDir()
	rec := newTestRecorder(t, RecorderConfig{Root: root})
	rec.StartStep(1, 0, 0).End()
	rec.Start(FP, MarkerForward, 0, 0).End()
	rec.Mark(DataLoader, MarkerDataLoader, 0, 0)
	if rec.Record(&Record{Flag: FlagHostStart, Domain: DomainDefault}) {
		t.Error("raw record taken while all is off")
	}
	rec.Close()
	if ents, _ := os.ReadDir(root); len(ents) != 0 {
		t.Fatalf("files created while off: %v", ents)
	}
}

// TestRecorderFlushesPeriodically records without Flush or Close: the
// records reach the file within FlushInterval, as complete lines.
func TestRecorderFlushesPeriodically(t *testing.T) {
	root := t.TempDir()
	rec := newTestRecorder(t, RecorderConfig{Root: root, Switch: AllOn(), FlushInterval: 50 * time.Millisecond})
	rec.StartStep(1, 0, 0).End()
	dir := filepath.Join(root, "job", "0")
	testkit.WaitFor(t, "the periodic flush", func() bool {
		if _, err := os.Stat(dir); err != nil {
			return false
		}
		recs, st := readAll(t, dir)
		if st.GarbageLines != 0 {
			t.Fatalf("garbage after a periodic flush: %v", st.LastGarbage)
		}
		return len(recs) == 2
	})
}

func TestRecorderSwitchPerKind(t *testing.T) {
	root := t.TempDir()
	rec := newTestRecorder(t, RecorderConfig{Root: root, Switch: Switch{FP: true}})
	rec.StartStep(1, 0, 0).End()             // off
	rec.Start(FP, MarkerForward, 0, 0).End() // on
	if !rec.Record(&Record{Flag: FlagHostStart, ID: 1, Name: "x", Domain: DomainDefault}) {
		t.Error("default-domain raw record refused while FP is on")
	}
	if rec.Record(&Record{Flag: FlagHostStart, ID: 2, Domain: DomainCommunication}) {
		t.Error("communication raw record taken while CommunicationOperator is off")
	}
	span := rec.Start(FP, MarkerForward, 0, 0)
	rec.SetSwitch(Switch{})
	span.End() // a started range still ends
	rec.Start(FP, MarkerForward, 0, 0).End()
	if got := rec.Switch(); got != (Switch{}) {
		t.Errorf("Switch() = %v", got)
	}
	rec.Close()
	recs, _ := readAll(t, filepath.Join(root, "job", "0"))
	var names []string
	for _, r := range recs {
		names = append(names, r.Name)
	}
	if diff := cmp.Diff([]string{"forward", "", "x", "forward", ""}, names); diff != "" {
		t.Fatalf("records (-want +got):\n%s", diff)
	}
}

func TestRecorderConcurrentIDsUnique(t *testing.T) {
	root := t.TempDir()
	rec := newTestRecorder(t, RecorderConfig{Root: root, Switch: AllOn(), BufferRecords: 1 << 16})
	const goroutines, each = 8, 2000
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				rec.StartStep(uint64(i), uint32(g), 0).End()
			}
		}()
	}
	wg.Wait()
	if err := rec.Close(); err != nil {
		t.Fatal(err)
	}
	recs, _ := readAll(t, filepath.Join(root, "job", "0"))
	s := rec.Stats()
	if got := uint64(len(recs)) + s.Dropped.Default; got != 2*goroutines*each {
		t.Fatalf("%d read + %d dropped, want %d", len(recs), s.Dropped.Default, 2*goroutines*each)
	}
	starts := map[uint64]bool{}
	var p Pairer
	for i := range recs {
		if recs[i].Flag.IsStart() {
			if starts[recs[i].ID] {
				t.Fatalf("id %d used twice", recs[i].ID)
			}
			starts[recs[i].ID] = true
		}
		p.Add(&recs[i])
	}
	if ps := p.Stats(); ps.UnmatchedEnds != 0 || ps.Open != 0 {
		t.Fatalf("pairer: %+v", ps)
	}
}

// TestRecorderDropsWhenWriterStalls holds the writer goroutine and fills
// the ring: the callers go on, the excess is counted, nothing blocks.
func TestRecorderDropsWhenWriterStalls(t *testing.T) {
	root := t.TempDir()
	reg := prometheus.NewPedanticRegistry()
	rec := newTestRecorder(t, RecorderConfig{Root: root, Switch: AllOn(), BufferRecords: 64, Registerer: reg})
	release := make(chan struct{})
	held := make(chan struct{})
	go rec.do(func(*fileWriter) error { close(held); <-release; return nil })
	<-held
	for i := range 100 {
		rec.StartStep(uint64(i), 0, 0).End()
		rec.StartComm(&CommOp{OpName: "HcclSend"}, 0, 0).End()
	}
	close(release)
	if err := rec.Flush(); err != nil {
		t.Fatal(err)
	}
	s := rec.Stats()
	if s.Written.Default+s.Written.Communication != 64 {
		t.Errorf("written %+v, want 64 in all", s.Written)
	}
	if s.Dropped.Default+s.Dropped.Communication != 400-64 || s.Dropped.Default == 0 || s.Dropped.Communication == 0 {
		t.Errorf("dropped %+v, want %d in all", s.Dropped, 400-64)
	}
	want := []string{
		`faultline_trace_records_dropped_total{domain="communication",reason="buffer_full"} ` + itoa(s.Dropped.Communication),
		`faultline_trace_records_dropped_total{domain="communication",reason="write_error"} 0`,
		`faultline_trace_records_dropped_total{domain="default",reason="buffer_full"} ` + itoa(s.Dropped.Default),
		`faultline_trace_records_dropped_total{domain="default",reason="write_error"} 0`,
	}
	if diff := cmp.Diff(want, gatherLines(t, reg, "faultline_trace_records_dropped_total")); diff != "" {
		t.Errorf("metrics (-want +got):\n%s", diff)
	}
}

func TestRecorderMetrics(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	rec := newTestRecorder(t, RecorderConfig{Switch: Switch{Step: true, CommunicationOperator: true}, Registerer: reg})
	rec.StartStep(1, 0, 0).End()
	rec.StartComm(&CommOp{OpName: "HcclAllGather"}, 0, 0).End()
	if err := rec.Flush(); err != nil {
		t.Fatal(err)
	}
	want := []string{
		`faultline_trace_files_created_total 1`,
		`faultline_trace_records_written_total{domain="communication"} 2`,
		`faultline_trace_records_written_total{domain="default"} 2`,
		`faultline_trace_switch_enabled{kind="CommunicationOperator"} 1`,
		`faultline_trace_switch_enabled{kind="DataLoader"} 0`,
		`faultline_trace_switch_enabled{kind="FP"} 0`,
		`faultline_trace_switch_enabled{kind="SaveCheckpoint"} 0`,
		`faultline_trace_switch_enabled{kind="Step"} 1`,
	}
	got := gatherLines(t, reg, "faultline_trace_records_written_total", "faultline_trace_switch_enabled", "faultline_trace_files_created_total")
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("metrics (-want +got):\n%s", diff)
	}
	if n := gatherValue(t, reg, "faultline_trace_written_bytes_total"); n <= 0 {
		t.Errorf("written bytes %v", n)
	}
}

// TestCloseUnregistersMetrics builds each metered type twice on one
// registry: the second collides while the first lives, and registers once
// it is closed.
func TestCloseUnregistersMetrics(t *testing.T) {
	root := t.TempDir()
	closer := func(c io.Closer, err error) (func() error, error) {
		if err != nil {
			return nil, err
		}
		return c.Close, nil
	}
	for _, tc := range []struct {
		name string
		open func(prometheus.Registerer) (func() error, error)
	}{
		{"RecorderConfig", func(reg prometheus.Registerer) (func() error, error) {
			return closer(NewRecorder(RecorderConfig{Root: root, Job: "job", Registerer: reg}))
		}},
		{"AgerConfig", func(reg prometheus.Registerer) (func() error, error) {
			return closer(NewAger(AgerConfig{Root: root, Registerer: reg}))
		}},
		{"SwitchWatcherConfig", func(reg prometheus.Registerer) (func() error, error) {
			return closer(NewSwitchWatcher(SwitchWatcherConfig{Path: filepath.Join(root, "switch"), Registerer: reg}))
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			testkit.SharedRegisterer(t, "trace: "+tc.name+".Registerer", "faultline_trace_", tc.open)
		})
	}
}

func TestRecorderZeroAllocs(t *testing.T) {
	rec := newTestRecorder(t, RecorderConfig{Switch: AllOn(), BufferRecords: 1 << 20})
	op := CommOp{OpName: "HcclAllReduce", GroupName: "dp"}
	allocs := testing.AllocsPerRun(1000, func() {
		rec.StartStep(1, 0, 0).End()
		rec.Start(FP, MarkerForward, 0, 1).End()
		rec.StartComm(&op, 0, 1).End()
		rec.Mark(DataLoader, MarkerDataLoader, 0, 0)
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per run with the switch on", allocs)
	}
}

func TestRecorderConfigValidate(t *testing.T) {
	for _, c := range []RecorderConfig{
		{Rank: -1},
		{Job: "../../etc"},
		{Job: "a/b"},
		{BufferRecords: -1},
		{FlushInterval: -1},
		{MaxFileBytes: -5},
	} {
		if _, err := NewRecorder(c); err == nil || !strings.Contains(err.Error(), "RecorderConfig.") {
			t.Errorf("NewRecorder(%+v) = %v, want an error naming the field", c, err)
		}
	}
}

func TestRecorderCloseIdempotentAndAfterClose(t *testing.T) {
	rec := newTestRecorder(t, RecorderConfig{Switch: AllOn()})
	if err := rec.Close(); err != nil {
		t.Fatal(err)
	}
	if err := rec.Close(); err != nil {
		t.Fatal(err)
	}
	rec.SetSwitch(AllOn())
	if rec.Enabled(Step) {
		t.Fatal("switch turned on after Close")
	}
	rec.StartStep(1, 0, 0).End()
	if err := rec.Flush(); err == nil {
		t.Fatal("Flush after Close succeeded")
	}
}

func TestRecorderStopsWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	rec, err := NewRecorder(RecorderConfig{Root: t.TempDir(), Job: "j", Switch: AllOn()})
	if err != nil {
		t.Fatal(err)
	}
	ran := make(chan error)
	go func() { ran <- rec.Run(ctx) }()
	rec.StartStep(1, 0, 0).End()
	cancel()
	if err := <-ran; err != nil {
		t.Fatal(err)
	}
	if s := rec.Stats(); s.Written.Default != 2 {
		t.Fatalf("written %+v after the context ended", s.Written)
	}
	if err := rec.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestRecorderWithoutRun closes and flushes a Recorder that Run never ran:
// what was recorded is written all the same.
func TestRecorderWithoutRun(t *testing.T) {
	root := t.TempDir()
	rec, err := NewRecorder(RecorderConfig{Root: root, Job: "j", Switch: AllOn()})
	if err != nil {
		t.Fatal(err)
	}
	rec.StartStep(1, 0, 0).End()
	if err := rec.Flush(); err != nil {
		t.Fatal(err)
	}
	rec.StartStep(2, 0, 0).End()
	if err := rec.Close(); err != nil {
		t.Fatal(err)
	}
	if s := rec.Stats(); s.Written.Default != 4 {
		t.Fatalf("written %+v", s.Written)
	}
	if err := rec.Run(context.Background()); err != nil {
		t.Fatalf("Run after Close: %v", err)
	}
}

func itoa(n uint64) string { return strconv.FormatUint(n, 10) }

// gatherLines returns the named metrics as sorted `name{labels} value` lines.
func gatherLines(t *testing.T, reg prometheus.Gatherer, names ...string) []string {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	for _, mf := range mfs {
		if !slices.Contains(names, mf.GetName()) {
			continue
		}
		for _, m := range mf.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			v := m.GetCounter().GetValue() + m.GetGauge().GetValue()
			name := mf.GetName()
			if len(labels) > 0 {
				name += "{" + strings.Join(labels, ",") + "}"
			}
			lines = append(lines, fmt.Sprintf("%s %v", name, v))
		}
	}
	slices.Sort(lines)
	return lines
}

// gatherValue returns the value of an unlabelled counter or gauge.
func gatherValue(t *testing.T, reg prometheus.Gatherer, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) == 1 {
			m := mf.GetMetric()[0]
			if c := m.GetCounter(); c != nil {
				return c.GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// The caller's thread stores one cache line a record.
func TestRingCellIsOneCacheLine(t *testing.T) {
	if n := unsafe.Sizeof(cell{}); n != 64 {
		t.Errorf("a ring cell is %d bytes, want 64", n)
	}
}
