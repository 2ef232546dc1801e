package hang

import (
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

func newTestWatchdog(t *testing.T, cfg Config) (*Watchdog, *fakeClock) {
	t.Helper()
	clock := newFakeClock()
	cfg.Now = clock.Now
	w, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return w, clock
}

func TestFixedTimeout(t *testing.T) {
	w, clock := newTestWatchdog(t, Config{Rank: 2, World: 4})
	op := w.Op("HcclAllReduce", "dp")
	if op.Timeout() != 300*time.Second {
		t.Fatalf("default timeout %v", op.Timeout())
	}
	t1 := op.Start(1)
	clock.Advance(299 * time.Second)
	t2 := op.Start(2)
	if f := w.Check(); len(f) != 0 {
		t.Fatalf("faults before the timeout: %v", f)
	}
	clock.Advance(time.Second)
	faults := w.Check()
	want := []Fault{{Kind: FaultHang, Rank: 2, Op: "HcclAllReduce", Group: "dp", Stream: 1, Elapsed: 300 * time.Second, Timeout: 300 * time.Second, Time: clock.Now()}}
	if diff := cmp.Diff(want, faults); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	if f := w.Check(); len(f) != 0 {
		t.Errorf("a hang is reported once, got again %v", f)
	}
	t1.End()
	t1.End() // a second End does nothing
	t2.End()
	clock.Advance(time.Hour)
	if f := w.Check(); len(f) != 0 {
		t.Errorf("ended ops reported: %v", f)
	}
	var zero Timing
	zero.End()
	zero.Fail(errors.New("x"))
}

// Ops found hung at one Check come earliest deadline first, whatever
// slots they took.
func TestHangsEarliestDeadlineFirst(t *testing.T) {
	w, clock := newTestWatchdog(t, Config{Timeout: 10 * time.Second})
	op := w.Op("HcclAllReduce", "dp")
	a := op.Start(1)
	op.Start(2)
	a.End() // its slot goes to the next Start
	clock.Advance(time.Second)
	op.Start(3)
	clock.Advance(time.Minute)
	var streams []int
	for _, f := range w.Check() {
		streams = append(streams, f.Stream)
	}
	if diff := cmp.Diff([]int{2, 3}, streams); diff != "" {
		t.Errorf("streams of the hung ops (-want +got):\n%s", diff)
	}
}

func TestLearnedTimeout(t *testing.T) {
	w, clock := newTestWatchdog(t, Config{LearnTimeouts: true, LearnMinSamples: 10, LearnWindow: 100, LearnFactor: 4, LearnFloor: time.Second, Timeout: time.Minute})
	op := w.Op("AllGather", "tp")
	run := func(d time.Duration) {
		tm := op.Start(0)
		clock.Advance(d)
		tm.End()
	}
	for range 9 {
		run(500 * time.Millisecond)
	}
	w.Check()
	if op.Timeout() != time.Minute {
		t.Fatalf("learned from 9 < 10 samples: %v", op.Timeout())
	}
	run(500 * time.Millisecond)
	w.Check()
	if op.Timeout() != 2*time.Second {
		t.Fatalf("timeout %v, want p99 500ms × 4 = 2s", op.Timeout())
	}
	// 1% of slow ops does not move the p99 of 100 much; 2% does.
	for i := range 100 {
		d := 100 * time.Millisecond
		if i == 0 {
			d = 10 * time.Second
		}
		run(d)
	}
	w.Check()
	if op.Timeout() != time.Second {
		t.Errorf("timeout %v, want the floor of 1s (p99 100ms × 4)", op.Timeout())
	}
	// The window holds the last 100: the next sample pushes out the
	// oldest, the slow one, so two slow ones are 2%.
	run(10 * time.Second)
	run(10 * time.Second)
	w.Check()
	if op.Timeout() != 40*time.Second {
		t.Errorf("timeout %v, want p99 10s × 4", op.Timeout())
	}
	run(20 * time.Second)
	run(20 * time.Second)
	w.Check()
	if op.Timeout() != time.Minute {
		t.Errorf("timeout %v, want the cap of Timeout (1m)", op.Timeout())
	}

	// The healthy op now hangs after its learned timeout, in seconds.
	for range 100 {
		run(100 * time.Millisecond)
	}
	w.Check()
	tm := op.Start(3)
	clock.Advance(999 * time.Millisecond)
	if f := w.Check(); len(f) != 0 {
		t.Fatalf("early fault %v", f)
	}
	clock.Advance(time.Millisecond)
	f := w.Check()
	if len(f) != 1 || f[0].Timeout != time.Second || f[0].Stream != 3 {
		t.Fatalf("faults %v, want a hang at the 1s learned timeout", f)
	}
	// A hung op's duration is not learned from.
	clock.Advance(time.Hour)
	tm.End()
	w.Check()
	if op.Timeout() != time.Second {
		t.Errorf("hung op moved the timeout to %v", op.Timeout())
	}
	// Another group of the same name learns apart.
	if w.Op("AllGather", "dp").Timeout() != time.Minute || w.Op("AllGather", "tp") != op {
		t.Error("ops are not keyed by name and group")
	}
}

func TestLearnedTimeoutValue(t *testing.T) {
	cfg := Config{Timeout: time.Hour, LearnFactor: 2, LearnFloor: time.Millisecond}
	durations := make([]int64, 200)
	for i := range durations {
		durations[i] = int64(i+1) * int64(time.Millisecond)
	}
	// ceil(0.99 × 200) = 198th smallest = 198ms.
	if got := learnedTimeout(durations, cfg); got != 396*time.Millisecond {
		t.Errorf("got %v, want 396ms", got)
	}
	if got := learnedTimeout([]int64{int64(time.Hour) * 1000}, Config{Timeout: time.Hour, LearnFactor: 1e6}); got != time.Hour {
		t.Errorf("overflow not capped: %v", got)
	}
}

func TestHeartbeat(t *testing.T) {
	w, clock := newTestWatchdog(t, Config{Rank: 1, World: 2})
	hb := w.Heartbeat("trainer")
	other := w.Heartbeat("data")
	for range 10 {
		clock.Advance(100 * time.Millisecond)
		hb.Beat()
		other.Beat()
		if f := w.Check(); len(f) != 0 {
			t.Fatalf("faults while beating: %v", f)
		}
	}
	other.Stop()
	clock.Advance(DefaultHeartbeatTimeout)
	if f := w.Check(); len(f) != 0 {
		t.Fatalf("fault at exactly the timeout: %v", f)
	}
	// With ticks of 100ms, the loss is seen at most one tick after the
	// timeout: within 1s of the last beat.
	clock.Advance(DefaultTick)
	faults := w.Check()
	want := []Fault{{Kind: FaultHeartbeat, Rank: 1, Heartbeat: "trainer", Elapsed: DefaultHeartbeatTimeout + DefaultTick, Timeout: DefaultHeartbeatTimeout, Time: clock.Now()}}
	if diff := cmp.Diff(want, faults); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	if want[0].Elapsed >= time.Second {
		t.Errorf("detected %v after the last beat, want under 1s", want[0].Elapsed)
	}
	clock.Advance(time.Minute)
	if f := w.Check(); len(f) != 0 {
		t.Errorf("a lost heartbeat is reported once: %v", f)
	}
	hb.Beat()
	w.Check()
	clock.Advance(time.Second)
	if f := w.Check(); len(f) != 1 {
		t.Errorf("a heartbeat that came back and stopped again: %v", f)
	}
}

func TestOpErrorReportedByCheck(t *testing.T) {
	var got []Fault
	w, clock := newTestWatchdog(t, Config{OnFault: func(f Fault) { got = append(got, f) }})
	op := w.Op("send", "")
	tm := op.Start(0)
	clock.Advance(3 * time.Millisecond)
	boom := errors.New("HCCL error 7: remote rank gone")
	tm.Fail(boom)
	tm.End() // after Fail, nothing
	faults := w.Check()
	if len(faults) != 1 || faults[0].Kind != FaultOpError || !errors.Is(faults[0].Err, boom) || faults[0].Elapsed != 3*time.Millisecond {
		t.Fatalf("faults %v", faults)
	}
	if diff := cmp.Diff(faults, got, cmpopts.EquateErrors()); diff != "" {
		t.Errorf("OnFault saw (-returned +seen):\n%s", diff)
	}
	if !strings.Contains(faults[0].String(), "op send (stream 0) failed after 3ms: HCCL error 7") {
		t.Errorf("String() = %q", faults[0].String())
	}
}

// TestOpErrorStormIsBounded: errors pile up while nobody checks; memory
// stays bounded and the metric still counts every one.
func TestOpErrorStormIsBounded(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	w, _ := newTestWatchdog(t, Config{Registerer: reg})
	op := w.Op("send", "")
	for range maxPending + 500 {
		op.Start(0).Fail(errors.New("link down"))
	}
	if got := len(w.Check()); got != maxPending {
		t.Errorf("Check returned %d faults, want the first %d", got, maxPending)
	}
	if v := metricValue(t, w.met.faults.WithLabelValues("op_error")); v != maxPending+500 {
		t.Errorf("op_error faults = %v, want %d", v, maxPending+500)
	}
	op.Start(0).Fail(errors.New("again"))
	if got := len(w.Check()); got != 1 {
		t.Errorf("after the storm, Check returned %d faults, want 1", got)
	}
}

// TestWatchdogModel drives the watchdog with random starts, ends and
// clock steps, and checks every Check against a direct computation.
func TestWatchdogModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for iter := range 50 {
		timeout := time.Duration(1+rng.IntN(100)) * time.Millisecond
		w, clock := newTestWatchdog(t, Config{Timeout: timeout})
		ops := []*Op{w.Op("a", ""), w.Op("b", "g")}
		type inflight struct {
			t        Timing
			deadline time.Time
			reported bool
		}
		var live []*inflight
		for step := range 500 {
			switch rng.IntN(4) {
			case 0, 1:
				live = append(live, &inflight{t: ops[rng.IntN(2)].Start(step), deadline: clock.Now().Add(timeout)})
			case 2:
				if len(live) > 0 {
					i := rng.IntN(len(live))
					live[i].t.End()
					live = append(live[:i], live[i+1:]...)
				}
			case 3:
				clock.Advance(time.Duration(rng.IntN(30)) * time.Millisecond)
			}
			if rng.IntN(3) > 0 {
				continue
			}
			want := map[int]bool{}
			for _, x := range live {
				if !x.reported && !clock.Now().Before(x.deadline) {
					x.reported = true
					want[x.t.slot2stream()] = true
				}
			}
			got := map[int]bool{}
			for _, f := range w.Check() {
				got[f.Stream] = true
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Fatalf("iter %d step %d: hung streams (-want +got):\n%s", iter, step, diff)
			}
		}
	}
}

