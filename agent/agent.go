package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/faultline-ml/faultline/hang"
	"github.com/faultline-ml/faultline/rescheduling"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/trace"
	"github.com/faultline-ml/faultline/trace/slownode"
)

// Errors that end Run.
var (
	// ErrStopped: recovery stopped the job for good (its restart budget
	// spent, or a fault no strategy could repair); the error says why.
	ErrStopped = errors.New("agent: the job was stopped")
	// ErrClosed: Run after Close.
	ErrClosed = errors.New("agent: closed")
)

// stackSignal is the signal on which a rank's faulthandler dumps its
// stacks: a real-time signal no library of the training stack takes.
const stackSignal = syscall.Signal(37) // SIGRTMIN+3 under glibc

// Agent runs one node of a training job: it starts the node's ranks,
// owns their checkpoint segments and dotting rings, watches them for
// exits, hangs and slowness, and has the job's taskd manager stop,
// restart and resume them together when one fails.
type Agent struct {
	cfg   Config
	log   *slog.Logger
	world int
	dir   string // the agent's private folder: socket, stack files
	sock  string
	slots []*slot
	// releaseOut unlocks Out (see claimOut).
	releaseOut func()

	mgr      *taskd.Manager  // node 0's, when the job has no other
	job      *jobCheckpoints // its handler's side
	mgrAddr  string
	policy   *rescheduling.Policy
	ckpts    *checkpoints
	incident *incidents
	instance string // this agent's, new at each start: a node that replaces another says so

	mu          sync.Mutex
	rounds      map[string]string // by message kind: the round carried out last
	sw          trace.Switch
	stopped     string   // why recovery stopped the job, "" while it runs
	resized     *Resized // how the job goes on, when it goes on with other nodes
	finished    chan struct{}
	term        chan struct{}  // closed by Terminate
	termSig     syscall.Signal // Terminate's signal, 0 before
	termAt      time.Time
	once        sync.Once
	stopJobOnce sync.Once
	warnOnce    sync.Once // a step longer than the collective timeout
	closed      bool

	done atomic.Bool // every rank of the node finished

	grows growHolds // the job taking in nodes: the faults it holds

	shape     chan struct{} // closed once the ranks may start (see shaped)
	shapeOnce sync.Once
	runCtx    context.Context // Run's: what deferred starts run under
	wg        sync.WaitGroup  // deferred starts
	deferOff  bool            // under mu: Run is ending, no deferred start begins
}

// New builds the agent of one node: its rings and folders; nothing runs
// before Run.
func New(cfg Config) (*Agent, error) {
	// The last run's warm interpreters that no slot adopts are killed.
	defer dropWarm(cfg.warm)
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	a := &Agent{cfg: cfg, log: cfg.Logger.With("node", cfg.NodeRank), world: cfg.world(), finished: make(chan struct{}), term: make(chan struct{}),
		instance: newRound(), shape: make(chan struct{})}
	if !a.elastic() {
		a.takeShape()
	}
	if err := os.MkdirAll(cfg.Out, 0o750); err != nil {
		return nil, fmt.Errorf("agent: Out: %w", err)
	}
	release, err := a.claimOut()
	if err != nil {
		return nil, err
	}
	a.releaseOut = sync.OnceFunc(release)
	if err := os.MkdirAll(cfg.TraceRoot, 0o750); err != nil {
		a.releaseOut()
		return nil, fmt.Errorf("agent: TraceRoot: %w", err)
	}
	if a.dir, err = os.MkdirTemp("", "faultline-run-"); err != nil {
		a.releaseOut()
		return nil, fmt.Errorf("agent: %w", err)
	}
	a.sock = filepath.Join(a.dir, "agent.sock")
	if a.ckpts, err = newCheckpoints(a); err != nil {
		os.RemoveAll(a.dir)
		return nil, err
	}
	a.incident = newIncidents(a)
	for l := range cfg.ProcsPerNode {
		s, err := newSlot(a, l)
		if err != nil {
			a.cleanup()
			return nil, err
		}
		a.slots = append(a.slots, s)
		if sp := cfg.warm[l]; sp != nil {
			s.adopt(sp)
			delete(cfg.warm, l)
		}
	}
	a.cfg.warm = nil
	a.applySwitch(a.initialSwitch())
	return a, nil
}

