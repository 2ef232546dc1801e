package taskd

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
)

// The orchestration core is pure: it is fed faults, registrations, the
// outcomes of what it asked for, requests and the time, and it says what
// to do next (actions) and what changed (transitions). It does no I/O,
// starts no goroutine and reads no clock, so that tests drive it step by
// step. The orchestrator (orchshell.go) performs its actions and feeds it.

// level is how far the rescheduling policy says a repair must go.
type level int

const (
	levelInPlace level = iota + 1 // restart the processes in place
	levelReplace                  // replace the processes of their pods or nodes
	levelJob                      // restart the whole job: beyond online recovery
	levelGiveUp                   // every budget is spent
)

func (l level) String() string {
	switch l {
	case levelInPlace:
		return "restart in place"
	case levelReplace:
		return "replace"
	case levelJob:
		return "restart the job"
	case levelGiveUp:
		return "give up"
	}
	return fmt.Sprintf("level(%d)", int(l))
}

type actionKind int

const (
	actBroadcast actionKind = iota + 1 // send msg to workers and collect their answers
	actDecide                          // ask the policy how far a repair must go
	actRepair                          // restart or replace processes through the executor
	actLoad                            // ready the newest intact checkpoint
	actPersist                         // persist the newest intact checkpoint
)

// String names the action in spans, logs and metrics.
func (k actionKind) String() string {
	switch k {
	case actBroadcast:
		return "broadcast"
	case actDecide:
		return "decide"
	case actRepair:
		return "repair"
	case actLoad:
		return "load"
	case actPersist:
		return "persist"
	}
	return ""
}

// action is what the core asks of its shell. The shell reports the
// outcome with the action's id; an outcome whose id is not the one the
// core waits for is stale and dropped.
type action struct {
	id      uint64
	run     uint64 // the orchestration that asks
	kind    actionKind
	msg     string  // actBroadcast: the message kind
	to      Target  // actBroadcast: the workers
	except  []int   // actBroadcast: ranks left out of to
	payload orchMsg // actBroadcast
	// timeout bounds the action; the core's own deadline for its state
	// is a little later, so that the outcome normally arrives first.
	timeout  time.Duration
	strategy Strategy // actRepair
	faults   []Fault  // actDecide, actRepair: one per faulty rank
}

// rankResult is the outcome of a broadcast for one rank.
type rankResult struct {
	rank  int
	node  int // -1 when unknown
	err   error
	reply orchReply
}

type transitionEvent struct {
	o Orchestration // as it is after the transition
	t Transition
}

type coreConfig struct {
	triggers      map[FaultKind]bool
	retryable     map[FaultKind]bool
	strategies    map[Strategy]bool
	canRepair     bool // an executor is configured
	canCheckpoint bool // checkpoints are configured
	timeouts      Timeouts
	maxRounds     int
	maxHistory    int
}

func newCoreConfig(c OrchestrationConfig) coreConfig {
	set := func(ks []FaultKind, def ...FaultKind) map[FaultKind]bool {
		if len(ks) == 0 {
			ks = def
		}
		out := make(map[FaultKind]bool, len(ks))
		for _, k := range ks {
			out[k] = true
		}
		return out
	}
	strategies := c.Strategies
	if len(strategies) == 0 {
		strategies = AllStrategies()
	}
	cc := coreConfig{
		triggers:      set(c.Triggers, FaultProcessExit, FaultLost, FaultHang, FaultOpError),
		retryable:     set(c.Retryable, FaultOpError),
		strategies:    make(map[Strategy]bool),
		canRepair:     c.Executor != nil,
		canCheckpoint: c.Checkpoints != nil,
		timeouts:      c.Timeouts,
		maxRounds:     orDefault(c.MaxRounds, 3),
		maxHistory:    orDefault(c.MaxHistory, 100),
	}
	cc.timeouts.setDefaults()
	for _, s := range strategies {
		cc.strategies[s] = true
	}
	return cc
}

// deadKinds are the fault kinds after which a rank cannot take part in
// the job until it is restarted: it is left out of every broadcast.
func deadKind(k FaultKind) bool {
	return k == FaultProcessExit || k == FaultLost || k == FaultHang
}

