package rescheduling

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"golang.org/x/sync/semaphore"
)

// WatchdogConfig configures a Watchdog. Policy, Executor and Faults are
// required; every other field's zero value is a documented default.
type WatchdogConfig struct {
	Policy   *Policy
	Executor Executor
	// Faults is consumed until it is closed.
	Faults <-chan Fault
	// Parallel bounds the executions that run at once; default 16. A job
	// restart runs alone.
	Parallel int
	// Retries is how many times a failed execution is retried, with
	// RetryBackoff between tries, before the decision escalates; default
	// 3, negative: none. Errors wrapping ErrUnsupported or ErrTargetGone
	// are not retried.
	Retries int
	// RetryBackoff shapes the waits between retries; defaults as Backoff,
	// but with Initial 500 ms and Max 10 s.
	RetryBackoff Backoff
	// OnOutcome, if set, is called with the outcome of each execution
	// and each give-up, from the goroutine that executed it. It must not
	// call Close.
	OnOutcome func(Outcome)
	// Logger receives a record per outcome; nil: discard.
	Logger *slog.Logger
	// Registerer receives the watchdog's metrics; nil: none.
	Registerer prometheus.Registerer
	// TracerProvider traces each execution; nil: no tracing.
	TracerProvider trace.TracerProvider
}

// Validate reports the first field that is missing or out of range.
func (c WatchdogConfig) Validate() error {
	switch {
	case c.Policy == nil:
		return errors.New("rescheduling: WatchdogConfig.Policy is nil")
	case c.Executor == nil:
		return errors.New("rescheduling: WatchdogConfig.Executor is nil")
	case c.Faults == nil:
		return errors.New("rescheduling: WatchdogConfig.Faults is nil")
	case c.Parallel < 0:
		return fmt.Errorf("rescheduling: WatchdogConfig.Parallel is %d, want >= 0", c.Parallel)
	}
	r := c.RetryBackoff
	switch {
	case r.Initial < 0:
		return fmt.Errorf("rescheduling: WatchdogConfig.RetryBackoff.Initial is %v, want >= 0", r.Initial)
	case r.Max < 0:
		return fmt.Errorf("rescheduling: WatchdogConfig.RetryBackoff.Max is %v, want >= 0", r.Max)
	case r.Multiplier != 0 && r.Multiplier < 1:
		return fmt.Errorf("rescheduling: WatchdogConfig.RetryBackoff.Multiplier is %g, want >= 1", r.Multiplier)
	case r.Jitter >= 1:
		return fmt.Errorf("rescheduling: WatchdogConfig.RetryBackoff.Jitter is %g, want < 1", r.Jitter)
	}
	return nil
}

// Outcome is what became of one decision.
type Outcome struct {
	Decision Decision
	// Result is ok, failed, gone (the target no longer existed),
	// superseded (a later decision replaced it before it ran), canceled
	// (Run ended first) or gave_up.
	Result string
	// Err is the executor's error, nil when Result is ok.
	Err error
	// AvoidErr is AvoidNode's error; the recreation goes on without it.
	AvoidErr error
	// Started and Finished bracket the execution, backoff excluded.
	Started, Finished time.Time
	// Recovery is the time from the fault to its target restarted
	// (Finished - Decision.Fault.Time), set when Result is ok.
	Recovery time.Duration
}

// Outcome results.
const (
	ResultOK         = "ok"
	ResultFailed     = "failed"
	ResultGone       = "gone"
	ResultSuperseded = "superseded"
	ResultCanceled   = "canceled"
	ResultGaveUp     = "gave_up"
)

// Watchdog ties a Policy to an Executor: it consumes faults, decides,
// waits out the backoff, executes, retries and escalates failed
// executions, records the outcome and measures the time from fault to
// restarted. Executions on one node run one at a time, in order; a
// decision that supersedes one still waiting cancels it.
type Watchdog struct {
	cfg    WatchdogConfig
	now    func() time.Time
	log    *slog.Logger
	tracer trace.Tracer
	m      *watchdogMetrics
	sem    *semaphore.Weighted

	mu      sync.Mutex
	pending map[uint64]*pending      // executions not started yet
	nodes   map[string]chan struct{} // one execution per node at a time

	gaveUp  chan Decision
	closing chan struct{}
	closed  sync.Once
	ran     atomic.Bool
	done    chan struct{}
}

type pending struct {
	d          Decision
	cancel     context.CancelFunc
	superseded bool
}

