package taskd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/faultline-ml/faultline/internal/promreg"
	pb "github.com/faultline-ml/faultline/internal/taskdpb"
	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/trace"
)

func TestBroadcast(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{})
	c.onMsg = func(rank int, m Message) error {
		if rank == 2 {
			return fmt.Errorf("cannot %s", m.Kind)
		}
		return nil
	}
	c.addProxy(0)
	for r := range 4 {
		c.addWorker(0, r)
	}
	c.addWorker(1, 4) // direct
	testkit.WaitFor(t, "5 workers", func() bool { return c.liveWorkers() == 5 })
	ctx := context.Background()
	ds, err := c.m.Broadcast(ctx, NodeWorkers(0), "pause", nil)
	if err != nil {
		t.Fatal(err)
	}
	var errs []string
	for _, d := range ds {
		if d.Err != nil {
			errs = append(errs, d.Err.Error())
		}
	}
	if len(ds) != 4 || !cmp.Equal(errs, []string{"taskd: rank 2: cannot pause"}) {
		t.Fatalf("node broadcast: %+v", ds)
	}
	// Rank 99 never connects: the call ends with its context.
	short, cancel := context.WithTimeout(ctx, 4*time.Second)
	defer cancel()
	ds, err = c.m.Broadcast(short, RankList(4, 99), "resume", []byte("now"))
	if err != nil {
		t.Fatal(err)
	}
	if len(ds) != 2 || ds[0].Err != nil || !errors.Is(ds[1].Err, ErrNotConnected) {
		t.Fatalf("rank broadcast: %+v", ds)
	}
	if ds, _ := c.m.Broadcast(ctx, AllWorkers(), "x", nil); len(ds) != 5 {
		t.Fatalf("all: %+v", ds)
	}
	if _, err := c.m.Broadcast(ctx, AllWorkers(), "x", make([]byte, defaultMaxMessageBytes)); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("oversized: %v", err)
	}
}

// TestLostAndRejoin: a worker process killed without a word is lost once
// its heartbeats stop; a worker that closes leaves, with no fault; a
// restarted process takes the rank again.
func TestLostAndRejoin(t *testing.T) {
	var mu sync.Mutex
	var events []Event
	got := make(chan struct{}, 10)
	c := newCluster(t, insecureSec(), ManagerConfig{Handlers: []Handler{{Name: "rec", Handle: func(_ context.Context, _ *Manager, ev Event) error {
		if ev.Kind == EventFault || ev.Kind == EventLeft {
			mu.Lock()
			events = append(events, ev)
			mu.Unlock()
			got <- struct{}{}
		}
		return nil
	}}}})
	next := func() Event {
		t.Helper()
		select {
		case <-got:
		case <-time.After(testTimings.deadline + 20*time.Second):
			t.Fatal("no event")
		}
		mu.Lock()
		defer mu.Unlock()
		ev := events[0]
		events = events[1:]
		return ev
	}
	a := childArgs{Job: c.job, Upstream: c.m.Addr().String(), Interval: testTimings.interval, Deadline: testTimings.deadline, Ack: testTimings.ack}
	proc := startChild(t, "worker", a)
	proc.expect(0, "connected", 60*time.Second)
	killed := time.Now()
	proc.kill()
	ev := next()
	// Lost only after its heartbeats stopped; how long after depends on
	// when the last one got through, which a loaded machine delays.
	if f := ev.Fault; ev.Kind != EventFault || f.Kind != FaultLost || f.Position != (Position{0, 0}) || f.ReporterRole != RoleManager || f.Received.Before(killed) {
		t.Fatalf("after the kill: %+v, %v after it", ev, ev.Fault.Received.Sub(killed))
	}
	// A restarted process takes the rank again, and leaves when it stops.
	w := c.addWorker(0, 0)
	testkit.WaitFor(t, "re-registration", w.Connected)
	c.stop(w, w)
	if ev := next(); ev.Kind != EventLeft || ev.Departure.Position != (Position{0, 0}) || !ev.Departure.Left {
		t.Fatalf("after Close: %+v", ev)
	}
	if st := c.m.JobStatus(); len(st.Live) != 0 || len(st.Departed) != 1 || st.Complete {
		t.Fatalf("job status %+v", st)
	}
}

// TestWorkerTaken: a second worker of a rank another live instance holds
// is told so (Taken), and stops being told once the holder left and it
// registered.
func TestWorkerTaken(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{})
	w := c.addWorker(0, 0)
	testkit.WaitFor(t, "registration", w.Connected)
	second := c.addWorker(0, 0)
	testkit.WaitFor(t, "the second worker told the rank is taken", second.Taken)
	if w.Taken() {
		t.Fatal("the holder is told its rank is taken")
	}
	c.stop(w, w)
	testkit.WaitFor(t, "the second worker registered", second.Connected)
	if second.Taken() {
		t.Fatal("a registered worker still says its rank is taken")
	}
}

