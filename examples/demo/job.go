package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/ckpt/layout"
	"github.com/faultline-ml/faultline/internal/atomicfile"
	"github.com/faultline-ml/faultline/rescheduling"
	"github.com/faultline-ml/faultline/rescheduling/local"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/topology"
	"github.com/faultline-ml/faultline/trace"
	"github.com/faultline-ml/faultline/trace/slownode"
)

// jobID names the job: its dotting and stack folders, its manager.
const jobID = "faultline-demo"

// job is the demo's training job as its launcher sees it.
type job struct {
	cfg         config
	out         string // the output folder
	con         *console
	log         *slog.Logger
	start       time.Time
	world       int
	hosts       []string // node n's address
	proxyToken  string   // the proxies' token: the manager's, handed to the proxies
	switchOf    []string // node n's access switch
	exe         string
	shm         string
	reg         *prometheus.Registry
	fab         *fabric
	m           *taskd.Manager
	policy      *rescheduling.Policy // the manager's orchestration's: closed after it
	owners      []*ckpt.Owner
	ckpts       *nodeCheckpoints
	sups        []*local.Supervisor
	proxies     []*proxyProc
	diag        *hangDiagnosis
	metrics     string // the launcher's /metrics URL
	files       []*os.File
	wg          sync.WaitGroup
	cancel      context.CancelFunc // ends the job's goroutines
	stopMetrics func()

	mu        sync.Mutex
	changed   chan struct{} // closed and replaced on every change below
	ranks     []*rankView
	orchs     map[uint64]taskd.Orchestration
	verdict   *slownode.Result
	verdictAt time.Time
	verdicts  []seenVerdict // the latest verdicts, oldest first
	phase     string
	exits     []exitSeen
}

// rankView is what the launcher knows of a rank, from its output.
type rankView struct {
	rank, node   int
	state        string // starting, training, paused, hung, down, stopped
	step         int64
	metrics      string
	lastSave     int64
	lastLoad     loadSeen
	injectedAt   time.Time
	injectedFrom int64 // the first step the latest injection slows
	hungAt       time.Time
	events       []rankEvent
}

type loadSeen struct {
	step     int64
	tier     string
	strategy string
	time     time.Time
}

type rankEvent struct {
	kind   string
	step   int64
	detail string
	time   time.Time
}

type exitSeen struct {
	rank   int
	pid    string
	code   int
	signal string
	time   time.Time
	fault  taskd.Fault
}

// proxyProc is a node's proxy process.
type proxyProc struct {
	node    int
	cmd     *exec.Cmd
	addr    string
	metrics string
}

// notifyLocked wakes whoever waits for a change.
func (j *job) notifyLocked() {
	close(j.changed)
	j.changed = make(chan struct{})
}

// errTimeout is a wait that ran out of time.
var errTimeout = errors.New("timed out")