// coreRun is the orchestration in progress.
type coreRun struct {
	o        Orchestration
	origin   time.Time         // the first fault, or the request
	faults   map[int][]Fault   // faulty ranks not yet repaired
	ids      map[string]bool   // fault IDs taken in
	pending  bool              // faults arrived that the state in progress does not cover
	deadline time.Time         // of the state
	action   uint64            // the action the state waits for, 0 if none
	handover []Fault           // link switch, stress test: faults for the recovery to come
	failed   map[Strategy]bool // strategies that failed in this run
	// supported is the strategies every rank that answered the notice
	// supports; nil when none answered.
	supported map[Strategy]bool
	level     level
	// A repair in progress: when it began, the faults it repairs (by
	// rank), whether the executor is done, the ranks it restarted and
	// those registered again since it began.
	repairStart time.Time
	repairing   map[int]Fault
	repairDone  bool
	awaited     []int
	registered  map[int]bool
	// evictedInst is the instance of each rank that the repair in
	// progress evicted ("" for a rank it found none of) before it called
	// the executor: a manager that takes over tells by it whether the
	// executor restarted the rank.
	evictedInst map[int]string
	restarted   []int // every rank restarted in this run
	resumeStep  int64
	// restored is set on a run that a manager took over from the state
	// another left (it restarted, or a standby took the lease); settling
	// while it waits for the members to register again, before it
	// carries on; deferred are the faults it took in meanwhile, for it to
	// react to once it carries on.
	restored bool
	settling bool
	deferred []Fault
}

// addFault takes f in and reports whether its rank is newly faulty. A
// fault already taken in (same ID) changes nothing.
func (r *coreRun) addFault(f Fault) bool {
	if r.ids[f.ID] {
		return false
	}
	r.ids[f.ID] = true
	r.o.Faults = append(r.o.Faults, f.clone())
	rank := f.Position.Rank
	if !slices.Contains(r.o.FaultyRanks, rank) {
		r.o.FaultyRanks = append(r.o.FaultyRanks, rank)
		slices.Sort(r.o.FaultyRanks)
	}
	_, known := r.faults[rank]
	r.faults[rank] = append(r.faults[rank], f)
	return !known
}

// dead returns the faulty ranks that cannot take part, sorted.
func (r *coreRun) dead() []int {
	var out []int
	for rank, fs := range r.faults {
		if slices.ContainsFunc(fs, func(f Fault) bool { return deadKind(f.Kind) }) {
			out = append(out, rank)
		}
	}
	slices.Sort(out)
	return out
}

// kindRank orders the kinds of a rank's faults by what they say of it, the
// most telling first, for the policy and the notice.
func kindRank(k FaultKind) int {
	switch k {
	case FaultProcessExit:
		return 0
	case FaultHang:
		return 1
	case FaultOpError:
		return 2
	case FaultStressTest:
		return 3
	case FaultLink:
		return 4
	case FaultLost:
		return 5
	}
	return 6
}

// primaries returns one fault per faulty rank, the most telling, in rank
// order.
func (r *coreRun) primaries() []Fault {
	ranks := slices.Sorted(maps.Keys(r.faults))
	out := make([]Fault, 0, len(ranks))
	for _, rank := range ranks {
		fs := r.faults[rank]
		best := fs[0]
		for _, f := range fs[1:] {
			if kindRank(f.Kind) < kindRank(best.Kind) {
				best = f
			}
		}
		out = append(out, best.clone())
	}
	return out
}

func (r *coreRun) supports(s Strategy) bool { return r.supported == nil || r.supported[s] }

// machine is the orchestration core: at most one orchestration at a time.
type machine struct {
	cfg         coreConfig
	run         *coreRun
	history     []Orchestration
	nextRun     uint64
	nextAction  uint64
	restartedAt map[int]time.Time     // rank -> when its last restart began
	links       map[[2]int]LinkTarget // (node, device) -> target, for links off their primary
	// epoch is random per machine, kept with its state: it makes the keys
	// of the commands a worker carries out once (see onceKey) differ from
	// those of any other manager's orchestrations.
	epoch string
	seen  faultMark // the faults of the log taken in
	out   []action
	trans []transitionEvent
	// dirty is set by every input that changed the state, and cleared by
	// save: the shell writes the state down before it acts on it.
	dirty   bool
	histNew bool // an orchestration joined the history since the last save
}

func newMachine(cfg coreConfig) *machine {
	return &machine{cfg: cfg, restartedAt: make(map[int]time.Time), links: make(map[[2]int]LinkTarget), epoch: newInstanceID()[:16]}
}

// ready returns what the core asks for and what changed since the last
// call. Of the actions, only the last may still be awaited: the others
// were overtaken by the inputs that followed them.
func (m *machine) ready() ([]action, []transitionEvent) {
	a, t := m.out, m.trans
	m.out, m.trans = nil, nil
	return a, t
}

// awaited reports whether the core still waits for action id.
func (m *machine) awaited(id uint64) bool { return m.run != nil && m.run.action == id }

// deadline returns when the state in progress times out; zero when idle.
func (m *machine) deadline() time.Time {
	if m.run == nil {
		return time.Time{}
	}
	return m.run.deadline
}

