//go:build cgo

package npu_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/faultline-ml/faultline/npu"
	"github.com/faultline-ml/faultline/npu/internal/fakedriver"
	"github.com/faultline-ml/faultline/trace"
)

// Marker flags the tests emit, as mspti defines them.
const (
	hostStart   = int64(trace.FlagHostStart)
	hostEnd     = int64(trace.FlagHostEnd)
	deviceStart = int64(trace.FlagDeviceStart)
	// Size of msptiActivityMarker: 52 packed bytes, 8-byte aligned.
	markerSize = 56
	// The smallest buffer MarkerConfig allows, 73 markers.
	smallBuffer = 4096
	perBuffer   = smallBuffer / markerSize
)

// collector is a sink that keeps copies of the records it gets.
type collector struct {
	mu   sync.Mutex
	recs []trace.Record
}

func (c *collector) sink(r *trace.Record) {
	c.mu.Lock()
	c.recs = append(c.recs, *r)
	c.mu.Unlock()
}

func (c *collector) records() []trace.Record {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]trace.Record(nil), c.recs...)
}

func (c *collector) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.recs)
}

// fakeMspti builds a fresh fake libmspti and returns its path and control.
func fakeMspti(t testing.TB) (string, *fakedriver.Lib) {
	t.Helper()
	path := fakedriver.Build(t, "testdata/fake_mspti.c")
	return path, fakedriver.Open(t, path)
}

// openMarkers opens a source on the fake and closes it when the test ends.
func openMarkers(t testing.TB, cfg npu.MarkerConfig) *npu.MarkerSource {
	t.Helper()
	src, err := npu.OpenMarkers(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := src.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return src
}

// run starts src.Run and stops it when the test ends, checking it returns nil.
func run(t testing.TB, src *npu.MarkerSource) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

func flush(t testing.TB, src *npu.MarkerSource) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := src.Flush(ctx); err != nil {
		t.Fatalf("Flush: %v", err)
	}
}

func TestMarkersDeliverRecords(t *testing.T) {
	path, fake := fakeMspti(t)
	var c collector
	src := openMarkers(t, npu.MarkerConfig{Library: path, Sink: c.sink, Switch: trace.AllOn()})
	run(t, src)
	fake.Control("set_device", 5, 77, 0, "", "")

	op := `{"opName":"HcclAllReduce","groupName":"tp0","count":4096,"dataType":"fp16","streamId":77}`
	fake.Control("emit", 1, hostStart, 41, "step 12", "")
	fake.Control("emit_api", 2, 0, 0, "", "")
	fake.Control("emit", 1, deviceStart, 42, op, trace.DomainCommunication)
	fake.Control("emit", 1, hostEnd, 41, "", "")
	flush(t, src)

	got := c.records()
	pid := uint32(os.Getpid())
	const t0 = 1700000000000000000
	want := []trace.Record{
		{Kind: 1, Flag: trace.FlagHostStart, SourceKind: 0, Timestamp: t0 + 1000, ID: 41,
			ProcessID: pid, DeviceID: pid, Name: "step 12", Domain: "default"},
		{Kind: 1, Flag: trace.FlagDeviceStart, SourceKind: 1, Timestamp: t0 + 2000, ID: 42,
			ProcessID: 5, ThreadID: 77, DeviceID: 5, StreamID: 77, Name: op, Domain: "communication"},
		{Kind: 1, Flag: trace.FlagHostEnd, SourceKind: 0, Timestamp: t0 + 3000, ID: 41,
			ProcessID: pid, DeviceID: pid, Domain: "default"},
	}
	if len(got) == len(want) {
		// Host records carry the emitting thread's id in both union halves.
		for i := range want {
			if want[i].SourceKind == 0 {
				if got[i].ThreadID == 0 || got[i].ThreadID != got[i].StreamID {
					t.Errorf("record %d: thread id %d, stream id %d: want the same non-zero id", i, got[i].ThreadID, got[i].StreamID)
				}
				want[i].ThreadID, want[i].StreamID = got[i].ThreadID, got[i].StreamID
			}
		}
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("records (-want +got):\n%s", d)
	}
	// The records survive as the dotting file's lines.
	for _, r := range got {
		back, err := trace.ParseRecord(r.AppendJSON(nil))
		if err != nil || back != r {
			t.Errorf("record %+v: JSON round trip gives %+v, %v", r, back, err)
		}
	}
	st := src.Stats()
	if st.Records != 3 || st.Skipped != 2 || st.Buffers != 1 || st.Declined != 0 || st.Malformed != 0 {
		t.Errorf("stats %+v, want 3 records, 2 skipped, 1 buffer", st)
	}
}

