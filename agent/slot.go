package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/hang"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/trace"
)

// slotState is where a slot's rank is.
type slotState int

const (
	slotIdle    slotState = iota // not started yet
	slotRunning                  // its process runs
	slotPaused                   // stopped by the agent or a recovery (its stacks taken): waits for a resume
	slotFailed                   // exited non-zero or killed by a signal: a fault
	slotDone                     // exited 0: the rank finished; a restart of the job's ranks starts it again
	slotStopped                  // stopped for good by recovery
)

func (s slotState) String() string {
	return [...]string{"idle", "running", "paused", "failed", "done", "stopped"}[s]
}

// ringBytes is the data area of each rank's dotting ring.
const ringBytes = 4 << 20

// slot is one local rank: the succession of processes that run it, its
// ring, recorder, watchdog and taskd worker.
type slot struct {
	a           *Agent
	local, rank int
	ringPath    string
	ring        *Ring
	rec         *trace.Recorder
	wd          *hang.Watchdog
	stackFile   string
	out, errOut *lineWriter

	mu       sync.Mutex
	state    slotState
	proc     *rankProc
	spare    *spareProc
	starts   int   // processes started: the restart count is starts-1
	lastStep int64 // the last step its ring says it completed, -1 before
	saved    int64 // the newest step its rank said it saved, -1 before
	resume   int64 // the step agreed at its last start, -1 none
	waiting  bool  // a first start waits for the job's shape (deferStart)
	deferred int64 // and resumes from this step
	worker   *taskd.Worker
	socks    []tcpSocket            // TCP sockets its process held (see notePorts)
	notes    int                    // notes of socks taken
	drainMu  sync.Mutex             // the ring's reader, and the maps below
	opens    map[uint64]openRange   // ranges in flight, by ring id
	timings  map[uint64]hang.Timing // collectives in flight, by ring id
	ops      map[string]*hang.Op
	noted    map[string]bool // communicators whose ports are noted
	closed   bool
}

// rankProc is one process of a slot.
type rankProc struct {
	cmd      *exec.Cmd
	pid      int
	started  time.Time
	done     chan struct{} // closed once reaped
	state    *os.ProcessState
	expected bool // the agent killed it: its exit is no fault
	heldExit bool // it exited while a grow held the node's faults (releaseGrow judges it)
	frozen   bool // stopped where it was (SIGSTOP) while the job takes in nodes
	hello    bool // it said hello: its faulthandler dumps on stackSignal
	// owner is the slot whose process it is, and out and errOut take its
	// output to that slot's: a warm spare moves to the slot of the node's
	// next run (Resized).
	owner       atomic.Pointer[slot]
	out, errOut *relay
}

func newSlot(a *Agent, local int) (*slot, error) {
	rank := a.cfg.NodeRank*a.cfg.ProcsPerNode + local
	s := &slot{a: a, local: local, rank: rank, lastStep: -1, resume: -1, starts: a.cfg.Restarts, opens: map[uint64]openRange{}, timings: map[uint64]hang.Timing{}, ops: map[string]*hang.Op{},
		noted: map[string]bool{}, saved: -1}
	s.ringPath = filepath.Join(a.cfg.ShmDir, fmt.Sprintf("faultline-%s-ring-%d", a.cfg.Job, rank))
	var err error
	if s.ring, err = CreateRing(s.ringPath, ringBytes); err != nil {
		return nil, fmt.Errorf("agent: rank %d: ring %s: %w", rank, s.ringPath, err)
	}
	s.rec, err = trace.NewRecorder(trace.RecorderConfig{Root: a.cfg.TraceRoot, Job: a.controlJob(), Rank: rank,
		FlushInterval: time.Second, Registerer: wrapRank(a.cfg.Registerer, rank), Logger: a.log})
	if err != nil {
		s.close()
		return nil, fmt.Errorf("agent: rank %d: %w", rank, err)
	}
	go s.rec.Run(context.Background())
	if s.wd, err = hang.New(a.hangConfig(rank, s.onHang)); err != nil {
		s.close()
		return nil, fmt.Errorf("agent: rank %d: %w", rank, err)
	}
	s.stackFile = filepath.Join(a.dir, fmt.Sprintf("stacks-%d.txt", rank))
	prefix := fmt.Sprintf("[rank%d]: ", rank)
	s.out, s.errOut = newLineWriter(a.cfg.Stdout, prefix), newLineWriter(a.cfg.Stderr, prefix)
	return s, nil
}