// holding reports whether the job is held paused for a worker of rank
// that registers now: it must not start its trainer, since the
// orchestration will resume it with the others. From the moment the
// resume goes out, a newcomer starts on its own; but a rank the recovery
// restarted had registered before the resume went out, so the resume
// reaches it, and its registration now is the same process registering
// again (its answer to the first was lost, say).
//
// A run taken over from another manager holds every rank: a worker held
// by the manager before does not know whether the resume it waits for
// went out, and one whose registration comes after the resume picked its
// targets gets it again (registered).
func (m *machine) holding(rank int) bool {
	r := m.run
	if r == nil {
		return false
	}
	if r.restored {
		return true
	}
	switch r.o.State {
	case StateResuming:
		return slices.Contains(r.restarted, rank)
	case StateContinuing:
		return false
	}
	return true
}

// status returns the orchestration in progress, the finished ones with an
// ID above after, and the links off their primary.
func (m *machine) status(after uint64) OrchestrationStatus {
	var st OrchestrationStatus
	if m.run != nil {
		o := m.run.o.clone()
		st.Current = &o
	}
	for _, o := range m.history {
		if o.ID > after {
			st.History = append(st.History, o.clone())
		}
	}
	st.Links = m.linkStates()
	return st
}

// linkStates returns the links off their primary, by node and device.
func (m *machine) linkStates() []LinkState {
	var out []LinkState
	for k, t := range m.links {
		out = append(out, LinkState{Node: k[0], Device: k[1], Target: t})
	}
	slices.SortFunc(out, func(a, b LinkState) int {
		if a.Node != b.Node {
			return a.Node - b.Node
		}
		return a.Device - b.Device
	})
	return out
}

func faultTime(f Fault) time.Time {
	if f.Time.IsZero() {
		return f.Received
	}
	return f.Time
}

func describeFault(f Fault) string {
	s := fmt.Sprintf("%s on rank %d", f.Kind, f.Position.Rank)
	if f.Code != 0 {
		s += fmt.Sprintf(" (code %d)", f.Code)
	}
	if f.Message != "" {
		s += ": " + f.Message
	}
	return s
}

// fault takes in a fault from the job's fault log.
func (m *machine) fault(now time.Time, f Fault) {
	if m.seen.add(f.Seq) {
		m.dirty = true
	}
	if !m.cfg.triggers[f.Kind] || f.Position.Rank < 0 {
		return
	}
	if t, ok := m.restartedAt[f.Position.Rank]; ok && faultTime(f).Before(t) {
		return // it happened before the rank's process was restarted
	}
	m.dirty = true
	r := m.run
	if r == nil {
		m.startRecovery(now, []Fault{f}, 0, describeFault(f))
		return
	}
	if !m.take(f) {
		return
	}
	if r.settling {
		r.deferred = append(r.deferred, f.clone())
		return
	}
	m.react(now, f)
}

// take takes f into the orchestration in progress, and reports whether
// the orchestration is to react to it: a recovery to a rank newly
// faulty, a link switch or stress test to any fault it had not seen.
func (m *machine) take(f Fault) bool {
	r := m.run
	if r.o.Kind == KindRecovery {
		return r.addFault(f)
	}
	if slices.ContainsFunc(r.handover, func(g Fault) bool { return g.ID == f.ID }) {
		return false
	}
	r.handover = append(r.handover, f.clone())
	return true
}

// react moves the orchestration in progress on after it took f in. A
// link switch or stress test hands over to a recovery, at once or when
// the links it is moving have answered.
func (m *machine) react(now time.Time, f Fault) {
	r := m.run
	why := describeFault(f)
	if r.o.Kind != KindRecovery {
		switch r.o.State {
		case StateSwitching, StateTesting:
			r.pending = true
		default:
			m.handOver(now, why)
		}
		return
	}
	switch r.o.State {
	case StateStopping:
		if deadKind(f.Kind) {
			// Asked to pause, a hung rank would hold the pause up until its
			// timeout: ask again without it. Those paused answer at once.
			m.broadcast(now, kindPause, AllWorkers(), r.dead(), orchMsg{}, m.cfg.timeouts.Pause)
		}
	case StateNotifying, StateDeciding:
		m.enter(now, StateNotifying, why+"; telling the ranks again")
	case StateRestarting, StateReplacing:
		if r.repairDone && slices.Contains(r.awaited, f.Position.Rank) && !r.registered[f.Position.Rank] {
			m.repairFailed(now, "restarted "+why)
			return
		}
		r.pending = true // another round once the repair ends
	case StateRetrying:
		r.pending = true // another round once the retry ends
	case StateLoading, StateResuming:
		m.newRound(now, why+" while resuming")
	}
	// dumping, exiting: the job ends anyway.
}