// waitFor waits until cond, called with j.mu held, holds.
func (j *job) waitFor(ctx context.Context, timeout time.Duration, cond func() bool) error {
	t := time.NewTimer(timeout)
	defer t.Stop()
	for {
		j.mu.Lock()
		ok := cond()
		ch := j.changed
		j.mu.Unlock()
		if ok {
			return nil
		}
		select {
		case <-ch:
		case <-t.C:
			return errTimeout
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (j *job) since() float64 { return time.Since(j.start).Seconds() }

// rel returns path relative to the output folder, for printing.
func (j *job) rel(path string) string {
	if r, err := filepath.Rel(filepath.Dir(j.out), path); err == nil {
		return r
	}
	return path
}

func (j *job) path(elem ...string) string { return filepath.Join(append([]string{j.out}, elem...)...) }

// nodeOf returns the node of rank.
func (j *job) nodeOf(rank int) int { return rank / j.cfg.ProcsPerNode }

// setPhase says what the job is going through, for the status line.
func (j *job) setPhase(s string) {
	j.mu.Lock()
	j.phase = s
	j.mu.Unlock()
}

// statusLine is the live status line.
func (j *job) statusLine() string {
	disk := int64(-1)
	if b, err := os.ReadFile(j.path("ckpt", layout.DLRoverTrackerFile)); err == nil {
		disk, _ = layout.ParseStepText(b)
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	lo, hi, training, mem := int64(-1), int64(-1), 0, int64(-1)
	for _, v := range j.ranks {
		if v.state == "training" {
			training++
		}
		if lo < 0 || v.step < lo {
			lo = v.step
		}
		hi = max(hi, v.step)
		if mem < 0 || v.lastSave < mem {
			mem = v.lastSave
		}
	}
	steps := fmt.Sprintf("step %d", hi)
	if lo != hi {
		steps = fmt.Sprintf("steps %d-%d", lo, hi)
	}
	ck := "no checkpoint yet"
	switch {
	case mem > 0 && disk >= 0:
		ck = fmt.Sprintf("checkpoint %d in memory, %d on disk", mem, disk)
	case mem > 0:
		ck = fmt.Sprintf("checkpoint %d in memory", mem)
	}
	return fmt.Sprintf("[%5.1fs] %s | %d/%d ranks training | %s | %s", j.since(), steps, training, j.world, ck, j.phase)
}

// minStep returns the lowest step of the ranks, and whether every rank is
// training.
func (j *job) minStepLocked() (int64, bool) {
	lo, all := int64(-1), true
	for _, v := range j.ranks {
		if lo < 0 || v.step < lo {
			lo = v.step
		}
		all = all && v.state == "training"
	}
	return lo, all
}

// waitSteps waits until every rank trains and has done n more steps than
// the slowest one has now.
func (j *job) waitSteps(ctx context.Context, n int) error {
	j.mu.Lock()
	lo, _ := j.minStepLocked()
	j.mu.Unlock()
	target := lo + int64(n)
	timeout := time.Duration(n)*j.cfg.StepTime*4 + 60*time.Second
	return j.waitFor(ctx, timeout, func() bool {
		lo, all := j.minStepLocked()
		return all && lo >= target
	})
}

// rankOutput follows a worker's standard output, across its restarts.
type rankOutput struct {
	j    *job
	rank int
	part []byte
}

func (o *rankOutput) Write(p []byte) (int, error) {
	o.part = append(o.part, p...)
	for {
		i := slices.Index(o.part, '\n')
		if i < 0 {
			break
		}
		line := string(o.part[:i])
		o.part = o.part[i+1:]
		o.j.rankLine(o.rank, line)
	}
	return len(p), nil
}

// rankLine takes in one line of a worker's output.
func (j *job) rankLine(rank int, line string) {
	now := time.Now()
	f := strings.Fields(line)
	if len(f) < 2 {
		return
	}
	j.mu.Lock()
	defer j.mu.Unlock()
	v := j.ranks[rank]
	switch f[0] {
	case "ready":
		v.metrics, v.state = f[1], "starting"
	case "step":
		if n, err := strconv.ParseInt(f[1], 10, 64); err == nil {
			v.step = n
		}
	case "event":
		if len(f) < 3 {
			return
		}
		step, _ := strconv.ParseInt(f[2], 10, 64)
		ev := rankEvent{kind: f[1], step: step, detail: strings.Join(f[3:], " "), time: now}
		if len(v.events) >= 256 {
			v.events = slices.Delete(v.events, 0, 128)
		}
		v.events = append(v.events, ev)
		switch ev.kind {
		case "start", "resume":
			v.state, v.step = "training", step
			if len(f) >= 5 {
				v.lastLoad = loadSeen{step: step, tier: f[3], strategy: f[4], time: now}
			}
		case "pause":
			v.state = "paused"
		case "hang":
			v.state, v.hungAt = "hung", now
		case "save":
			if !strings.Contains(ev.detail, "failed") {
				v.lastSave = step
			}
		case "inject":
			v.injectedAt, v.injectedFrom = now, step
		case "stop":
			v.state = "stopped"
		}
	default:
		return
	}
	j.notifyLocked()
}

// setup builds the job: topology, checkpoint owners, the fabric, the
// manager, the proxies and the workers; it returns once every rank
// trains.
func (j *job) setup(ctx context.Context) error {
	cfg := j.cfg
	j.world = cfg.Nodes * cfg.ProcsPerNode
	j.changed = make(chan struct{})
	j.orchs = map[uint64]taskd.Orchestration{}
	for r := range j.world {
		j.ranks = append(j.ranks, &rankView{rank: r, node: r / cfg.ProcsPerNode, state: "starting"})
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	j.exe = exe
	for _, d := range []string{"logs", "metrics", "ckpt", "manager", filepath.Join("profiling", jobID), filepath.Join("stacks", jobID)} {
		if err := os.MkdirAll(j.path(d), 0o750); err != nil {
			return err
		}
	}
	logFile, err := j.openLog("launcher.log")
	if err != nil {
		return err
	}
	j.log = slog.New(slog.NewTextHandler(logFile, &slog.HandlerOptions{Level: slog.LevelInfo}))
	j.reg = prometheus.NewRegistry()

	j.con.printf("Faultline demo: a training job of %d ranks on %d nodes, on this machine", j.world, cfg.Nodes)
	j.con.printf("output: %s (replaced on the next run)\n", j.out)
	if err := j.setupTopology(); err != nil {
		return err
	}
	if err := j.setupCheckpoints(); err != nil {
		return err
	}
	if j.fab, err = newFabric(); err != nil {
		return err
	}
	if err := j.setupManager(ctx); err != nil {
		return err
	}
	started := time.Now()
	if err := j.startProxies(); err != nil {
		return err
	}
	if err := j.startWorkers(ctx); err != nil {
		return err
	}
	j.wg.Go(func() { j.watchSlowNodes(ctx) })
	ager, err := trace.NewAger(trace.AgerConfig{Root: j.path("profiling"), BudgetBytes: 512 << 20, Interval: 10 * time.Second, Registerer: j.reg, Logger: j.log})
	if err != nil {
		return err
	}
	j.wg.Go(func() { ager.Run(ctx); ager.Close() })

	if err := j.waitFor(ctx, 2*time.Minute, func() bool {
		_, all := j.minStepLocked()
		return all
	}); err != nil {
		return fmt.Errorf("waiting for every rank to train: %w", err)
	}
	j.con.printf("  ready      proxies up, %d/%d ranks registered with the manager and training %.1fs after they started\n", j.world, j.world, time.Since(started).Seconds())
	return nil
}

func (j *job) openLog(name string) (*os.File, error) {
	f, err := os.OpenFile(j.path("logs", name), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	j.files = append(j.files, f)
	return f, nil
}

// setupTopology writes the cluster's wiring as DLRover's
// node-topology-config, orders the nodes the scheduler listed by it, and
// writes the rank table of that order.
func (j *job) setupTopology() error {
	n := j.cfg.Nodes
	half := (n + 1) / 2
	var conf strings.Builder
	conf.WriteString("# asw psw ip: the node-topology-config of the demo's simulated cluster\n")
	listed := make([]string, 0, n) // as a scheduler lists them: switches interleaved
	for i := range half {
		for _, k := range []int{i, half + i} {
			if k < n {
				listed = append(listed, fmt.Sprintf("127.0.1.%d", k+1))
			}
		}
	}
	for k := range n {
		asw := "asw-01"
		if k >= half {
			asw = "asw-02"
		}
		fmt.Fprintf(&conf, "%s psw-1 127.0.1.%d\n", asw, k+1)
	}
	path := j.path("topology.txt")
	if err := atomicfile.WriteFile(path, []byte(conf.String()), 0o644); err != nil {
		return err
	}
	topo, err := topology.ReadFile(path)
	if err != nil {
		return err
	}
	j.hosts = topo.Order(listed)
	servers := make([]topology.Server, n)
	for i, h := range j.hosts {
		node, _ := topo.Lookup(h)
		j.switchOf = append(j.switchOf, node.ASW)
		servers[i] = topology.Server{ID: h}
		for d := range j.cfg.ProcsPerNode {
			servers[i].Devices = append(servers[i].Devices, topology.Device{ID: d, IP: fmt.Sprintf("192.168.%d.%d", i+1, d+1)})
		}
	}
	rt, err := topology.NewRankTable(servers)
	if err != nil {
		return err
	}
	b, err := rt.Marshal()
	if err != nil {
		return err
	}
	if err := atomicfile.WriteFile(j.path("hccl.json"), b, 0o644); err != nil {
		return err
	}
	j.con.printf("setup")
	j.con.printf("  topology   %s lists the nodes as %s; by switch: %s", j.rel(path), strings.Join(listed, " "), strings.Join(j.hosts, " "))
	for i, h := range j.hosts {
		lo, hi := i*j.cfg.ProcsPerNode, (i+1)*j.cfg.ProcsPerNode-1
		j.con.printf("             node %d = %s under %s: ranks %s", i, h, j.switchOf[i], rankRange(lo, hi))
	}
	j.con.printf("             rank table %s", j.rel(j.path("hccl.json")))
	return nil
}

func rankRange(lo, hi int) string {
	if lo == hi {
		return strconv.Itoa(lo)
	}
	return fmt.Sprintf("%d-%d", lo, hi)
}

// setupCheckpoints starts each node's checkpoint owner, the agent that
// holds its ranks' flash checkpoints in shared memory and persists them
// to the job's disk tier (one folder that every node shares here).
func (j *job) setupCheckpoints() error {
	for _, p := range sweepShm("/dev/shm") {
		j.con.printf("  (removed %s, left by a demo that was killed)", p)
	}
	j.shm = filepath.Join("/dev/shm", shmPrefix+strconv.Itoa(os.Getpid()))
	if err := os.MkdirAll(j.shm, 0o700); err != nil {
		return fmt.Errorf("shared memory: %w", err)
	}
	capacity := layout.StepSize([]string{"model"}, []int64{modelBytes})
	committer := &ckpt.LocalCommitter{Dir: j.path("ckpt"), Retention: ckpt.Retention{KeepLatest: 3}}
	j.ckpts = &nodeCheckpoints{}
	for n := range j.cfg.Nodes {
		var shards []int
		for r := n * j.cfg.ProcsPerNode; r < (n+1)*j.cfg.ProcsPerNode; r++ {
			shards = append(shards, r)
		}
		o, err := ckpt.NewOwner(ckpt.OwnerConfig{
			ShmDir: j.shm, Name: "ckpt", Shards: shards, NumShards: j.world, Capacity: capacity,
			Dir: j.path("ckpt"), Committer: committer, PollInterval: 50 * time.Millisecond, Workers: 1,
			Registerer: prometheus.WrapRegistererWith(prometheus.Labels{"node": strconv.Itoa(n)}, j.reg), Logger: j.log,
		})
		if err != nil {
			return err
		}
		j.owners = append(j.owners, o)
		j.ckpts.owners = append(j.ckpts.owners, o)
		j.ckpts.shards = append(j.ckpts.shards, shards)
	}
	for _, o := range j.owners {
		j.wg.Go(func() { o.Run(context.Background()) }) // Close ends it
	}
	return nil
}

// setupManager starts the manager with orchestration on, and the
// launcher's /metrics.
func (j *job) setupManager(ctx context.Context) error {
	// The policy never escalates on recurrence and barely backs off: the
	// demo breaks the same nodes again within seconds, on purpose.
	policy, err := rescheduling.NewPolicy(rescheduling.Config{
		FailWindow: -1, DedupeWindow: time.Millisecond,
		Backoff:    rescheduling.Backoff{Initial: 50 * time.Millisecond, Max: time.Second},
		Registerer: j.reg, Logger: j.log,
	})
	if err != nil {
		return err
	}
	j.policy = policy
	j.sups = make([]*local.Supervisor, j.cfg.Nodes)
	j.diag = newHangDiagnosis(j)
	switchFile := j.path("datatrace-config", "profilingSwitch")
	if err := os.MkdirAll(filepath.Dir(switchFile), 0o755); err != nil {
		return err
	}
	if err := atomicfile.WriteFile(switchFile, []byte(trace.AllOn().String()), 0o644); err != nil {
		return err
	}
	// The proxies' token, made here and handed to the proxies this job
	// starts: without one the manager takes no proxy.
	var secret [16]byte
	rand.Read(secret[:])
	j.proxyToken = hex.EncodeToString(secret[:])
	j.m, err = taskd.NewManager(taskd.ManagerConfig{
		Job: jobID, Listen: "127.0.0.1:0", Nodes: j.cfg.Nodes, ProcsPerNode: j.cfg.ProcsPerNode,
		Security: taskd.Security{Insecure: true}, ProxyToken: j.proxyToken,
		HeartbeatInterval: 500 * time.Millisecond, HeartbeatDeadline: 3 * time.Second, AckTimeout: time.Second,
		StateDir:     j.path("manager"),
		SwitchSource: taskd.SwitchFile(trace.SwitchWatcherConfig{Path: switchFile, Registerer: j.reg, Logger: j.log}),
		Handlers:     []taskd.Handler{{Name: "hang-diagnosis", Handle: j.diag.handle}},
		Orchestration: &taskd.OrchestrationConfig{
			// Slow-node verdicts start a recovery too: the policy replaces
			// a slow rank's pod.
			Triggers:    []taskd.FaultKind{taskd.FaultProcessExit, taskd.FaultLost, taskd.FaultHang, taskd.FaultOpError, taskd.FaultSlowNode},
			Policy:      policy,
			Executor:    local.Nodes(j.sups),
			Checkpoints: j.ckpts,
			Timeouts: taskd.Timeouts{Pause: 10 * time.Second, Notify: 10 * time.Second, Decide: 5 * time.Second,
				Restart: time.Minute, Replace: time.Minute, Load: 30 * time.Second, Resume: 30 * time.Second, Switch: 30 * time.Second},
			OnTransition: func(o taskd.Orchestration, _ taskd.Transition) {
				j.mu.Lock()
				j.orchs[o.ID] = o
				j.notifyLocked()
				j.mu.Unlock()
			},
		},
		Registerer: j.reg, Logger: j.log,
	})
	if err != nil {
		return err
	}
	j.wg.Go(func() { j.m.Run(ctx) })
	url, err := j.serveMetrics()
	if err != nil {
		return err
	}
	j.metrics = url
	j.con.printf("  manager    %s: orchestration on (rescheduling policy, a local supervisor per node, the nodes' checkpoint owners)", j.m.Addr())
	j.con.printf("             metrics %s; profiling switch from %s (all on)", url, j.rel(switchFile))
	return nil
}

// serveMetrics serves the launcher's registry: the manager, the
// checkpoint owners, the policy, the slow-node watcher and the ager.
func (j *job) serveMetrics() (string, error) {
	var wg sync.WaitGroup
	ctx, cancel := context.WithCancel(context.Background())
	url, err := serveMetrics(ctx, "127.0.0.1", j.reg, &wg)
	if err != nil {
		cancel()
		return "", err
	}
	j.stopMetrics = func() { cancel(); wg.Wait() }
	return url, nil
}

// childEnv returns the environment entries that make this program a
// child of role with args.
func childEnv(role string, a childArgs) []string {
	b, _ := json.Marshal(a)
	return []string{envRole + "=" + role, envArgs + "=" + string(b)}
}

// startProxies starts one proxy process per node, listening on the
// node's address.
func (j *job) startProxies() error {
	for n, host := range j.hosts {
		stderr, err := j.openLog(fmt.Sprintf("proxy-%d.log", n))
		if err != nil {
			return err
		}
		cmd := exec.Command(j.exe)
		cmd.Env = append(os.Environ(), childEnv("proxy", childArgs{Job: jobID, Node: n, Host: host, Upstream: j.m.Addr().String(), ProxyToken: j.proxyToken,
			DottingRoot: j.path("profiling"), StackDir: j.path("stacks")})...)
		cmd.Stderr = stderr
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			return err
		}
		if err := cmd.Start(); err != nil {
			return fmt.Errorf("proxy of node %d: %w", n, err)
		}
		p := &proxyProc{node: n, cmd: cmd}
		j.proxies = append(j.proxies, p)
		ready := make(chan []string, 1)
		go func() {
			sc := bufio.NewScanner(stdout)
			for sc.Scan() {
				if f := strings.Fields(sc.Text()); len(f) == 3 && f[0] == "ready" {
					ready <- f[1:]
				}
			}
			close(ready)
		}()
		select {
		case f, ok := <-ready:
			if !ok {
				return fmt.Errorf("proxy of node %d exited; see %s", n, j.rel(stderr.Name()))
			}
			p.addr, p.metrics = f[0], f[1]
		case <-time.After(time.Minute):
			return fmt.Errorf("proxy of node %d not ready after a minute; see %s", n, j.rel(stderr.Name()))
		}
	}
	return nil
}

// startWorkers starts every node's supervisor, which runs its ranks.
func (j *job) startWorkers(ctx context.Context) error {
	c := j.cfg
	for n := range c.Nodes {
		var cmds []local.Command
		for r := n * c.ProcsPerNode; r < (n+1)*c.ProcsPerNode; r++ {
			stderr, err := j.openLog(fmt.Sprintf("rank-%d.log", r))
			if err != nil {
				return err
			}
			a := childArgs{Job: jobID, Node: n, Host: j.hosts[n], Upstream: j.proxies[n].addr,
				Rank: r, World: j.world, ProcsPerNode: c.ProcsPerNode, Fabric: j.fab.Addr(),
				DottingRoot: j.path("profiling"), StackDir: j.path("stacks", jobID),
				Segment: j.owners[n].SegmentPath(r), CkptDir: j.path("ckpt"),
				StepTime: c.StepTime, HangTimeout: c.HangTimeout, SaveEvery: c.SaveEvery, PersistEvery: c.PersistEvery,
				SwitchTime: 300 * time.Millisecond, PauseGrace: 500 * time.Millisecond}
			cmds = append(cmds, local.Command{Name: fmt.Sprintf("rank-%d", r), Path: j.exe, Env: childEnv("worker", a),
				Stdout: &rankOutput{j: j, rank: r}, Stderr: stderr})
		}
		s, err := local.New(local.Config{Commands: cmds, Node: fmt.Sprintf("node-%d", n), StopTimeout: 3 * time.Second, Logger: j.log})
		if err != nil {
			return err
		}
		j.sups[n] = s
		j.wg.Go(func() { s.Run(ctx) })
		j.wg.Go(func() { j.reportExits(n, s) })
	}
	lo, hi := 0, c.ProcsPerNode-1
	j.con.printf("  nodes      each: a proxy process (taskd), a checkpoint owner (ckpt, in %s) and a supervisor (rescheduling/local)", j.shm)
	j.con.printf("  workers    %d processes, one per rank (ranks %s on node 0, ...), each training a synthetic model:", j.world, rankRange(lo, hi))
	j.con.printf("             dataloader, forward with a TP all-gather, backward, DP all-reduce; %v a step", c.StepTime)
	j.con.printf("             dotting every phase (trace) into %s/<rank>/", j.rel(j.path("profiling", jobID)))
	j.con.printf("             flash checkpoint to memory every %d steps, to disk every %d (%s)", c.SaveEvery, c.SaveEvery*c.PersistEvery, j.rel(j.path("ckpt")))
	j.con.printf("             collectives timed by a hang watchdog (timeout %v)", c.HangTimeout)
	return nil
}

// reportExits reports each unexpected exit a supervisor sees to the
// manager, as a node agent does.
func (j *job) reportExits(node int, s *local.Supervisor) {
	for f := range s.Faults() {
		rank, _ := strconv.Atoi(strings.TrimPrefix(f.Process, "rank-"))
		attrs := map[string]string{}
		sig := ""
		if f.Signal != 0 {
			sig = unix.SignalName(f.Signal)
			attrs["signal"] = sig
		}
		pid := ""
		for _, e := range f.Evidence {
			if p, ok := strings.CutPrefix(e, "pid="); ok {
				pid = p
			}
		}
		fault, _, err := j.m.ReportFault(taskd.Fault{Kind: taskd.FaultProcessExit, Position: taskd.Position{Node: node, Rank: rank},
			Code: f.ExitCode, Attrs: attrs, Message: fmt.Sprintf("pid %s exited with code %d", pid, f.ExitCode), Time: f.Time})
		if err != nil {
			j.log.Error("demo: exit not reported", "rank", rank, "err", err)
		}
		j.mu.Lock()
		if rank >= 0 && rank < len(j.ranks) {
			j.ranks[rank].state = "down"
		}
		j.exits = append(j.exits, exitSeen{rank: rank, pid: pid, code: f.ExitCode, signal: sig, time: f.Time, fault: fault})
		j.notifyLocked()
		j.mu.Unlock()
	}
}

// watchSlowNodes follows the slow-node verdict of the live dotting files.
func (j *job) watchSlowNodes(ctx context.Context) {
	nodes := map[int]string{}
	if b, err := os.ReadFile(j.path("hccl.json")); err == nil {
		if rt, err := slownode.ParseRankTable(b); err == nil {
			nodes = rt
		}
	}
	cfg := slownode.Config{
		// The injected faults are several times slower; the thresholds
		// leave a loaded machine's jitter well alone.
		RelativeThreshold: 0.5, MinEffect: 0.1,
		Nodes: nodes, RanksPerNode: j.cfg.ProcsPerNode, PollInterval: 500 * time.Millisecond,
		Registerer: j.reg, Logger: j.log,
	}
	err := slownode.Watch(ctx, j.path("profiling", jobID), cfg, func(r *slownode.Result) {
		j.mu.Lock()
		j.verdict, j.verdictAt = r, time.Now()
		if len(j.verdicts) >= 64 {
			j.verdicts = slices.Delete(j.verdicts, 0, 32)
		}
		j.verdicts = append(j.verdicts, seenVerdict{r, j.verdictAt})
		j.notifyLocked()
		j.mu.Unlock()
	})
	if err != nil {
		j.log.Error("demo: slow-node watch", "err", err)
	}
}

// seenVerdict is a verdict of the slow-node watch and when it came.
type seenVerdict struct {
	r  *slownode.Result
	at time.Time
}

// stopProxies ends the proxy processes: SIGTERM to their groups, SIGKILL
// after 3 s.
func (j *job) stopProxies() {
	for _, p := range j.proxies {
		syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
		done := make(chan struct{})
		go func() { p.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(3 * time.Second):
			syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
			<-done
		}
	}
}

// teardown stops everything setup started, in order, and removes the
// shared memory. It is safe after a partial setup.
func (j *job) teardown() {
	for _, s := range j.sups {
		if s != nil {
			s.Close()
		}
	}
	j.stopProxies()
	if j.m != nil {
		j.m.Close()
	}
	if j.policy != nil {
		j.policy.Close()
	}
	if j.cancel != nil {
		j.cancel()
	}
	for _, o := range j.owners {
		if err := o.Remove(); err != nil {
			j.log.Error("demo: remove checkpoint segments", "err", err)
		}
	}
	if j.fab != nil {
		j.fab.Close()
	}
	if j.stopMetrics != nil {
		j.stopMetrics()
	}
	j.wg.Wait()
	if j.shm != "" {
		os.RemoveAll(j.shm)
	}
	for _, f := range j.files {
		f.Close()
	}
}

// scrape fetches a /metrics URL into a file.
func scrape(client *http.Client, url, path string) error {
	res, err := client.Get(url)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		return fmt.Errorf("%s: %s", url, res.Status)
	}
	b, err := io.ReadAll(io.LimitReader(res.Body, 64<<20))
	if err != nil {
		return err
	}
	return atomicfile.WriteFile(path, b, 0o644)
}
