package hang

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// ErrNoDumpDir is returned by Watchdog.Dump when Config.DumpDir is empty.
var ErrNoDumpDir = errors.New("hang: Config.DumpDir is empty")

// Watchdog times the ops of one rank (kernels, collectives), watches its
// heartbeats, and reports what hangs or fails: metrics, Config.OnFault,
// and, in Run, a stack file and the optional stop.
//
// Its logic runs in Check, which reads Config.Now; Run calls Check every
// Tick and at once when an op fails, and does the slow work (stack
// capture, stop) off the caller's path. Start and End cost the same
// however many ops are in flight; a Check scans the ops in flight.
type Watchdog struct {
	cfg    Config
	clock  func() time.Time
	mono   bool      // clock is time.Now
	base   time.Time // op times are nanoseconds since base
	log    *slog.Logger
	tracer trace.Tracer
	met    *metrics

	wake    chan struct{} // an op failed: check now
	closing chan struct{}
	closed  sync.Once

	runMu   sync.Mutex
	runDone chan struct{} // closed when the Run in progress returns; nil when none

	mu        sync.Mutex
	ops       map[opKey]*Op
	slots     []slot
	free      []int32
	hungCount int
	pending   []Fault // op errors waiting for Check, at most maxPending
	dropped   int     // op errors past maxPending since the last Check
	beats     []*Heartbeat

	checkMu sync.Mutex // one Check at a time; guards the fields below
	dumped  bool       // the current hang has had its stack dump
	stopped bool
}

type opKey struct{ name, group string }

// maxPending bounds the op errors held between two Checks, so that a storm
// of failures with nobody checking cannot grow memory without end; the
// rest are counted and logged, not returned.
const maxPending = 1024

// slot is one op in flight.
type slot struct {
	op       *Op
	stream   int
	start    int64
	deadline int64
	gen      uint32 // bumped at each end, so a stale Timing is ignored
	live     bool
	hung     bool
}

// New returns a Watchdog for cfg. It starts no goroutine; call Run.
func New(cfg Config) (*Watchdog, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	if cfg.Host == "" {
		cfg.Host, _ = os.Hostname()
	}
	w := &Watchdog{
		cfg:     cfg,
		clock:   cfg.Now,
		mono:    cfg.Now == nil,
		log:     cfg.Logger,
		wake:    make(chan struct{}, 1),
		closing: make(chan struct{}),
		ops:     map[opKey]*Op{},
	}
	if w.mono {
		w.clock = time.Now
	}
	w.base = w.clock()
	w.log = cmp.Or(w.log, slog.New(slog.DiscardHandler))
	tp := cmp.Or(cfg.TracerProvider, trace.TracerProvider(noop.NewTracerProvider()))
	w.tracer = tp.Tracer(instrumentation)
	met, err := newMetrics(cfg.Registerer, cfg.Rank, func() float64 {
		w.mu.Lock()
		defer w.mu.Unlock()
		return float64(len(w.slots) - len(w.free))
	})
	if err != nil {
		return nil, err
	}
	w.met = met
	return w, nil
}

func (w *Watchdog) now() int64 {
	if w.mono {
		// time.Since on a monotonic base reads only the monotonic clock:
		// half the cost of time.Now on the hot path.
		return int64(time.Since(w.base))
	}
	return int64(w.clock().Sub(w.base))
}

func (w *Watchdog) at(ns int64) time.Time { return w.base.Add(time.Duration(ns)) }

// Op is one kind of op (a name in a group, "HcclAllReduce" in "dp"),
// obtained once from Watchdog.Op and then started many times. Its
// timeout is fixed or learned from its own past durations.
type Op struct {
	w     *Watchdog
	name  string
	group string

	// Guarded by w.mu.
	timeout time.Duration
	ring    []int64 // recent durations, when learning
	n, pos  int
	dirty   bool

	sorted []int64 // Check's scratch for the p99
}

// Op returns the op of this name and group, creating it on first use.
// Keep the result: Start on it is the hot path.
func (w *Watchdog) Op(name, group string) *Op {
	w.mu.Lock()
	defer w.mu.Unlock()
	k := opKey{name, group}
	if o := w.ops[k]; o != nil {
		return o
	}
	o := &Op{w: w, name: name, group: group, timeout: w.cfg.Timeout}
	if w.cfg.LearnTimeouts {
		o.ring = make([]int64, w.cfg.LearnWindow)
	}
	w.ops[k] = o
	w.met.opTimeout.WithLabelValues(name, group).Set(o.timeout.Seconds())
	return o
}

// Name returns the op's name.
func (o *Op) Name() string { return o.name }

// Group returns the op's group.
func (o *Op) Group() string { return o.group }