// registered takes in a worker that registered as a new instance.
func (m *machine) registered(now time.Time, rank int) {
	r := m.run
	if r == nil {
		return
	}
	switch r.o.State {
	case StateRestarting, StateReplacing:
		if r.settling && !r.repairDone {
			return // the repair is made again: what registered before it does not count
		}
		r.registered[rank] = true
		m.dirty = true
		if !r.settling {
			m.checkRepaired(now)
		}
	case StateResuming, StateContinuing:
		if r.restored && !r.settling {
			// Taken over, the resume may have picked its targets before
			// this rank registered again: it goes out again, and the
			// ranks that carried it out already answer at once.
			m.dirty = true
			m.issue(now)
		}
	}
}

// evicted takes in that repair id evicted instances, the live instance
// of each rank it is to restart ("" for none): only the registrations of
// their successors count from now on.
func (m *machine) evicted(id uint64, instances map[int]string) {
	r := m.run
	if r == nil || id == 0 || id != r.action || (r.o.State != StateRestarting && r.o.State != StateReplacing) {
		return
	}
	if r.evictedInst == nil {
		r.evictedInst = make(map[int]string, len(instances))
	}
	for rank, inst := range instances {
		delete(r.registered, rank)
		r.evictedInst[rank] = inst
	}
	m.dirty = true
}

// request starts a link switch, switchback or stress test, unless an
// orchestration runs.
func (m *machine) request(now time.Time, kind OrchestrationKind, link *LinkRequest, stress *StressRequest) (uint64, error) {
	if m.run != nil {
		return 0, fmt.Errorf("%w: %s #%d is %s", ErrBusy, m.run.o.Kind, m.run.o.ID, m.run.o.State)
	}
	m.dirty = true
	m.nextRun++
	r := m.newRun(now, kind)
	r.o.Link, r.o.Stress = link, stress
	r.origin = now
	m.run = r
	m.enter(now, StatePausing, "requested")
	return r.o.ID, nil
}

func (m *machine) newRun(now time.Time, kind OrchestrationKind) *coreRun {
	return &coreRun{
		o:          Orchestration{ID: m.nextRun, Kind: kind, State: StateIdle, Start: now, Round: 1, ResumedStep: -1},
		faults:     make(map[int][]Fault),
		ids:        make(map[string]bool),
		failed:     make(map[Strategy]bool),
		resumeStep: -1,
	}
}

func (m *machine) startRecovery(now time.Time, faults []Fault, from uint64, why string) {
	m.nextRun++
	r := m.newRun(now, KindRecovery)
	r.o.HandedOverFrom = from
	r.origin = now
	for i, f := range faults {
		r.addFault(f)
		if t := faultTime(f); !t.IsZero() && t.Before(r.origin) {
			r.origin = t
		}
		if i == 0 {
			got := f.Received
			if got.IsZero() {
				got = now
			}
			r.o.Detected = max(got.Sub(faultTime(f)), 0)
		}
	}
	m.run = r
	m.enter(now, StateStopping, why)
}

// grace is how much later than its action's timeout a state times out.
func grace(d time.Duration) time.Duration {
	return min(max(d/10, 50*time.Millisecond), 5*time.Second)
}

func (m *machine) act(now time.Time, a action) {
	m.nextAction++
	a.id, a.run = m.nextAction, m.run.o.ID
	m.run.action = a.id
	m.run.deadline = now.Add(a.timeout + grace(a.timeout))
	m.out = append(m.out, a)
}

func (m *machine) broadcast(now time.Time, msg string, to Target, except []int, payload orchMsg, timeout time.Duration) {
	payload.TimeoutMS = timeout.Milliseconds()
	m.act(now, action{kind: actBroadcast, msg: msg, to: to, except: except, payload: payload, timeout: timeout})
}

// enter moves the orchestration in progress to state to and asks for what
// that state needs.
func (m *machine) enter(now time.Time, to State, why string) {
	r := m.run
	switch to {
	case StateRetrying:
		r.o.Strategy = StrategyRetry
	case StateRestarting:
		r.o.Strategy = StrategyRecoverInPlace
	case StateReplacing:
		r.o.Strategy = StrategyRecover
	case StateDumping:
		r.o.Strategy = StrategyDump
	case StateExiting:
		if r.o.Strategy != StrategyDump {
			r.o.Strategy = StrategyExit
		}
	}
	m.record(now, to, why)
	if to.Terminal() {
		m.finish()
		return
	}
	if to == StateRestarting || to == StateReplacing {
		faults := r.primaries()
		r.repairStart, r.repairDone, r.awaited, r.registered, r.evictedInst = now, false, nil, make(map[int]bool), nil
		r.repairing = make(map[int]Fault, len(faults))
		for _, f := range faults {
			r.repairing[f.Position.Rank] = f
		}
	}
	m.issue(now)
}

