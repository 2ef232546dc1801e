package local

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/faultline-ml/faultline/rescheduling"
)

// Command is one supervised process.
type Command struct {
	// Name identifies the process; it is the Process of its faults and
	// of the decisions that target it. Required, unique.
	Name string
	// Path is the program to run; required. Args are its arguments,
	// without the program name.
	Path string
	Args []string
	// Env is added to the supervisor's environment.
	Env []string
	// Dir is the working directory; "" is the supervisor's.
	Dir string
	// Stdout and Stderr receive the process's output; nil discards it.
	Stdout, Stderr io.Writer
}

// Config configures a Supervisor. Commands is required; every other
// field's zero value is a documented default.
type Config struct {
	Commands []Command
	// Node is the Node of the faults reported; default the host name.
	Node string
	// Pod is the Pod of the faults reported; default "".
	Pod string
	// StopTimeout is how long a process has to exit after SIGTERM before
	// SIGKILL; default 10 s.
	StopTimeout time.Duration
	// FaultBuffer is the capacity of the Faults channel; default 64.
	FaultBuffer int
	// Logger receives a record per start, exit and restart; nil: discard.
	Logger *slog.Logger
}

// Validate reports the first field that is missing or out of range.
func (c Config) Validate() error {
	if len(c.Commands) == 0 {
		return errors.New("local: Config.Commands is empty")
	}
	seen := map[string]bool{}
	for i, cmd := range c.Commands {
		switch {
		case cmd.Name == "":
			return fmt.Errorf("local: Config.Commands[%d].Name is empty", i)
		case seen[cmd.Name]:
			return fmt.Errorf("local: Config.Commands[%d].Name %q is used twice", i, cmd.Name)
		case cmd.Path == "":
			return fmt.Errorf("local: Config.Commands[%d] (%q): Path is empty", i, cmd.Name)
		}
		seen[cmd.Name] = true
	}
	switch {
	case c.StopTimeout < 0:
		return fmt.Errorf("local: Config.StopTimeout is %v, want >= 0", c.StopTimeout)
	case c.FaultBuffer < 0:
		return fmt.Errorf("local: Config.FaultBuffer is %d, want >= 0", c.FaultBuffer)
	}
	return nil
}

// ErrNotRunning is returned by the executor methods before Run has started
// the processes and after it has stopped them.
var ErrNotRunning = errors.New("local: supervisor is not running")

// Supervisor runs child processes, reports each unexpected exit as a
// Fault, and restarts them on request: it is the rescheduling.Executor of
// one machine. Every process runs in its own process group, so that a
// stop or restart also ends what it started.
type Supervisor struct {
	cfg    Config
	log    *slog.Logger
	faults chan rescheduling.Fault
	procs  []*proc
	byName map[string]*proc

	op      sync.Mutex // one start, stop or restart at a time
	mu      sync.Mutex // guards the fields below and every proc's
	running bool
	waiters sync.WaitGroup

	finished chan struct{} // signalled when a process exits with code 0
	quit     chan struct{} // closed when Run winds down: faults are no longer sent
	closing  chan struct{}
	closed   sync.Once
	ran      atomic.Bool
	done     chan struct{}
}

// proc is one command and its current incarnation.
type proc struct {
	cmd      Command
	cur      *incarnation // nil before the first start
	restarts int
}

// incarnation is one run of a command.
type incarnation struct {
	pid      int
	started  time.Time
	exited   chan struct{} // closed when the process has been waited for
	stopping bool          // the supervisor ends it: its exit is no fault
	state    *os.ProcessState
}

func (in *incarnation) running() bool {
	select {
	case <-in.exited:
		return false
	default:
		return true
	}
}

// succeeded reports whether the incarnation exited with code 0 on its own.
func (in *incarnation) succeeded() bool {
	return !in.running() && !in.stopping && in.state != nil && in.state.Success()
}