// slot2stream returns the stream a timing was started on (test only).
func (t Timing) slot2stream() int {
	w := t.op.w
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.slots[t.slot].stream
}

func TestMetrics(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	w, clock := newTestWatchdog(t, Config{Rank: 5, World: 8, Registerer: reg, Timeout: time.Second})
	var are prometheus.AlreadyRegisteredError
	if _, err := New(Config{Rank: 5, World: 8, Registerer: reg}); !errors.As(err, &are) ||
		!strings.HasPrefix(err.Error(), "hang: Config.Registerer (rank 5): register faultline_hang_") {
		t.Errorf("a second watchdog of rank 5 on one registry: %v, want an AlreadyRegisteredError naming the field", err)
	}
	if _, err := New(Config{Rank: 6, World: 8, Registerer: reg}); err != nil {
		t.Errorf("a watchdog of another rank on the same registry: %v", err)
	}
	op := w.Op("allreduce", "dp")
	tm := op.Start(0)
	op.Start(1).Fail(errors.New("x"))
	clock.Advance(2 * time.Second)
	w.Check()
	if v := metricValue(t, w.met.hung); v != 1 {
		t.Errorf("hung = %v, want 1", v)
	}
	if v := metricValue(t, w.met.faults.WithLabelValues("hang")); v != 1 {
		t.Errorf("hang faults = %v", v)
	}
	if v := metricValue(t, w.met.faults.WithLabelValues("op_error")); v != 1 {
		t.Errorf("op_error faults = %v", v)
	}
	if got := gathered(t, reg, "faultline_hang_ops_in_flight"); len(got) != 2 || got[`rank="5"`] != 1 {
		t.Errorf("in-flight series %v, want rank 5 at 1 (one op ended by Fail) and rank 6", got)
	}
	tm.End()
	w.Check()
	if v := metricValue(t, w.met.hung); v != 0 {
		t.Errorf("hung = %v after the op ended, want 0", v)
	}
	if got := gathered(t, reg, "faultline_hang_hung"); !cmp.Equal(got, map[string]float64{`rank="5"`: 0, `rank="6"`: 0}) {
		t.Errorf("faultline_hang_hung series %v", got)
	}
	// Closed, rank 5 can be watched again (a restarted worker).
	w.Close()
	if _, err := New(Config{Rank: 5, World: 8, Registerer: reg}); err != nil {
		t.Errorf("a new watchdog of rank 5 after Close: %v", err)
	}
}

