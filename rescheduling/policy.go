package rescheduling

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

const instrumentation = "github.com/faultline-ml/faultline/rescheduling"

// Defaults of Config.
const (
	// DefaultMaxRestarts is the per-process budget, torchrun's
	// max_restarts default.
	DefaultMaxRestarts = 32767
	// DefaultPodRestarts is the per-pod budget (a pod's restartCount).
	DefaultPodRestarts = 3
	// DefaultJobRestarts is the per-job budget.
	DefaultJobRestarts = 3
	// DefaultDedupeWindow is one monitor interval of a torchrun agent
	// (seed 002: 5 s): faults of one target within it are one event.
	DefaultDedupeWindow = 5 * time.Second
	// DefaultFailWindow: a fault within this time of a restart means the
	// restart failed, and the next decision escalates.
	DefaultFailWindow = time.Minute
)

// Backoff configures the exponential backoff, with jitter, between
// attempts on one target. The first attempt after a quiet period (no
// fault for Config.FailWindow) waits nothing; while faults recur, the
// waits grow from Initial by Multiplier up to Max, each randomised by
// ±Jitter.
type Backoff struct {
	Initial    time.Duration // default 1 s
	Max        time.Duration // default 5 min
	Multiplier float64       // default 2
	Jitter     float64       // default 0.5; negative: none
}

func (b Backoff) withDefaults() Backoff {
	b.Initial = cmp.Or(b.Initial, time.Second)
	b.Max = cmp.Or(b.Max, 5*time.Minute)
	b.Multiplier = cmp.Or(b.Multiplier, 2)
	b.Jitter = cmp.Or(b.Jitter, 0.5)
	if b.Jitter < 0 {
		b.Jitter = 0
	}
	return b
}

// Config configures a Policy. The zero value holds the documented
// defaults.
type Config struct {
	// MaxRestarts is the budget of in-place restarts per process; default
	// DefaultMaxRestarts. A negative value allows none, so process-level
	// faults start at the next level.
	MaxRestarts int
	// PodRestarts is the budget of recreations per pod (or per node, for a
	// decision that recreates every pod of a node); default
	// DefaultPodRestarts; negative: none.
	PodRestarts int
	// JobRestarts is the budget of job restarts; default
	// DefaultJobRestarts; negative: none.
	JobRestarts int
	// DedupeWindow: faults of one node and pod that happen within it after
	// a decision are the same event and get no decision of their own,
	// unless they need a stronger action. Default DefaultDedupeWindow.
	DedupeWindow time.Duration
	// FailWindow: a fault within it after a restart means that restart
	// failed; the next decision for the target escalates one level (up to
	// its rule's Last) and backs off. Default DefaultFailWindow; negative:
	// never escalate on recurrence.
	FailWindow time.Duration
	// Backoff shapes the waits between attempts.
	Backoff Backoff
	// Rules override DefaultRules class by class.
	Rules map[Class]Rule
	// Now is the clock; nil means time.Now. Tests inject a fake one.
	Now func() time.Time
	// Logger receives a record per decision; nil: discard.
	Logger *slog.Logger
	// Registerer receives the policy's metrics; nil: none.
	Registerer prometheus.Registerer
	// TracerProvider traces each decision; nil: no tracing.
	TracerProvider trace.TracerProvider
}

// Validate reports the first field that is out of range.
func (c Config) Validate() error {
	for cl, r := range c.Rules {
		if cl == Unclassified || cl >= ClassNone {
			return fmt.Errorf("rescheduling: Config.Rules has a rule for class %s, want killed..membership", cl)
		}
		if err := r.validate(cl); err != nil {
			return err
		}
	}
	b := c.Backoff
	switch {
	case b.Initial < 0:
		return fmt.Errorf("rescheduling: Config.Backoff.Initial is %v, want >= 0", b.Initial)
	case b.Max < 0:
		return fmt.Errorf("rescheduling: Config.Backoff.Max is %v, want >= 0", b.Max)
	case b.Initial > 0 && b.Max > 0 && b.Max < b.Initial:
		return fmt.Errorf("rescheduling: Config.Backoff.Max is %v, below Initial %v", b.Max, b.Initial)
	case b.Multiplier != 0 && b.Multiplier < 1:
		return fmt.Errorf("rescheduling: Config.Backoff.Multiplier is %g, want >= 1", b.Multiplier)
	case b.Jitter >= 1:
		return fmt.Errorf("rescheduling: Config.Backoff.Jitter is %g, want < 1", b.Jitter)
	case c.DedupeWindow < 0:
		return fmt.Errorf("rescheduling: Config.DedupeWindow is %v, want >= 0", c.DedupeWindow)
	}
	return nil
}