// record notes the transition of the orchestration in progress to state
// to.
func (m *machine) record(now time.Time, to State, why string) {
	r := m.run
	m.dirty = true
	t := Transition{From: r.o.State, To: to, Time: now, Reason: why}
	r.o.State = to
	r.o.Transitions = append(r.o.Transitions, t)
	r.deadline, r.action = time.Time{}, 0
	if to.Terminal() {
		r.o.Done, r.o.End, r.o.Outcome = true, now, why
	}
	m.trans = append(m.trans, transitionEvent{o: r.o.clone(), t: t})
}

// issue asks for what the state in progress needs.
func (m *machine) issue(now time.Time) {
	r := m.run
	T := m.cfg.timeouts
	all := AllWorkers()
	switch r.o.State {
	case StateStopping, StatePausing:
		m.broadcast(now, kindPause, all, r.dead(), orchMsg{}, T.Pause)
	case StateNotifying:
		m.broadcast(now, kindNotice, all, r.dead(), orchMsg{Notice: &FaultNotice{Faults: r.primaries()}}, T.Notify)
	case StateDeciding:
		m.act(now, action{kind: actDecide, faults: r.primaries(), timeout: T.Decide})
	case StateRetrying:
		m.broadcast(now, kindRetry, all, r.dead(), orchMsg{Once: m.onceKey()}, T.Retry)
	case StateRestarting, StateReplacing:
		m.act(now, action{kind: actRepair, strategy: r.o.Strategy, faults: slices.SortedFunc(maps.Values(r.repairing), byRank), timeout: m.repairTimeout()})
	case StateLoading:
		m.act(now, action{kind: actLoad, timeout: T.Load})
	case StateResuming:
		resume := ResumeRequest{Step: r.resumeStep, Strategy: r.o.Strategy, Restarted: slices.Clone(r.restarted)}
		m.broadcast(now, kindResume, all, r.dead(), orchMsg{Resume: &resume, Once: m.onceKey()}, T.Resume)
	case StateDumping:
		m.act(now, action{kind: actPersist, timeout: T.Dump})
	case StateExiting:
		m.broadcast(now, kindStop, all, r.dead(), orchMsg{Reason: r.o.reasonFor(StateExiting)}, T.Exit)
	case StateSwitching:
		l := *r.o.Link
		tgt := Target{Ranks: l.Ranks}
		if len(l.Ranks) == 0 {
			tgt = NodeWorkers(l.Node)
		}
		m.broadcast(now, kindSwitch, tgt, nil, orchMsg{Link: &l}, T.Switch)
	case StateTesting:
		s := *r.o.Stress
		m.broadcast(now, kindStress, Target{Nodes: s.Nodes, Ranks: s.Ranks}, nil, orchMsg{Stress: &s}, T.Stress)
	case StateContinuing:
		m.broadcast(now, kindResume, all, nil, orchMsg{Resume: &ResumeRequest{Step: -1}, Once: m.onceKey()}, T.Resume)
	}
}

// reasonFor returns why the orchestration entered state last.
func (o *Orchestration) reasonFor(state State) string {
	for i := len(o.Transitions) - 1; i >= 0; i-- {
		if t := o.Transitions[i]; t.To == state && t.From != state {
			return t.Reason
		}
	}
	return ""
}

func byRank(a, b Fault) int { return a.Position.Rank - b.Position.Rank }

func (m *machine) repairTimeout() time.Duration {
	if m.run.o.State == StateReplacing {
		return m.cfg.timeouts.Replace
	}
	return m.cfg.timeouts.Restart
}

// onceKey names the retry, resume or continue of the round in progress: a worker
// carries out a command with a key once, however many managers send it.
func (m *machine) onceKey() string {
	r := m.run
	return fmt.Sprintf("%s/%d/%d/%s", m.epoch, r.o.ID, r.o.Round, r.o.State)
}

// finish files the orchestration that reached a terminal state.
func (m *machine) finish() {
	r := m.run
	m.run = nil
	if r.o.State == StateSwitched && r.o.Link != nil {
		for _, d := range r.o.Link.Devices {
			key := [2]int{r.o.Link.Node, d}
			if r.o.Kind == KindSwitchback {
				delete(m.links, key)
			} else {
				m.links[key] = LinkStandby
			}
		}
	}
	m.history = append(m.history, r.o)
	m.histNew = true
	if over := len(m.history) - m.cfg.maxHistory; over > 0 {
		m.history = slices.Delete(m.history, 0, over)
	}
}