// Run starts the ranks and serves them until the job ends: nil when every
// rank exited 0, an error wrapping ErrStopped when recovery stopped the
// job, one wrapping ErrTerminated after Terminate, or ctx's error. Each
// ending gives the node's checkpoint segments back, or keeps them for a
// new agent of the job when their newest step is not on disk.
func (a *Agent) Run(ctx context.Context) error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return ErrClosed
	}
	a.mu.Unlock()
	defer a.cleanup()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	srv, err := listen(a)
	if err != nil {
		return err
	}
	defer srv.close()

	g, gctx := errgroup.WithContext(ctx)
	a.runCtx = gctx
	defer func() {
		// After cancel, below: deferred starts end with gctx, and none
		// begins once Wait has.
		a.mu.Lock()
		a.deferOff = true
		a.mu.Unlock()
		a.wg.Wait()
	}()
	g.Go(func() error { srv.serve(gctx); return nil })
	switch {
	case a.cfg.joining:
		warm := ""
		if !a.cfg.NoPython && !a.cfg.NoSpares {
			warm = ", keeps warm interpreters,"
		}
		fmt.Fprintf(a.cfg.Stderr, "faultline-run: the node started as --node-rank %d waits to join job %s, which went on without it: it runs no rank%s until the job takes it in, at its next restart point, or has it take a lost node's place\n", a.cfg.launchRank, a.controlJob(), warm)
	case a.cfg.spare():
		fmt.Fprintf(a.cfg.Stderr, "faultline-run: node %d is a spare of job %s: it runs no rank, keeps warm interpreters and the replicas it is sent, and takes the place of a node of the job that is lost\n", a.cfg.NodeRank, a.cfg.Job)
		a.ckpts.holdReplicas(gctx)
	}
	// Each rank's interpreter imports torch while the node joins the job
	// (the store, the manager, the first rendezvous), so that its first
	// process starts warm, as its restarts do: seconds saved at every
	// start, most of all for a node that replaces a lost one.
	for _, s := range a.slots {
		s.prepareSpare()
	}
	if a.hostsStore() {
		ready, failed := make(chan struct{}), make(chan error, 1)
		g.Go(func() error {
			err := a.runStore(gctx, ready)
			failed <- err
			return err
		})
		if err := a.awaitStore(gctx, ready, failed); err != nil {
			cancel()
			_ = g.Wait()
			return err
		}
	}
	if err := a.startManager(gctx, g); err != nil {
		cancel()
		_ = g.Wait()
		return err
	}
	g.Go(func() error { a.drain(gctx); return nil })
	g.Go(func() error { a.watchSlowness(gctx); return nil })
	for _, s := range a.slots {
		g.Go(func() error { return s.wd.Run(gctx) })
		g.Go(func() error { s.serveWorkers(gctx); return nil })
	}
	g.Go(func() error { a.awaitManager(gctx); return nil })
	g.Go(func() error { a.announce(gctx); return nil })
	g.Go(func() error { a.awaitNodes(gctx); return nil })
	g.Go(func() error { a.watchJoiners(gctx); return nil })
	var result error
	select {
	case <-a.finished:
		a.mu.Lock()
		switch {
		case a.resized != nil:
			result = a.resized
		case a.stopped != "":
			result = fmt.Errorf("%w: %s", ErrStopped, a.stopped)
		}
		a.mu.Unlock()
	case <-a.term:
		result = a.terminate(ctx)
	case <-ctx.Done():
		result = ctx.Err()
	}
	if r, ok := result.(*Resized); ok && a.terminating() == 0 {
		r.warm = a.warmSpares() // the next run starts its ranks from them
	}
	a.shutdown()
	cancel()
	if err := g.Wait(); err != nil && result == nil && !errors.Is(err, context.Canceled) {
		result = err
	}
	// Every ending gives the segments back, or keeps them on purpose (their
	// newest step not on disk) and says so; a job that goes on resized
	// keeps them under the ranks' new numbers.
	var r *Resized
	if errors.As(result, &r) {
		a.ckpts.mu.Lock()
		r.dir = a.ckpts.dir // the next run knows the job's folder before its ranks name it
		a.ckpts.mu.Unlock()
		if err := a.ckpts.renumber(r); err != nil {
			fmt.Fprintf(a.cfg.Stderr, "faultline-run: node %d: the ranks' segments were not all renumbered, so not every rank resumes from its memory (the job agrees on a step every rank holds, on disk or none): %v\n", a.cfg.NodeRank, err)
		}
		return result
	}
	a.ckpts.release(context.Background(), result == nil)
	return result
}