func (c Config) withDefaults() Config {
	budget := func(v *int, def int) {
		switch {
		case *v == 0:
			*v = def
		case *v < 0:
			*v = 0
		}
	}
	budget(&c.MaxRestarts, DefaultMaxRestarts)
	budget(&c.PodRestarts, DefaultPodRestarts)
	budget(&c.JobRestarts, DefaultJobRestarts)
	c.DedupeWindow = cmp.Or(c.DedupeWindow, DefaultDedupeWindow)
	c.FailWindow = cmp.Or(c.FailWindow, DefaultFailWindow)
	c.Backoff = c.Backoff.withDefaults()
	rules := DefaultRules()
	for cl, r := range c.Rules {
		rules[cl] = r
	}
	c.Rules = rules
	if c.Now == nil {
		c.Now = time.Now
	}
	c.Logger = cmp.Or(c.Logger, slog.New(slog.DiscardHandler))
	return c
}

// ErrGaveUp is returned (wrapped) by Watchdog.Run when the policy gave the
// job up.
var ErrGaveUp = errors.New("rescheduling: gave up")

// Policy decides, for each fault, whether to restart processes in place,
// recreate pods, restart the job or give up. It keeps the budgets,
// deduplicates storms and escalates when a cheaper level failed or its
// budget is spent.
//
// Policy is a pure state machine: it does no I/O, starts no goroutine and
// reads time only from Config.Now, so a test drives it step by step. It is
// safe for concurrent use.
type Policy struct {
	cfg    Config
	rules  [numClasses]Rule
	log    *slog.Logger
	tracer trace.Tracer
	m      *policyMetrics

	mu       sync.Mutex
	seq      uint64
	procs    map[string]int // restarts per node/pod/process
	pods     map[string]int // recreations per pod (or node)
	jobs     int            // job restarts
	scopes   map[scope]*entry
	job      *entry // the last RestartJob decision
	gaveUp   uint64 // the GiveUp decision, 0 while going
	suspects map[string]time.Time
}

// scope is what one decision acts on: a node and a pod, either empty.
type scope struct{ node, pod string }

// entry is the last decision for a scope.
type entry struct {
	id       uint64
	action   Action
	class    Class
	avoid    bool      // the decision moves the pods off the node
	decided  time.Time // when decided
	window   time.Time // decided + max(DedupeWindow, backoff)
	start    time.Time // when its execution started (or is expected to)
	started  bool      // start was reported by Executing
	recovery *backoff.ExponentialBackOff
}

// covers reports whether a fault at t belongs to the event e decided on:
// it happened before e's execution started, or, when its time is unknown
// or e's execution was not reported, within the dedupe window.
func (e *entry) covers(t time.Time, known bool) bool {
	if e.started {
		return t.Before(e.start) || (!known && t.Before(e.window))
	}
	return t.Before(e.window)
}

// NewPolicy returns a policy built from cfg. Its metrics are registered on
// cfg.Registerer until Close.
func NewPolicy(cfg Config) (*Policy, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	m, err := newPolicyMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	p := &Policy{
		cfg:      cfg,
		log:      cfg.Logger,
		tracer:   tracerOf(cfg.TracerProvider),
		m:        m,
		procs:    map[string]int{},
		pods:     map[string]int{},
		scopes:   map[scope]*entry{},
		suspects: map[string]time.Time{},
	}
	for cl, r := range cfg.Rules {
		p.rules[cl] = r
	}
	return p, nil
}

// Close unregisters the policy's metrics, so that another policy may use
// the Registerer. It is idempotent; decisions made after it are not
// counted.
func (p *Policy) Close() error {
	p.m.reg.UnregisterAll()
	return nil
}

// Decide returns the decision for f and updates the budgets. ctx only
// parents the decision's trace span.
func (p *Policy) Decide(ctx context.Context, f Fault) Decision {
	_, span := p.tracer.Start(ctx, "rescheduling.Decide")
	defer span.End()
	p.mu.Lock()
	d := p.decide(f)
	p.mu.Unlock()
	p.observe(ctx, span, &d)
	return d
}

// Executing tells the policy that the execution of d starts at t. Faults
// that happen from t on are new events, not duplicates of the one d
// covers; a fault soon after t means d failed (see Config.FailWindow).
// Watchdog calls it; an embedder driving the policy itself should too.
func (p *Policy) Executing(d Decision, t time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if e := p.entryOf(&d); e != nil && e.id == d.ID {
		e.start, e.started = t, true
	}
}