// Callbacks run on a thread the library creates, buffer after buffer.
func TestMarkersFromLibraryThread(t *testing.T) {
	path, fake := fakeMspti(t)
	var c collector
	src := openMarkers(t, npu.MarkerConfig{Library: path, Sink: c.sink, Switch: trace.AllOn(),
		BufferBytes: smallBuffer, MaxBuffers: 1000})
	run(t, src)
	const n = 20 * perBuffer
	fake.Control("emit_thread", n, hostStart, 1000, "forward", "")
	flush(t, src)

	got := c.records()
	if len(got) != n {
		t.Fatalf("got %d records, want %d", len(got), n)
	}
	for i, r := range got {
		if r.ID != uint64(1000+i) || r.Name != "forward" {
			t.Fatalf("record %d: id %d name %q, want id %d name forward (in order)", i, r.ID, r.Name, 1000+i)
		}
	}
	if st := src.Stats(); st.Buffers != 20 || st.Declined != 0 {
		t.Errorf("stats %+v, want 20 buffers and none declined", st)
	}
	if dropped := fake.Get("dropped", 0, 0); dropped != 0 {
		t.Errorf("library dropped %d records", dropped)
	}
}

// With every buffer waiting for delivery, further requests are declined and
// the library drops records; once delivered, buffers are reused.
func TestMarkersBackpressure(t *testing.T) {
	path, fake := fakeMspti(t)
	var c collector
	src := openMarkers(t, npu.MarkerConfig{Library: path, Sink: c.sink, Switch: trace.AllOn(),
		BufferBytes: smallBuffer, MaxBuffers: 2})

	// Run is not running: nothing is delivered, nothing recycled.
	const n = 1000
	fake.Control("emit", n, hostStart, 0, "step 1", "")
	held := int64(2 * perBuffer)
	if dropped := fake.Get("dropped", 0, 0); dropped != n-held {
		t.Errorf("library dropped %d records, want %d", dropped, n-held)
	}
	st := src.Stats()
	if st.Declined == 0 || st.Records != 0 {
		t.Errorf("stats %+v: want declined requests and no records yet", st)
	}

	run(t, src)
	flush(t, src)
	if got := c.len(); got != int(held) {
		t.Errorf("delivered %d records, want the %d that had buffers", got, held)
	}
	fake.Control("emit", 10, hostStart, 0, "step 2", "")
	flush(t, src)
	if got := c.len(); got != int(held)+10 {
		t.Errorf("delivered %d records after recycling, want %d", got, held+10)
	}
	if req := fake.Get("requests", 0, 0); req < 3 {
		t.Errorf("library asked for %d buffers", req)
	}
}

func TestMarkersFollowSwitch(t *testing.T) {
	path, fake := fakeMspti(t)
	var c collector
	src := openMarkers(t, npu.MarkerConfig{Library: path, Sink: c.sink}) // zero switch: all off
	run(t, src)
	state := func() (marker, comm int64) {
		return fake.Get("marker_enabled", 0, 0), fake.Control("domain_enabled", 0, 0, 0, "communication", "")
	}
	emit := func(id int64) {
		fake.Control("emit", 1, hostStart, id, "forward", "")
		fake.Control("emit", 1, deviceStart, id+1, `{"opName":"HcclBroadcast"}`, "communication")
		flush(t, src)
	}
	ids := func() []uint64 {
		var v []uint64
		for _, r := range c.records() {
			v = append(v, r.ID)
		}
		return v
	}

	if m, cm := state(); m != 0 || cm != 0 {
		t.Fatalf("all off: marker activity %d, communication domain %d; want both off", m, cm)
	}
	emit(10)
	if got := ids(); len(got) != 0 {
		t.Fatalf("all off: got records %v", got)
	}

	steps := trace.Switch{Step: true, FP: true}
	if err := src.ApplySwitch(steps); err != nil {
		t.Fatal(err)
	}
	if m, cm := state(); m != 1 || cm != 0 {
		t.Errorf("step on: marker activity %d, communication domain %d; want on, off", m, cm)
	}
	emit(20)

	if err := src.ApplySwitch(trace.AllOn()); err != nil {
		t.Fatal(err)
	}
	if m, cm := state(); m != 1 || cm != 1 {
		t.Errorf("all on: marker activity %d, communication domain %d; want on, on", m, cm)
	}
	emit(30)

	if err := src.ApplySwitch(trace.Switch{}); err != nil {
		t.Fatal(err)
	}
	emit(40)
	if d := cmp.Diff([]uint64{20, 30, 31}, ids()); d != "" {
		t.Errorf("delivered ids (-want +got):\n%s", d)
	}
	if got := src.Switch(); got != (trace.Switch{}) {
		t.Errorf("Switch() = %v, want all off", got)
	}
}