// startManager runs node 0's manager when the job names no other.
func (a *Agent) startManager(ctx context.Context, g *errgroup.Group) error {
	a.mgrAddr = a.cfg.Manager
	if a.cfg.Manager != "" || a.cfg.NodeRank != 0 {
		if a.mgrAddr == "" {
			a.mgrAddr = net.JoinHostPort(a.cfg.MasterAddr, strconv.Itoa(a.cfg.MasterPort+1))
		}
		return nil
	}
	policy, err := newPolicy(a.log)
	if err != nil {
		return fmt.Errorf("agent: %w", err)
	}
	a.policy = policy
	job := newJobCheckpoints(a.cfg.Nodes, a, a.log)
	if g := a.cfg.grown; g != nil {
		job.core.adopters = g.adopters
	}
	a.job = job
	interval, deadline := a.cfg.heartbeats()
	// The manager lives and dies with this launcher: a recovery the last
	// one left in progress ended with its ranks, and this is a new run
	// of the job, which it must not stop with that recovery's reason.
	// The fault log and the recoveries' history stay.
	stateDir := filepath.Join(a.cfg.Out, "manager")
	if a.cfg.Generation > 0 {
		// The manager of a job that went on resized keeps its state
		// beside the first one's, and moves with it to previous/.
		stateDir = filepath.Join(stateDir, a.controlJob())
	}
	if err := os.Remove(filepath.Join(stateDir, "orchestration.json")); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("agent: the last run's recovery state: %w", err)
	}
	spares := a.cfg.SpareNodes
	if a.cfg.growable() {
		spares = 2*a.cfg.joinBase() - a.cfg.Nodes // and the nodes waiting to join
	}
	m, err := taskd.NewManager(taskd.ManagerConfig{
		Job: a.controlJob(), Listen: a.cfg.ManagerListen, Nodes: a.cfg.Nodes, ProcsPerNode: a.cfg.ProcsPerNode, SpareNodes: spares,
		Security: a.cfg.Security, StateDir: stateDir,
		HeartbeatInterval: interval, HeartbeatDeadline: deadline,
		Handlers:     []taskd.Handler{job.handler()},
		SwitchSource: switchSource(a.cfg.SwitchFile),
		Orchestration: &taskd.OrchestrationConfig{
			Policy:       policy,
			Executor:     executor{},
			Checkpoints:  job,
			Strategies:   strategies,
			OnTransition: a.incident.transition,
			Timeouts:     taskd.Timeouts{Pause: 20 * time.Second, Restart: 30 * time.Second, Replace: a.cfg.NodeTimeout, Resume: 60 * time.Second},
		},
		Registerer: a.cfg.Registerer,
		Logger:     a.log.With("component", "manager"),
	})
	if err != nil {
		return fmt.Errorf("agent: manager: %w", err)
	}
	a.mgr = m
	a.mgrAddr = dialable(m.Addr())
	if a.cfg.SwitchFile == "" {
		if _, err := m.SetSwitch(a.initialSwitch()); err != nil {
			return fmt.Errorf("agent: manager: %w", err)
		}
	}
	g.Go(func() error {
		err := m.Run(ctx)
		if ctx.Err() != nil {
			return nil
		}
		return err
	})
	return nil
}

// controlJob is the job's name on the control plane and in the dotting
// root: a job that went on resized has a new one, so that no node
// registers with the manager of its last shape, which may not have ended
// yet, and starts its ranks before the new shape's store is up, and so
// that the slow-rank analysis reads no rank of the last shape.
func (a *Agent) controlJob() string {
	if a.cfg.Generation == 0 {
		return a.cfg.Job
	}
	return fmt.Sprintf("%s-g%d", a.cfg.Job, a.cfg.Generation)
}

// dialable is the address at which this host reaches a listener on addr:
// loopback for one on every interface.
func dialable(addr net.Addr) string {
	if t, ok := addr.(*net.TCPAddr); ok && t.IP.IsUnspecified() {
		return net.JoinHostPort("127.0.0.1", strconv.Itoa(t.Port))
	}
	return addr.String()
}