// New returns a supervisor for cfg's commands; Run starts them.
func New(cfg Config) (*Supervisor, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Node == "" {
		cfg.Node, _ = os.Hostname()
	}
	cfg.StopTimeout = cmp.Or(cfg.StopTimeout, 10*time.Second)
	cfg.FaultBuffer = cmp.Or(cfg.FaultBuffer, 64)
	cfg.Logger = cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	s := &Supervisor{
		cfg:      cfg,
		log:      cfg.Logger,
		faults:   make(chan rescheduling.Fault, cfg.FaultBuffer),
		byName:   map[string]*proc{},
		finished: make(chan struct{}, 1),
		quit:     make(chan struct{}),
		closing:  make(chan struct{}),
		done:     make(chan struct{}),
	}
	for _, c := range cfg.Commands {
		p := &proc{cmd: c}
		s.procs = append(s.procs, p)
		s.byName[c.Name] = p
	}
	return s, nil
}

// Faults delivers a fault for each process that exits on its own with a
// code other than 0 or is killed by a signal the supervisor did not send.
// Run closes it when it returns.
func (s *Supervisor) Faults() <-chan rescheduling.Fault { return s.faults }

// Run starts every process and supervises them until ctx is done, Close
// is called or every process has exited with code 0; it then stops the
// processes still running (SIGTERM, then SIGKILL after StopTimeout),
// closes Faults and returns: ctx's error, or nil after Close or success.
// A process that cannot start makes Run stop the others and return the
// error.
func (s *Supervisor) Run(ctx context.Context) error {
	if !s.ran.CompareAndSwap(false, true) {
		return errors.New("local: Supervisor.Run called twice")
	}
	defer close(s.done)
	defer close(s.faults)
	defer s.waiters.Wait()
	defer s.stopAll()
	defer close(s.quit)

	s.op.Lock()
	s.mu.Lock()
	s.running = true
	s.mu.Unlock()
	var err error
	for _, p := range s.procs {
		if err = s.start(p); err != nil {
			break
		}
	}
	s.op.Unlock()
	if err != nil {
		return err
	}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-s.closing:
			return nil
		case <-s.finished:
			if s.allSucceeded() {
				s.log.Info("every process exited with code 0")
				return nil
			}
		}
	}
}

// Close stops Run, and with it every process, and waits for Run to
// return. Close is idempotent.
func (s *Supervisor) Close() error {
	s.closed.Do(func() { close(s.closing) })
	if s.ran.Load() {
		<-s.done
	}
	return nil
}

// ProcessState is a snapshot of one supervised process.
type ProcessState struct {
	Name     string
	PID      int // of the current incarnation, 0 before the first start
	Running  bool
	Restarts int
	// ExitCode is the last incarnation's exit status (128+n for signal
	// n), -1 while it runs or before it started.
	ExitCode int
}

// State returns a snapshot of every process, in Config.Commands order.
func (s *Supervisor) State() []ProcessState {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]ProcessState, 0, len(s.procs))
	for _, p := range s.procs {
		st := ProcessState{Name: p.cmd.Name, Restarts: p.restarts, ExitCode: -1}
		if in := p.cur; in != nil {
			st.PID, st.Running = in.pid, in.running()
			if !st.Running && in.state != nil {
				st.ExitCode, _ = exitStatus(in.state)
			}
		}
		out = append(out, st)
	}
	return out
}

// RestartProcesses restarts d.Process and every other process that is not
// running, unless it exited with code 0; with d.Process "" it restarts
// every process. A process that still runs, hung or not, is restarted only
// when named: restarting several running processes takes a call for each.
// The processes to restart are all stopped before any is started again.
func (s *Supervisor) RestartProcesses(ctx context.Context, d rescheduling.Decision) error {
	if err := s.mine(d); err != nil {
		return err
	}
	if d.Process != "" && s.byName[d.Process] == nil {
		return fmt.Errorf("local: process %q is not supervised here: %w", d.Process, rescheduling.ErrTargetGone)
	}
	s.mu.Lock()
	var targets []*proc
	for _, p := range s.procs {
		if d.Process == "" || p.cmd.Name == d.Process || (p.cur != nil && !p.cur.running() && !p.cur.succeeded()) {
			targets = append(targets, p)
		}
	}
	s.mu.Unlock()
	return s.restart(ctx, targets)
}