func TestMarkersSwitchError(t *testing.T) {
	path, fake := fakeMspti(t)
	src := openMarkers(t, npu.MarkerConfig{Library: path, Sink: func(*trace.Record) {}})
	fake.Control("fail", 999, 0, 0, "msptiActivityEnable", "")
	err := src.ApplySwitch(trace.AllOn())
	var de *npu.DriverError
	if !errors.As(err, &de) || de.Func != "msptiActivityEnable" || de.Code != 999 {
		t.Fatalf("ApplySwitch: %v, want a DriverError from msptiActivityEnable, code 999", err)
	}
	if got := src.Switch(); got != (trace.Switch{}) {
		t.Errorf("after a failure Switch() = %v, want the previous (all off)", got)
	}
	fake.Control("fail", 0, 0, 0, "", "")
	if err := src.ApplySwitch(trace.AllOn()); err != nil {
		t.Fatalf("retry: %v", err)
	}
	if fake.Get("marker_enabled", 0, 0) != 1 {
		t.Error("retry did not enable marker activity")
	}
}

func TestMarkersOneSourcePerProcess(t *testing.T) {
	path, _ := fakeMspti(t)
	other, _ := fakeMspti(t)
	first, err := npu.OpenMarkers(npu.MarkerConfig{Library: path, Sink: func(*trace.Record) {}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := npu.OpenMarkers(npu.MarkerConfig{Library: other, Sink: func(*trace.Record) {}}); !errors.Is(err, npu.ErrBusy) {
		t.Errorf("second source: %v, want ErrBusy", err)
	}
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	second, err := npu.OpenMarkers(npu.MarkerConfig{Library: other, Sink: func(*trace.Record) {}})
	if err != nil {
		t.Fatalf("after Close: %v", err)
	}
	second.Close()
}

func TestMarkersSubscriberTaken(t *testing.T) {
	path, fake := fakeMspti(t)
	fake.Control("fail", 2, 0, 0, "msptiSubscribe", "") // MSPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED
	_, err := npu.OpenMarkers(npu.MarkerConfig{Library: path, Sink: func(*trace.Record) {}})
	var de *npu.DriverError
	if !errors.Is(err, npu.ErrBusy) || !errors.As(err, &de) || de.Func != "msptiSubscribe" {
		t.Fatalf("OpenMarkers: %v, want ErrBusy from msptiSubscribe", err)
	}
	fake.Control("fail", 0, 0, 0, "", "")
	src, err := npu.OpenMarkers(npu.MarkerConfig{Library: path, Sink: func(*trace.Record) {}})
	if err != nil {
		t.Fatalf("after the failure released its slot: %v", err)
	}
	src.Close()

	fake.Control("fail", 1, 0, 0, "msptiActivityRegisterCallbacks", "")
	if _, err := npu.OpenMarkers(npu.MarkerConfig{Library: path, Sink: func(*trace.Record) {}}); err == nil || errors.Is(err, npu.ErrBusy) {
		t.Fatalf("register failure: %v", err)
	}
	if fake.Get("subscribed", 0, 0) != 0 {
		t.Error("a failed open left the subscription behind")
	}
}

func TestMarkersWithoutLibrary(t *testing.T) {
	_, err := npu.OpenMarkers(npu.MarkerConfig{Library: "/nonexistent/libmspti.so", Sink: func(*trace.Record) {}})
	var le *npu.LoadError
	if !errors.Is(err, npu.ErrNoDevice) || !errors.As(err, &le) || le.Symbol != "" {
		t.Errorf("missing library: %v, want a LoadError wrapping ErrNoDevice", err)
	}
	// A library that is not mspti.
	nvml := fakedriver.Build(t, "testdata/fake_nvml.c")
	_, err = npu.OpenMarkers(npu.MarkerConfig{Library: nvml, Sink: func(*trace.Record) {}})
	if !errors.Is(err, npu.ErrNoDevice) || !errors.As(err, &le) || le.Symbol != "msptiSubscribe" {
		t.Errorf("wrong library: %v, want a LoadError for msptiSubscribe", err)
	}
}

// Close takes back what the library holds and delivers it, after Run has
// stopped.
func TestMarkersCloseDeliversTheRest(t *testing.T) {
	path, fake := fakeMspti(t)
	var c collector
	src, err := npu.OpenMarkers(npu.MarkerConfig{Library: path, Sink: c.sink, Switch: trace.AllOn()})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- src.Run(context.Background()) }()
	fake.Control("emit", 10, hostStart, 0, "dataloader", "")
	if err := src.Close(); err != nil {
		t.Fatal(err)
	}
	// Run returns nil, or ErrClosed if it had not started before Close.
	if err := <-done; err != nil && !errors.Is(err, npu.ErrClosed) {
		t.Errorf("Run after Close: %v", err)
	}
	if got := c.len(); got != 10 {
		t.Errorf("delivered %d records, want 10", got)
	}
	if fake.Get("subscribed", 0, 0) != 0 || fake.Get("marker_enabled", 0, 0) != 0 {
		t.Error("Close left the subscription or marker activity on")
	}
	if err := src.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if err := src.ApplySwitch(trace.AllOn()); !errors.Is(err, npu.ErrClosed) {
		t.Errorf("ApplySwitch after Close: %v", err)
	}
	if err := src.Flush(context.Background()); !errors.Is(err, npu.ErrClosed) {
		t.Errorf("Flush after Close: %v", err)
	}
	if err := src.Run(context.Background()); err == nil {
		t.Error("Run after Close returned nil")
	}
	// A library that goes on after Close gets no buffers and crashes nothing.
	fake.Control("force_enable", 0, 0, 0, "", "")
	fake.Control("emit_thread", 5, hostStart, 0, "late", "")
	fake.Control("flush_thread", 0, 0, 0, "", "")
	if dropped := fake.Get("dropped", 0, 0); dropped != 5 {
		t.Errorf("library dropped %d records after Close, want 5", dropped)
	}
	if got := c.len(); got != 10 {
		t.Errorf("sink got %d records after Close, want still 10", got)
	}
}

func TestMarkersRunStopsOnCancel(t *testing.T) {
	path, fake := fakeMspti(t)
	var c collector
	src := openMarkers(t, npu.MarkerConfig{Library: path, Sink: c.sink, Switch: trace.AllOn()})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx) }()
	fake.Control("emit", 3, hostStart, 0, "forward", "")
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := c.len(); got != 3 {
		t.Errorf("Run delivered %d records on its way out, want 3", got)
	}
	short, cancel2 := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel2()
	if err := src.Flush(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Flush with Run stopped: %v, want the context's error", err)
	}
	if err := src.Run(context.Background()); err == nil || errors.Is(err, npu.ErrClosed) {
		t.Errorf("second Run: %v, want an error", err)
	}
}