func TestDirectImpersonation(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{})
	w := c.addWorker(0, 0)
	testkit.WaitFor(t, "registration", w.Connected)
	refused(t, c.m.Addr().String(), insecureSec(), 0, codes.AlreadyExists, "a second instance of rank 0")
	if n := counterValue(c.m.met.refused); n < 1 {
		t.Fatalf("refused = %v", n)
	}
	testkit.WaitFor(t, "the holder still registered", func() bool {
		for _, mi := range c.m.Members() {
			if mi.Position.Rank == 0 {
				return mi.Instance == w.self.GetInstance()
			}
		}
		return false
	})
}

func TestRateLimitAndSizeCap(t *testing.T) {
	// Half a call a second after a burst of 5: at most 5 + t/2 of 20 calls
	// get through, however slow the machine.
	c := newCluster(t, insecureSec(), ManagerConfig{RateLimit: 0.5, RateBurst: 5, MaxMessageBytes: 64 << 10})
	r := newRawMember(t, c.m.Addr().String(), c.job, insecureSec(), RoleWorker, Position{Rank: 0})
	if err := r.register(); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	limited := 0
	for range 20 {
		_, err := r.client.Heartbeat(ctx, &pb.HeartbeatRequest{Job: c.job, Beats: []*pb.Beat{{Member: r.self}}})
		if status.Code(err) == codes.ResourceExhausted {
			limited++
		}
	}
	if limited < 10 || counterValue(c.m.met.rateLimited) != float64(limited) {
		t.Fatalf("%d of 20 calls limited (metric %v)", limited, counterValue(c.m.met.rateLimited))
	}
	// A new connection has its own budget.
	r2 := newRawMember(t, c.m.Addr().String(), c.job, insecureSec(), RoleWorker, Position{Rank: 1})
	if err := r2.register(); err != nil {
		t.Fatalf("fresh connection: %v", err)
	}
	big := &pb.SendRequest{Job: c.job, Reports: []*pb.Report{{Id: "x", From: r2.self, Body: &pb.Report_Message{Message: &pb.UserMessage{Kind: "k", Payload: make([]byte, 100<<10)}}}}}
	if _, err := r2.client.Send(ctx, big); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("oversized message: %v", err)
	}
	w, err := NewWorker(WorkerConfig{Job: c.job, Upstream: c.m.Addr().String(), Security: insecureSec(), MaxMessageBytes: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if err := w.Send("k", make([]byte, 32<<10)); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("worker oversized: %v", err)
	}
}

func TestHandlers(t *testing.T) {
	var mu sync.Mutex
	var calls []string
	rec := func(name string) func(context.Context, *Manager, Event) error {
		return func(_ context.Context, _ *Manager, ev Event) error {
			if ev.Kind != EventRegistered && ev.Kind != EventMessage {
				return nil // a loaded machine may add a lost worker's fault
			}
			mu.Lock()
			calls = append(calls, name+":"+ev.Kind.String())
			mu.Unlock()
			if name == "broken" {
				panic("bug")
			}
			return nil
		}
	}
	c := newCluster(t, insecureSec(), ManagerConfig{Handlers: []Handler{
		{Name: "recovery", Priority: 10, Handle: rec("recovery")},
		{Name: "profiling", Priority: 0, Handle: rec("profiling")},
		{Name: "broken", Priority: 5, Handle: rec("broken")},
	}})
	w := c.addWorker(0, 0)
	testkit.WaitFor(t, "registration", w.Connected)
	if err := w.Send("hello", []byte("hi")); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, "two events through every handler", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(calls) >= 6
	})
	mu.Lock()
	got := calls[:6]
	mu.Unlock()
	want := []string{"profiling:registered", "broken:registered", "recovery:registered", "profiling:message", "broken:message", "recovery:message"}
	if d := cmp.Diff(want, got); d != "" {
		t.Fatal(d)
	}
	if n := counterValue(c.m.met.handlerErrs.WithLabelValues("broken")); n != 2 {
		t.Fatalf("handler errors = %v", n)
	}
}

// chanSource is a SwitchSource fed by a test.
type chanSource chan trace.Switch

func (s chanSource) Watch(ctx context.Context, set func(trace.Switch)) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case sw := <-s:
			set(sw)
		}
	}
}