// failure turns a rank's failed answer into a fault. A rank that could not
// be reached is lost; one that did not answer in time is hung, or its link
// or test failed; one that refused failed as kind says.
func (m *machine) failure(now time.Time, res rankResult, kind FaultKind, what string) Fault {
	r := m.run
	switch {
	case errors.Is(res.err, ErrNotConnected):
		kind = FaultLost
	case errors.Is(res.err, ErrAckTimeout) && kind == FaultOpError:
		kind = FaultHang
	}
	return Fault{
		ID:           fmt.Sprintf("orchestration/%d/%d/%d", r.o.ID, r.action, res.rank),
		Kind:         kind,
		Position:     Position{Node: res.node, Rank: res.rank},
		Message:      fmt.Sprintf("%s: %v", what, res.err),
		Time:         now,
		Received:     now,
		Reporter:     Position{Node: -1, Rank: -1},
		ReporterRole: RoleManager,
	}
}

// delivered takes in the outcome of a broadcast.
func (m *machine) delivered(now time.Time, id uint64, results []rankResult) {
	r := m.run
	if r == nil || id == 0 || id != r.action {
		return
	}
	m.dirty = true
	var failed []rankResult
	for _, res := range results {
		if res.err != nil {
			failed = append(failed, res)
		}
	}
	okCount := fmt.Sprintf("%d of %d ranks", len(results)-len(failed), len(results))
	note := func(kind FaultKind, what string) {
		for _, res := range failed {
			f := m.failure(now, res, kind, what)
			if r.o.Kind == KindRecovery {
				r.addFault(f)
			} else {
				r.handover = append(r.handover, f)
			}
		}
	}
	switch r.o.State {
	case StateStopping:
		note(FaultOpError, "did not pause")
		r.o.Stopped = now.Sub(r.origin)
		if len(r.faults) == 0 {
			// Ranks resume from the step the last round readied, if any.
			m.enter(now, StateResuming, okCount+" paused; no faulty rank left")
			return
		}
		m.enter(now, StateNotifying, okCount+" paused")
	case StateNotifying:
		note(FaultOpError, "did not answer the fault notice")
		var sup map[Strategy]bool
		for _, res := range results {
			if res.err != nil {
				continue
			}
			mine := make(map[Strategy]bool)
			for _, s := range res.reply.Strategies {
				mine[s] = true
			}
			if sup == nil {
				sup = mine
				continue
			}
			maps.DeleteFunc(sup, func(s Strategy, _ bool) bool { return !mine[s] })
		}
		r.supported = sup
		m.afterNotify(now, okCount+" answered")
	case StateRetrying:
		note(FaultOpError, "step retry failed")
		switch {
		case r.pending:
			m.newRound(now, "faults arrived during the step retry")
		case len(failed) > 0:
			r.failed[StrategyRetry] = true
			m.enter(now, StateDeciding, okCount+" retried the step")
		default:
			for rank := range r.faults {
				delete(r.faults, rank) // cleared by the retry
			}
			// Ranks continue where they paused, or from the step an
			// earlier round of this recovery readied.
			m.enter(now, StateResuming, okCount+" ran the step again")
		}
	case StateResuming:
		note(FaultOpError, "did not resume")
		if len(failed) > 0 {
			m.newRound(now, okCount+" resumed")
			return
		}
		r.o.Resumed = now.Sub(r.origin)
		r.o.ResumedStep = r.resumeStep
		m.enter(now, StateRecovered, okCount+" resumed")
	case StateExiting:
		m.enter(now, StateExited, okCount+" stopped")
	case StatePausing:
		note(FaultOpError, "did not pause")
		r.o.Stopped = now.Sub(r.origin)
		switch {
		case len(r.handover) > 0:
			m.handOver(now, okCount+" paused")
		case r.o.Kind == KindStressTest:
			m.enter(now, StateTesting, okCount+" paused")
		default:
			m.enter(now, StateSwitching, okCount+" paused")
		}
	case StateSwitching, StateTesting:
		kind, what := FaultLink, "link switch failed"
		if r.o.State == StateTesting {
			kind, what = FaultStressTest, "stress test "+r.o.Stress.Test+" failed"
		}
		note(kind, what)
		if len(r.handover) > 0 {
			m.handOver(now, okCount+" succeeded")
			return
		}
		m.enter(now, StateContinuing, okCount+" succeeded")
	case StateContinuing:
		note(FaultOpError, "did not continue")
		if len(r.handover) > 0 {
			m.handOver(now, okCount+" continued")
			return
		}
		r.o.Resumed = now.Sub(r.origin)
		done := StateSwitched
		if r.o.Kind == KindStressTest {
			done = StatePassed
		}
		m.enter(now, done, okCount+" continued")
	}
}