func TestMarkersPeriodicFlush(t *testing.T) {
	path, fake := fakeMspti(t)
	got := make(chan *trace.Record, 1)
	src := openMarkers(t, npu.MarkerConfig{Library: path, Switch: trace.AllOn(), FlushInterval: 10 * time.Millisecond,
		Sink: func(r *trace.Record) {
			c := *r
			got <- &c
		}})
	run(t, src)
	fake.Control("emit", 1, hostStart, 7, "save_checkpoint", "")
	select {
	case r := <-got:
		if r.ID != 7 || r.Name != "save_checkpoint" {
			t.Errorf("got %+v", r)
		}
	case <-time.After(time.Minute):
		t.Fatal("the partly filled buffer was never flushed")
	}
}

func TestMarkersForeignBuffer(t *testing.T) {
	path, fake := fakeMspti(t)
	src := openMarkers(t, npu.MarkerConfig{Library: path, Sink: func(*trace.Record) {}})
	fake.Control("complete_foreign", 0, 0, 0, "", "")
	if st := src.Stats(); st.Foreign != 1 || st.Buffers != 0 {
		t.Errorf("stats %+v: want one foreign buffer, ignored", st)
	}
}

func TestMarkersMetrics(t *testing.T) {
	path, fake := fakeMspti(t)
	reg := prometheus.NewPedanticRegistry()
	for round := range 2 { // Close unregisters, so a second source can register again.
		src, err := npu.OpenMarkers(npu.MarkerConfig{Library: path, Sink: func(*trace.Record) {}, Switch: trace.AllOn(),
			Registerer: reg, BufferBytes: smallBuffer, MaxBuffers: 1})
		if err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		fake.Control("emit", perBuffer+5, hostStart, 0, "forward", "") // fills the only buffer: the rest is declined
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- src.Run(ctx) }()
		flush(t, src)
		got := gather(t, reg)
		if got["faultline_npu_marker_records_total"] != perBuffer || got["faultline_npu_marker_buffers_declined_total"] != 5 ||
			got["faultline_npu_marker_buffers_total"] != 1 || got["faultline_npu_marker_buffers"] != 1 {
			t.Errorf("round %d: metrics %v: want %d records, 5 declined, 1 buffer", round, got, perBuffer)
		}
		cancel()
		<-done
		if err := src.Close(); err != nil {
			t.Fatal(err)
		}
		if got := gather(t, reg); len(got) != 0 {
			t.Errorf("round %d: metrics left after Close: %v", round, got)
		}
	}
}