func TestSwitchSourceAndSubscribe(t *testing.T) {
	src := make(chanSource)
	c := newCluster(t, insecureSec(), ManagerConfig{SwitchSource: src})
	conn, err := grpc.NewClient("passthrough:///"+c.m.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sub, err := pb.NewTrainingDataTraceClient(conn).SubscribeDataTraceSwitch(ctx, &pb.DataStatusReq{JobNsName: c.job})
	if err != nil {
		t.Fatal(err)
	}
	first, err := sub.Recv()
	if err != nil || first.GetProfilingSwitch().GetStep() != "off" {
		t.Fatalf("first: %v %v", first, err)
	}
	src <- trace.Switch{Step: true}
	next, err := sub.Recv()
	if err != nil || next.GetProfilingSwitch().GetStep() != "on" || next.GetProfilingSwitch().GetFP() != "off" {
		t.Fatalf("next: %v %v", next, err)
	}
	st := c.m.SwitchStatus()
	if st.Version == 0 || !st.Switch.Step {
		t.Fatalf("status %+v", st)
	}
	// A bad document leaves the switch in force.
	if _, err := c.m.SetSwitchDocument([]byte(`{"Step":"maybe"}`)); !errors.Is(err, trace.ErrSwitch) {
		t.Fatalf("bad document: %v", err)
	}
	if st2 := c.m.SwitchStatus(); st2.Version != st.Version || !st2.Switch.Step {
		t.Fatalf("status after a bad document %+v", st2)
	}
	unknown, err := pb.NewTrainingDataTraceClient(conn).SubscribeDataTraceSwitch(ctx, &pb.DataStatusReq{JobNsName: "nope"})
	if err != nil {
		t.Fatal(err)
	}
	if r, err := unknown.Recv(); err != nil || r.GetCode() != pb.Code_CODE_UNKNOWN_JOB {
		t.Fatalf("unknown job: %v %v", r, err)
	}
}

func TestQueueKeepsReportsUntilConnected(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{})
	reg := newWorkerMetrics(promreg.New(nil, ""))
	w, err := NewWorker(WorkerConfig{Job: c.job, Upstream: c.m.Addr().String(), Security: insecureSec(), QueueSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	w.met = reg
	w.up.overflow = reg.overflow.Inc
	for i := range 3 {
		err := w.ReportFault(Fault{Kind: FaultOpError, Code: i})
		if (i == 2) != errors.Is(err, ErrQueueFull) {
			t.Fatalf("report %d: %v", i, err)
		}
	}
	if counterValue(reg.overflow) != 1 || w.Pending() != 2 {
		t.Fatalf("overflow %v, pending %d", counterValue(reg.overflow), w.Pending())
	}
	if err := w.ReportFault(Fault{}); err == nil || !strings.Contains(err.Error(), "Kind") {
		t.Fatalf("fault without kind: %v", err)
	}
	c.run(w, w.Run)
	testkit.WaitFor(t, "queued faults delivered", func() bool { return len(c.m.Faults(0)) == 2 && w.Pending() == 0 })
}

func TestConfigValidate(t *testing.T) {
	sec := insecureSec()
	for _, tc := range []struct {
		err   error
		field string
	}{
		{ManagerConfig{Security: sec}.Validate(), "Job"},
		{ManagerConfig{Job: "a/b", Security: sec}.Validate(), "Job"},
		{ManagerConfig{Job: "j", Security: sec, HeartbeatInterval: time.Second, HeartbeatDeadline: time.Second}.Validate(), "HeartbeatDeadline"},
		{ManagerConfig{Job: "j", Security: sec, MaxMessageBytes: 10}.Validate(), "MaxMessageBytes"},
		{ManagerConfig{Job: "j", Security: sec, Handlers: []Handler{{Name: "x"}}}.Validate(), "Handlers[0]"},
		{ManagerConfig{Job: "j"}.Validate(), "Security"},
		{ManagerConfig{Job: "j", Security: Security{Insecure: true, Token: "short"}}.Validate(), "ManagerConfig.Security.Token: 5 bytes, want at least 16"},
		{ManagerConfig{Job: "j", Security: Security{Insecure: true, Token: "0123456789abcdef "}}.Validate(), "ManagerConfig.Security.Token: holds white space"},
		{ManagerConfig{Job: "j", Security: sec, AdminToken: "admin"}.Validate(), "ManagerConfig.AdminToken: 5 bytes"},
		{ManagerConfig{Job: "j", Security: Security{Insecure: true, Token: "0123456789abcdef"}, AdminToken: "0123456789abcdef"}.Validate(), "ManagerConfig.AdminToken: the same as ManagerConfig.Security.Token"},
		{ProxyConfig{Job: "j", Upstream: "x", Security: Security{Insecure: true, Token: "s3cret"}}.Validate(), "ProxyConfig.Security.Token: 6 bytes"},
		{ProxyConfig{Job: "j", Upstream: "x", Security: sec, UpstreamToken: "x"}.Validate(), "ProxyConfig.UpstreamToken: 1 bytes"},
		{ProxyConfig{Job: "j", Security: sec}.Validate(), "Upstream"},
		{ProxyConfig{Job: "j", Upstream: "x", Node: -1, Security: sec}.Validate(), "Node"},
		{WorkerConfig{Job: "j", Rank: -2, Security: sec}.Validate(), "Rank"},
		{WorkerConfig{Security: sec}.Validate(), "Job"},
		{ManagerConfig{Job: "j", Security: sec, DeliveryTimeout: -time.Second}.Validate(), "ManagerConfig.DeliveryTimeout: -1s"},
		{ProxyConfig{Job: "j", Upstream: "x", Security: sec, ReconnectMax: -1}.Validate(), "ProxyConfig.ReconnectMax"},
		{WorkerConfig{Job: "j", Security: sec, AckTimeout: -1}.Validate(), "WorkerConfig.AckTimeout"},
		{ManagerConfig{Job: "j", Security: sec, Orchestration: &OrchestrationConfig{Timeouts: Timeouts{Load: -time.Minute}}}.Validate(), "OrchestrationConfig.Timeouts.Load: -1m0s"},
	} {
		if tc.err == nil || !strings.Contains(tc.err.Error(), tc.field) {
			t.Errorf("error %v does not name %s", tc.err, tc.field)
		}
	}
	if err := (ManagerConfig{Job: "j", Security: sec}).Validate(); err != nil {
		t.Fatal(err)
	}
}

func TestSwitchFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "profilingSwitch")
	writeFile(t, path, []byte(`{"Step":"on"}`))
	reg := prometheus.NewRegistry()
	c := newCluster(t, insecureSec(), ManagerConfig{SwitchSource: SwitchFile(trace.SwitchWatcherConfig{Path: path, PollInterval: 50 * time.Millisecond, Registerer: reg})})
	w := c.addWorker(0, 0)
	testkit.WaitFor(t, "the file's switch applied", func() bool { sw, _ := w.Switch(); return sw == trace.Switch{Step: true} })
	writeFile(t, path, []byte(`{"Step":"on","CommunicationOperator":"on"}`))
	testkit.WaitFor(t, "the change applied", func() bool { sw, _ := w.Switch(); return sw.CommunicationOperator })
	v := c.m.SwitchStatus().Version
	writeFile(t, path, []byte(`{"Step":"bogus"}`))
	testkit.WaitFor(t, "the bad document read and rejected", func() bool {
		return gathered(t, reg)[`faultline_trace_switch_loads_total{result="error"}`] >= 1
	})
	if st := c.m.SwitchStatus(); st.Version != v || !st.Switch.CommunicationOperator {
		t.Fatalf("after a bad document: %+v", st)
	}
}