// Escalate returns the decision that replaces d after d's execution
// failed with cause: the next action up, whatever d's rule says its last
// is, subject to the budgets. It returns GiveUp after a RestartJob.
func (p *Policy) Escalate(ctx context.Context, d Decision, cause error) Decision {
	_, span := p.tracer.Start(ctx, "rescheduling.Escalate")
	defer span.End()
	p.mu.Lock()
	e := p.escalate(d, cause)
	p.mu.Unlock()
	p.observe(ctx, span, &e)
	return e
}

// Suspects returns the nodes that decisions asked to avoid, sorted.
func (p *Policy) Suspects() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]string, 0, len(p.suspects))
	for n := range p.suspects {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

func (p *Policy) next(f Fault, class Class, now time.Time) Decision {
	p.seq++
	return Decision{ID: p.seq, Class: class, Fault: f, Time: now}
}

func (p *Policy) decide(f Fault) Decision {
	now := p.cfg.Now()
	known := !f.Time.IsZero()
	if !known {
		f.Time = now
	}
	class := Classify(f)
	d := p.next(f, class, now)
	what := describe(f, class)
	if p.gaveUp != 0 {
		d.Covered = p.gaveUp
		d.Reason = what + ": no action, the job was given up by #" + strconv.FormatUint(p.gaveUp, 10)
		return d
	}
	if class == ClassNone {
		d.Reason = what + ": no action, not a fault"
		return d
	}
	rule := p.rules[class]
	if e := p.covering(f, known, rule); e != nil {
		d.Covered = e.id
		d.Reason = what + ": no action, covered by #" + strconv.FormatUint(e.id, 10) + " (" + e.action.String() + ")"
		return d
	}

	d.Evidence = facts(f)
	action := rule.First
	var prev *entry // the decision that this fault shows failed
	for _, e := range p.related(f) {
		if e == nil {
			continue
		}
		// A fault during an event that needs more than its decision
		// (a conflict) is no sign that the decision failed.
		if e.class == ClassMembership || p.cfg.FailWindow <= 0 || e.covers(f.Time, known) {
			continue
		}
		if f.Time.Sub(e.start) < p.cfg.FailWindow && (prev == nil || e.action > prev.action) {
			prev = e
		}
	}
	if prev != nil {
		action = max(action, min(prev.action+1, rule.Last))
		d.Evidence = append(d.Evidence, "recurred="+f.Time.Sub(prev.start).Round(time.Millisecond).String()+
			" after #"+strconv.FormatUint(prev.id, 10)+" ("+prev.action.String()+")")
	}
	d.Action = p.charge(&d, rule, action)
	var recovery *backoff.ExponentialBackOff
	if prev != nil {
		recovery = prev.recovery
		if recovery == nil {
			recovery = p.newBackoff()
		}
		d.Backoff = recovery.NextBackOff()
	}
	p.commit(&d, rule, what, recovery)
	return d
}

func (p *Policy) escalate(old Decision, cause error) Decision {
	d := p.next(old.Fault, old.Class, p.cfg.Now())
	what := describe(old.Fault, old.Class)
	if p.gaveUp != 0 {
		d.Covered = p.gaveUp
		d.Reason = what + ": no action, the job was given up by #" + strconv.FormatUint(p.gaveUp, 10)
		return d
	}
	rule := p.rules[old.Class]
	if old.Class == Unclassified || old.Class >= ClassNone {
		rule = p.rules[ClassUnknown]
	}
	rule.Last = RestartJob // a level that cannot be executed is skipped
	d.Supersedes = old.ID
	d.Evidence = append(facts(old.Fault), "escalated_from=#"+strconv.FormatUint(old.ID, 10)+" ("+old.Action.String()+")")
	if cause != nil {
		d.Evidence = append(d.Evidence, "cause="+cause.Error())
	}
	d.Action = p.charge(&d, rule, max(old.Action+1, rule.First))
	var recovery *backoff.ExponentialBackOff
	if e := p.entryOf(&old); e != nil {
		recovery = e.recovery
	}
	p.commit(&d, rule, what, recovery)
	return d
}

// commit sets d's target-dependent fields and reason and records d.
func (p *Policy) commit(d *Decision, rule Rule, what string, recovery *backoff.ExponentialBackOff) {
	now := d.Time
	switch d.Action {
	case GiveUp:
		p.gaveUp = d.ID
		d.Reason = what + ": give up, every budget that could help is spent"
		return
	default:
		d.Reason = what + ": " + d.what()
	}
	if d.AvoidNode != "" {
		d.Reason += ", keeping the job off node " + d.AvoidNode
		p.suspects[d.AvoidNode] = now
	}
	if rule.Uncounted {
		d.Reason += " (not counted)"
	} else {
		d.Reason += " (attempt " + strconv.Itoa(d.Attempt) + " of " + strconv.Itoa(d.Budget) + ")"
	}
	e := &entry{
		id:       d.ID,
		action:   d.Action,
		class:    d.Class,
		avoid:    d.AvoidNode != "",
		decided:  now,
		window:   now.Add(max(p.cfg.DedupeWindow, d.Backoff)),
		start:    now.Add(d.Backoff),
		recovery: recovery,
	}
	if old := p.entryOf(d); old != nil && old.covers(d.Fault.Time, true) && d.Supersedes == 0 {
		d.Supersedes = old.id // still pending or in progress: replaced
	}
	if d.Action == RestartJob {
		p.job = e
		return
	}
	p.scopes[scope{d.Node, d.Pod}] = e
}

// entryOf returns the entry a decision was recorded in, nil if none.
func (p *Policy) entryOf(d *Decision) *entry {
	if d.Action == RestartJob {
		return p.job
	}
	return p.scopes[scope{d.Node, d.Pod}]
}

// related returns the entries whose scope holds f's target: its pod, its
// node, the whole job; nil entries are skipped by the callers.
func (p *Policy) related(f Fault) [4]*entry {
	var out [4]*entry
	out[0] = p.scopes[scope{f.Node, f.Pod}]
	if f.Pod != "" {
		out[1] = p.scopes[scope{f.Node, ""}]
	}
	if f.Node != "" || f.Pod != "" {
		out[2] = p.scopes[scope{}]
	}
	out[3] = p.job
	return out
}

// covering returns the decision that already covers f, nil if none: one
// whose scope holds f's target, whose action is at least as strong as f
// needs, and whose event f belongs to. Of several, the strongest and then
// the latest wins, as it supersedes the others.
func (p *Policy) covering(f Fault, known bool, rule Rule) *entry {
	var best *entry
	for _, e := range p.related(f) {
		if e == nil || !e.covers(f.Time, known) {
			continue
		}
		if e.action != RestartJob && (e.action < rule.First || (rule.AvoidNode && !e.avoid)) {
			continue
		}
		if best == nil || e.action > best.action || (e.action == best.action && e.id > best.id) {
			best = e
		}
	}
	return best
}

// charge picks the first action from a up whose budget is not spent,
// consumes it, and sets d's target. It returns GiveUp when a budget at or
// past rule.Last is spent.
func (p *Policy) charge(d *Decision, rule Rule, a Action) Action {
	f := &d.Fault
	for ; a <= RestartJob; a++ {
		d.Node, d.Pod, d.Process, d.AvoidNode = "", "", "", ""
		var budget map[string]int // nil: the job's
		var key string
		var limit int
		switch a {
		case RestartProcesses:
			d.Node, d.Pod, d.Process = f.Node, f.Pod, f.Process
			budget, key, limit = p.procs, f.Node+"\x00"+f.Pod+"\x00"+f.Process, p.cfg.MaxRestarts
		case RecreatePods:
			if f.Node == "" && f.Pod == "" {
				d.Evidence = append(d.Evidence, "no_pod=the fault names no node or pod to recreate")
				continue
			}
			d.Node, d.Pod = f.Node, f.Pod
			key = "pod\x00" + f.Pod
			if rule.AvoidNode && f.Node != "" {
				d.Pod = "" // every pod of the job on a suspect node moves
			}
			if d.Pod == "" {
				// The node's pods move together and share its budget.
				key = "node\x00" + f.Node
			}
			budget, limit = p.pods, p.cfg.PodRestarts
		case RestartJob:
			limit = p.cfg.JobRestarts
		}
		if rule.AvoidNode && a >= RecreatePods {
			d.AvoidNode = f.Node
		}
		if rule.Uncounted {
			d.Attempt, d.Budget = 0, 0
			return a
		}
		used := p.jobs
		if budget != nil {
			used = budget[key]
		}
		if used < limit {
			used++
			if budget != nil {
				budget[key] = used
			} else {
				p.jobs = used
			}
			d.Attempt, d.Budget = used, limit
			return a
		}
		d.Evidence = append(d.Evidence, "budget_spent="+a.String()+" "+strconv.Itoa(used)+"/"+strconv.Itoa(limit))
		p.m.exhausted[a].Inc()
		if a >= rule.Last {
			break
		}
	}
	d.Node, d.Pod, d.Process, d.AvoidNode = f.Node, f.Pod, f.Process, ""
	return GiveUp
}

func (p *Policy) newBackoff() *backoff.ExponentialBackOff {
	b := p.cfg.Backoff
	return backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(b.Initial),
		backoff.WithMaxInterval(b.Max),
		backoff.WithMultiplier(b.Multiplier),
		backoff.WithRandomizationFactor(b.Jitter),
		backoff.WithMaxElapsedTime(0), // budgets end the attempts, not time
		backoff.WithClockProvider(clock(p.cfg.Now)),
	)
}

