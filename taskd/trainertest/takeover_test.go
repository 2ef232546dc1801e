package trainertest_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/ckpt/layout"
	pb "github.com/faultline-ml/faultline/internal/taskdpb"
	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/rescheduling"
	"github.com/faultline-ml/faultline/rescheduling/local"
	"github.com/faultline-ml/faultline/taskd"
)

// A job whose manager is a process of its own, killed with SIGKILL and
// started again: the test process is every node's agent (its proxy, its
// launcher, which restarts the ranks' processes, and the checkpoint
// owner), and serves the manager's executor and checkpoints over HTTP on
// loopback; each rank is a worker process with a fake trainer.

// agentCall is an executor or checkpoint call from the manager process.
type agentCall struct {
	Node, Pod, Process string
}

// agentClient is the manager process's Executor and Checkpoints: each call
// goes to the node agents.
type agentClient struct{ base string }

func (c agentClient) call(ctx context.Context, path string, d rescheduling.Decision) (int64, error) {
	body, _ := json.Marshal(agentCall{Node: d.Node, Pod: d.Pod, Process: d.Process})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+path, bytes.NewReader(body))
	if err != nil {
		return -1, err
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return -1, err
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusOK {
		return -1, errors.New(strings.TrimSpace(string(b)))
	}
	return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
}

func (c agentClient) RestartProcesses(ctx context.Context, d rescheduling.Decision) error {
	_, err := c.call(ctx, "/restart-processes", d)
	return err
}
func (c agentClient) RecreatePods(ctx context.Context, d rescheduling.Decision) error {
	_, err := c.call(ctx, "/recreate-pods", d)
	return err
}
func (c agentClient) RestartJob(context.Context, rescheduling.Decision) error {
	return rescheduling.ErrUnsupported
}
func (c agentClient) AvoidNode(context.Context, rescheduling.Decision) error {
	return rescheduling.ErrUnsupported
}
func (c agentClient) LoadNewest(ctx context.Context) (int64, error) {
	return c.call(ctx, "/load-newest", rescheduling.Decision{})
}
func (c agentClient) PersistNewest(ctx context.Context) (int64, error) {
	return c.call(ctx, "/persist-newest", rescheduling.Decision{})
}

// runManager runs the job's manager until SIGTERM, or until it kills
// itself on entering the state its KillFile names first.
func runManager(ctx context.Context, a childArgs, say func(string, ...any)) error {
	policy, err := rescheduling.NewPolicy(rescheduling.Config{FailWindow: -1, DedupeWindow: time.Millisecond})
	if err != nil {
		return err
	}
	defer policy.Close()
	agent := agentClient{base: a.Agent}
	m, err := taskd.NewManager(taskd.ManagerConfig{
		Job: a.Job, Listen: a.Listen, Nodes: a.Nodes, ProcsPerNode: a.PPN, Security: taskd.Security{Insecure: true}, ProxyToken: proxyToken, StateDir: a.StateDir,
		HeartbeatInterval: 200 * time.Millisecond, HeartbeatDeadline: 2 * time.Second, AckTimeout: time.Second, Logger: childLogger(),
		Orchestration: &taskd.OrchestrationConfig{
			Policy: policy, Executor: agent, Checkpoints: agent, Timeouts: a.Timeouts,
			OnTransition: func(o taskd.Orchestration, t taskd.Transition) {
				say("transition %d %s %s %s", o.ID, o.Kind, t.From, t.To)
				if t.To.Terminal() {
					b, _ := json.Marshal(o)
					say("done %s", b)
				}
				if t.From != t.To && killAt(a.KillFile, t.To) {
					say("killed %s", t.To)
					syscall.Kill(os.Getpid(), syscall.SIGKILL)
				}
			},
		},
	})
	if err != nil {
		return err
	}
	defer m.Close()
	say("ready %s", m.Addr())
	return m.Run(ctx)
}

// killAt reports whether state is the first line of file, and removes
// that line if so.
func killAt(file string, state taskd.State) bool {
	b, err := os.ReadFile(file)
	if err != nil {
		return false
	}
	first, rest, _ := strings.Cut(string(b), "\n")
	if strings.TrimSpace(first) != string(state) {
		return false
	}
	return os.WriteFile(file, []byte(rest), 0o644) == nil
}