// env is the environment of the slot's next process, a restart of count
// restart resuming from step resume (-1: none agreed).
func (s *slot) env(restart int, resume int64) map[string]string {
	c := &s.a.cfg
	e := map[string]string{
		"RANK": strconv.Itoa(s.rank), "LOCAL_RANK": strconv.Itoa(s.local), "WORLD_SIZE": strconv.Itoa(s.a.world),
		"LOCAL_WORLD_SIZE": strconv.Itoa(c.ProcsPerNode), "GROUP_RANK": strconv.Itoa(c.NodeRank), "GROUP_WORLD_SIZE": strconv.Itoa(c.Nodes),
		"ROLE_RANK": strconv.Itoa(s.rank), "ROLE_WORLD_SIZE": strconv.Itoa(s.a.world), "ROLE_NAME": "default",
		"MASTER_ADDR": c.MasterAddr, "MASTER_PORT": strconv.Itoa(c.MasterPort),
		"TORCHELASTIC_RESTART_COUNT": strconv.Itoa(restart), "TORCHELASTIC_MAX_RESTARTS": strconv.Itoa(c.MaxRestarts),
		"TORCHELASTIC_RUN_ID": c.Job, "FAULTLINE_JOB": c.Job,
		"FAULTLINE_AGENT": s.a.sock, "FAULTLINE_RING": s.ringPath,
		"FAULTLINE_STACK_FILE": s.stackFile, "FAULTLINE_STACK_SIGNAL": strconv.Itoa(int(stackSignal)),
		"FAULTLINE_RESUME_STEP": strconv.FormatInt(resume, 10),
	}
	if !c.NoPython {
		e["TORCHELASTIC_USE_AGENT_STORE"] = "True" // node 0's agent hosts the store (runStore)
	}
	return e
}

// environ is the full environment of a process with the variables of e.
func (s *slot) environ(e map[string]string) []string {
	c := &s.a.cfg
	out := make([]string, 0, len(c.Env)+len(e)+3)
	seen := map[string]bool{}
	for _, kv := range c.Env {
		k, v, _ := strings.Cut(kv, "=")
		if _, over := e[k]; over {
			continue
		}
		switch k {
		case "PYTHONPATH":
			if c.PythonPath != "" {
				v = c.PythonPath + string(os.PathListSeparator) + v
			}
		}
		seen[k] = true
		out = append(out, k+"="+v)
	}
	if !seen["PYTHONPATH"] && c.PythonPath != "" {
		out = append(out, "PYTHONPATH="+c.PythonPath)
	}
	if !seen["MINDX_TASK_ID"] {
		out = append(out, "MINDX_TASK_ID="+c.Job)
	}
	if !seen["PYTHONUNBUFFERED"] && !c.NoPython {
		out = append(out, "PYTHONUNBUFFERED=1") // lines reach the agent's output as they are printed
	}
	if !seen["OMP_NUM_THREADS"] && c.ProcsPerNode > 1 {
		out = append(out, "OMP_NUM_THREADS=1") // as torchrun does
	}
	for k, v := range e {
		out = append(out, k+"="+v)
	}
	return out
}

// command is the argv of a rank run directly (no spare).
func (s *slot) command() []string {
	c := &s.a.cfg
	switch {
	case c.NoPython:
		return c.Command
	case c.Module:
		return append([]string{c.Python, "-m"}, c.Command...)
	}
	return append([]string{c.Python}, c.Command...)
}