// metricValue returns the value of a collector of one gauge or counter.
func metricValue(t *testing.T, c prometheus.Collector) float64 {
	t.Helper()
	ch := make(chan prometheus.Metric, 1)
	c.Collect(ch)
	var m dto.Metric
	if err := (<-ch).Write(&m); err != nil {
		t.Fatal(err)
	}
	if m.Gauge != nil {
		return m.Gauge.GetValue()
	}
	return m.Counter.GetValue()
}

// gathered returns the series of a metric family in reg, by their labels.
func gathered(t *testing.T, reg *prometheus.Registry, name string) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.Metric {
			var labels []string
			for _, l := range m.Label {
				labels = append(labels, l.GetName()+"="+strconv.Quote(l.GetValue()))
			}
			v := m.GetGauge().GetValue() + m.GetCounter().GetValue()
			out[strings.Join(labels, ",")] = v
		}
	}
	return out
}

func TestConfigValidate(t *testing.T) {
	if err := (Config{}).Validate(); err != nil {
		t.Errorf("zero Config: %v", err)
	}
	for _, tc := range []struct {
		cfg   Config
		field string
	}{
		{Config{World: -1}, "World"},
		{Config{Rank: 1}, "Rank"},
		{Config{Rank: 4, World: 4}, "Rank"},
		{Config{Timeout: -1}, "Timeout"},
		{Config{LearnFactor: 0.5}, "LearnFactor"},
		{Config{LearnFloor: -1}, "LearnFloor"},
		{Config{LearnMinSamples: -1}, "LearnMinSamples"},
		{Config{LearnWindow: 1 << 30}, "LearnWindow"},
		{Config{HeartbeatTimeout: -1}, "HeartbeatTimeout"},
		{Config{Tick: -1}, "Tick"},
		{Config{Pid: -1}, "Pid"},
		{Config{CaptureTimeout: -1}, "CaptureTimeout"},
		{Config{StopOn: 1 << 7}, "StopOn"},
	} {
		err := tc.cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), "Config."+tc.field) {
			t.Errorf("%+v: %v, want an error naming %s", tc.cfg, err, tc.field)
		}
		if _, err := New(tc.cfg); err == nil {
			t.Errorf("New(%+v): no error", tc.cfg)
		}
	}
	if _, err := Merge(nil, MergeConfig{World: -1}); err == nil || !strings.Contains(err.Error(), "MergeConfig.World") {
		t.Errorf("MergeConfig{World: -1}: %v", err)
	}
}