// awaitManager says so when the ranks wait long for the manager: they
// start once their workers are registered with it.
func (a *Agent) awaitManager(ctx context.Context) {
	t := time.NewTimer(15 * time.Second)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return
	case <-t.C:
	}
	for _, s := range a.slots {
		s.mu.Lock()
		w := s.worker
		s.mu.Unlock()
		switch {
		case w != nil && w.OtherJob() != "":
			fmt.Fprintf(a.cfg.Stderr, "faultline-run: %s's ranks wait for the job's manager at %s: it serves job %q, not %q; give every node the same --rdzv-id\n",
				a.name(), a.mgrAddr, w.OtherJob(), a.controlJob())
			return
		case w != nil && w.Taken():
			fmt.Fprintf(a.cfg.Stderr, "faultline-run: %s's ranks wait to register with the job's manager at %s: another live node's workers hold them, a node this one replaces, say, not yet declared lost (--heartbeat-deadline %v)\n",
				a.name(), a.mgrAddr, a.cfg.HeartbeatDeadline)
			return
		case w == nil || !w.Connected():
			fmt.Fprintf(a.cfg.Stderr, "faultline-run: %s's ranks wait for the job's manager at %s (job %q): not registered after 15s; check --master-addr, --master-port, --rdzv-id and the token on every node\n",
				a.name(), a.mgrAddr, a.controlJob())
			return
		}
	}
}

// hostsStore reports whether this agent hosts the job's c10d store: node
// 0's, for Python ranks.
func (a *Agent) hostsStore() bool { return a.cfg.NodeRank == 0 && !a.cfg.NoPython }

// initialSwitch is the profiling switch the ranks start with, before the
// manager's reaches them.
func (a *Agent) initialSwitch() trace.Switch {
	if a.cfg.Switch != nil {
		return *a.cfg.Switch
	}
	if a.cfg.SwitchFile != "" {
		return trace.Switch{}
	}
	return trace.AllOn()
}

// switchSource follows a profilingSwitch file, when one is named.
func switchSource(path string) taskd.SwitchSource {
	if path == "" {
		return nil
	}
	return taskd.SwitchFile(trace.SwitchWatcherConfig{Path: path})
}

// slotEnded is told when a slot's rank is done (exit 0); the job ends
// here when every slot's is, and the node's ranks leave it finished.
func (a *Agent) slotEnded() {
	for _, s := range a.slots {
		if !s.stateIs(slotDone) {
			return
		}
	}
	if !a.done.CompareAndSwap(false, true) {
		return
	}
	a.tellSpares(jobFinished)
	// A worker serveWorkers registers from now on sees done and leaves.
	for _, s := range a.slots {
		s.mu.Lock()
		w := s.worker
		s.mu.Unlock()
		if w != nil {
			w.Finish()
			w.Close()
		}
	}
	a.incident.finish(jobFinished)
	a.once.Do(func() { close(a.finished) })
}

// nodeFinished reports whether every rank of the node finished.
func (a *Agent) nodeFinished() bool { return a.done.Load() }

// stop records why recovery stopped the job (the first reason given
// stays: the most telling one comes first).
func (a *Agent) stop(reason string) {
	a.mu.Lock()
	if a.stopped == "" {
		a.stopped = reason
	}
	a.mu.Unlock()
}

// stopOthers stops the node's ranks but s's, their stacks first, into
// the open incident's folder.
func (a *Agent) stopOthers(s *slot, why string) {
	dir := a.incident.stackDir()
	var wg sync.WaitGroup
	for _, o := range a.slots {
		if o != s {
			wg.Go(func() { o.stop("stopped: "+why, dir) })
		}
	}
	wg.Wait()
}

// stopNode stops every rank of the node for good, and ends the job here.
func (a *Agent) stopNode(reason string) {
	a.stop(reason)
	a.mu.Lock()
	reason = a.stopped // the first, most telling reason
	a.mu.Unlock()
	for _, s := range a.slots {
		s.kill()
		s.mu.Lock()
		s.state = slotStopped
		s.mu.Unlock()
	}
	if r := a.resizedTo(); r != nil && a.terminating() == 0 {
		a.incident.finish("resized: " + r.Why)
	} else {
		a.incident.finish("stopped: " + reason)
	}
	a.once.Do(func() { close(a.finished) })
}