// RecreatePods restarts every process: on one machine the pod is the
// whole set.
func (s *Supervisor) RecreatePods(ctx context.Context, d rescheduling.Decision) error {
	if err := s.mine(d); err != nil {
		return err
	}
	return s.restart(ctx, s.procs)
}

// RestartJob restarts every process.
func (s *Supervisor) RestartJob(ctx context.Context, d rescheduling.Decision) error {
	return s.restart(ctx, s.procs)
}

// AvoidNode is not supported on one machine.
func (s *Supervisor) AvoidNode(context.Context, rescheduling.Decision) error {
	return fmt.Errorf("local: avoid a node: %w", rescheduling.ErrUnsupported)
}

// mine checks that a decision targets this supervisor's node and pod.
func (s *Supervisor) mine(d rescheduling.Decision) error {
	if d.Node != "" && d.Node != s.cfg.Node {
		return fmt.Errorf("local: node %q is not this supervisor's (%q): %w", d.Node, s.cfg.Node, rescheduling.ErrTargetGone)
	}
	if d.Pod != "" && d.Pod != s.cfg.Pod {
		return fmt.Errorf("local: pod %q is not this supervisor's (%q): %w", d.Pod, s.cfg.Pod, rescheduling.ErrTargetGone)
	}
	return nil
}

func (s *Supervisor) restart(ctx context.Context, targets []*proc) error {
	s.op.Lock()
	defer s.op.Unlock()
	s.mu.Lock()
	running := s.running
	s.mu.Unlock()
	if !running {
		return ErrNotRunning
	}
	for _, p := range targets {
		if err := s.stop(ctx, p); err != nil {
			return err
		}
	}
	for _, p := range targets {
		if err := s.start(p); err != nil {
			return err
		}
		s.mu.Lock()
		p.restarts++
		s.mu.Unlock()
	}
	return nil
}

// start starts p's next incarnation. The caller holds s.op.
func (s *Supervisor) start(p *proc) error {
	c := exec.Command(p.cmd.Path, p.cmd.Args...)
	c.Env = append(os.Environ(), p.cmd.Env...)
	c.Dir = p.cmd.Dir
	c.Stdout, c.Stderr = p.cmd.Stdout, p.cmd.Stderr
	// Its own group, so that a stop ends its children too; killed if
	// the supervisor dies.
	c.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	// A leftover child holding the output open must not delay the
	// report of the exit.
	c.WaitDelay = time.Second
	if err := c.Start(); err != nil {
		return fmt.Errorf("local: start %q: %w", p.cmd.Name, err)
	}
	in := &incarnation{pid: c.Process.Pid, started: time.Now(), exited: make(chan struct{})}
	s.mu.Lock()
	p.cur = in
	s.mu.Unlock()
	s.log.Info("process started", "process", p.cmd.Name, "pid", in.pid)
	s.waiters.Add(1)
	go s.wait(p, in, c)
	return nil
}

// wait reaps one incarnation and reports its exit.
func (s *Supervisor) wait(p *proc, in *incarnation, c *exec.Cmd) {
	defer s.waiters.Done()
	c.Wait() // the exit status is in c.ProcessState; an I/O copy error is not a fault
	now := time.Now()
	// What the process started dies with it, so that a restart does not
	// run beside its predecessor's leftovers.
	syscall.Kill(-in.pid, syscall.SIGKILL)
	s.mu.Lock()
	in.state = c.ProcessState
	close(in.exited)
	stopping := in.stopping
	s.mu.Unlock()
	code, sig := exitStatus(c.ProcessState)
	s.log.Info("process exited", "process", p.cmd.Name, "pid", in.pid, "exit_code", code, "expected", stopping)
	if stopping {
		return
	}
	if code == 0 {
		select {
		case s.finished <- struct{}{}:
		default:
		}
		return
	}
	f := rescheduling.Fault{
		Kind:     rescheduling.KindExit,
		Time:     now,
		Node:     s.cfg.Node,
		Pod:      s.cfg.Pod,
		Process:  p.cmd.Name,
		ExitCode: code,
		Signal:   sig,
		Evidence: []string{
			"pid=" + strconv.Itoa(in.pid),
			"ran=" + now.Sub(in.started).Round(time.Millisecond).String(),
		},
	}
	select {
	case s.faults <- f:
	case <-s.quit:
	}
}