// start starts the slot's next process, resuming from step resume (-1:
// none agreed): from its warm spare when it has one, else directly.
func (s *slot) start(ctx context.Context, resume int64) error {
	if sig := s.a.terminating(); sig != 0 {
		return fmt.Errorf("agent: rank %d: not started: the job is being terminated by %s", s.rank, unix.SignalName(sig))
	}
	s.mu.Lock()
	if s.closed || s.state == slotStopped {
		s.mu.Unlock()
		return fmt.Errorf("agent: rank %d: stopped", s.rank)
	}
	restart := s.starts
	sp := s.spare // stays the slot's spare, found by its pid, until it runs the rank
	s.mu.Unlock()

	s.forget()
	env := s.env(restart, resume)
	// The process is the slot's before it can run a line of the script, so
	// that however soon it exits, its exit is the rank's.
	run := func(p *rankProc) {
		s.mu.Lock()
		if s.spare == sp {
			s.spare = nil
		}
		s.proc, s.state, s.resume = p, slotRunning, resume
		s.starts = restart + 1
		s.socks = nil
		s.mu.Unlock()
	}
	var p *rankProc
	if sp != nil {
		if err := sp.run(ctx, env, s.a.cfg, run); err != nil {
			s.a.log.Warn("agent: spare interpreter unusable; starting the rank afresh", "rank", s.rank, "err", err)
			s.killProc(sp.p)
		} else {
			p = sp.p
		}
	}
	if p == nil {
		argv := s.command()
		cmd := exec.Command(argv[0], argv[1:]...)
		cmd.Env = s.environ(env)
		var err error
		if p, err = s.launch(cmd, run); err != nil {
			return fmt.Errorf("agent: rank %d: start %s: %w", s.rank, argv[0], err)
		}
	}
	s.a.log.Info("agent: rank started", "rank", s.rank, "pid", p.pid, "restart", restart, "resume_step", resume, "spare", p != nil && sp != nil && p == sp.p)
	s.prepareSpare()
	return nil
}

// forget drops what the slot's last process left in its ring and in the
// watchdog: the next one starts clean.
func (s *slot) forget() {
	s.drainMu.Lock()
	defer s.drainMu.Unlock()
	if _, err := s.ring.Drain(func(*RingRecord) {}); err != nil {
		s.a.log.Warn("agent: rank's dotting ring is corrupt; skipping what it holds", "rank", s.rank, "err", err)
	}
	for id, t := range s.timings {
		t.Fail(errStopped)
		delete(s.timings, id)
	}
	clear(s.opens)
	clear(s.noted)
}

// launch starts cmd as a rank's process (or spare): in a process group
// of its own, killed with the agent, its output prefixed. own makes it
// the slot's before its exit is watched.
func (s *slot) launch(cmd *exec.Cmd, own func(*rankProc)) (*rankProc, error) {
	out, errOut := &relay{w: s.out}, &relay{w: s.errOut}
	cmd.Stdout, cmd.Stderr = out, errOut
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.WaitDelay = time.Second
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &rankProc{cmd: cmd, pid: cmd.Process.Pid, started: time.Now(), done: make(chan struct{}), out: out, errOut: errOut}
	p.owner.Store(s)
	own(p)
	go func() {
		// Whatever the process started ends with it, however it ended (a
		// data loader worker, a subprocess left running): its group is
		// killed between its exit and its reaping, while its pid, the
		// group's id, cannot be taken by another process.
		waitExited(p.pid)
		_ = killGroup(p.pid)
		_ = cmd.Wait()
		p.state = cmd.ProcessState
		close(p.done)
		p.owner.Load().exited(p)
	}()
	return p, nil
}