// TestMarkersMetricsRegistration: metrics that cannot be registered (a
// collector of the same name is there) fail OpenMarkers with an error
// naming the field and the metric; nothing is left registered and the
// library is released, so that a later open succeeds.
func TestMarkersMetricsRegistration(t *testing.T) {
	path, _ := fakeMspti(t)
	reg := prometheus.NewPedanticRegistry()
	blocker := prometheus.NewCounter(prometheus.CounterOpts{Name: "faultline_npu_marker_buffers_declined_total", Help: "Buffer requests refused because every buffer was taken; the library dropped records."})
	reg.MustRegister(blocker)
	cfg := npu.MarkerConfig{Library: path, Sink: func(*trace.Record) {}, Registerer: reg}
	_, err := npu.OpenMarkers(cfg)
	var are prometheus.AlreadyRegisteredError
	if !errors.As(err, &are) || !strings.Contains(err.Error(), "MarkerConfig.Registerer") || !strings.Contains(err.Error(), "faultline_npu_marker_buffers_declined_total") {
		t.Fatalf("open beside a collector of the same name: %v", err)
	}
	if got := gather(t, reg); len(got) != 1 {
		t.Fatalf("a failed open left metrics: %v", got)
	}
	reg.Unregister(blocker)
	src, err := npu.OpenMarkers(cfg)
	if err != nil {
		t.Fatalf("open after the collector left: %v", err)
	}
	if err := src.Close(); err != nil {
		t.Fatal(err)
	}
}

// gather returns the value of every counter and gauge in reg by name.
func gather(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := make(map[string]float64)
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			switch {
			case m.GetCounter() != nil:
				out[mf.GetName()] = m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				out[mf.GetName()] = m.GetGauge().GetValue()
			}
		}
	}
	return out
}

func TestMarkerConfigValidate(t *testing.T) {
	sink := func(*trace.Record) {}
	for _, tc := range []struct {
		cfg   npu.MarkerConfig
		field string
	}{
		{npu.MarkerConfig{}, "Sink"},
		{npu.MarkerConfig{Sink: sink, BufferBytes: 100}, "BufferBytes"},
		{npu.MarkerConfig{Sink: sink, BufferBytes: 2 << 30}, "BufferBytes"},
		{npu.MarkerConfig{Sink: sink, MaxBuffers: -1}, "MaxBuffers"},
		{npu.MarkerConfig{Sink: sink, MaxBuffers: 1 << 20}, "MaxBuffers"},
		{npu.MarkerConfig{Sink: sink, FlushInterval: -time.Second}, "FlushInterval"},
	} {
		err := tc.cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), "MarkerConfig."+tc.field) {
			t.Errorf("Validate(%+v) = %v, want an error naming %s", tc.cfg, err, tc.field)
		}
		if _, err := npu.OpenMarkers(tc.cfg); err == nil {
			t.Errorf("OpenMarkers(%+v) succeeded", tc.cfg)
		}
	}
	if err := (npu.MarkerConfig{Sink: sink}).Validate(); err != nil {
		t.Errorf("defaults: %v", err)
	}
}

// FAULTLINE_MSPTI_REAL=1 loads the system's libmspti.so (on an Ascend host
// with CANN's environment set up), collects for two seconds and closes.
func TestMarkersRealLibrary(t *testing.T) {
	if os.Getenv("FAULTLINE_MSPTI_REAL") != "1" {
		t.Skip("set FAULTLINE_MSPTI_REAL=1 to load the system's libmspti.so")
	}
	var c collector
	src := openMarkers(t, npu.MarkerConfig{Sink: c.sink, Switch: trace.AllOn()})
	run(t, src)
	time.Sleep(2 * time.Second)
	flush(t, src)
	t.Logf("%d records, stats %+v", c.len(), src.Stats())
}