// stop ends p's current incarnation, if running: SIGTERM to its group,
// SIGKILL after StopTimeout. The caller holds s.op.
func (s *Supervisor) stop(ctx context.Context, p *proc) error {
	s.mu.Lock()
	in := p.cur
	if in == nil || !in.running() {
		s.mu.Unlock()
		return nil
	}
	in.stopping = true
	s.mu.Unlock()
	syscall.Kill(-in.pid, syscall.SIGTERM) // ESRCH: it is exiting already
	t := time.NewTimer(s.cfg.StopTimeout)
	defer t.Stop()
	select {
	case <-in.exited:
		return nil
	case <-t.C:
	case <-ctx.Done():
	}
	syscall.Kill(-in.pid, syscall.SIGKILL)
	<-in.exited // SIGKILL cannot be ignored
	return nil
}

// stopAll ends every process, once Run is over.
func (s *Supervisor) stopAll() {
	s.op.Lock()
	defer s.op.Unlock()
	s.mu.Lock()
	s.running = false
	s.mu.Unlock()
	for _, p := range s.procs {
		s.stop(context.Background(), p)
	}
}

func (s *Supervisor) allSucceeded() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range s.procs {
		if p.cur == nil || !p.cur.succeeded() {
			return false
		}
	}
	return true
}

// exitStatus returns the exit status as a shell reports it (128+n for
// signal n) and the signal, if any.
func exitStatus(ps *os.ProcessState) (int, syscall.Signal) {
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal()), ws.Signal()
	}
	return ps.ExitCode(), 0
}

// Nodes is the rescheduling.Executor of several supervisors on one
// machine, each standing for a node (a test cluster, a demo): a decision
// goes to the supervisor whose Config.Node is the decision's Node, and
// RestartJob to every one of them in turn. Nil entries (nodes not started
// yet) are skipped.
type Nodes []*Supervisor

var _ rescheduling.Executor = Nodes(nil)

// of returns the supervisor of d's node.
func (ns Nodes) of(d rescheduling.Decision) (*Supervisor, error) {
	for _, s := range ns {
		if s != nil && s.cfg.Node == d.Node {
			return s, nil
		}
	}
	return nil, fmt.Errorf("local: node %q has no supervisor here: %w", d.Node, rescheduling.ErrTargetGone)
}

// RestartProcesses restarts processes of d's node (see
// Supervisor.RestartProcesses).
func (ns Nodes) RestartProcesses(ctx context.Context, d rescheduling.Decision) error {
	s, err := ns.of(d)
	if err != nil {
		return err
	}
	return s.RestartProcesses(ctx, d)
}

// RecreatePods restarts every process of d's node.
func (ns Nodes) RecreatePods(ctx context.Context, d rescheduling.Decision) error {
	s, err := ns.of(d)
	if err != nil {
		return err
	}
	return s.RecreatePods(ctx, d)
}

// RestartJob restarts every process of every node.
func (ns Nodes) RestartJob(ctx context.Context, d rescheduling.Decision) error {
	for _, s := range ns {
		if s == nil {
			continue
		}
		if err := s.RestartJob(ctx, d); err != nil {
			return err
		}
	}
	return nil
}

// AvoidNode is not supported on one machine.
func (ns Nodes) AvoidNode(context.Context, rescheduling.Decision) error {
	return fmt.Errorf("local: avoid a node: %w", rescheduling.ErrUnsupported)
}