// exitedAlready reports whether p has exited or is exiting on its own: it
// is a zombie, or reaped already by the goroutine that watches it (whose
// exited may not have run yet), or the kernel is taking it down (its
// sockets closed, so that its peers' collectives fail before it can be
// waited for: a process of many threads is waitable only once all are
// gone).
func exitedAlready(p *rankProc) bool {
	select {
	case <-p.done:
		return true
	default:
	}
	if exiting(p.pid) {
		return true
	}
	for {
		var info unix.Siginfo // Linux leaves it zero when no child is waitable
		err := unix.Waitid(unix.P_PID, p.pid, &info, unix.WEXITED|unix.WNOHANG|unix.WNOWAIT, nil)
		if !errors.Is(err, unix.EINTR) {
			return errors.Is(err, unix.ECHILD) || err == nil && info.Signo != 0
		}
	}
}

// exiting reports whether pid is a zombie or on its way out (PF_EXITING
// in the flags of /proc/<pid>/stat).
func exiting(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return false
	}
	f := strings.Fields(string(b[i+1:])) // state, ppid, pgrp, session, tty_nr, tpgid, flags, ...
	if len(f) < 7 {
		return false
	}
	if f[0] == "Z" || f[0] == "X" {
		return true
	}
	flags, err := strconv.ParseUint(f[6], 10, 64)
	const pfExiting = 0x4
	return err == nil && flags&pfExiting != 0
}

// waitExited waits until the child pid has exited, without reaping it.
func waitExited(pid int) {
	var info unix.Siginfo
	for {
		if err := unix.Waitid(unix.P_PID, pid, &info, unix.WEXITED|unix.WNOWAIT, nil); !errors.Is(err, unix.EINTR) {
			return
		}
	}
}

// exited takes in the exit of p: a rank's process or a spare.
func (s *slot) exited(p *rankProc) {
	terminating, growing := s.a.terminating() != 0, s.a.growing()
	s.mu.Lock()
	if s.spare != nil && s.spare.p == p {
		s.spare = nil // died unused
	}
	current := s.proc == p
	expected := p.expected || s.closed || terminating
	if current && !expected && growing {
		p.heldExit, expected = true, true
	}
	if current && !expected {
		if p.state.Success() {
			s.state = slotDone
		} else {
			s.state = slotFailed
		}
	}
	s.mu.Unlock()
	if !current || expected {
		return
	}
	code, sig := exitOf(p.state)
	if code == 0 && sig == 0 {
		// The rank stays in the job (its worker registered) until every
		// rank of the node finished: a fault of another rank meanwhile
		// restarts it with the others, as torchrun restarts its whole
		// worker group, since the others cannot rebuild their process group
		// without it.
		s.a.log.Info("agent: rank finished", "rank", s.rank, "pid", p.pid)
		s.a.slotEnded()
		return
	}
	now := time.Now()
	msg := fmt.Sprintf("rank %d (pid %d) exited with code %d", s.rank, p.pid, code)
	attrs := map[string]string{"pid": strconv.Itoa(p.pid)}
	if sig != 0 {
		msg = fmt.Sprintf("rank %d (pid %d) was killed by %s", s.rank, p.pid, signalName(sig))
		attrs["signal"] = signalName(sig)
	}
	f := taskd.Fault{Kind: taskd.FaultProcessExit, Position: taskd.Position{Node: s.a.cfg.NodeRank, Rank: s.rank}, Code: code,
		Message: msg, Attrs: attrs, Time: now}
	if !s.a.incident.fault(f, now) {
		return // its peers' failure: recorded in the incident
	}
	fmt.Fprintf(s.a.cfg.Stderr, "faultline-run: %s\n", msg)
	s.report(f)
	// The node's other ranks cannot go on without this one: stop them now,
	// stacks first, rather than let each fail on its own.
	s.a.stopOthers(s, msg)
}

