package taskd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	oteltrace "go.opentelemetry.io/otel/trace"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/internal/promreg"
	"github.com/faultline-ml/faultline/rescheduling"
	"github.com/faultline-ml/faultline/taskd/lease"
)

// orchestrator is the shell around the orchestration core: it feeds the
// core the manager's events, performs the core's actions over Broadcast,
// the rescheduling policy and executor and the checkpoints, and logs,
// counts and traces every transition.
type orchestrator struct {
	m         *Manager
	cfg       OrchestrationConfig
	log       *slog.Logger
	tracer    oteltrace.Tracer
	met       *orchMetrics
	policy    *rescheduling.Policy
	ownPolicy bool // policy was built here: close it with the manager
	target    func(Position) RescheduleTarget
	wake      chan struct{}
	inflight  sync.WaitGroup // goroutines performing actions
	// stateDir keeps the core's state ("" without a StateDir); the run
	// loop alone writes it.
	stateDir string

	mu        sync.Mutex
	core      *machine
	nodeOf    map[int]int                   // rank -> node, as last seen
	decisions map[int]rescheduling.Decision // rank -> latest decision of the run in progress
	decRun    uint64                        // the run the decisions belong to
	gaveUp    map[uint64]bool               // ids of the policy's GiveUp decisions
	spans     map[uint64]oteltrace.Span     // run -> its span
	waiters   map[uint64]chan Orchestration // run -> a request waiting for its end
	actions   map[uint64]context.CancelFunc // actions in flight
	settleBy  time.Time                     // an orchestration taken over carries on by then
	// fed counts the inputs fed to the core; written is the count that
	// the last state written down covers, and writes is closed when it
	// grows (see waitWritten).
	fed, written uint64
	writes       chan struct{}
	bcast        struct {
		id   uint64
		done chan struct{}
	} // the broadcast in flight
}

type orchMetrics struct {
	runs        *prometheus.CounterVec
	transitions *prometheus.CounterVec
	running     *prometheus.GaugeVec
	phase       *prometheus.HistogramVec
	refused     prometheus.Counter
	actionErrs  *prometheus.CounterVec
	stateErrs   prometheus.Counter
}