// TestMetricsRegistration: a component whose metrics cannot be registered
// (a second one on the same Registerer) is refused with an error naming
// the field and the metric, and registers nothing; Close unregisters what
// a component registered, so that it can be built again.
func TestMetricsRegistration(t *testing.T) {
	reg := prometheus.NewRegistry()
	families := func() int {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		return len(mfs)
	}
	sec := insecureSec()
	newManager := func() (io.Closer, error) {
		return NewManager(ManagerConfig{Job: "j", Listen: "127.0.0.1:0", Security: sec, Registerer: reg, Orchestration: &OrchestrationConfig{}})
	}
	newProxy := func() (io.Closer, error) {
		return NewProxy(ProxyConfig{Job: "j", Node: 0, Upstream: "127.0.0.1:1", Listen: "127.0.0.1:0", Security: sec, Registerer: reg})
	}
	newWorker := func() (io.Closer, error) {
		return NewWorker(WorkerConfig{Job: "j", Upstream: "127.0.0.1:1", Security: sec, Registerer: reg})
	}
	for _, tc := range []struct {
		field string
		build func() (io.Closer, error)
	}{
		{"ManagerConfig.Registerer", newManager},
		{"ProxyConfig.Registerer", newProxy},
		{"WorkerConfig.Registerer", newWorker},
	} {
		// Counters and gauges without labels show at once; vectors once
		// they have a child, so gather after building a few of each.
		first, err := tc.build()
		if err != nil {
			t.Fatalf("%s: %v", tc.field, err)
		}
		n := families()
		_, err = tc.build()
		var are prometheus.AlreadyRegisteredError
		if !errors.As(err, &are) || !strings.Contains(err.Error(), tc.field) || !strings.Contains(err.Error(), "faultline_taskd_") {
			t.Fatalf("%s: a second one on the same registry: %v", tc.field, err)
		}
		if got := families(); got != n {
			t.Fatalf("%s: the refused one left metrics: %d families, want %d", tc.field, got, n)
		}
		first.Close()
		first.Close()
		if got := families(); got != 0 {
			t.Fatalf("%s: %d metric families left after Close", tc.field, got)
		}
		again, err := tc.build()
		if err != nil {
			t.Fatalf("%s: built again after Close: %v", tc.field, err)
		}
		again.Close()
	}
}