// report sends f to the manager through the slot's worker.
func (s *slot) report(f taskd.Fault) {
	for deadline := time.Now().Add(30 * time.Second); ; {
		s.mu.Lock()
		w := s.worker
		s.mu.Unlock()
		if w != nil {
			if err := w.ReportFault(f); err == nil {
				return
			} else if time.Now().After(deadline) {
				s.a.log.Error("agent: fault not reported", "rank", s.rank, "err", err)
				return
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// signalName names sig as the shell does, or by its number where it has
// no name (a real-time signal: the agent's stackSignal, once a rank's
// interpreter stopped handling it as it exited).
func signalName(sig syscall.Signal) string {
	if n := unix.SignalName(sig); n != "" {
		return n
	}
	return fmt.Sprintf("signal %d", int(sig))
}

// exitOf returns the exit code of a process state as a shell reports it
// (128+n for signal n), and the signal that ended it.
func exitOf(ps *os.ProcessState) (int, syscall.Signal) {
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal()), ws.Signal()
	}
	return ps.ExitCode(), 0
}

// kill ends the slot's current process; see killProc.
func (s *slot) kill() {
	s.mu.Lock()
	p := s.proc
	s.mu.Unlock()
	s.killProc(p)
}

// killProc ends p (its whole process group) and waits for it to be
// reaped; its exit is no fault.
func (s *slot) killProc(p *rankProc) {
	if p == nil {
		return
	}
	// One that died on its own before this keeps its exit: it is a fault
	// of its own (the root cause, often), not one the agent caused.
	if !exitedAlready(p) {
		s.mu.Lock()
		p.expected = true
		s.mu.Unlock()
	}
	select {
	case <-p.done:
	default:
		_ = killGroup(p.pid)
		<-p.done
	}
}

// errStopped ends the watchdog timings of a process the agent stopped:
// its collectives neither hung nor failed, and none of them is learned.
var errStopped = errors.New("agent: the rank was stopped")

// stop takes the stacks of the slot's running process (reason says why)
// and kills it: the rank waits for a resume. It returns the dump, nil
// when none was taken.
func (s *slot) stop(reason, dir string) *hang.Dump {
	s.mu.Lock()
	p, state := s.proc, s.state
	s.mu.Unlock()
	if p == nil || state != slotRunning {
		return nil
	}
	var d *hang.Dump
	if dir != "" {
		d = s.dumpStacks(context.Background(), p, reason, dir)
	}
	s.killProc(p)
	s.mu.Lock()
	if s.proc == p && s.state == slotRunning {
		s.state = slotPaused
	}
	s.mu.Unlock()
	return d
}

// freeze stops the slot's running process where it is (SIGSTOP to its
// process group): it neither saves nor sees its peers end until it is
// killed.
func (s *slot) freeze() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p := s.proc; p != nil && s.state == slotRunning && !p.frozen {
		p.frozen = syscall.Kill(-p.pid, syscall.SIGSTOP) == nil
	}
}

// thaw lets a process freeze stopped go on.
func (s *slot) thaw() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p := s.proc; p != nil && p.frozen {
		p.frozen = false
		_ = syscall.Kill(-p.pid, syscall.SIGCONT)
	}
}

// killGroup kills the process group that pid leads: a rank and whatever
// it started (data loader workers).
func killGroup(pid int) error { return syscall.Kill(-pid, syscall.SIGKILL) }

// restarts is how many times the slot's rank was restarted.
func (s *slot) restarts() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return max(s.starts-1, 0)
}

// stateIs reports whether the slot is in state st.
func (s *slot) stateIs(st slotState) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.state == st
}

// shutdown kills the slot's process and spare; Run ends.
func (s *slot) shutdown() {
	s.dropSpare()
	s.kill()
}

// dropSpare kills the slot's spare, if it has one.
func (s *slot) dropSpare() {
	s.mu.Lock()
	sp := s.spare
	s.spare = nil
	s.mu.Unlock()
	if sp != nil {
		s.killProc(sp.p)
	}
}