// NewWatchdog returns a watchdog built from cfg. Its metrics are
// registered on cfg.Registerer until Close.
func NewWatchdog(cfg WatchdogConfig) (*Watchdog, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Parallel = cmp.Or(cfg.Parallel, 16)
	switch {
	case cfg.Retries == 0:
		cfg.Retries = 3
	case cfg.Retries < 0:
		cfg.Retries = 0
	}
	cfg.RetryBackoff.Initial = cmp.Or(cfg.RetryBackoff.Initial, 500*time.Millisecond)
	cfg.RetryBackoff.Max = cmp.Or(cfg.RetryBackoff.Max, max(10*time.Second, cfg.RetryBackoff.Initial))
	cfg.RetryBackoff = cfg.RetryBackoff.withDefaults()
	cfg.Logger = cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	cfg.TracerProvider = cmp.Or(cfg.TracerProvider, trace.TracerProvider(noop.NewTracerProvider()))
	m, err := newWatchdogMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	return &Watchdog{
		cfg:     cfg,
		now:     cfg.Policy.cfg.Now,
		log:     cfg.Logger,
		tracer:  cfg.TracerProvider.Tracer(instrumentation),
		m:       m,
		sem:     semaphore.NewWeighted(int64(cfg.Parallel)),
		pending: map[uint64]*pending{},
		nodes:   map[string]chan struct{}{},
		gaveUp:  make(chan Decision, 1),
		closing: make(chan struct{}),
		done:    make(chan struct{}),
	}, nil
}

// Run consumes faults until Faults is closed (it then waits for the
// executions in progress and returns nil), ctx is done (it cancels them
// and returns ctx's error), Close is called (nil) or the policy gives up
// (an error wrapping ErrGaveUp).
func (w *Watchdog) Run(ctx context.Context) error {
	if !w.ran.CompareAndSwap(false, true) {
		return errors.New("rescheduling: Watchdog.Run called twice")
	}
	defer close(w.done)
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	stop := func(err error) error {
		cancel()
		wg.Wait()
		return err
	}
	faults := w.cfg.Faults
	var drained chan struct{} // closed when the executions are done after Faults closed
	for {
		select {
		case <-ctx.Done():
			return stop(ctx.Err())
		case <-w.closing:
			return stop(nil)
		case d := <-w.gaveUp:
			return stop(fmt.Errorf("%w: %s", ErrGaveUp, d))
		case <-drained:
			select {
			case d := <-w.gaveUp:
				return stop(fmt.Errorf("%w: %s", ErrGaveUp, d))
			default:
			}
			return stop(nil)
		case f, ok := <-faults:
			if !ok {
				faults = nil
				drained = make(chan struct{})
				go func() { wg.Wait(); close(drained) }()
				continue
			}
			w.dispatch(ctx, &wg, w.cfg.Policy.Decide(ctx, f))
		}
	}
}

// Close stops Run, canceling the executions in progress, waits for it to
// return and unregisters the watchdog's metrics. Close is idempotent; it
// does not close the Policy.
func (w *Watchdog) Close() error {
	w.closed.Do(func() { close(w.closing) })
	if w.ran.Load() {
		<-w.done
	}
	w.m.reg.UnregisterAll()
	return nil
}

// dispatch starts the execution of d.
func (w *Watchdog) dispatch(ctx context.Context, wg *sync.WaitGroup, d Decision) {
	switch d.Action {
	case NoAction:
		return
	case GiveUp:
		now := w.now()
		w.report(ctx, Outcome{Decision: d, Result: ResultGaveUp, Started: now, Finished: now})
		select {
		case w.gaveUp <- d:
		default:
		}
		return
	}
	runCtx := ctx
	ctx, cancel := context.WithCancel(ctx)
	w.mu.Lock()
	for id, p := range w.pending {
		if supersedes(d, p.d) {
			p.superseded = true
			p.cancel()
			delete(w.pending, id)
		}
	}
	w.pending[d.ID] = &pending{d: d, cancel: cancel}
	w.mu.Unlock()
	w.m.inFlight.Inc()
	wg.Go(func() {
		defer w.m.inFlight.Dec()
		defer cancel()
		w.execute(runCtx, ctx, wg, d)
	})
}

// supersedes reports whether d replaces old, which has not started: a job
// restart replaces everything, a node's recreation replaces what waits on
// that node, and a decision replaces a weaker one for the same pod.
func supersedes(d, old Decision) bool {
	switch {
	case d.Action == RestartJob:
		return true
	case d.Action == RecreatePods && d.Pod == "" && d.Node != "":
		return old.Node == d.Node
	}
	return old.Node == d.Node && old.Pod == d.Pod && old.Action <= d.Action
}