// retryable reports whether step retry may clear the faults in progress:
// every faulty rank is alive, each of its faults is of a retryable kind,
// and every rank supports retry.
func (m *machine) retryable() bool {
	r := m.run
	if !m.cfg.strategies[StrategyRetry] || r.failed[StrategyRetry] || !r.supports(StrategyRetry) || len(r.faults) == 0 {
		return false
	}
	for _, fs := range r.faults {
		for _, f := range fs {
			if !m.cfg.retryable[f.Kind] {
				return false
			}
		}
	}
	return true
}

func (m *machine) afterNotify(now time.Time, why string) {
	if len(m.run.faults) == 0 {
		// A link switch that timed out hands over no faulty rank: there
		// is nothing to repair. Ranks resume from the step the last round
		// readied, if any.
		m.enter(now, StateResuming, why+"; no faulty rank left")
		return
	}
	if m.retryable() {
		m.enter(now, StateRetrying, why+"; the faults are transient")
		return
	}
	m.enter(now, StateDeciding, why)
}

// decided takes in the policy's answer.
func (m *machine) decided(now time.Time, id uint64, l level, why string) {
	r := m.run
	if r == nil || id == 0 || id != r.action || r.o.State != StateDeciding {
		return
	}
	m.dirty = true
	r.level = l
	m.pickRepair(now, "policy: "+why)
}

func (m *machine) can(s Strategy) bool {
	r := m.run
	return m.cfg.strategies[s] && m.cfg.canRepair && r.supports(s) && !r.failed[s]
}

// pickRepair takes the cheapest repair that the policy's level, the
// configuration and every rank allow, else dump or exit.
func (m *machine) pickRepair(now time.Time, why string) {
	r := m.run
	switch {
	case r.level <= levelInPlace && m.can(StrategyRecoverInPlace):
		m.enter(now, StateRestarting, why)
	case r.level <= levelReplace && m.can(StrategyRecover):
		m.enter(now, StateReplacing, why)
	default:
		m.giveUp(now, why+"; no repair applies")
	}
}

// giveUp ends a recovery that cannot repair: dump if it can, then exit.
func (m *machine) giveUp(now time.Time, why string) {
	r := m.run
	if m.cfg.strategies[StrategyDump] && m.cfg.canCheckpoint && !r.failed[StrategyDump] {
		m.enter(now, StateDumping, why)
		return
	}
	m.enter(now, StateExiting, why)
}

// newRound starts the recovery over from stopping, or gives up after
// MaxRounds.
func (m *machine) newRound(now time.Time, why string) {
	r := m.run
	if r.o.Round >= m.cfg.maxRounds {
		m.giveUp(now, fmt.Sprintf("%s; %d rounds spent", why, r.o.Round))
		return
	}
	r.o.Round++
	r.pending, r.supported, r.level = false, nil, 0
	m.enter(now, StateStopping, why)
}

// repaired takes in the executor's outcome: the ranks it restarted, or
// why it failed.
func (m *machine) repaired(now time.Time, id uint64, ranks []int, err error) {
	r := m.run
	if r == nil || id == 0 || id != r.action || (r.o.State != StateRestarting && r.o.State != StateReplacing) {
		return
	}
	m.dirty = true
	if err != nil {
		m.repairFailed(now, fmt.Sprintf("%s failed: %v", r.o.Strategy, err))
		return
	}
	r.repairDone = true
	// With the ranks it restarted, those a repair taken over was waiting
	// for from the dead manager's call (evicted, and not made again).
	r.awaited = sortedUnique(append(slices.Collect(maps.Keys(r.evictedInst)), ranks...))
	for _, rank := range r.awaited {
		m.restartedAt[rank] = r.repairStart
		delete(r.faults, rank)
		if !slices.Contains(r.restarted, rank) {
			r.restarted = append(r.restarted, rank)
		}
	}
	slices.Sort(r.restarted)
	m.checkRepaired(now)
}

func (m *machine) repairFailed(now time.Time, why string) {
	r := m.run
	m.unregistered(now)
	r.failed[r.o.Strategy] = true
	if r.pending {
		m.newRound(now, why)
		return
	}
	m.pickRepair(now, why)
}

