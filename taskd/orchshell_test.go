package taskd

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/rescheduling"
)

// trainerJob is an in-process job whose workers have recording trainers,
// and whose executor restarts a worker by replacing it with a new one.
type trainerJob struct {
	*cluster
	reg      *prometheus.Registry
	spans    *tracetest.SpanRecorder
	exec     sync.Mutex // one executor call at a time: they share the cluster's maps
	mu       sync.Mutex
	trainers map[int]*callTrainerRecorder
	restarts map[int]int
	trans    chan Transition
	ppn      int
	// beforeRepair, if set, is called as an executor call begins.
	beforeRepair func()
}

func newTrainerJob(t *testing.T, nodes, ppn int, oc OrchestrationConfig) *trainerJob {
	return newTrainerJobProxied(t, nodes, ppn, nodes, oc)
}

// newTrainerJobProxied starts a trainerJob whose first proxied nodes have
// a proxy; the workers of the others attach to the manager directly.
func newTrainerJobProxied(t *testing.T, nodes, ppn, proxied int, oc OrchestrationConfig) *trainerJob {
	return newTrainerJobWith(t, nodes, ppn, proxied, ManagerConfig{Orchestration: &oc})
}

// newTrainerJobWith starts a trainerJob whose manager has mcfg and its
// orchestration, an executor and a recorder of transitions added.
func newTrainerJobWith(t *testing.T, nodes, ppn, proxied int, mcfg ManagerConfig) *trainerJob {
	j := &trainerJob{trainers: map[int]*callTrainerRecorder{}, restarts: map[int]int{}, trans: make(chan Transition, 1024), ppn: ppn,
		reg: prometheus.NewRegistry(), spans: tracetest.NewSpanRecorder()}
	oc := *mcfg.Orchestration
	oc.Executor = j
	oc.OnTransition = func(_ Orchestration, tr Transition) { j.trans <- tr }
	mcfg.Orchestration, mcfg.Registerer = &oc, j.reg
	// A generous heartbeat deadline: on a loaded machine a stall must
	// not add lost ranks to the recoveries these tests drive.
	mcfg.HeartbeatDeadline = orDefault(mcfg.HeartbeatDeadline, 10*time.Second)
	mcfg.TracerProvider = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(j.spans))
	j.cluster = newCluster(t, insecureSec(), mcfg)
	for n := range proxied {
		j.addProxy(n)
	}
	for r := range nodes * ppn {
		j.start(r)
	}
	testkit.WaitFor(t, "every trainer started", func() bool {
		for r := range nodes * ppn {
			if !slices.Contains(j.trainer(r).Calls(), "resume -1  []") {
				return false
			}
		}
		return true
	})
	return j
}

func (j *trainerJob) trainer(rank int) *callTrainerRecorder {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.trainers[rank]
}

func (j *trainerJob) start(rank int) {
	tr := &callTrainerRecorder{fail: map[string]error{}}
	j.mu.Lock()
	j.trainers[rank] = tr
	j.mu.Unlock()
	node := rank / j.ppn
	up := j.m.Addr().String()
	if p := j.proxies[node]; p != nil {
		up = p.Addr().String()
	}
	w, err := NewWorker(WorkerConfig{Job: j.job, Node: node, Rank: rank, Upstream: up, Security: j.sec, AckTimeout: j.ack, ReconnectMax: 200 * time.Millisecond, Trainer: tr})
	if err != nil {
		j.t.Fatal(err)
	}
	j.workers[rank] = w
	j.run(w, w.Run)
}

func (j *trainerJob) restart(rank int) {
	j.mu.Lock()
	j.restarts[rank]++
	j.mu.Unlock()
	j.stop(j.workers[rank], j.workers[rank])
	j.start(rank)
}

func rankOf(process string) (int, error) {
	return strconv.Atoi(strings.TrimPrefix(process, "rank-"))
}

func (j *trainerJob) RestartProcesses(_ context.Context, d rescheduling.Decision) error {
	j.exec.Lock()
	defer j.exec.Unlock()
	if j.beforeRepair != nil {
		j.beforeRepair()
	}
	r, err := rankOf(d.Process)
	if err != nil {
		return err
	}
	j.restart(r)
	return nil
}