// close releases the slot's ring, recorder and watchdog.
func (s *slot) close() {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.closed = true
	s.mu.Unlock()
	s.shutdown()
	if s.rec != nil {
		s.rec.Close()
	}
	if s.wd != nil {
		s.wd.Close()
	}
	if s.ring != nil {
		s.drainMu.Lock() // the agent's drain may be reading it
		s.ring.Close()
		s.drainMu.Unlock()
		os.Remove(s.ringPath)
	}
}

// applySwitch applies sw to the slot's ring and recorder.
func (s *slot) applySwitch(sw trace.Switch) {
	s.ring.SetSwitch(sw)
	s.rec.SetSwitch(sw)
}

// serveWorkers keeps a taskd worker registered for the slot's rank until
// ctx ends or every rank of the node finished, building a successor each
// time recovery evicts one.
func (s *slot) serveWorkers(ctx context.Context) {
	for ctx.Err() == nil {
		w, err := taskd.NewWorker(taskd.WorkerConfig{Job: s.a.controlJob(), Node: s.a.cfg.NodeRank, Rank: s.rank,
			Upstream: s.a.mgrAddr, Security: s.a.cfg.Security, Trainer: trainer{s},
			OnSwitch:   func(sw trace.Switch) error { return s.a.applySwitch(sw) },
			OnMessage:  func(m taskd.Message) error { return s.a.onMessage(ctx, m) },
			Registerer: wrapRank(s.a.cfg.Registerer, s.rank), Logger: s.a.log.With("rank", s.rank)})
		if err != nil {
			s.a.log.Error("agent: taskd worker", "rank", s.rank, "err", err)
			return
		}
		s.mu.Lock()
		if s.closed || s.a.nodeFinished() {
			s.mu.Unlock()
			w.Close()
			return
		}
		s.worker = w
		s.mu.Unlock()
		err = w.Run(ctx)
		w.Close()
		if errors.Is(err, taskd.ErrPosition) {
			s.a.stopNode(fmt.Sprintf("the job's manager refuses rank %d of node %d (%v): give every node, spares too, the job's --nnodes, --spare-nodes and --nproc-per-node", s.rank, s.a.cfg.NodeRank, err))
			return
		}
		if !errors.Is(err, taskd.ErrEvicted) {
			return
		}
		s.a.log.Info("agent: recovery evicted the rank's worker; registering its successor", "rank", s.rank)
	}
}

// Lines of output from the ranks.

// relay writes to the writer it is set to.
type relay struct {
	mu sync.Mutex
	w  io.Writer
}

func (r *relay) set(w io.Writer) {
	r.mu.Lock()
	r.w = w
	r.mu.Unlock()
}

func (r *relay) Write(p []byte) (int, error) {
	r.mu.Lock()
	w := r.w
	r.mu.Unlock()
	return w.Write(p)
}

// lineWriter writes whole lines to w, each with prefix, so that ranks'
// lines do not interleave.
type lineWriter struct {
	w      *os.File
	prefix string
	mu     sync.Mutex
	part   []byte
}

var outputMu sync.Mutex // one line at a time on the agent's output

func newLineWriter(w *os.File, prefix string) *lineWriter { return &lineWriter{w: w, prefix: prefix} }

func (l *lineWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.part = append(l.part, p...)
	for {
		i := bytes.IndexByte(l.part, '\n')
		if i < 0 {
			break
		}
		outputMu.Lock()
		l.w.WriteString(l.prefix + string(l.part[:i+1]))
		outputMu.Unlock()
		l.part = l.part[i+1:]
	}
	if len(l.part) > 64<<10 { // a line that never ends
		outputMu.Lock()
		l.w.WriteString(l.prefix + string(l.part) + "\n")
		outputMu.Unlock()
		l.part = l.part[:0]
	}
	return len(p), nil
}