// lock waits for d's node to be free and for room to run, and takes
// both; a job restart takes all the room.
func (w *Watchdog) lock(ctx context.Context, d Decision) (unlock func(), err error) {
	key := d.Node
	if key == "" {
		key = "pod\x00" + d.Pod
	}
	w.mu.Lock()
	node := w.nodes[key]
	if node == nil {
		node = make(chan struct{}, 1)
		w.nodes[key] = node
	}
	w.mu.Unlock()
	select {
	case node <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	weight := int64(1)
	if d.Action == RestartJob {
		weight = int64(w.cfg.Parallel)
	}
	if err := w.sem.Acquire(ctx, weight); err != nil {
		<-node
		return nil, err
	}
	return func() { w.sem.Release(weight); <-node }, nil
}

// execute runs d under ctx, which a superseding decision cancels; an
// escalation is dispatched under runCtx.
func (w *Watchdog) execute(runCtx, ctx context.Context, wg *sync.WaitGroup, d Decision) {
	o := Outcome{Decision: d}
	canceled := func() {
		w.mu.Lock()
		p := w.pending[d.ID]
		delete(w.pending, d.ID)
		w.mu.Unlock()
		o.Result = ResultCanceled
		if p == nil { // removed by a superseding decision
			o.Result = ResultSuperseded
		}
		o.Err = ctx.Err()
		o.Started, o.Finished = w.now(), w.now()
		w.report(ctx, o)
	}
	if d.Backoff > 0 {
		t := time.NewTimer(d.Backoff)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			canceled()
			return
		}
	}
	unlock, err := w.lock(ctx, d)
	if err != nil {
		canceled()
		return
	}
	locked := true
	defer func() {
		if locked {
			unlock()
		}
	}()
	w.mu.Lock()
	_, waiting := w.pending[d.ID]
	delete(w.pending, d.ID) // started: no longer superseded
	w.mu.Unlock()
	if !waiting {
		canceled()
		return
	}

	ctx, span := w.tracer.Start(ctx, "rescheduling.Execute", trace.WithAttributes(
		attribute.Int64("rescheduling.decision", int64(d.ID)),
		attribute.String("rescheduling.action", d.Action.String()),
		attribute.String("rescheduling.node", d.Node),
		attribute.String("rescheduling.pod", d.Pod),
		attribute.String("rescheduling.process", d.Process),
	))
	defer span.End()
	o.Started = w.now()
	w.cfg.Policy.Executing(d, o.Started)
	if d.AvoidNode != "" && d.Action >= RecreatePods {
		if err := w.cfg.Executor.AvoidNode(ctx, d); err != nil && !errors.Is(err, ErrUnsupported) {
			o.AvoidErr = err
		}
	}
	o.Err = w.retry(ctx, func() error {
		switch d.Action {
		case RestartProcesses:
			return w.cfg.Executor.RestartProcesses(ctx, d)
		case RecreatePods:
			return w.cfg.Executor.RecreatePods(ctx, d)
		default:
			return w.cfg.Executor.RestartJob(ctx, d)
		}
	})
	o.Finished = w.now()
	switch {
	case o.Err == nil:
		o.Result = ResultOK
		o.Recovery = o.Finished.Sub(d.Fault.Time)
		w.m.recovery.WithLabelValues(d.Action.String()).Observe(o.Recovery.Seconds())
	case errors.Is(o.Err, ErrTargetGone):
		o.Result = ResultGone
	case ctx.Err() != nil:
		o.Result = ResultCanceled
	default:
		o.Result = ResultFailed
		span.SetStatus(codes.Error, o.Err.Error())
	}
	span.SetAttributes(attribute.String("rescheduling.result", o.Result))
	w.report(ctx, o)
	if o.Result == ResultFailed {
		unlock() // the escalated decision may act on this node at once
		locked = false
		w.dispatch(runCtx, wg, w.cfg.Policy.Escalate(ctx, d, o.Err))
	}
}

// retry runs op until it succeeds, fails for good or runs out of retries.
func (w *Watchdog) retry(ctx context.Context, op func() error) error {
	b := w.cfg.RetryBackoff
	exp := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(b.Initial),
		backoff.WithMaxInterval(b.Max),
		backoff.WithMultiplier(b.Multiplier),
		backoff.WithRandomizationFactor(b.Jitter),
		backoff.WithMaxElapsedTime(0),
	)
	policy := backoff.WithContext(backoff.WithMaxRetries(exp, uint64(w.cfg.Retries)), ctx)
	return backoff.Retry(func() error {
		err := op()
		if err != nil && (errors.Is(err, ErrUnsupported) || errors.Is(err, ErrTargetGone) || ctx.Err() != nil) {
			return backoff.Permanent(err)
		}
		return err
	}, policy)
}

func (w *Watchdog) report(ctx context.Context, o Outcome) {
	d := &o.Decision
	w.m.executions.WithLabelValues(d.Action.String(), o.Result).Inc()
	level := slog.LevelInfo
	if o.Result == ResultFailed || o.Result == ResultGaveUp || o.AvoidErr != nil {
		level = slog.LevelWarn
	}
	if w.log.Enabled(ctx, level) {
		w.log.LogAttrs(ctx, level, "rescheduling outcome",
			slog.Uint64("id", d.ID),
			slog.String("action", d.Action.String()),
			slog.String("result", o.Result),
			slog.String("node", d.Node),
			slog.String("pod", d.Pod),
			slog.String("process", d.Process),
			slog.Duration("recovery", o.Recovery),
			slog.Any("error", o.Err),
			slog.Any("avoid_error", o.AvoidErr),
			slog.String("reason", d.Reason),
		)
	}
	if w.cfg.OnOutcome != nil {
		w.cfg.OnOutcome(o)
	}
}