// TestRunReportsOpErrorAtOnce uses a tick of an hour: only the wake-up of
// Fail can report the error.
func TestRunReportsOpErrorAtOnce(t *testing.T) {
	faults := make(chan Fault, 1)
	stops := make(chan Fault, 1)
	w, err := New(Config{Tick: time.Hour, StopOn: FaultOpError,
		OnFault: func(f Fault) { faults <- f },
		Stop:    func(_ context.Context, f Fault) error { stops <- f; return nil }})
	if err != nil {
		t.Fatal(err)
	}
	runErr := make(chan error, 1)
	go func() { runErr <- w.Run(context.Background()) }()
	defer w.Close()

	w.Op("recv", "pp").Start(0).Fail(errors.New("link down"))
	select {
	case f := <-faults:
		if f.Kind != FaultOpError {
			t.Errorf("fault %v", f)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("op error not reported")
	}
	select {
	case f := <-stops:
		if f.Kind != FaultOpError {
			t.Errorf("stopped for %v", f)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("stop policy not applied")
	}
	// Stop happens once.
	w.Op("recv", "pp").Start(0).Fail(errors.New("again"))
	<-faults
	// Close ends Run. (Run's result reaches runErr through the goroutine
	// after Run returns, which may be after Close returned: wait for it.)
	w.Close()
	select {
	case err := <-runErr:
		if err != nil {
			t.Errorf("Run after Close: %v", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("Run did not return after Close")
	}
	select {
	case f := <-stops:
		t.Errorf("second stop for %v", f)
	default:
	}
	if err := w.Run(context.Background()); err != nil {
		t.Errorf("Run after Close: %v, want nil at once", err)
	}
}

func TestRunTwiceAndContext(t *testing.T) {
	w, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	started := make(chan struct{})
	go func() {
		close(started)
		done <- w.Run(ctx)
	}()
	<-started
	// A second Run fails at once or, if the first has not begun, the first
	// one fails: either way exactly one returns an error now.
	second := w.Run(ctx)
	if second == nil {
		t.Fatal("second Run returned nil")
	}
	if strings.Contains(second.Error(), "already running") {
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("Run after cancel: %v", err)
		}
	} else {
		t.Fatalf("second Run: %v", second)
	}
	if err := w.Close(); err != nil {
		t.Error(err)
	}
	if err := w.Close(); err != nil {
		t.Error(err)
	}
}

func TestDumpSelf(t *testing.T) {
	dir := t.TempDir()
	reg := prometheus.NewRegistry()
	w, err := New(Config{Rank: 3, World: 4, DumpDir: dir, Host: "test-node", Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	path, err := w.Dump(context.Background(), "asked by a test")
	if err != nil {
		t.Fatal(err)
	}
	if path != filepath.Join(dir, "00003-00004.stacktrace") {
		t.Errorf("path %s", path)
	}
	d, err := ReadStackFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if d.Rank != 3 || d.World != 4 || d.Host != "test-node" || d.Reason != "asked by a test" || d.Pid != os.Getpid() || !hasFrame(d.Threads, KindGo, "TestDumpSelf") {
		t.Errorf("dump %+v", d)
	}
	if metricValue(t, w.met.dumpStarted) != 1 || metricValue(t, w.met.dumpEnded) != 1 {
		t.Error("dump gauges not set")
	}
	if _, err := (&Watchdog{}).Dump(context.Background(), ""); !errors.Is(err, ErrNoDumpDir) {
		t.Errorf("no DumpDir: %v", err)
	}
}

// TestDecideOncePerHang drives Run's choice of responses with a fake
// clock: one dump per hang however many ops hang in it, a dump for the
// next hang once no op is hung, one per silent heartbeat, and one stop.
func TestDecideOncePerHang(t *testing.T) {
	w, clock := newTestWatchdog(t, Config{DumpDir: t.TempDir(), Timeout: time.Second, HeartbeatTimeout: time.Minute, StopOn: FaultHang})
	op := w.Op("allreduce", "dp")
	type response struct{ Kind, Dump, Stop string }
	var got []response
	step := func(d time.Duration) {
		clock.Advance(d)
		faults, hung := w.check()
		for _, f := range faults {
			a := w.decide(f, hung)
			got = append(got, response{f.Kind.String(), strconv.FormatBool(a.dump), strconv.FormatBool(a.stop)})
		}
	}
	a, b := op.Start(0), op.Start(1)
	step(time.Second) // two ops hang at once
	c := op.Start(2)
	step(time.Second) // a third joins the hang
	a.End()
	b.End()
	step(0) // c still hangs
	c.End()
	step(0) // no op hung: the hang is over
	op.Start(3)
	step(time.Second) // a new hang
	w.Heartbeat("trainer")
	step(2 * time.Minute) // a heartbeat goes silent
	want := []response{
		{"hang", "true", "true"},
		{"hang", "false", "false"},
		{"hang", "false", "false"},
		{"hang", "true", "false"},
		{"heartbeat", "true", "false"},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("responses (-want +got):\n%s", diff)
	}
}

// TestRunDumpsOncePerHangAndStops checks Run's responses with a real
// clock: a hang of two ops writes one stack file, then the stop.
func TestRunDumpsOncePerHangAndStops(t *testing.T) {
	dir := t.TempDir()
	logs := make(chan string, 64)
	stops := make(chan Fault, 4)
	w, err := New(Config{DumpDir: dir, Timeout: 50 * time.Millisecond, Tick: 10 * time.Millisecond, StopOn: FaultHang,
		Logger: slogTo(logs),
		Stop:   func(_ context.Context, f Fault) error { stops <- f; return nil }})
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Go(func() { w.Run(context.Background()) })
	defer wg.Wait()
	defer w.Close()

	op := w.Op("allreduce", "dp")
	a, b := op.Start(0), op.Start(1)
	waitLog(t, logs, "hang: stacks written")
	select {
	case <-stops:
	case <-time.After(60 * time.Second):
		t.Fatal("not stopped")
	}
	a.End()
	b.End()
	files, _ := filepath.Glob(filepath.Join(dir, "*"))
	if len(files) != 1 {
		t.Errorf("files %v, want one stack file", files)
	}
	d, err := ReadStackFile(filepath.Join(dir, FileName(0, 1)))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(d.Reason, "hang: op allreduce") {
		t.Errorf("reason %q", d.Reason)
	}
}

func TestDefaultStopSignalsPid(t *testing.T) {
	cmd := newSleeper(t)
	w, err := New(Config{Pid: cmd.Process.Pid, StopSignal: syscall.SIGTERM})
	if err != nil {
		t.Fatal(err)
	}
	if err := w.stop(context.Background(), Fault{Kind: FaultHang}); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	if ws := cmd.ProcessState.Sys().(syscall.WaitStatus); !ws.Signaled() || ws.Signal() != syscall.SIGTERM {
		t.Errorf("child ended with %v", cmd.ProcessState)
	}
}

func TestFaultKindString(t *testing.T) {
	for k, want := range map[FaultKind]string{0: "none", FaultHang: "hang", FaultHang | FaultHeartbeat: "hang|heartbeat", 1 << 6: "0x40"} {
		if got := k.String(); got != want {
			t.Errorf("%d: %q, want %q", k, got, want)
		}
	}
}