// Timeout returns the timeout that a Start now would get.
func (o *Op) Timeout() time.Duration {
	o.w.mu.Lock()
	defer o.w.mu.Unlock()
	return o.timeout
}

// Timing is one run of an op, from Start to End or Fail. Its zero value
// does nothing.
type Timing struct {
	op   *Op
	slot int32
	gen  uint32
}

// Start records that the op started on stream now and returns its
// timing. It does not allocate once the watchdog has seen as many ops in
// flight at once.
func (o *Op) Start(stream int) Timing {
	w := o.w
	now := w.now()
	w.mu.Lock()
	var i int32
	if n := len(w.free); n > 0 {
		i = w.free[n-1]
		w.free = w.free[:n-1]
	} else {
		w.slots = append(w.slots, slot{})
		i = int32(len(w.slots) - 1)
	}
	s := &w.slots[i]
	s.op, s.stream, s.start, s.deadline = o, stream, now, now+int64(o.timeout)
	s.live, s.hung = true, false
	gen := s.gen
	w.mu.Unlock()
	return Timing{op: o, slot: i, gen: gen}
}

// End records that the op completed. A second End, or an End after Fail,
// does nothing.
func (t Timing) End() { t.finish(nil) }

// Fail records that the op completed with err, a fault reported at once
// (within one scheduling of Run's goroutine, not on the next tick). Of
// the errors between two Checks, the first 1024 are returned as faults;
// the rest are only counted and logged.
func (t Timing) Fail(err error) {
	if err == nil {
		err = errors.New("op failed")
	}
	t.finish(err)
}

func (t Timing) finish(err error) {
	if t.op == nil {
		return
	}
	w := t.op.w
	now := w.now()
	w.mu.Lock()
	s := &w.slots[t.slot]
	if !s.live || s.gen != t.gen {
		w.mu.Unlock()
		return
	}
	d := now - s.start
	if s.hung {
		w.hungCount--
	} else if err == nil && t.op.ring != nil {
		o := t.op
		o.ring[o.pos] = d
		// A compare, not a modulo: a division costs the hot path more.
		if o.pos++; o.pos == len(o.ring) {
			o.pos = 0
		}
		if o.n < len(o.ring) {
			o.n++
		}
		o.dirty = true
	}
	switch {
	case err == nil:
	case len(w.pending) < maxPending:
		w.pending = append(w.pending, Fault{Kind: FaultOpError, Rank: w.cfg.Rank, Op: t.op.name, Group: t.op.group,
			Stream: s.stream, Elapsed: time.Duration(d), Err: err, Time: w.at(now)})
	default:
		w.dropped++
	}
	s.live, s.hung, s.op = false, false, nil
	s.gen++
	w.free = append(w.free, t.slot)
	w.mu.Unlock()
	if err != nil {
		select {
		case w.wake <- struct{}{}:
		default:
		}
	}
}

// Heartbeat is a liveness signal (a trainer's main loop, a worker's
// messages) that must beat at least every Config.HeartbeatTimeout.
type Heartbeat struct {
	w    *Watchdog
	name string
	last atomic.Int64 // ns since w.base
	lost bool         // guarded by w.checkMu
}

// Heartbeat registers a heartbeat; it counts as having beaten now.
func (w *Watchdog) Heartbeat(name string) *Heartbeat {
	h := &Heartbeat{w: w, name: name}
	h.last.Store(w.now())
	w.mu.Lock()
	w.beats = append(slices.Clip(w.beats), h)
	w.mu.Unlock()
	return h
}

// Beat records a sign of life. It does not lock or allocate.
func (h *Heartbeat) Beat() { h.last.Store(h.w.now()) }

// Stop stops watching the heartbeat, as when its process ends cleanly.
func (h *Heartbeat) Stop() {
	w := h.w
	w.mu.Lock()
	defer w.mu.Unlock()
	w.beats = slices.DeleteFunc(slices.Clone(w.beats), func(x *Heartbeat) bool { return x == h })
}

// Check evaluates op timeouts and heartbeats at Config.Now's now, takes
// in the op errors reported since the last call, updates learned
// timeouts and metrics, calls Config.OnFault for each fault and returns
// them. Run calls it every Tick; an embedder with its own loop (or a
// test with a fake clock) calls it directly. It takes no stacks and stops
// nothing: that is Run's work.
func (w *Watchdog) Check() []Fault {
	faults, _ := w.check()
	return faults
}