// haJob is the job: its manager process, and the agents in this process.
type haJob struct {
	nodes     int
	ppn       int
	dir       string
	owner     *ckpt.Owner
	sups      []*local.Supervisor
	proxies   []*taskd.Proxy
	out       []*testkit.Output // by rank
	mgrAddr   string
	mgr       *exec.Cmd
	mgrExited chan struct{}
	mgrOut    *testkit.Output // every manager's lines, one after the other
	agent     *http.Server
	agentURL  string
	killFile  string
	timeouts  taskd.Timeouts
	cancel    context.CancelFunc
	wg        sync.WaitGroup

	mu   sync.Mutex
	hold chan struct{} // while set, an executor call waits for it to close
	held chan struct{} // receives when an executor call begins to wait
}

func startHAJob(t testing.TB, nodes, ppn int, timeouts taskd.Timeouts) *haJob {
	t.Helper()
	world := nodes * ppn
	j := &haJob{nodes: nodes, ppn: ppn, dir: t.TempDir(), mgrAddr: freeAddr(t), mgrOut: newLines("manager"), timeouts: timeouts, held: make(chan struct{}, 16)}
	j.killFile = filepath.Join(j.dir, "kill-at")
	ctx, cancel := context.WithCancel(context.Background())
	j.cancel = cancel
	t.Cleanup(j.stop)

	shards := make([]int, world)
	for r := range shards {
		shards[r] = r
	}
	if err := os.MkdirAll(filepath.Join(j.dir, "shm"), 0o755); err != nil {
		t.Fatal(err)
	}
	owner, err := ckpt.NewOwner(ckpt.OwnerConfig{ShmDir: filepath.Join(j.dir, "shm"), Shards: shards, Capacity: layout.StepSize([]string{"state"}, []int64{64}),
		Dir: filepath.Join(j.dir, "ckpt"), PollInterval: 10 * time.Millisecond, Workers: 1})
	if err != nil {
		t.Fatal(err)
	}
	j.owner = owner
	j.run(func() { owner.Run(ctx) })
	ckpts := taskd.OwnerCheckpoints{Owner: owner, Shards: shards}
	sups := make(local.Nodes, nodes)

	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	j.agentURL = "http://" + lis.Addr().String()
	mux := http.NewServeMux()
	decision := func(r *http.Request) (rescheduling.Decision, error) {
		var c agentCall
		err := json.NewDecoder(r.Body).Decode(&c)
		return rescheduling.Decision{Node: c.Node, Pod: c.Pod, Process: c.Process}, err
	}
	handle := func(path string, f func(ctx context.Context, d rescheduling.Decision) (int64, error)) {
		mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
			d, err := decision(r)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			// What the manager asked is done, whether or not it lives to
			// hear of it.
			step, err := f(context.WithoutCancel(r.Context()), d)
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			fmt.Fprintln(w, step)
		})
	}
	repair := func(f func(context.Context, rescheduling.Decision) error) func(context.Context, rescheduling.Decision) (int64, error) {
		return func(ctx context.Context, d rescheduling.Decision) (int64, error) {
			j.mu.Lock()
			hold := j.hold
			j.mu.Unlock()
			if hold != nil {
				j.held <- struct{}{}
				<-hold
			}
			return 0, f(ctx, d)
		}
	}
	handle("/restart-processes", repair(sups.RestartProcesses))
	handle("/recreate-pods", repair(sups.RecreatePods))
	handle("/load-newest", func(ctx context.Context, _ rescheduling.Decision) (int64, error) { return ckpts.LoadNewest(ctx) })
	handle("/persist-newest", func(ctx context.Context, _ rescheduling.Decision) (int64, error) { return ckpts.PersistNewest(ctx) })
	j.agent = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	j.run(func() { j.agent.Serve(lis) })

	j.startManager(t)
	for n := range nodes {
		p, err := taskd.NewProxy(taskd.ProxyConfig{Job: "job-h", Node: n, Upstream: j.mgrAddr, Listen: "127.0.0.1:0", Security: taskd.Security{Insecure: true}, UpstreamToken: proxyToken,
			AckTimeout: time.Second, ReconnectMax: 200 * time.Millisecond, Logger: testLogger(t)})
		if err != nil {
			t.Fatal(err)
		}
		j.proxies = append(j.proxies, p)
		j.run(func() { p.Run(ctx) })
	}
	for n := range nodes {
		var cmds []local.Command
		for r := n * ppn; r < (n+1)*ppn; r++ {
			out := newLines(fmt.Sprintf("rank %d", r))
			j.out = append(j.out, out)
			args, _ := json.Marshal(childArgs{Job: "job-h", Node: n, Rank: r, Upstream: j.proxies[n].Addr().String(), Segment: owner.SegmentPath(r), CkptDir: filepath.Join(j.dir, "ckpt"),
				StepTime: 20 * time.Millisecond, SwitchTime: 100 * time.Millisecond, SaveEvery: 5})
			cmds = append(cmds, local.Command{Name: fmt.Sprintf("rank-%d", r), Path: os.Args[0], Args: []string{"-test.run=^$"},
				Env: []string{testkit.RoleEnv("worker"), childArgsEnv + "=" + string(args)}, Stdout: out, Stderr: stderrOf(t, fmt.Sprintf("rank %d", r))})
		}
		s, err := local.New(local.Config{Commands: cmds, Node: fmt.Sprintf("node-%d", n), StopTimeout: 2 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		sups[n] = s
		j.sups = append(j.sups, s)
		j.run(func() { s.Run(ctx) })
		j.run(func() { j.reportExits(n, s) })
	}
	for r := range world {
		j.out[r].Wait(t, 0, "event start", 120*time.Second)
	}
	return j
}

func (j *haJob) run(f func()) {
	j.wg.Add(1)
	go func() {
		defer j.wg.Done()
		f()
	}()
}

// reportExits reports each unexpected exit of a rank's process through
// its node's proxy, which keeps it while the manager is away.
func (j *haJob) reportExits(node int, s *local.Supervisor) {
	for f := range s.Faults() {
		rank, _ := strconv.Atoi(strings.TrimPrefix(f.Process, "rank-"))
		attrs := map[string]string{}
		if f.Signal != 0 {
			attrs["signal"] = unix.SignalName(f.Signal)
		}
		j.proxies[node].ReportFault(taskd.Fault{Kind: taskd.FaultProcessExit, Position: taskd.Position{Node: node, Rank: rank}, Code: f.ExitCode, Attrs: attrs,
			Message: fmt.Sprintf("exit code %d", f.ExitCode), Time: f.Time})
	}
}

// startManager starts a manager process on the job's address, with the
// job's StateDir, and waits until it serves.
func (j *haJob) startManager(t testing.TB) {
	t.Helper()
	args, _ := json.Marshal(childArgs{Job: "job-h", Listen: j.mgrAddr, Nodes: j.nodes, PPN: j.ppn, StateDir: filepath.Join(j.dir, "state"),
		Timeouts: j.timeouts, Agent: j.agentURL, KillFile: j.killFile})
	cmd := testkit.Command(t, "manager", childArgsEnv+"="+string(args))
	cmd.Stderr = nil
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.Stdout = j.mgrOut
	if w := stderrOf(t, "manager"); w != nil {
		cmd.Stderr = w
	}
	from := j.mgrOut.Len()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	j.mgr = cmd
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	j.mgrExited = exited
	j.mgrOut.Wait(t, from, "ready", 60*time.Second)
}

// killed waits for the manager to kill itself, and starts another.
func (j *haJob) restartAfterKill(t testing.TB, from int, state taskd.State) {
	t.Helper()
	j.mgrOut.Wait(t, from, "killed "+string(state), 60*time.Second)
	select {
	case <-j.mgrExited:
	case <-time.After(30 * time.Second):
		t.Fatalf("the manager did not die")
	}
	j.startManager(t)
}

func (j *haJob) stop() {
	for _, s := range j.sups {
		s.Close()
	}
	if j.mgr != nil {
		j.mgr.Process.Kill()
		<-j.mgrExited
	}
	j.cancel()
	for _, p := range j.proxies {
		p.Close()
	}
	if j.agent != nil {
		j.agent.Close()
	}
	j.wg.Wait()
	if j.owner != nil {
		j.owner.Close()
	}
}

// setKills has the managers kill themselves on entering states, in
// order.
func (j *haJob) setKills(t testing.TB, states ...taskd.State) {
	var b strings.Builder
	for _, s := range states {
		b.WriteString(string(s) + "\n")
	}
	if err := os.WriteFile(j.killFile, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
}

// done waits for the next orchestration of kind to end, after the
// manager's line from, and returns its record.
func (j *haJob) done(t testing.TB, from int, kind taskd.OrchestrationKind) taskd.Orchestration {
	t.Helper()
	for i := from; ; i++ {
		i = j.mgrOut.Wait(t, i, "done ", 2*time.Minute)
		var o taskd.Orchestration
		if err := json.Unmarshal([]byte(strings.TrimPrefix(j.mgrOut.From(i)[0], "done ")), &o); err != nil {
			t.Fatal(err)
		}
		if o.Kind == kind {
			return o
		}
	}
}

// resumes returns rank's resume and start events from its line from on.
func (j *haJob) resumes(rank, from int) []string {
	var out []string
	for _, line := range j.out[rank].From(from) {
		if k, _, _, ok := event(line); ok && (k == "resume" || k == "start") {
			out = append(out, line)
		}
	}
	return out
}

// checkOnce checks that every rank resumed once since from, the
// resume of rec: none was left held, none was resumed by itself (a
// worker releases its trainer only when no manager will resume it) or
// twice.
func (j *haJob) checkOnce(t testing.TB, rec taskd.Orchestration, from []int) {
	t.Helper()
	for r := range j.out {
		got := j.resumes(r, from[r])
		if len(got) != 1 || !strings.HasSuffix(got[0], " "+string(rec.Strategy)) && rec.Strategy != "" {
			t.Errorf("rank %d: resumed %q, want once by %s #%d (strategy %q)", r, got, rec.Kind, rec.ID, rec.Strategy)
		}
	}
}

// TestManagerKilled runs a job of real processes whose manager, a process
// of its own with a StateDir, is killed with SIGKILL in each state of a
// recovery, of a step retry and of a link switch, and started again each
// time: the manager that comes back takes the orchestration over where
// the dead one left it, and the job resumes, from the right step, with
// every rank resumed once. One more is killed while the executor restarts
// a rank: the manager that takes over waits for the rank that call
// restarts rather than restarting it again.
func TestManagerKilled(t *testing.T) {
	timeouts := taskd.Timeouts{Pause: 5 * time.Second, Notify: 5 * time.Second, Decide: 5 * time.Second, Retry: 5 * time.Second,
		Restart: 20 * time.Second, Replace: 20 * time.Second, Load: 10 * time.Second, Resume: 10 * time.Second,
		Dump: 10 * time.Second, Exit: 5 * time.Second, Switch: 10 * time.Second, Stress: 10 * time.Second}
	j := startHAJob(t, 2, 2, timeouts)
	const every = 5
	last := 3 // a rank of node 1

	t.Run("SIGKILL of a rank: killed on entering each state of the recovery", func(t *testing.T) {
		for deadline := time.Now().Add(time.Minute); committed(filepath.Join(j.dir, "ckpt")) < 0; time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("no checkpoint committed within a minute")
			}
		}
		kills := []taskd.State{taskd.StateStopping, taskd.StateNotifying, taskd.StateDeciding, taskd.StateRestarting, taskd.StateLoading, taskd.StateResuming}
		j.setKills(t, kills...)
		from, mfrom, before := marks(j.out), j.mgrOut.Len(), committed(filepath.Join(j.dir, "ckpt"))
		if err := syscall.Kill(j.pid(t, last), syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		for _, s := range kills {
			j.restartAfterKill(t, mfrom, s)
		}
		rec := j.done(t, mfrom, taskd.KindRecovery)
		var want []taskd.State
		for _, s := range kills {
			want = append(want, s, s)
		}
		wantStates(t, rec, append(want, taskd.StateRecovered)...)
		if rec.Restored != len(kills) || rec.Strategy != taskd.StrategyRecoverInPlace || !slices.Equal(rec.FaultyRanks, []int{last}) {
			t.Fatalf("recovery: %+v", rec)
		}
		checkResumed(t, j.out, every, rec, from, before, lastSaveBefore(j.out[last], from[last], "event start"))
		j.checkOnce(t, rec, from)
	})

	t.Run("killed while the executor restarts the rank: the rank it restarts waited for", func(t *testing.T) {
		hold := make(chan struct{})
		j.mu.Lock()
		j.hold = hold
		j.mu.Unlock()
		from, mfrom, before := marks(j.out), j.mgrOut.Len(), committed(filepath.Join(j.dir, "ckpt"))
		if err := syscall.Kill(j.pid(t, 1), syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		select {
		case <-j.held:
		case <-time.After(time.Minute):
			t.Fatal("no executor call within a minute")
		}
		j.mgr.Process.Kill()
		<-j.mgrExited
		j.mu.Lock()
		j.hold = nil
		j.mu.Unlock()
		close(hold) // the restart the dead manager asked for goes on
		j.startManager(t)
		rec := j.done(t, mfrom, taskd.KindRecovery)
		wantStates(t, rec, taskd.StateStopping, taskd.StateNotifying, taskd.StateDeciding, taskd.StateRestarting, taskd.StateRestarting,
			taskd.StateLoading, taskd.StateResuming, taskd.StateRecovered)
		if rec.Restored != 1 || !slices.Equal(rec.FaultyRanks, []int{1}) {
			t.Fatalf("recovery: %+v", rec)
		}
		checkResumed(t, j.out, every, rec, from, before, lastSaveBefore(j.out[1], from[1], "event start"))
		j.checkOnce(t, rec, from)
	})

	t.Run("op error: killed on entering the step retry", func(t *testing.T) {
		j.setKills(t, taskd.StateRetrying)
		from, mfrom := marks(j.out), j.mgrOut.Len()
		if err := syscall.Kill(j.pid(t, 0), syscall.SIGHUP); err != nil {
			t.Fatal(err)
		}
		j.restartAfterKill(t, mfrom, taskd.StateRetrying)
		rec := j.done(t, mfrom, taskd.KindRecovery)
		wantStates(t, rec, taskd.StateStopping, taskd.StateNotifying, taskd.StateRetrying, taskd.StateRetrying, taskd.StateResuming, taskd.StateRecovered)
		if rec.Restored != 1 || rec.Strategy != taskd.StrategyRetry || rec.ResumedStep != -1 {
			t.Fatalf("recovery: %+v", rec)
		}
		j.checkOnce(t, rec, from)
		for r, l := range j.out {
			pause := l.Wait(t, from[r], "event pause", 10*time.Second)
			_, paused, _, _ := event(l.From(pause)[0])
			resume := l.Wait(t, pause, "event resume", 10*time.Second)
			if _, step, _, _ := event(l.From(resume)[0]); step != paused {
				t.Errorf("rank %d paused after step %d and resumed after %d", r, paused, step)
			}
			var retries int
			for _, line := range l.From(from[r]) {
				if strings.HasPrefix(line, "event retry") {
					retries++
				}
			}
			if retries != 1 {
				t.Errorf("rank %d retried the step %d times", r, retries)
			}
		}
	})

	t.Run("link switch: killed on entering each state", func(t *testing.T) {
		kills := []taskd.State{taskd.StatePausing, taskd.StateSwitching, taskd.StateContinuing}
		j.setKills(t, kills...)
		from, mfrom := marks(j.out), j.mgrOut.Len()
		conn, err := grpc.NewClient("passthrough:///"+j.mgrAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		go pb.NewAdminClient(conn).SwitchLink(context.Background(), &pb.SwitchLinkReq{JobNsName: "job-h", // its manager dies: no answer
			Link: &pb.LinkRequest{Node: 1, Devices: []int32{0, 1}, Target: string(taskd.LinkStandby)}})
		for _, s := range kills {
			j.restartAfterKill(t, mfrom, s)
		}
		rec := j.done(t, mfrom, taskd.KindLinkSwitch)
		wantStates(t, rec, taskd.StatePausing, taskd.StatePausing, taskd.StateSwitching, taskd.StateSwitching, taskd.StateContinuing, taskd.StateContinuing, taskd.StateSwitched)
		if rec.Restored != len(kills) {
			t.Fatalf("link switch: %+v", rec)
		}
		j.checkOnce(t, rec, from)
		for r := 2; r < 4; r++ {
			if !slices.ContainsFunc(j.out[r].From(from[r]), func(l string) bool {
				return strings.HasPrefix(l, "event switch-link") && strings.HasSuffix(l, " standby")
			}) {
				t.Errorf("rank %d of node 1 did not switch: %q", r, j.out[r].From(from[r]))
			}
		}
	})
}

// pid returns the process of rank.
func (j *haJob) pid(t testing.TB, rank int) int {
	name := fmt.Sprintf("rank-%d", rank)
	for _, st := range j.sups[rank/j.ppn].State() {
		if st.Name == name {
			return st.PID
		}
	}
	t.Fatalf("rank %d: no process", rank)
	return 0
}