func newOrchMetrics(r *promreg.Registrar) *orchMetrics {
	f := promauto.With(r)
	return &orchMetrics{
		runs:        f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_taskd_orchestrations_total", Help: "Orchestrations finished, by kind and terminal state."}, []string{"kind", "state"}),
		transitions: f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_taskd_orchestration_transitions_total", Help: "State transitions of orchestrations, by kind, from and to."}, []string{"kind", "from", "to"}),
		running:     f.NewGaugeVec(prometheus.GaugeOpts{Name: "faultline_taskd_orchestration_running", Help: "1 while an orchestration of the kind runs."}, []string{"kind"}),
		phase: f.NewHistogramVec(prometheus.HistogramOpts{Name: "faultline_taskd_orchestration_phase_seconds",
			Help:    "Time from the first fault (or the request) to detected, stopped (training paused) and resumed, by kind and phase.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 20)}, []string{"kind", "phase"}),
		refused:    f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_orchestration_refused_total", Help: "Link switch and stress test requests refused because another orchestration ran."}),
		actionErrs: f.NewCounterVec(prometheus.CounterOpts{Name: "faultline_taskd_orchestration_action_errors_total", Help: "Actions of orchestrations that failed, by action (broadcast, decide, repair, load, persist)."}, []string{"action"}),
		stateErrs:  f.NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_orchestration_state_errors_total", Help: "Writes of the orchestration state to StateDir that failed."}),
	}
}

func newOrchestrator(m *Manager, cfg OrchestrationConfig) (*orchestrator, error) {
	policy, own := cfg.Policy, cfg.Policy == nil
	if own {
		var err error
		policy, err = rescheduling.NewPolicy(rescheduling.Config{Logger: m.log, TracerProvider: m.cfg.TracerProvider})
		if err != nil {
			return nil, err
		}
	}
	target := cfg.Target
	if target == nil {
		target = defaultTarget
	}
	return &orchestrator{
		m:         m,
		cfg:       cfg,
		log:       m.log,
		tracer:    m.tracer,
		met:       newOrchMetrics(m.metrics),
		policy:    policy,
		ownPolicy: own,
		target:    target,
		wake:      make(chan struct{}, 1),
		stateDir:  m.cfg.StateDir,
		core:      newMachine(newCoreConfig(cfg)),
		nodeOf:    make(map[int]int),
		decisions: make(map[int]rescheduling.Decision),
		gaveUp:    make(map[uint64]bool),
		spans:     make(map[uint64]oteltrace.Span),
		waiters:   make(map[uint64]chan Orchestration),
		actions:   make(map[uint64]context.CancelFunc),
		writes:    make(chan struct{}),
	}, nil
}

// closePolicy closes the policy that newOrchestrator built, not one of
// OrchestrationConfig.Policy, which is its owner's to close.
func (o *orchestrator) closePolicy() {
	if o.ownPolicy {
		o.policy.Close()
	}
}

// handler plugs the orchestrator into the manager's events.
func (o *orchestrator) handler() Handler {
	return Handler{Name: "orchestration", Priority: 100, Handle: func(_ context.Context, _ *Manager, ev Event) error {
		switch ev.Kind {
		case EventFault:
			if o.m.spare(ev.Fault.Position) {
				return nil // no rank of the job
			}
			o.feed(func(now time.Time, c *machine) {
				if ev.Fault.Position.Rank >= 0 {
					o.nodeOf[ev.Fault.Position.Rank] = ev.Fault.Position.Node
				}
				c.fault(now, ev.Fault)
			})
		case EventRegistered:
			// A registration counts for a repair only while its instance
			// lives: one evicted since, that the repair is replacing,
			// does not.
			if ev.Role == RoleWorker && !o.m.spare(ev.Position) && o.m.isLive(ev.Position.Rank, ev.instance) {
				o.feed(func(now time.Time, c *machine) {
					o.nodeOf[ev.Position.Rank] = ev.Position.Node
					c.registered(now, ev.Position.Rank)
				})
			}
		}
		return nil
	}}
}

// feed gives the core an input and wakes the loop to act on what follows.
// It returns the input's number, for waitWritten.
func (o *orchestrator) feed(f func(time.Time, *machine)) uint64 {
	o.mu.Lock()
	f(time.Now(), o.core)
	o.fed++
	seq := o.fed
	o.mu.Unlock()
	select {
	case o.wake <- struct{}{}:
	default:
	}
	return seq
}

// waitWritten waits until the state written down in StateDir covers input
// seq, or ctx ends.
func (o *orchestrator) waitWritten(ctx context.Context, seq uint64) error {
	if o.stateDir == "" {
		return nil
	}
	for {
		o.mu.Lock()
		done, writes := o.written >= seq, o.writes
		o.mu.Unlock()
		if done {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("taskd: orchestration state not written: %w", context.Cause(ctx))
		case <-writes:
		}
	}
}

// holding reports whether a new worker must wait for the orchestration to
// resume it.
func (o *orchestrator) holding(rank int) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.core.holding(rank)
}

func (o *orchestrator) status(after uint64) OrchestrationStatus {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.core.status(after)
}

// run performs the core's actions and times its states out until ctx
// ends; then it cancels the actions in flight and waits for them.
func (o *orchestrator) run(ctx context.Context) error {
	defer func() {
		o.mu.Lock()
		for _, cancel := range o.actions {
			cancel()
		}
		for id, span := range o.spans {
			span.SetStatus(codes.Error, "manager stopped")
			span.End()
			delete(o.spans, id)
		}
		o.mu.Unlock()
		o.inflight.Wait()
	}()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	// What the core asked for while its state was not written down: held
	// until a write succeeds, retried with backoff until ctx ends.
	var held []action
	var heldTrans []transitionEvent
	retry := newBackoff(100*time.Millisecond, 10*time.Second)
	for {
		o.mu.Lock()
		o.settle(time.Now())
		acts, trans := o.core.ready()
		acts, trans = append(held, acts...), append(heldTrans, trans...)
		acts = slices.DeleteFunc(acts, func(a action) bool { return !o.core.awaited(a.id) })
		deadline := o.core.deadline()
		if r := o.core.run; r != nil && r.settling {
			deadline = o.settleBy
		}
		var state, history []byte
		var err error
		if o.stateDir != "" {
			state, history, err = o.core.save()
		}
		fed := o.fed
		o.mu.Unlock()
		if err != nil {
			err = fmt.Errorf("taskd: orchestration state not encoded: %w", err)
		} else {
			err = o.persist(state, history)
		}
		if errors.Is(err, ErrStateFile) {
			// A newer term's manager wrote the state: this one was
			// deposed and must not act on what it holds.
			return err
		}
		wait := time.Hour
		if !deadline.IsZero() {
			wait = max(time.Until(deadline), 0)
		}
		if err != nil {
			// Nothing takes effect before it is written down, or a
			// manager that took over would not know of it: the actions
			// wait, and the core's deadlines run on, so that an action
			// held past its own deadline counts as one that did not
			// complete.
			o.mu.Lock()
			o.core.unsaved(history != nil)
			o.mu.Unlock()
			held, heldTrans = acts, trans
			next := retry.NextBackOff()
			o.met.stateErrs.Inc()
			o.log.Error("taskd: orchestration state not written; its actions wait for it", "err", err, "actions", len(acts), "retry_in", next)
			wait = min(wait, next)
		} else {
			o.mu.Lock()
			o.written = fed
			close(o.writes)
			o.writes = make(chan struct{})
			o.mu.Unlock()
			held, heldTrans = nil, nil
			retry.Reset()
			o.observe(trans)
			for _, a := range acts {
				o.perform(ctx, a)
			}
		}
		timer.Reset(wait)
		select {
		case <-ctx.Done():
			return nil
		case <-o.wake:
		case <-timer.C:
			o.feed(func(now time.Time, c *machine) { c.tick(now) })
		}
	}
}

// persist writes the state down before the manager acts on it: the
// history first, so that a run that ended is not taken over. It returns
// the first write that failed; one refused because a newer term's
// manager wrote the state wraps ErrStateFile.
func (o *orchestrator) persist(state, history []byte) error {
	for _, f := range []struct {
		name string
		data []byte
	}{{orchHistoryFile, history}, {orchStateFile, state}} {
		if f.data == nil {
			continue
		}
		err := writeStateFile(filepath.Join(o.stateDir, f.name), o.m.cfg.Job, o.m.token(), f.data)
		if errors.Is(err, ErrStateFile) {
			o.log.Error("taskd: orchestration state not written; stopping", "err", err)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// take has the core take over the orchestration state p read from
// StateDir, and the faults of the log that it had not taken in; with no
// state kept, the faults of the log are taken for handled. An
// orchestration in progress carries on once the members have registered
// again (settle), or a heartbeat deadline from now.
func (o *orchestrator) take(p persisted, faults *faultStore) {
	o.mu.Lock()
	defer o.mu.Unlock()
	c := o.core
	if p.state == nil {
		c.history = p.history
		c.seen.Below = faults.newest()
		c.dirty, c.histNew = true, false
		return
	}
	c.restore(*p.state, p.history)
	now := time.Now()
	for _, f := range faults.after(c.seen.Below) {
		if !c.seen.has(f.Seq) {
			if f.Position.Rank >= 0 {
				o.nodeOf[f.Position.Rank] = f.Position.Node
			}
			c.fault(now, f)
		}
	}
	if r := c.run; r != nil {
		if !r.settling {
			// A fault the dead manager had logged, and not taken in,
			// started it: it waits for the members like one taken over.
			r.restored, r.settling, r.action, r.deadline = true, true, 0, time.Time{}
			c.out = nil
		}
		o.settleBy = now.Add(o.m.cfg.HeartbeatDeadline)
		o.log.Info("taskd: taking over the orchestration in progress once the members have registered again",
			"id", r.o.ID, "kind", r.o.Kind, "state", r.o.State, "round", r.o.Round, "by", o.settleBy)
	}
}

// settle carries on an orchestration taken over once every rank it waits
// for has registered again (the job's ranks but the dead ones, when the
// job's shape is known), or at settleBy. o.mu is held.
func (o *orchestrator) settle(now time.Time) {
	r := o.core.run
	if r == nil || !r.settling {
		return
	}
	why := fmt.Sprintf("taken over by manager %s from the state in %s", o.m.instance, o.stateDir)
	if now.Before(o.settleBy) {
		world := o.m.cfg.Nodes * o.m.cfg.ProcsPerNode
		if world == 0 {
			return
		}
		live := o.m.liveWorkers()
		dead := r.dead()
		for rank := range world {
			if !slices.Contains(dead, rank) {
				if _, ok := slices.BinarySearch(live, rank); !ok {
					return
				}
			}
		}
		why += "; every rank registered again"
	} else {
		why += fmt.Sprintf("; the ranks that registered again within %v", o.m.cfg.HeartbeatDeadline)
	}
	o.core.settled(now, why, o.m.liveInstances())
}

// observe logs, counts and traces transitions, and answers the requests
// whose orchestration ended.
func (o *orchestrator) observe(trans []transitionEvent) {
	for _, te := range trans {
		rec, t := te.o, te.t
		kind := string(rec.Kind)
		o.met.transitions.WithLabelValues(kind, string(t.From), string(t.To)).Inc()
		attrs := []any{"id", rec.ID, "kind", rec.Kind, "from", t.From, "to", t.To, "round", rec.Round, "reason", t.Reason}
		if rec.Strategy != "" {
			attrs = append(attrs, "strategy", rec.Strategy)
		}
		o.mu.Lock()
		if t.From == StateIdle || (o.spans[rec.ID] == nil && !t.To.Terminal()) {
			_, span := o.tracer.Start(context.Background(), "taskd.orchestration", oteltrace.WithTimestamp(rec.Start),
				oteltrace.WithAttributes(attribute.String("taskd.job", o.m.cfg.Job), attribute.String("taskd.orchestration.kind", kind), attribute.Int64("taskd.orchestration.id", int64(rec.ID))))
			o.spans[rec.ID] = span
			o.met.running.WithLabelValues(kind).Set(1)
			if rec.Kind == KindRecovery && t.From == StateIdle {
				o.met.phase.WithLabelValues(kind, "detected").Observe(rec.Detected.Seconds())
			}
		}
		span := o.spans[rec.ID]
		o.mu.Unlock()
		if span != nil {
			span.AddEvent(string(t.To), oteltrace.WithTimestamp(t.Time), oteltrace.WithAttributes(attribute.String("from", string(t.From)), attribute.String("reason", t.Reason)))
		}
		if t.From != t.To && (t.From == StatePausing || (t.From == StateStopping && rec.Round == 1)) {
			o.met.phase.WithLabelValues(kind, "stopped").Observe(rec.Stopped.Seconds())
		}
		switch {
		case !t.To.Terminal():
			o.log.Info("taskd: orchestration", attrs...)
		case t.To == StateRecovered || t.To == StateSwitched || t.To == StatePassed:
			o.met.phase.WithLabelValues(kind, "resumed").Observe(rec.Resumed.Seconds())
			o.log.Info("taskd: orchestration done", append(attrs, "stopped_after", rec.Stopped, "resumed_after", rec.Resumed, "resumed_step", rec.ResumedStep)...)
		default:
			o.log.Warn("taskd: orchestration failed", attrs...)
		}
		if t.To.Terminal() {
			o.met.runs.WithLabelValues(kind, string(t.To)).Inc()
			o.met.running.WithLabelValues(kind).Set(0)
			o.mu.Lock()
			if span != nil {
				span.SetAttributes(attribute.String("taskd.orchestration.state", string(t.To)), attribute.String("taskd.orchestration.strategy", string(rec.Strategy)))
				if t.To == StateExited || t.To == StateFailed {
					span.SetStatus(codes.Error, t.Reason)
				}
				span.End(oteltrace.WithTimestamp(t.Time))
				delete(o.spans, rec.ID)
			}
			if ch := o.waiters[rec.ID]; ch != nil {
				ch <- rec
				delete(o.waiters, rec.ID)
			}
			o.mu.Unlock()
		}
		if o.cfg.OnTransition != nil {
			o.cfg.OnTransition(rec, t)
		}
	}
}

// perform starts an action. What was in flight is stale once the core
// asks for something else: it is cancelled, and a stale broadcast is
// waited for, so that no copy of it (a resume, say) reaches a worker
// after the messages that follow.
func (o *orchestrator) perform(ctx context.Context, a action) {
	o.mu.Lock()
	for id, cancel := range o.actions {
		cancel()
		delete(o.actions, id)
	}
	prev := o.bcast.done
	o.mu.Unlock()
	if prev != nil {
		<-prev
	}
	actx, cancel := context.WithTimeout(ctx, a.timeout)
	o.mu.Lock()
	// A fault the core raised for a rank it knew no node of (one that a
	// replacement restarted and that never came back) is placed where
	// the rank was last seen, so that its executor call finds the node.
	for i := range a.faults {
		if p := &a.faults[i].Position; p.Node < 0 {
			if n, ok := o.nodeOf[p.Rank]; ok {
				p.Node = n
			}
		}
	}
	o.actions[a.id] = cancel
	span := o.spans[a.run]
	var done chan struct{}
	if a.kind == actBroadcast {
		done = make(chan struct{})
		o.bcast.id, o.bcast.done = a.id, done
	}
	o.mu.Unlock()
	if span != nil {
		actx = oteltrace.ContextWithSpan(actx, span)
	}
	o.inflight.Add(1)
	go func() {
		defer o.inflight.Done()
		defer cancel()
		if done != nil {
			defer close(done)
		}
		o.do(actx, a)
		o.mu.Lock()
		delete(o.actions, a.id)
		o.mu.Unlock()
	}()
}

func (o *orchestrator) do(ctx context.Context, a action) {
	name := a.kind.String()
	ctx, span := o.tracer.Start(ctx, "taskd.orchestration."+name, oteltrace.WithAttributes(attribute.String("taskd.message", a.msg)))
	defer span.End()
	if !o.confirm(ctx, name) {
		span.SetStatus(codes.Error, "the lease term is over")
		return
	}
	fail := func(err error) {
		if ctx.Err() == nil || errors.Is(ctx.Err(), context.DeadlineExceeded) {
			o.met.actionErrs.WithLabelValues(name).Inc()
			o.log.Warn("taskd: orchestration action failed", "action", name, "err", err)
		}
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	// An action cancelled is either stale (the core asked for something
	// else and ignores its outcome) or ended with the manager; in the
	// latter case its outcome is no outcome ("context canceled" is not a
	// load that failed) and must not reach the state a successor takes
	// over from.
	feed := func(f func(time.Time, *machine)) {
		if !errors.Is(ctx.Err(), context.Canceled) {
			o.feed(f)
		}
	}
	switch a.kind {
	case actBroadcast:
		results, err := o.broadcast(ctx, a)
		if err != nil && !errors.Is(err, ErrClosed) {
			fail(err)
		}
		feed(func(now time.Time, c *machine) { c.delivered(now, a.id, results) })
	case actDecide:
		lvl, why := o.decide(ctx, a)
		feed(func(now time.Time, c *machine) { c.decided(now, a.id, lvl, why) })
	case actRepair:
		ranks, err := o.repair(ctx, a)
		if err != nil {
			fail(err)
		}
		feed(func(now time.Time, c *machine) { c.repaired(now, a.id, ranks, err) })
	case actLoad:
		step, err := o.cfg.Checkpoints.LoadNewest(ctx)
		if err != nil {
			fail(err)
		}
		feed(func(now time.Time, c *machine) { c.loaded(now, a.id, step, err) })
	case actPersist:
		step, err := o.cfg.Checkpoints.PersistNewest(ctx)
		if err != nil {
			fail(err)
		}
		feed(func(now time.Time, c *machine) { c.persisted(now, a.id, step, err) })
	}
}

// confirm confirms the manager's lease term before an act of an
// orchestration, which two managers must never both do. While the lease's
// store cannot be asked, the act waits; it is not done once the term is
// over (the manager then stops) or ctx ends.
func (o *orchestrator) confirm(ctx context.Context, act string) bool {
	t := o.m.cfg.Term
	if t == nil {
		return true
	}
	bo := newBackoff(50*time.Millisecond, time.Second)
	for {
		err := t.Check(ctx)
		switch {
		case err == nil:
			return true
		case errors.Is(err, lease.ErrLost) || ctx.Err() != nil:
			o.log.Warn("taskd: orchestration act not done: the lease term is over", "action", act, "err", err)
			return false
		}
		o.log.Warn("taskd: the lease term cannot be confirmed; the act waits", "action", act, "err", err)
		if waitBackoff(ctx, bo.NextBackOff()) != nil {
			return false
		}
	}
}

// broadcast sends an orchestration message and returns each rank's
// outcome, and the error of a message that was not sent to every rank
// (the ranks it did not reach have no outcome).
func (o *orchestrator) broadcast(ctx context.Context, a action) ([]rankResult, error) {
	to := a.to
	if to.All && len(a.except) > 0 {
		to = Target{Ranks: slices.DeleteFunc(o.m.liveWorkers(), func(r int) bool { return slices.Contains(a.except, r) })}
		if len(to.Ranks) == 0 {
			return nil, nil
		}
	}
	payload, err := json.Marshal(a.payload)
	if err != nil {
		return nil, fmt.Errorf("taskd: orchestration message %s: %w", a.msg, err)
	}
	ds, sendErr := o.m.broadcast(ctx, to, a.msg, payload)
	if sendErr != nil {
		sendErr = fmt.Errorf("taskd: orchestration message %s: %w", a.msg, sendErr)
		// A rank the message did not reach has failed it: an act no rank
		// was told of has not succeeded.
		reached := make(map[int]bool, len(ds))
		for _, d := range ds {
			reached[d.Rank] = true
		}
		o.m.mu.Lock()
		ranks := o.m.resolveLocked(to)
		o.m.mu.Unlock()
		for _, r := range ranks {
			if !reached[r] {
				ds = append(ds, Delivery{Rank: r, Err: sendErr})
			}
		}
	}
	out := make([]rankResult, 0, len(ds))
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, d := range ds {
		res := rankResult{rank: d.Rank, node: -1, err: d.Err}
		if n, ok := o.nodeOf[d.Rank]; ok {
			res.node = n
		}
		if d.Err == nil {
			if res.reply, err = parseReply(d.reply); err != nil {
				res.err = fmt.Errorf("taskd: bad answer to %s: %w", a.msg, err)
			}
		}
		out = append(out, res)
	}
	return out, sendErr
}

// decide asks the policy about each faulty rank and returns how far the
// repair must go: as far as the strongest decision.
func (o *orchestrator) decide(ctx context.Context, a action) (level, string) {
	o.mu.Lock()
	if o.decRun != a.run {
		o.decRun, o.decisions = a.run, make(map[int]rescheduling.Decision)
	}
	o.mu.Unlock()
	lvl := levelInPlace
	var why []string
	for _, f := range a.faults {
		d := o.policy.Decide(ctx, o.rescheduleFault(f))
		l := levelInPlace
		switch d.Action {
		case rescheduling.RecreatePods:
			l = levelReplace
		case rescheduling.RestartJob:
			l = levelJob
		case rescheduling.GiveUp:
			l = levelGiveUp
		case rescheduling.NoAction:
			o.mu.Lock()
			if o.gaveUp[d.Covered] {
				l = levelGiveUp
			}
			o.mu.Unlock()
		}
		o.mu.Lock()
		if d.Action == rescheduling.GiveUp {
			o.gaveUp[d.ID] = true
		}
		o.decisions[f.Position.Rank] = d
		o.mu.Unlock()
		lvl = max(lvl, l)
		why = append(why, fmt.Sprintf("rank %d: %s", f.Position.Rank, d.Reason))
	}
	return lvl, strings.Join(why, "; ")
}

// rescheduleFault says what a fault is to the rescheduling policy.
func (o *orchestrator) rescheduleFault(f Fault) rescheduling.Fault {
	t := o.target(f.Position)
	rf := rescheduling.Fault{Time: faultTime(f), Node: t.Node, Pod: t.Pod, Process: t.Process, Reason: f.Message, Evidence: []string{"taskd_fault=" + f.ID}}
	switch f.Kind {
	case FaultProcessExit:
		rf.Kind, rf.ExitCode, rf.Signal = rescheduling.KindExit, f.Code, signalNamed(f.Attrs["signal"])
	case FaultHang:
		rf.Kind = rescheduling.KindHang
	case FaultLost:
		rf.Kind = rescheduling.KindHeartbeat
	case FaultSlowNode:
		rf.Kind = rescheduling.KindSlow
	case FaultLink, FaultStressTest:
		rf.Kind = rescheduling.KindNode
	default: // an op error that retry did not clear, or a kind of the embedder's
		rf.Kind, rf.Class = rescheduling.KindLog, rescheduling.ClassUnknown
	}
	return rf
}

// signalNamed returns the signal a fault's "signal" attribute names, as
// "SIGKILL", "KILL" or "kill"; 0 when it names none.
func signalNamed(name string) syscall.Signal {
	return unix.SignalNum("SIG" + strings.TrimPrefix(strings.ToUpper(name), "SIG"))
}

// repair restarts the faulty processes in place, or replaces the
// processes of their pods or nodes, and returns the ranks restarted. The
// old instances are evicted first, so that their replacements may take
// their ranks at once.
func (o *orchestrator) repair(ctx context.Context, a action) ([]int, error) {
	ex := o.cfg.Executor
	o.mu.Lock()
	decisions := make(map[int]rescheduling.Decision, len(a.faults))
	for _, f := range a.faults {
		d, ok := o.decisions[f.Position.Rank]
		if !ok || o.decRun != a.run {
			d = o.policy.Decide(ctx, o.rescheduleFault(f))
		}
		decisions[f.Position.Rank] = d
	}
	known := maps.Clone(o.nodeOf)
	o.mu.Unlock()
	if a.strategy == StrategyRecoverInPlace {
		return o.restartInPlace(ctx, a, decisions)
	}
	// Replace: one recreation per pod (or node), of every rank in it.
	// The faults the policy decided to replace come first, so that the
	// other faulty ranks of their pods or nodes need no escalation, and
	// spend no budget, of their own.
	type scope struct{ node, pod string }
	scopes := make(map[scope]rescheduling.Decision)
	covered := func(f Fault) bool {
		t := o.target(f.Position)
		for sc := range scopes {
			if t.Node == sc.node && (sc.pod == "" || t.Pod == sc.pod) {
				return true
			}
		}
		return false
	}
	var rest []Fault
	for _, f := range a.faults {
		if d := decisions[f.Position.Rank]; d.Action == rescheduling.RecreatePods {
			scopes[scope{d.Node, d.Pod}] = d
		} else {
			rest = append(rest, f)
		}
	}
	for _, f := range rest {
		if covered(f) {
			continue
		}
		d := decisions[f.Position.Rank]
		if d.Action == rescheduling.RestartProcesses || d.Action == rescheduling.NoAction {
			d = o.policy.Escalate(ctx, o.inPlaceDecision(d, f), errors.New("restart in place failed or does not apply"))
		}
		if d.Action != rescheduling.RecreatePods {
			return nil, fmt.Errorf("policy: %s", d.Reason)
		}
		o.mu.Lock()
		o.decisions[f.Position.Rank] = d
		o.mu.Unlock()
		scopes[scope{d.Node, d.Pod}] = d
	}
	var ranks []int
	for rank, node := range known {
		t := o.target(Position{Node: node, Rank: rank})
		for sc := range scopes {
			if t.Node == sc.node && (sc.pod == "" || t.Pod == sc.pod) {
				ranks = append(ranks, rank)
			}
		}
	}
	for _, f := range a.faults {
		ranks = append(ranks, f.Position.Rank)
	}
	ranks = sortedUnique(ranks)
	var backoff time.Duration
	for _, d := range scopes {
		backoff = max(backoff, d.Backoff)
	}
	if err := waitBackoff(ctx, backoff); err != nil {
		return nil, err
	}
	if err := o.evict(ctx, a, ranks, fmt.Sprintf("replaced by orchestration #%d", a.run)); err != nil {
		return nil, err
	}
	g, gctx := errgroup.WithContext(ctx)
	for _, d := range scopes {
		g.Go(func() error {
			o.policy.Executing(d, time.Now())
			if d.AvoidNode != "" {
				if err := ex.AvoidNode(gctx, d); err != nil && !errors.Is(err, rescheduling.ErrUnsupported) {
					return fmt.Errorf("avoid node %s: %w", d.AvoidNode, err)
				}
			}
			return ex.RecreatePods(gctx, d)
		})
	}
	return ranks, g.Wait()
}

// evict drops the live instances of ranks before repair a restarts or
// replaces their processes, and tells the core: what they registered
// before does not count for the repair, only their successors do. It
// returns once that is written down: a manager that takes over must
// know whether the executor may have been called, or it would restart
// the ranks again. It comes after the policy's backoff, right before the
// calls, so that a manager taking over takes evictions written down for
// calls made; nothing is evicted once ctx ended.
func (o *orchestrator) evict(ctx context.Context, a action, ranks []int, why string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	instances := o.m.evict(ranks, why)
	return o.waitWritten(ctx, o.feed(func(_ time.Time, c *machine) { c.evicted(a.id, instances) }))
}

// restartInPlace restarts each faulty process on its own node (or pod):
// the nodes at once, the processes of one node one after the other.
func (o *orchestrator) restartInPlace(ctx context.Context, a action, decisions map[int]rescheduling.Decision) ([]int, error) {
	var ranks []int
	for _, f := range a.faults {
		ranks = append(ranks, f.Position.Rank)
	}
	groups := o.inPlaceCalls(a.faults, decisions)
	var backoff time.Duration
	for _, calls := range groups {
		for _, d := range calls {
			backoff = max(backoff, d.Backoff)
		}
	}
	if err := waitBackoff(ctx, backoff); err != nil {
		return nil, err
	}
	if err := o.evict(ctx, a, ranks, fmt.Sprintf("restarted by orchestration #%d", a.run)); err != nil {
		return nil, err
	}
	var g errgroup.Group
	for _, calls := range groups {
		g.Go(func() error {
			// One at a time: a call restarts what is dead in its pod, and
			// the next must find it running.
			for _, d := range calls {
				o.policy.Executing(d, time.Now())
				if err := o.cfg.Executor.RestartProcesses(ctx, d); err != nil {
					return fmt.Errorf("restart %s on node %s: %w", d.Process, d.Node, err)
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	return sortedUnique(ranks), nil
}

// inPlaceCalls returns the executor calls that restart the faulty
// processes in place, grouped by node and pod, each group sorted by
// process. The Executor restarts the named process and every process of
// its target that is not running. So a process that exited is restarted
// by any call for its pod, and named only when no call for its pod names
// another: none is restarted twice. Every other faulty process is named:
// a hung or silent one may well be running still, and only a call that
// names it restarts it.
func (o *orchestrator) inPlaceCalls(faults []Fault, decisions map[int]rescheduling.Decision) [][]rescheduling.Decision {
	type scope struct{ node, pod string }
	named := make(map[scope][]rescheduling.Decision)
	exited := make(map[scope][]rescheduling.Decision)
	for _, f := range faults {
		d := o.inPlaceDecision(decisions[f.Position.Rank], f)
		sc := scope{d.Node, d.Pod}
		if f.Kind == FaultProcessExit {
			exited[sc] = append(exited[sc], d)
		} else {
			named[sc] = append(named[sc], d)
		}
	}
	for sc, ds := range exited {
		if len(named[sc]) == 0 {
			named[sc] = ds[:1]
		}
	}
	out := make([][]rescheduling.Decision, 0, len(named))
	for _, ds := range named {
		slices.SortFunc(ds, func(x, y rescheduling.Decision) int { return strings.Compare(x.Process, y.Process) })
		out = append(out, ds)
	}
	slices.SortFunc(out, func(x, y []rescheduling.Decision) int {
		if c := strings.Compare(x[0].Node, y[0].Node); c != 0 {
			return c
		}
		return strings.Compare(x[0].Pod, y[0].Pod)
	})
	return out
}

// inPlaceDecision is d as an in-place restart of f's process: the policy
// covers the faults of a pod with one decision, and each faulty process
// needs its own call.
func (o *orchestrator) inPlaceDecision(d rescheduling.Decision, f Fault) rescheduling.Decision {
	if d.Action == rescheduling.RestartProcesses && d.Process != "" {
		return d
	}
	t := o.target(f.Position)
	d.Action, d.Node, d.Pod, d.Process = rescheduling.RestartProcesses, t.Node, t.Pod, t.Process
	return d
}

func waitBackoff(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// request starts a link switch, switchback or stress test and waits for
// it to end or ctx to.
func (o *orchestrator) request(ctx context.Context, kind OrchestrationKind, link *LinkRequest, stress *StressRequest) (Orchestration, error) {
	o.mu.Lock()
	id, err := o.core.request(time.Now(), kind, link, stress)
	if err != nil {
		o.mu.Unlock()
		o.met.refused.Inc()
		return Orchestration{}, err
	}
	ch := make(chan Orchestration, 1)
	o.waiters[id] = ch
	o.mu.Unlock()
	select {
	case o.wake <- struct{}{}:
	default:
	}
	select {
	case rec := <-ch:
		want := StateSwitched
		if kind == KindStressTest {
			want = StatePassed
		}
		if rec.State != want {
			return rec, fmt.Errorf("%w: %s #%d ended %s: %s", ErrOrchestrationFailed, rec.Kind, rec.ID, rec.State, rec.Outcome)
		}
		return rec, nil
	case <-ctx.Done():
		o.mu.Lock()
		delete(o.waiters, id)
		st := o.core.status(id - 1)
		o.mu.Unlock()
		var rec Orchestration
		if st.Current != nil && st.Current.ID == id {
			rec = *st.Current
		}
		return rec, fmt.Errorf("taskd: %s #%d still running: %w", kind, id, ctx.Err())
	}
}