func (w *Watchdog) check() (faults []Fault, hung int) {
	w.checkMu.Lock()
	defer w.checkMu.Unlock()
	now := w.now()

	w.mu.Lock()
	faults = append(faults, w.pending...)
	clear(w.pending) // drop the errors they hold
	w.pending = w.pending[:0]
	dropped := w.dropped
	w.dropped = 0
	// A scan, not a heap of deadlines kept by Start and End: a few
	// thousand ops in flight cost a check microseconds each Tick, a
	// heap cost every op a logarithm.
	first := len(faults)
	for i := range w.slots {
		s := &w.slots[i]
		if !s.live || s.hung || s.deadline > now {
			continue
		}
		s.hung = true
		w.hungCount++
		faults = append(faults, Fault{Kind: FaultHang, Rank: w.cfg.Rank, Op: s.op.name, Group: s.op.group, Stream: s.stream,
			Elapsed: time.Duration(now - s.start), Timeout: time.Duration(s.deadline - s.start), Time: w.at(now)})
	}
	// The earliest deadline first.
	slices.SortStableFunc(faults[first:], func(a, b Fault) int { return cmp.Compare(b.Elapsed-b.Timeout, a.Elapsed-a.Timeout) })
	hung = w.hungCount
	var learn []*Op
	if w.cfg.LearnTimeouts {
		for _, o := range w.ops {
			if o.dirty && o.n >= w.cfg.LearnMinSamples {
				o.dirty = false
				o.sorted = append(o.sorted[:0], o.ring[:o.n]...)
				learn = append(learn, o)
			}
		}
	}
	beats := w.beats
	w.mu.Unlock()

	// Sort outside the lock so that Start and End never wait for it.
	for _, o := range learn {
		t := learnedTimeout(o.sorted, w.cfg)
		w.mu.Lock()
		changed := o.timeout != t
		o.timeout = t
		w.mu.Unlock()
		if changed {
			w.met.opTimeout.WithLabelValues(o.name, o.group).Set(t.Seconds())
		}
	}
	for _, h := range beats {
		silent := time.Duration(now - h.last.Load())
		if silent <= w.cfg.HeartbeatTimeout {
			h.lost = false
			continue
		}
		if !h.lost {
			h.lost = true
			faults = append(faults, Fault{Kind: FaultHeartbeat, Rank: w.cfg.Rank, Heartbeat: h.name,
				Elapsed: silent, Timeout: w.cfg.HeartbeatTimeout, Time: w.at(now)})
		}
	}

	if hung > 0 {
		w.met.hung.Set(1)
	} else {
		w.met.hung.Set(0)
		w.dumped = false // the next hang gets its own dump
	}
	if dropped > 0 {
		w.met.faults.WithLabelValues(FaultOpError.String()).Add(float64(dropped))
		w.log.Warn("hang: op errors not reported one by one", "rank", w.cfg.Rank, "dropped", dropped, "kept", maxPending)
	}
	for _, f := range faults {
		w.met.faults.WithLabelValues(f.Kind.String()).Inc()
		w.log.Warn("hang: fault", "rank", f.Rank, "kind", f.Kind.String(), "fault", f.String())
		if w.cfg.OnFault != nil {
			w.cfg.OnFault(f)
		}
	}
	return faults, hung
}

// learnedTimeout returns p99 × factor of durations, clamped to
// [LearnFloor, Timeout]. It sorts durations in place.
func learnedTimeout(durations []int64, cfg Config) time.Duration {
	slices.Sort(durations)
	k := (len(durations)*99 + 99) / 100 // ceil(0.99 n), 1-based
	p99 := time.Duration(durations[max(k-1, 0)])
	t := time.Duration(float64(p99) * cfg.LearnFactor)
	if t < 0 || float64(p99)*cfg.LearnFactor > float64(cfg.Timeout) {
		t = cfg.Timeout
	}
	return min(max(t, cfg.LearnFloor), cfg.Timeout)
}

// Run checks every Tick until ctx ends or Close is called, and responds
// to faults: on a hang (once per hang, until no op is hung) or a silent
// heartbeat it writes the stack file to DumpDir when set; then, for the
// kinds in StopOn, it stops the watched process (once). It returns nil
// after Close and ctx.Err() when ctx ends; a second concurrent Run
// returns an error at once.
func (w *Watchdog) Run(ctx context.Context) error {
	done := make(chan struct{})
	w.runMu.Lock()
	if w.runDone != nil {
		w.runMu.Unlock()
		return errors.New("hang: Watchdog.Run is already running")
	}
	select {
	case <-w.closing:
		w.runMu.Unlock()
		return nil
	default:
	}
	w.runDone = done
	w.runMu.Unlock()
	defer func() {
		w.runMu.Lock()
		w.runDone = nil
		w.runMu.Unlock()
		close(done)
	}()

	ctx, cancel := context.WithCancel(ctx)
	actions := make(chan action, 64)
	var wg sync.WaitGroup
	wg.Go(func() { w.respond(ctx, actions) })
	defer func() {
		cancel() // ends a capture in progress
		close(actions)
		wg.Wait()
	}()

	t := time.NewTicker(w.cfg.Tick)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-w.closing:
			return nil
		case <-t.C:
		case <-w.wake:
		}
		faults, hung := w.check()
		for _, f := range faults {
			a := w.decide(f, hung)
			if !a.dump && !a.stop {
				continue
			}
			select {
			case actions <- a:
			default:
				w.log.Error("hang: responses back up; fault not acted on", "fault", f.String())
			}
		}
	}
}