func (j *trainerJob) RecreatePods(_ context.Context, d rescheduling.Decision) error {
	j.exec.Lock()
	defer j.exec.Unlock()
	n, err := strconv.Atoi(strings.TrimPrefix(d.Node, "node-"))
	if err != nil {
		return err
	}
	for r := n * j.ppn; r < (n+1)*j.ppn; r++ {
		j.restart(r)
	}
	return nil
}

func (j *trainerJob) RestartJob(context.Context, rescheduling.Decision) error {
	return rescheduling.ErrUnsupported
}
func (j *trainerJob) AvoidNode(context.Context, rescheduling.Decision) error {
	return rescheduling.ErrUnsupported
}

// explain describes the orchestrations that ended, for a failure.
func (j *trainerJob) explain() string {
	var b strings.Builder
	for _, o := range j.m.Orchestrations(0).History {
		fmt.Fprintf(&b, "\n#%d %s %s:", o.ID, o.Kind, o.State)
		for _, tr := range o.Transitions {
			fmt.Fprintf(&b, "\n  %s -> %s: %s", tr.From, tr.To, tr.Reason)
		}
	}
	return b.String()
}

// until reads transitions until one enters a state in states.
func (j *trainerJob) until(states ...State) []State {
	j.t.Helper()
	var seen []State
	timeout := time.After(60 * time.Second)
	for {
		select {
		case tr := <-j.trans:
			seen = append(seen, tr.To)
			if slices.Contains(states, tr.To) {
				return seen
			}
		case <-timeout:
			j.t.Fatalf("no %v within 60 s; saw %v", states, seen)
		}
	}
}

func shortTimeouts() Timeouts {
	return Timeouts{Pause: 5 * time.Second, Notify: 5 * time.Second, Retry: 5 * time.Second, Restart: 20 * time.Second, Replace: 20 * time.Second, Resume: 5 * time.Second, Switch: 5 * time.Second, Stress: 5 * time.Second, Exit: 5 * time.Second}
}