// unregistered takes the ranks the repair in progress restarted that have
// not registered again back among the faulty ones, as lost: the repair
// that follows must cover them, or the job would resume without them.
func (m *machine) unregistered(now time.Time) {
	r := m.run
	if !r.repairDone {
		return // the faults of the ranks it was to restart are still held
	}
	for _, rank := range r.awaited {
		if r.registered[rank] {
			continue
		}
		if _, faulty := r.faults[rank]; faulty {
			continue
		}
		node := -1
		if f, ok := r.repairing[rank]; ok {
			node = f.Position.Node
		}
		r.addFault(Fault{
			ID:           fmt.Sprintf("orchestration/%d/%d/%d", r.o.ID, r.action, rank),
			Kind:         FaultLost,
			Position:     Position{Node: node, Rank: rank},
			Message:      fmt.Sprintf("%s restarted it %v ago; it has not registered since", r.o.Strategy, now.Sub(r.repairStart).Round(time.Millisecond)),
			Time:         now,
			Received:     now,
			Reporter:     Position{Node: -1, Rank: -1},
			ReporterRole: RoleManager,
		})
	}
}

// checkRepaired moves on once the executor is done and every process it
// restarted has registered again.
func (m *machine) checkRepaired(now time.Time) {
	r := m.run
	if !r.repairDone {
		return
	}
	for _, rank := range r.awaited {
		if !r.registered[rank] {
			return
		}
	}
	why := fmt.Sprintf("ranks %v restarted and registered", r.awaited)
	switch {
	case r.pending || len(r.faults) > 0:
		m.newRound(now, why+"; faults remain")
	case m.cfg.canCheckpoint:
		m.enter(now, StateLoading, why)
	default:
		m.enter(now, StateResuming, why)
	}
}

// loaded takes in the checkpoint step readied for the resume.
func (m *machine) loaded(now time.Time, id uint64, step int64, err error) {
	r := m.run
	if r == nil || id == 0 || id != r.action || r.o.State != StateLoading {
		return
	}
	m.dirty = true
	if err != nil {
		r.resumeStep = -1
		m.enter(now, StateResuming, fmt.Sprintf("no checkpoint readied (%v); ranks continue from their own state", err))
		return
	}
	r.resumeStep = step
	m.enter(now, StateResuming, fmt.Sprintf("checkpoint step %d readied", step))
}

// persisted takes in the outcome of the dump.
func (m *machine) persisted(now time.Time, id uint64, step int64, err error) {
	r := m.run
	if r == nil || id == 0 || id != r.action || r.o.State != StateDumping {
		return
	}
	m.dirty = true
	// The exit says why the recovery gave up, not only what the dump did.
	why := r.o.reasonFor(StateDumping)
	if err != nil {
		r.failed[StrategyDump] = true
		m.enter(now, StateExiting, fmt.Sprintf("%s; dump failed: %v", why, err))
		return
	}
	m.enter(now, StateExiting, fmt.Sprintf("%s; checkpoint step %d persisted", why, step))
}

// handOver ends a link switch or stress test as failed and starts a
// recovery with the faults it met.
func (m *machine) handOver(now time.Time, why string) {
	r := m.run
	faults := r.handover
	var ranks []string
	for _, f := range faults {
		ranks = append(ranks, fmt.Sprint(f.Position.Rank))
	}
	if len(ranks) > 0 {
		why += "; faults on ranks " + strings.Join(ranks, ",")
	}
	r.o.HandedOverTo = m.nextRun + 1
	m.enter(now, StateFailed, why+"; handed over to recovery")
	m.startRecovery(now, faults, r.o.ID, fmt.Sprintf("taking over from %s #%d: %s", r.o.Kind, r.o.ID, why))
}

// tick moves the orchestration in progress on when its state timed out.
func (m *machine) tick(now time.Time) {
	r := m.run
	if r == nil || r.settling || r.deadline.IsZero() || now.Before(r.deadline) {
		return
	}
	m.dirty = true
	why := fmt.Sprintf("%s timed out", r.o.State)
	switch r.o.State {
	case StateStopping:
		r.o.Stopped = now.Sub(r.origin)
		m.enter(now, StateNotifying, why)
	case StateNotifying:
		r.supported = nil
		m.afterNotify(now, why)
	case StateDeciding:
		m.giveUp(now, why)
	case StateRetrying:
		r.failed[StrategyRetry] = true
		if r.pending {
			m.newRound(now, why)
			return
		}
		m.enter(now, StateDeciding, why)
	case StateRestarting, StateReplacing:
		m.repairFailed(now, why)
	case StateLoading:
		r.resumeStep = -1
		m.enter(now, StateResuming, why+"; ranks continue from their own state")
	case StateResuming:
		m.newRound(now, why)
	case StateDumping:
		r.failed[StrategyDump] = true
		m.enter(now, StateExiting, r.o.reasonFor(StateDumping)+"; "+why)
	case StateExiting:
		m.enter(now, StateExited, why)
	case StatePausing, StateSwitching, StateTesting, StateContinuing:
		m.handOver(now, why)
	}
}