// action is what Run does about a fault, off its checking loop.
type action struct {
	f          Fault
	dump, stop bool
}

// decide says whether f needs a dump (one per hang, until no op is hung;
// one per silent heartbeat) or the stop (once). Only Run's goroutine
// calls it.
func (w *Watchdog) decide(f Fault, hung int) action {
	w.checkMu.Lock()
	defer w.checkMu.Unlock()
	a := action{f: f}
	if w.cfg.DumpDir != "" {
		switch f.Kind {
		case FaultHeartbeat:
			a.dump = true
		case FaultHang:
			if !w.dumped && hung > 0 {
				w.dumped = true
				a.dump = true
			}
		}
	}
	if w.cfg.StopOn&f.Kind != 0 && !w.stopped {
		w.stopped = true
		a.stop = true
	}
	return a
}

func (w *Watchdog) respond(ctx context.Context, actions <-chan action) {
	for a := range actions {
		if ctx.Err() != nil {
			continue // drain
		}
		if a.dump {
			if path, err := w.Dump(ctx, a.f.String()); err != nil {
				w.log.Error("hang: stack dump failed", "rank", w.cfg.Rank, "err", err)
			} else {
				w.log.Info("hang: stacks written", "rank", w.cfg.Rank, "path", path)
			}
		}
		if a.stop {
			if err := w.stop(ctx, a.f); err != nil {
				w.log.Error("hang: stop failed", "rank", w.cfg.Rank, "err", err)
			} else {
				w.log.Warn("hang: process stopped", "rank", w.cfg.Rank, "fault", a.f.String())
			}
		}
	}
}

func (w *Watchdog) stop(ctx context.Context, f Fault) error {
	if w.cfg.Stop != nil {
		return w.cfg.Stop(ctx, f)
	}
	pid := w.cfg.Pid
	if pid == 0 {
		pid = os.Getpid()
	}
	if err := syscall.Kill(pid, w.cfg.StopSignal); err != nil {
		return fmt.Errorf("hang: stop pid %d with %v: %w", pid, w.cfg.StopSignal, err)
	}
	return nil
}

// Dump captures the watched process's stacks now (see Capture) and writes
// them atomically to DumpDir/FileName(Rank, World), with reason in the
// file. Run calls it on a hang; call it directly when the control plane
// asks every rank for its stacks. When no stack could be taken the file
// is still written, its notes saying why, and the error wraps ErrCapture.
func (w *Watchdog) Dump(ctx context.Context, reason string) (string, error) {
	if w.cfg.DumpDir == "" {
		return "", ErrNoDumpDir
	}
	ctx, span := w.tracer.Start(ctx, "hang.Dump", trace.WithAttributes(
		attribute.Int("rank", w.cfg.Rank), attribute.Int("pid", w.cfg.Pid), attribute.String("reason", reason)))
	defer span.End()
	w.met.dumpStarted.Set(1)
	w.met.dumpEnded.Set(0)
	start := time.Now()
	defer func() {
		w.met.dumpSeconds.Observe(time.Since(start).Seconds())
		w.met.dumpEnded.Set(1)
	}()

	cctx, cancel := context.WithTimeout(ctx, w.cfg.CaptureTimeout)
	d, capErr := Capture(cctx, w.cfg.Pid)
	cancel()
	if d == nil {
		span.RecordError(capErr)
		span.SetStatus(codes.Error, "capture failed")
		return "", capErr
	}
	d.Rank, d.World, d.Reason = w.cfg.Rank, w.cfg.World, reason
	if w.cfg.Host != "" {
		d.Host = w.cfg.Host
	}
	path, err := WriteStackFile(w.cfg.DumpDir, d)
	if err = errors.Join(capErr, err); err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, "dump incomplete")
	}
	span.SetAttributes(attribute.Int("threads", len(d.Threads)), attribute.String("path", path))
	return path, err
}

// Close stops Run, waits for it to return (a stack capture or a stop in
// progress is cancelled first), and unregisters the watchdog's metrics,
// so that a new watchdog for the same rank (a restarted worker) can
// register them. It is idempotent and returns nil; OnFault and Stop must
// not call it. Ops and heartbeats may still be used; nothing checks them.
func (w *Watchdog) Close() error {
	w.closed.Do(func() {
		close(w.closing)
		w.runMu.Lock()
		done := w.runDone
		w.runMu.Unlock()
		if done != nil {
			<-done
		}
		w.met.reg.UnregisterAll()
	})
	return nil
}