func TestOrchestrationInProcess(t *testing.T) {
	j := newTrainerJob(t, 2, 2, OrchestrationConfig{Timeouts: shortTimeouts()})
	m := j.m

	// An op error: every rank retries the step and resumes.
	if err := j.workers[1].ReportFault(Fault{Kind: FaultOpError, Message: "HCCL timeout"}); err != nil {
		t.Fatal(err)
	}
	got := j.until(StateRecovered, StateExited)
	want := []State{StateStopping, StateNotifying, StateRetrying, StateResuming, StateRecovered}
	if !slices.Equal(got, want) {
		t.Fatalf("op error: %v, want %v%s", got, want, j.explain())
	}
	for r := range 4 {
		calls := j.trainer(r).Calls()
		if !slices.Equal(calls[1:], []string{"pause", "strategies [1]", "retry", "resume -1 retry []"}) {
			t.Errorf("rank %d: %q", r, calls)
		}
	}

	// A process exit: the rank restarts in place, and the others resume
	// with it.
	if _, _, err := m.ReportFault(Fault{Kind: FaultProcessExit, Code: 137, Position: Position{1, 2}, Attrs: map[string]string{"signal": "SIGKILL"}}); err != nil {
		t.Fatal(err)
	}
	got = j.until(StateRecovered, StateExited)
	want = []State{StateStopping, StateNotifying, StateDeciding, StateRestarting, StateResuming, StateRecovered}
	if !slices.Equal(got, want) {
		t.Fatalf("exit: %v, want %v%s", got, want, j.explain())
	}
	if calls := j.trainer(2).Calls(); !slices.Equal(calls, []string{"resume -1 recover-in-place [2]"}) {
		t.Errorf("restarted rank 2: %q (it must wait for the recovery to start it)", calls)
	}
	if calls := j.trainer(0).Calls(); calls[len(calls)-1] != "resume -1 recover-in-place [2]" {
		t.Errorf("rank 0: %q", calls)
	}

	// A link switch and its switchback.
	ctx := context.Background()
	rec, err := m.SwitchLink(ctx, LinkRequest{Node: 1, Devices: []int{0, 1}, Target: LinkStandby})
	if err != nil || rec.State != StateSwitched {
		t.Fatalf("switch: %+v %v", rec, err)
	}
	if calls := j.trainer(3).Calls(); !slices.Contains(calls, "switch 1 [0 1] standby") {
		t.Errorf("rank 3: %q", calls)
	}
	if st := m.Orchestrations(0); len(st.Links) != 2 {
		t.Fatalf("links: %+v", st.Links)
	}
	if _, err := m.SwitchLink(ctx, LinkRequest{Node: 1, Devices: []int{0, 1}, Target: LinkPrimary}); err != nil {
		t.Fatal(err)
	}
	if st := m.Orchestrations(0); len(st.Links) != 0 {
		t.Fatalf("links after switchback: %+v", st.Links)
	}
	j.until(StateSwitched)
	j.until(StateSwitched)

	// A switch that fails on rank 3 hands over to a recovery, which
	// replaces rank 3 (a link fault moves the node's processes).
	j.trainer(3).mu.Lock()
	j.trainer(3).fail["switch 1 [0] standby"] = errors.New("NIC down")
	j.trainer(3).mu.Unlock()
	rec, err = m.SwitchLink(ctx, LinkRequest{Node: 1, Devices: []int{0}, Target: LinkStandby})
	if !errors.Is(err, ErrOrchestrationFailed) || rec.State != StateFailed || rec.HandedOverTo == 0 {
		t.Fatalf("failed switch: %+v %v", rec, err)
	}
	got = j.until(StateRecovered, StateExited)
	want = []State{StatePausing, StateSwitching, StateFailed, StateStopping, StateNotifying, StateDeciding, StateReplacing, StateResuming, StateRecovered}
	if !slices.Equal(got, want) {
		t.Fatalf("handover: %v, want %v%s", got, want, j.explain())
	}
	st := m.Orchestrations(0)
	last := st.History[len(st.History)-1]
	if last.HandedOverFrom != rec.ID || last.Strategy != StrategyRecover || !slices.Equal(last.FaultyRanks, []int{3}) {
		t.Fatalf("recovery: %+v", last)
	}
	j.mu.Lock()
	restarts := fmt.Sprint(j.restarts)
	j.mu.Unlock()
	if restarts != "map[2:2 3:1]" {
		t.Fatalf("restarts %s", restarts)
	}

	// The Admin service reports the same.
	conn, err := grpc.NewClient("passthrough:///"+m.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	admin := pb.NewAdminClient(conn)
	res, err := admin.GetOrchestration(ctx, &pb.GetOrchestrationReq{JobNsName: j.job})
	if err != nil || res.GetCode() != pb.Code_CODE_OK || res.GetCurrent() != nil || len(res.GetHistory()) != len(st.History) {
		t.Fatalf("GetOrchestration: %v %v", res, err)
	}
	if h := res.GetHistory()[len(res.GetHistory())-1]; h.GetState() != string(StateRecovered) || len(h.GetTransitions()) != 6 || h.GetResumeNs() <= 0 {
		t.Fatalf("last: %v", h)
	}
	sres, err := admin.StressTest(ctx, &pb.StressTestReq{JobNsName: j.job, Stress: &pb.StressRequest{Nodes: []int32{0}, Test: "hbm"}, TimeoutMs: 30000})
	if err != nil || sres.GetCode() != pb.Code_CODE_OK || sres.GetOrchestration().GetState() != string(StatePassed) {
		t.Fatalf("StressTest: %v %v", sres, err)
	}
	bad, _ := admin.SwitchLink(ctx, &pb.SwitchLinkReq{JobNsName: j.job, Link: &pb.LinkRequest{Node: 0, Target: "sideways"}})
	if bad.GetCode() != pb.Code_CODE_BAD_PARAMETER {
		t.Fatalf("bad switch: %v", bad)
	}

	// Counted and traced.
	wantMetrics := map[string]float64{
		`faultline_taskd_orchestrations_total{kind="recovery",state="recovered"}`:                          3,
		`faultline_taskd_orchestrations_total{kind="link-switch",state="failed"}`:                          1,
		`faultline_taskd_orchestration_transitions_total{from="deciding",kind="recovery",to="restarting"}`: 1,
		`faultline_taskd_orchestration_phase_seconds{kind="recovery",phase="resumed"}_count`:               3,
		`faultline_taskd_orchestration_phase_seconds{kind="recovery",phase="detected"}_count`:              3,
		`faultline_taskd_orchestration_running{kind="recovery"}`:                                           0,
	}
	metrics := gathered(t, j.reg)
	for k, v := range wantMetrics {
		if metrics[k] != v {
			t.Errorf("%s = %v, want %v", k, metrics[k], v)
		}
	}
	var runs, events int
	for _, sp := range j.spans.Ended() {
		if sp.Name() == "taskd.orchestration" {
			runs++
			events += len(sp.Events())
		}
	}
	if runs != len(st.History)+1 || events < 20 {
		t.Errorf("%d orchestration spans with %d events, want %d", runs, events, len(st.History)+1)
	}
}

// TestInPlaceCalls: every faulty process that may still run is named in a
// call of its own node; one that exited is restarted by a call for its
// node that names another, or named itself when there is none.
func TestInPlaceCalls(t *testing.T) {
	policy, err := rescheduling.NewPolicy(rescheduling.Config{FailWindow: -1, DedupeWindow: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer policy.Close()
	o := &orchestrator{target: defaultTarget, policy: policy}
	now := time.Now()
	fault := func(kind FaultKind, rank int) Fault {
		return Fault{ID: fmt.Sprint(kind, rank), Kind: kind, Position: Position{Node: rank / 4, Rank: rank}, Time: now.Add(-time.Second)}
	}
	for _, tc := range []struct {
		name   string
		faults []Fault
		want   string
	}{
		{"hangs on two nodes", []Fault{fault(FaultHang, 1), fault(FaultHang, 3), fault(FaultHang, 7)}, "[node-0/rank-1 node-0/rank-3] [node-1/rank-7]"},
		{"exits on two nodes", []Fault{fault(FaultProcessExit, 1), fault(FaultProcessExit, 3), fault(FaultProcessExit, 7)}, "[node-0/rank-1] [node-1/rank-7]"},
		{"an exit beside a hang", []Fault{fault(FaultProcessExit, 1), fault(FaultHang, 3), fault(FaultLost, 7)}, "[node-0/rank-3] [node-1/rank-7]"},
		{"op errors", []Fault{fault(FaultOpError, 0), fault(FaultOpError, 2)}, "[node-0/rank-0 node-0/rank-2]"},
	} {
		decisions := map[int]rescheduling.Decision{}
		for _, f := range tc.faults {
			decisions[f.Position.Rank] = policy.Decide(context.Background(), o.rescheduleFault(f))
		}
		var got []string
		for _, calls := range o.inPlaceCalls(tc.faults, decisions) {
			var names []string
			for _, d := range calls {
				if d.Action != rescheduling.RestartProcesses {
					t.Errorf("%s: %s", tc.name, d)
				}
				names = append(names, d.Node+"/"+d.Process)
			}
			got = append(got, fmt.Sprint(names))
		}
		if s := strings.Join(got, " "); s != tc.want {
			t.Errorf("%s: calls %s, want %s", tc.name, s, tc.want)
		}
	}
}

// blockingCheckpoints never readies a step: a recovery holds the job in
// loading until its timeout.
type blockingCheckpoints struct{}

func (blockingCheckpoints) LoadNewest(ctx context.Context) (int64, error) {
	<-ctx.Done()
	return -1, ctx.Err()
}
func (blockingCheckpoints) PersistNewest(context.Context) (int64, error) { return -1, errors.New("no") }

// TestManagerRestartReleasesHeldTrainers: the manager restarts while a
// recovery holds the job (the running ranks paused, a restarted one not
// started yet). The manager that comes back runs no orchestration, so
// nothing would resume them: each worker, behind a proxy or attached
// directly, resumes its trainer itself and says so.
func TestManagerRestartReleasesHeldTrainers(t *testing.T) {
	j := newTrainerJobProxied(t, 2, 2, 1, OrchestrationConfig{Checkpoints: blockingCheckpoints{},
		Timeouts: Timeouts{Pause: 5 * time.Second, Notify: 5 * time.Second, Restart: 20 * time.Second, Load: 5 * time.Minute}})
	if _, _, err := j.m.ReportFault(Fault{Kind: FaultProcessExit, Code: 137, Position: Position{1, 3}}); err != nil {
		t.Fatal(err)
	}
	j.until(StateLoading)
	for r := range 3 {
		if calls := j.trainer(r).Calls(); calls[len(calls)-1] != "strategies [3]" {
			t.Fatalf("rank %d before the restart: %q", r, calls)
		}
	}
	testkit.WaitFor(t, "restarted rank 3 told of the hold", func() bool { return j.workers[3].holder() != "" })
	if calls := j.trainer(3).Calls(); len(calls) != 0 {
		t.Fatalf("restarted rank 3 started while the job is held: %q", calls)
	}

	j.stop(j.m, j.m)
	j.startManager()
	released := func() bool {
		for r := range 4 {
			calls := j.trainer(r).Calls()
			if len(calls) == 0 || calls[len(calls)-1] != "resume -1  [] released" {
				return false
			}
		}
		return true
	}
	for deadline := time.Now().Add(30 * time.Second); !released(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			for r := range 4 {
				t.Errorf("rank %d: %q", r, j.trainer(r).Calls())
			}
			for _, f := range j.m.Faults(0) {
				t.Errorf("fault %+v", f)
			}
			st := j.m.Orchestrations(0)
			t.Errorf("orchestrations %+v", st)
			t.Fatal("not every trainer was released within 30 s")
		}
	}
	if st := j.m.Orchestrations(0); st.Current != nil {
		t.Fatalf("the restarted manager runs %+v", st.Current)
	}
}

// onceBlockingCheckpoints readies step 7, but its first LoadNewest never
// returns: a recovery waits in loading for the manager to be stopped.
type onceBlockingCheckpoints struct{ calls *atomic.Int32 }

func (c onceBlockingCheckpoints) LoadNewest(ctx context.Context) (int64, error) {
	if c.calls.Add(1) == 1 {
		<-ctx.Done()
		return -1, ctx.Err()
	}
	return 7, nil
}
func (onceBlockingCheckpoints) PersistNewest(context.Context) (int64, error) {
	return -1, errors.New("no")
}

// TestManagerRestartFinishesRecovery: with a StateDir, a manager that
// restarts while a recovery holds the job takes the recovery over: it
// asks for the checkpoint again, and every rank, behind a proxy or
// attached directly, the restarted one included, resumes once, from the
// step readied; none is released.
func TestManagerRestartFinishesRecovery(t *testing.T) {
	j := newTrainerJobWith(t, 2, 2, 1, ManagerConfig{Nodes: 2, ProcsPerNode: 2, StateDir: t.TempDir(),
		Orchestration: &OrchestrationConfig{Checkpoints: onceBlockingCheckpoints{calls: new(atomic.Int32)},
			Timeouts: Timeouts{Pause: 5 * time.Second, Notify: 5 * time.Second, Restart: 20 * time.Second, Load: 5 * time.Minute, Resume: 10 * time.Second}}})
	if _, _, err := j.m.ReportFault(Fault{Kind: FaultProcessExit, Code: 137, Position: Position{1, 3}}); err != nil {
		t.Fatal(err)
	}
	j.until(StateLoading)
	testkit.WaitFor(t, "restarted rank 3 told of the hold", func() bool { return j.workers[3].holder() != "" })
	j.stop(j.m, j.m)
	j.startManager()
	if got := j.until(StateRecovered); !slices.Equal(got, []State{StateLoading, StateResuming, StateRecovered}) {
		t.Fatalf("after the restart: %v%s", got, j.explain())
	}
	want := "resume 7 recover-in-place [3]"
	for r := range 4 {
		testkit.WaitFor(t, fmt.Sprintf("rank %d resumed", r), func() bool {
			calls := j.trainer(r).Calls()
			return len(calls) > 0 && calls[len(calls)-1] == want
		})
		var resumes []string
		for _, c := range j.trainer(r).Calls() {
			if strings.HasPrefix(c, "resume") && c != "resume -1  []" {
				resumes = append(resumes, c)
			}
		}
		if !slices.Equal(resumes, []string{want}) {
			t.Errorf("rank %d resumed %q, want once %q", r, resumes, want)
		}
	}
	st := j.m.Orchestrations(0)
	if st.Current != nil || len(st.History) != 1 || st.History[0].Restored != 1 || st.History[0].ResumedStep != 7 {
		t.Fatalf("orchestrations after the restart: %+v", st)
	}
}

// TestSignalNamed: a fault's "signal" attribute names a signal with or
// without its SIG prefix, in either case; anything else is no signal.
func TestSignalNamed(t *testing.T) {
	for name, want := range map[string]syscall.Signal{
		"SIGKILL": syscall.SIGKILL, "KILL": syscall.SIGKILL, "sigterm": syscall.SIGTERM,
		"SIGSEGV": syscall.SIGSEGV, "SIGUSR1": syscall.SIGUSR1, "": 0, "SIG": 0, "bogus": 0,
	} {
		if got := signalNamed(name); got != want {
			t.Errorf("signalNamed(%q) = %v, want %v", name, got, want)
		}
	}
}

// TestOrchestrationMessageNotSent: an orchestration message that cannot be
// sent (here, over the size cap) is an action error, logged and counted,
// not dropped.
func TestOrchestrationMessageNotSent(t *testing.T) {
	oc := OrchestrationConfig{Timeouts: shortTimeouts()}
	j := newTrainerJobWith(t, 1, 1, 0, ManagerConfig{Orchestration: &oc, MaxMessageBytes: 64 << 10})
	devices := make([]int, 20000)
	for i := range devices {
		devices[i] = 10000 + i
	}
	rec, err := j.m.SwitchLink(context.Background(), LinkRequest{Node: 0, Devices: devices, Target: LinkStandby})
	if n := counterValue(j.m.orch.met.actionErrs.WithLabelValues("broadcast")); n == 0 {
		t.Errorf("no broadcast action error counted (%+v, %v)", rec, err)
	}
	// No rank was told to switch: the switch has not succeeded.
	if rec.State == StateSwitched {
		t.Errorf("a switch no rank was told of ended %s: %+v", rec.State, rec)
	}
}

// TestStateWriteFailureHoldsActions: while the orchestration state cannot
// be written down, nothing it leads to takes effect: a fault's recovery
// pauses no rank. The write is retried, and once it succeeds the
// recovery goes on from where it was held.
func TestStateWriteFailureHoldsActions(t *testing.T) {
	dir := t.TempDir()
	j := newTrainerJobWith(t, 1, 2, 0, ManagerConfig{Nodes: 1, ProcsPerNode: 2, StateDir: dir,
		Orchestration: &OrchestrationConfig{Timeouts: shortTimeouts()}})
	path := filepath.Join(dir, orchStateFile)
	testkit.WaitFor(t, "the state written", func() bool { _, err := os.Stat(path); return err == nil })
	// A directory where the state file goes: every write of it fails.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(path, "x"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, _, err := j.m.ReportFault(Fault{Kind: FaultProcessExit, Code: 137, Position: Position{0, 1}}); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, "the write retried", func() bool { return counterValue(j.m.orch.met.stateErrs) >= 3 })
	for r := range 2 {
		if calls := j.trainer(r).Calls(); slices.Contains(calls, "pause") {
			t.Fatalf("rank %d paused while the state was not written: %q", r, calls)
		}
	}
	if err := os.RemoveAll(path); err != nil {
		t.Fatal(err)
	}
	if got := j.until(StateRecovered, StateFailed); got[len(got)-1] != StateRecovered {
		t.Fatalf("once the state could be written: %v%s", got, j.explain())
	}
	if _, _, err := readStateFile(path, j.job); err != nil {
		t.Fatal(err)
	}
}

// TestEvictionWrittenBeforeRepair: the instances a repair evicts are
// written down before the executor is called, so that a manager taking
// over from one killed during the call can tell the ranks it restarted.
func TestEvictionWrittenBeforeRepair(t *testing.T) {
	dir := t.TempDir()
	j := newTrainerJobWith(t, 1, 2, 0, ManagerConfig{Nodes: 1, ProcsPerNode: 2, StateDir: dir,
		Orchestration: &OrchestrationConfig{Timeouts: shortTimeouts()}})
	old := j.workers[1].self.GetInstance()
	written := make(chan map[int]string, 1)
	j.beforeRepair = func() {
		_, raw, err := readStateFile(filepath.Join(dir, orchStateFile), j.job)
		if err != nil {
			t.Error(err)
		}
		st, err := parseCoreState(orchStateFile, raw)
		if err != nil || st.Run == nil {
			t.Errorf("state %+v: %v", st, err)
			written <- nil
			return
		}
		written <- st.Run.Evicted
	}
	if _, _, err := j.m.ReportFault(Fault{Kind: FaultProcessExit, Code: 137, Position: Position{0, 1}}); err != nil {
		t.Fatal(err)
	}
	if got := j.until(StateRecovered, StateFailed); got[len(got)-1] != StateRecovered {
		t.Fatalf("%v%s", got, j.explain())
	}
	if ev := <-written; ev[1] != old {
		t.Fatalf("evicted as the executor was called: %v, want rank 1's instance %s", ev, old)
	}
}

// TestTakeoverInBackoff: a manager stopped while its repair waits out the
// policy's backoff has evicted nothing and called no executor, and says
// so in its state: the manager taking over makes the repair itself
// rather than waiting for ranks no one restarts.
func TestTakeoverInBackoff(t *testing.T) {
	pol, err := rescheduling.NewPolicy(rescheduling.Config{Backoff: rescheduling.Backoff{Initial: 3 * time.Second, Max: 3 * time.Second, Jitter: -1}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pol.Close() })
	dir := t.TempDir()
	to := shortTimeouts()
	to.Restart, to.Replace = 20*time.Second, 20*time.Second
	j := newTrainerJobWith(t, 2, 2, 0, ManagerConfig{Nodes: 2, ProcsPerNode: 2, StateDir: dir,
		Orchestration: &OrchestrationConfig{Policy: pol, Timeouts: to}})
	if _, _, err := j.m.ReportFault(Fault{Kind: FaultProcessExit, Code: 137, Position: Position{1, 3}}); err != nil {
		t.Fatal(err)
	}
	j.until(StateRecovered)
	// The same rank again: the policy backs off before restarting it.
	if _, _, err := j.m.ReportFault(Fault{Kind: FaultProcessExit, Code: 137, Position: Position{1, 3}}); err != nil {
		t.Fatal(err)
	}
	j.until(StateRestarting, StateReplacing)
	time.Sleep(time.Second) // within the 3 s backoff
	_, raw, err := readStateFile(filepath.Join(dir, orchStateFile), j.job)
	if err != nil {
		t.Fatal(err)
	}
	st, err := parseCoreState(orchStateFile, raw)
	if err != nil {
		t.Fatal(err)
	}
	if st.Run == nil || len(st.Run.Evicted) != 0 {
		t.Fatalf("evictions written during the backoff: %+v", st.Run)
	}
	j.stop(j.m, j.m)
	j.startManager()
	if got := j.until(StateRecovered, StateExited, StateFailed); got[len(got)-1] != StateRecovered {
		t.Fatalf("after the takeover: %v%s", got, j.explain())
	}
}