// stopJob, on node 0, has every node stop its ranks: recovery gave up.
// Only its first call counts.
func (a *Agent) stopJob(reason string) {
	a.stopJobOnce.Do(func() { a.stopAll(reason) })
}

func (a *Agent) stopAll(reason string) {
	if a.mgr != nil && (a.cfg.Nodes > 1 || a.cfg.growable()) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := a.mgr.Broadcast(ctx, taskd.Target{All: true, Nodes: a.spares()}, kindStop, []byte(reason)); err != nil {
			a.log.Warn("agent: not every node was told to stop", "err", err)
		}
	}
	a.stopNode(reason)
}

// shutdown kills what still runs: ranks, spares.
func (a *Agent) shutdown() {
	for _, s := range a.slots {
		s.shutdown()
	}
	if a.mgr != nil && a.terminating() == 0 {
		// Let node 0's manager outlive this node's ranks while another
		// node's are still registered: they would lose their control plane
		// (not past a grace period, though).
		deadline := time.Now().Add(30 * time.Second)
		for time.Now().Before(deadline) && slices.ContainsFunc(a.mgr.Members(), func(mi taskd.MemberInfo) bool {
			return mi.Role == taskd.RoleWorker && mi.Position.Node != a.cfg.NodeRank
		}) {
			time.Sleep(50 * time.Millisecond)
		}
	}
}

// Close releases what New made. It is idempotent; Run cleans up too.
func (a *Agent) Close() error {
	a.mu.Lock()
	a.closed = true
	a.mu.Unlock()
	a.cleanup()
	return nil
}

func (a *Agent) cleanup() {
	a.grows.mu.Lock()
	if a.grows.expiry != nil {
		a.grows.expiry.Stop()
	}
	a.grows.mu.Unlock()
	for _, s := range a.slots {
		s.close()
	}
	a.ckpts.close()
	if a.mgr != nil {
		a.mgr.Close()
	}
	if a.policy != nil {
		a.policy.Close()
	}
	if a.dir != "" {
		os.RemoveAll(a.dir)
	}
	a.releaseOut()
}

// applySwitch applies a profiling switch to every rank: its ring, which
// the rank reads before each range, and its recorder.
func (a *Agent) applySwitch(sw trace.Switch) error {
	a.mu.Lock()
	a.sw = sw
	a.mu.Unlock()
	for _, s := range a.slots {
		s.applySwitch(sw)
	}
	return nil
}

// watchSlowness runs slownode.Watch over the job's live dotting files and
// writes each new verdict to Out as it changes.
func (a *Agent) watchSlowness(ctx context.Context) {
	jobDir := filepath.Join(a.cfg.TraceRoot, a.controlJob())
	if err := os.MkdirAll(jobDir, 0o750); err != nil {
		a.log.Warn("agent: slownode: no dotting folder", "err", err)
		return
	}
	err := slownode.Watch(ctx, jobDir, slownode.Config{RanksPerNode: a.cfg.ProcsPerNode}, func(r *slownode.Result) {
		a.writeVerdict(r)
	})
	if err != nil && ctx.Err() == nil {
		a.log.Warn("agent: slownode watch ended", "err", err)
	}
}

// hangConfig is the watchdog configuration of rank.
func (a *Agent) hangConfig(rank int, onFault func(hang.Fault)) hang.Config {
	// hang labels its metrics with the rank itself.
	// A spare's ranks (which run nothing) follow the job's.
	c := hang.Config{Rank: rank, World: max(a.world, rank+1), Timeout: a.cfg.CollectiveTimeout, OnFault: onFault,
		Logger: a.log, Registerer: a.cfg.Registerer}
	if a.cfg.CollectiveTimeout == 0 {
		c.LearnTimeouts = true
	}
	return c
}

// wrapRank gives each rank's collectors a label of their own on reg.
func wrapRank(reg prometheus.Registerer, rank int) prometheus.Registerer {
	if reg == nil {
		return nil
	}
	return prometheus.WrapRegistererWith(prometheus.Labels{"rank": fmt.Sprint(rank)}, reg)
}