// facts returns what a decision's evidence starts with: the fault's own
// fields, then its evidence.
func facts(f Fault) []string {
	out := make([]string, 0, 4+len(f.Evidence))
	out = append(out, "kind="+f.Kind.String())
	if f.Kind == KindExit {
		out = append(out, "exit_code="+strconv.Itoa(f.ExitCode))
	}
	if f.Signal != 0 {
		out = append(out, "signal="+f.Signal.String())
	}
	if f.Reason != "" {
		out = append(out, "reason="+f.Reason)
	}
	return append(out, f.Evidence...)
}

// tracerOf returns tp's tracer, or a no-op one that does not even derive
// a context (a storm of decisions then allocates no span) when tp is nil.
func tracerOf(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		return nopTracer{span: noop.Span{}}
	}
	return tp.Tracer(instrumentation)
}

// nopTracer starts spans that record nothing, without touching ctx.
type nopTracer struct {
	noop.Tracer
	span trace.Span
}

func (t nopTracer) Start(ctx context.Context, _ string, _ ...trace.SpanStartOption) (context.Context, trace.Span) {
	return ctx, t.span
}

// clock adapts a Now function to backoff.Clock.
type clock func() time.Time

func (c clock) Now() time.Time { return c() }

// observe logs, counts and traces d.
func (p *Policy) observe(ctx context.Context, span trace.Span, d *Decision) {
	p.m.faults[min(d.Class, numClasses-1)].Inc()
	p.m.decisions[min(d.Action, GiveUp)].Inc()
	if d.Action == NoAction && d.Covered != 0 {
		p.m.deduplicated.Inc()
	}
	if d.AvoidNode != "" {
		p.mu.Lock()
		n := len(p.suspects)
		p.mu.Unlock()
		p.m.suspects.Set(float64(n))
	}
	level := slog.LevelInfo
	switch d.Action {
	case NoAction:
		level = slog.LevelDebug
	case GiveUp:
		level = slog.LevelWarn
	}
	if p.log.Enabled(ctx, level) {
		p.log.LogAttrs(ctx, level, "rescheduling decision",
			slog.Uint64("id", d.ID),
			slog.String("action", d.Action.String()),
			slog.String("class", d.Class.String()),
			slog.String("node", d.Fault.Node),
			slog.String("pod", d.Fault.Pod),
			slog.String("process", d.Fault.Process),
			slog.String("avoid_node", d.AvoidNode),
			slog.Int("attempt", d.Attempt),
			slog.Int("budget", d.Budget),
			slog.Duration("backoff", d.Backoff),
			slog.Uint64("covered", d.Covered),
			slog.Uint64("supersedes", d.Supersedes),
			slog.String("reason", d.Reason),
			slog.Any("evidence", d.Evidence),
		)
	}
	if span.IsRecording() {
		span.SetAttributes(
			attribute.Int64("rescheduling.decision", int64(d.ID)),
			attribute.String("rescheduling.action", d.Action.String()),
			attribute.String("rescheduling.class", d.Class.String()),
			attribute.String("rescheduling.kind", d.Fault.Kind.String()),
			attribute.String("rescheduling.node", d.Fault.Node),
			attribute.String("rescheduling.pod", d.Fault.Pod),
			attribute.String("rescheduling.process", d.Fault.Process),
			attribute.String("rescheduling.avoid_node", d.AvoidNode),
			attribute.Int("rescheduling.attempt", d.Attempt),
			attribute.Int64("rescheduling.backoff_ms", d.Backoff.Milliseconds()),
			attribute.String("rescheduling.reason", d.Reason),
			attribute.StringSlice("rescheduling.evidence", d.Evidence),
		)
		if d.Action == GiveUp {
			span.SetStatus(codes.Error, d.Reason)
		}
	}
}
