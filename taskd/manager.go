package taskd

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	oteltrace "go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/faultline-ml/faultline/internal/atomicfile"
	"github.com/faultline-ml/faultline/internal/promreg"
	pb "github.com/faultline-ml/faultline/internal/taskdpb"
	"github.com/faultline-ml/faultline/taskd/lease"
	"github.com/faultline-ml/faultline/trace"
)

// Manager is the job's root: it takes registrations and heartbeats,
// declares silent members lost, keeps the fault log, fans the profiling
// switch out to every worker and routes messages down the tree. One per job.
type Manager struct {
	cfg      ManagerConfig
	log      *slog.Logger
	tracer   oteltrace.Tracer
	met      *managerMetrics
	metrics  *promreg.Registrar // what met and the orchestrator registered
	handlers []Handler
	orch     *orchestrator // nil when orchestration is off
	lis      net.Listener
	srv      *grpc.Server
	instance string
	nextID   atomic.Uint64
	events   *eventQueue
	kick     chan struct{} // wakes the housekeeping loop
	recheck  chan struct{} // a member has seen a newer term: check the lease
	faults   *faultStore   // has a lock of its own
	ids      *identities   // secrets of the members attached directly; a lock of its own

	mu          sync.Mutex
	reg         *registry
	downlinks   map[memberKey]*downlink
	sw          *switchTracker
	fanSpan     oteltrace.Span
	swSubs      map[chan trace.Switch]struct{}
	evicted     *idSet // instances evicted by recovery: refused from then on
	recentMsgs  *idSet
	deliveries  map[uint64]*delivery
	collections map[uint64]*collection
	collectMu   sync.Mutex      // serialises Collect calls
	uploading   map[string]bool // collected paths being written, one upload each
	uploadIdle  time.Duration   // uploadIdleTimeout, shorter in tests
	proxyHosts  map[int]string
	gone        *departures // workers lost, evicted or left
	members     *membership // the job's ranks, when orchestration is on and the shape unset; else nil
	completedAt time.Time   // when every rank left finished; zero until then

	lifecycle
}

// NewManager validates cfg, loads the state in cfg.StateDir and listens on
// cfg.Listen. Serve it with Run; release it with Close.
func NewManager(cfg ManagerConfig) (*Manager, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	metrics := promreg.New(cfg.Registerer, "taskd: ManagerConfig.Registerer")
	m := &Manager{
		cfg:         cfg,
		log:         discardIfNil(cfg.Logger).With("component", "taskd-manager", "job", cfg.Job),
		met:         newManagerMetrics(metrics),
		metrics:     metrics,
		handlers:    sortHandlers(cfg.Handlers),
		instance:    newInstanceID(),
		kick:        make(chan struct{}, 1),
		recheck:     make(chan struct{}, 1),
		reg:         newRegistry(cfg.HeartbeatDeadline),
		downlinks:   make(map[memberKey]*downlink),
		sw:          newSwitchTracker(cfg.AckTimeout, 30*time.Second),
		swSubs:      make(map[chan trace.Switch]struct{}),
		evicted:     newIDSet(4096),
		recentMsgs:  newIDSet(4096),
		deliveries:  make(map[uint64]*delivery),
		collections: make(map[uint64]*collection),
		uploading:   make(map[string]bool),
		uploadIdle:  uploadIdleTimeout,
		proxyHosts:  make(map[int]string),
		ids:         newIdentities(),
		gone:        newDepartures(cfg.Nodes * cfg.ProcsPerNode),
	}
	m.init()
	tp := cfg.TracerProvider
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	m.tracer = tp.Tracer("github.com/faultline-ml/faultline/taskd")
	// Message ids start at random: those of a manager that took over
	// differ from its predecessor's, whose acknowledgements and whose
	// ids that workers remember are still about.
	m.nextID.Store(randomUint64() >> 1)
	m.faults = newFaultStore(cfg.MaxFaults, m.log)
	m.events = newEventQueue(1<<16, m.met.eventsDropped.Inc)
	if cfg.Orchestration != nil {
		orch, err := newOrchestrator(m, *cfg.Orchestration)
		if err != nil {
			metrics.UnregisterAll()
			return nil, err
		}
		m.orch = orch
		m.handlers = sortHandlers(append(slices.Clone(cfg.Handlers), orch.handler()))
		if cfg.Nodes == 0 || cfg.ProcsPerNode == 0 {
			m.members = newMembership(2 * cfg.HeartbeatDeadline)
		}
	}
	if err := metrics.Err(); err != nil {
		m.release()
		return nil, err
	}
	if cfg.Nodes > 0 && cfg.ProcsPerNode > 0 {
		for r := range cfg.Nodes * cfg.ProcsPerNode {
			m.sw.expect(r, r/cfg.ProcsPerNode)
		}
	}
	if err := m.loadState(); err != nil {
		m.release()
		return nil, err
	}
	lis, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		m.closeState()
		m.release()
		return nil, fmt.Errorf("taskd: manager listen on %s: %w", cfg.Listen, err)
	}
	g := newGuard(guardConfig{
		tokens: map[string]credential{cfg.Security.Token: credMember, cfg.ProxyToken: credProxy, cfg.AdminToken: credAdmin},
		open:   cfg.Security.Token == "", maxConns: cfg.MaxConnections, maxPerPeer: cfg.MaxConnectionsPerPeer, maxMsg: cfg.MaxMessageBytes,
		ids: m.ids, policy: m.policy, met: m.met.guard, log: m.log,
	})
	m.log.Info("taskd: roles open", cfg.roles()...)
	if cfg.AdminToken == "" && cfg.Security.Token == "" {
		m.log.Warn("taskd: the Admin and TrainingDataTrace services take whoever the transport admits: set AdminToken")
	}
	m.lis = g.listen(lis)
	m.srv = newServer(cfg.Security, limits{maxMsg: cfg.MaxMessageBytes, rate: cfg.RateLimit, burst: cfg.RateBurst, limited: m.met.rateLimited.Inc}, g, m.log)
	pb.RegisterControlServer(m.srv, &managerControl{m: m})
	pb.RegisterTrainingDataTraceServer(m.srv, &managerTraceAPI{m: m})
	pb.RegisterAdminServer(m.srv, &managerAdmin{m: m})
	return m, nil
}

// policy says which token each service takes: the operators' services
// the operators' token alone, and that token nothing else.
func (m *Manager) policy(method string, cred credential) error {
	svc, _, _ := strings.Cut(strings.TrimPrefix(method, "/"), "/")
	operator := svc == pb.Admin_ServiceDesc.ServiceName || svc == pb.TrainingDataTrace_ServiceDesc.ServiceName
	switch {
	case operator && (cred == credAdmin || (cred == credOpen && m.cfg.AdminToken == "")):
		return nil
	case operator && m.cfg.AdminToken == "":
		return permission("%s takes the operators' token, ManagerConfig.AdminToken, which this manager was not given", svc)
	case operator:
		return permission("%s takes the operators' token", svc)
	case cred == credAdmin:
		return permission("the operators' token does not serve %s", svc)
	}
	return nil
}

// token returns the fencing token of the manager's term, 0 without one.
func (m *Manager) token() uint64 {
	if m.cfg.Term == nil {
		return 0
	}
	return m.cfg.Term.Token()
}

// newerSeen refuses a member that has seen a newer lease term than the
// manager's (token, its newest): the manager was deposed, not knowing it
// yet. The term is checked with the lease's store, which ends it if so,
// and the manager with it; the member goes to another manager meanwhile.
func (m *Manager) newerSeen(token uint64) error {
	own := m.token()
	if m.cfg.Term == nil || token <= own {
		return nil
	}
	m.met.deposed.Inc()
	select {
	case m.recheck <- struct{}{}:
	default:
	}
	return status.Errorf(codes.Unavailable, "taskd: this manager's lease term (token %d) is older than one the member has seen (token %d): it was deposed", own, token)
}

// recheckTerm checks term with the lease's store each time a member has
// seen a newer one, until ctx ends.
func (m *Manager) recheckTerm(ctx context.Context, term lease.Term) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-m.recheck:
		}
		err := term.Check(ctx)
		switch {
		case errors.Is(err, lease.ErrLost):
			m.log.Warn("taskd: a member has seen a newer lease term; this manager's has ended", "token", term.Token(), "err", err)
		case err != nil:
			m.log.Warn("taskd: a member has seen a newer lease term, and the lease could not be asked", "token", term.Token(), "err", err)
		default:
			m.log.Warn("taskd: a member has seen a newer lease term, but the lease says this manager's is the newest", "token", term.Token())
		}
	}
}

// Addr returns the address the manager listens on.
func (m *Manager) Addr() net.Addr { return m.lis.Addr() }

// Job returns the job the manager serves.
func (m *Manager) Job() string { return m.cfg.Job }

// Run serves until ctx ends or Close is called. It returns nil then, or the
// first error that stopped it. Run may be called once.
func (m *Manager) Run(ctx context.Context) error {
	if err := m.begin("Manager"); err != nil {
		return err
	}
	defer m.end()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if t := m.cfg.Term; t != nil {
		// A deposed manager stops at once: its listener and every
		// connection close, and its orchestration's actions end.
		stop := context.AfterFunc(t.Context(), cancel)
		defer stop()
	}
	g, ctx := errgroup.WithContext(ctx)
	m.serveGRPC(ctx, g, cancel, m.srv, m.lis, "manager")
	g.Go(func() error { return m.housekeep(ctx) })
	if t := m.cfg.Term; t != nil {
		g.Go(func() error { m.recheckTerm(ctx, t); return nil })
	}
	g.Go(func() error { m.faults.run(ctx); return nil })
	g.Go(func() error { return m.runHandlers(ctx) })
	if m.orch != nil {
		g.Go(func() error { return m.orch.run(ctx) })
	}
	if src := m.cfg.SwitchSource; src != nil {
		g.Go(func() error {
			err := src.Watch(ctx, func(sw trace.Switch) {
				if _, err := m.SetSwitch(sw); err != nil {
					m.log.Error("taskd: switch from source not applied", "err", err)
				}
			})
			if err != nil && ctx.Err() == nil {
				return fmt.Errorf("taskd: switch source: %w", err)
			}
			return nil
		})
	}
	err := g.Wait()
	m.mu.Lock()
	if m.fanSpan != nil {
		m.fanSpan.End()
		m.fanSpan = nil
	}
	m.mu.Unlock()
	if t := m.cfg.Term; t != nil && err == nil && t.Context().Err() != nil {
		err = fmt.Errorf("taskd: manager of job %q: %w", m.cfg.Job, context.Cause(t.Context()))
	}
	return err
}

// Close stops the manager, waits for Run to return and unregisters the
// manager's metrics, so that another manager may register them on the
// same Registerer. Call it also after Run returned on its own. It is
// idempotent.
func (m *Manager) Close() error {
	m.close(func() {
		m.lis.Close()
		m.closeState()
	}, m.release)
	return nil
}

// release unregisters the manager's metrics and closes the orchestration
// policy that the manager built.
func (m *Manager) release() {
	if m.orch != nil {
		m.orch.closePolicy()
	}
	m.metrics.UnregisterAll()
}

// housekeep declares silent members lost and (re-)sends the switch to
// workers that lack it.
func (m *Manager) housekeep(ctx context.Context) error {
	tick := time.NewTicker(max(m.cfg.HeartbeatInterval/4, 5*time.Millisecond))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		case <-m.kick:
		}
		m.step(time.Now())
	}
}

// step is one round of housekeeping at now.
func (m *Manager) step(now time.Time) {
	m.mu.Lock()
	var evs []Event
	var lostFaults []Fault
	m.completeMembersLocked(now)
	for _, lm := range m.reg.expire(now) {
		m.ids.revoke(lm.key, lm.instance)
		if dl := m.downlinks[lm.key]; dl != nil && dl.instance == lm.instance {
			dl.detach()
			delete(m.downlinks, lm.key)
		}
		if lm.key.role == RoleWorker {
			m.sw.gone(lm.key.id)
			if m.spare(lm.pos) {
				// No fault, but its handlers learn that it is gone: the
				// job's nodes may hold on to it (their replicas' target).
				m.log.Warn("taskd: spare lost: no fault", "member", lm.key.String(), "last_seen", lm.lastSeen)
				evs = append(evs, Event{Kind: EventLeft, Time: now, Role: lm.key.role, Position: lm.pos,
					Departure: Departure{Position: lm.pos, Time: lm.lastSeen}})
				continue
			}
			if m.members != nil && !m.members.of(lm.pos.Rank) {
				// Past a gap in the first rendezvous: maybe no rank of
				// the job, whose loss must not stop the others.
				m.log.Warn("taskd: member lost, not of the job: no fault", "member", lm.key.String(), "last_seen", lm.lastSeen)
				continue
			}
			m.departedLocked(lm.pos, lm.lastSeen)
		}
		m.met.lost.WithLabelValues(lm.key.role.String()).Inc()
		m.log.Warn("taskd: member lost: no heartbeat within the deadline", "member", lm.key.String(), "last_seen", lm.lastSeen, "deadline", m.cfg.HeartbeatDeadline)
		f := Fault{
			ID:           fmt.Sprintf("lost/%s/%d", lm.instance, lm.since.UnixNano()),
			Kind:         FaultLost,
			Position:     lm.pos,
			Message:      fmt.Sprintf("%s not heard from since %s (deadline %v)", lm.key, lm.lastSeen.Format(time.RFC3339Nano), m.cfg.HeartbeatDeadline),
			Time:         lm.lastSeen, // heartbeats stopped then
			ReporterRole: RoleManager,
			Reporter:     Position{Node: -1, Rank: -1},
		}
		if stored, fresh := m.faults.add(f, now); fresh {
			lostFaults = append(lostFaults, stored)
		}
	}
	for _, f := range lostFaults {
		m.met.faults.WithLabelValues(kindLabel(f.Kind)).Inc()
		evs = append(evs, Event{Kind: EventFault, Time: now, Fault: f, Position: f.Position, Role: RoleManager})
	}
	m.updateMemberGaugesLocked()
	if due := m.sw.due(now); len(due) > 0 {
		id := m.nextID.Add(1)
		env := &pb.Envelope{Id: id, Body: &pb.Envelope_Switch{Switch: &pb.SwitchUpdate{Version: m.sw.version, Document: m.sw.doc}}}
		unrouted := m.routeLocked(env, due)
		m.sw.unsent(unrouted)
		m.sw.sent(id, now)
		if n := len(due) - len(unrouted); n > 0 {
			m.met.messages.WithLabelValues("down", "switch").Add(float64(n))
			if !m.sw.changedAt.Equal(now) && now.Sub(m.sw.changedAt) >= m.cfg.AckTimeout {
				m.met.resends.Add(float64(n))
			}
		}
	}
	m.checkFanoutLocked(now)
	m.mu.Unlock()
	m.events.push(evs...)
}

// completeMembersLocked completes the first rendezvous at now, when it
// is, and drops the workers that joined it past a gap: they are not of the
// job, and their silence from now on is nothing to it.
func (m *Manager) completeMembersLocked(now time.Time) {
	if m.members == nil {
		return
	}
	for _, rank := range m.members.complete(now) {
		key := workerKey(rank)
		lm := m.reg.get(key)
		if lm == nil {
			continue
		}
		m.reg.remove(key, lm.instance)
		m.ids.revoke(key, lm.instance)
		if dl := m.downlinks[key]; dl != nil {
			dl.detach()
			delete(m.downlinks, key)
		}
		m.sw.gone(rank)
		m.log.Warn("taskd: member dropped: it joined the first rendezvous past a gap, and is not of the job", "member", key.String(), "addr", lm.addr, "world", m.members.world)
	}
	m.updateMemberGaugesLocked()
}

func (m *Manager) checkFanoutLocked(now time.Time) {
	if m.fanSpan == nil || !m.sw.complete(now) {
		return
	}
	m.met.fanout.Observe(now.Sub(m.sw.changedAt).Seconds())
	m.fanSpan.SetAttributes(attribute.Int("taskd.workers", m.reg.count(RoleWorker)))
	m.fanSpan.End()
	m.fanSpan = nil
}

func (m *Manager) wake() {
	select {
	case m.kick <- struct{}{}:
	default:
	}
}

func (m *Manager) updateMemberGaugesLocked() {
	m.met.members.WithLabelValues("worker").Set(float64(m.reg.count(RoleWorker)))
	m.met.members.WithLabelValues("proxy").Set(float64(m.reg.count(RoleProxy)))
}

// downlink is the send queue of a registered member. It exists from
// registration, so that what is sent before the member's stream opens
// waits for it; each stream that opens takes it over.
type downlink struct {
	instance string
	ch       chan *pb.Envelope
	stop     chan struct{} // closed to end the stream attached now
}

// newDownlink returns a member's send queue: size messages deep, so that a
// proxy's holds its node's share of a fan-out, while the many workers
// attached directly cost little each. What a full queue drops is sent
// again.
func newDownlink(instance string, size int) *downlink {
	return &downlink{instance: instance, ch: make(chan *pb.Envelope, size)}
}

// Depths of the send queues.
const (
	proxyQueue  = 4096
	workerQueue = 64
)

// attach ends the stream attached before, if any, and returns the channel
// that ends the new one. The owner's lock is held.
func (d *downlink) attach() <-chan struct{} {
	d.detach()
	d.stop = make(chan struct{})
	return d.stop
}

// detach ends the stream attached now, if any. The owner's lock is held.
func (d *downlink) detach() {
	if d.stop != nil {
		close(d.stop)
		d.stop = nil
	}
}

// serveDownlink sends what dl queues on stream until the stream ends or
// another takes over.
func serveDownlink(ctx context.Context, stop <-chan struct{}, dl *downlink, send func(*pb.Envelope) error) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-stop:
			return status.Error(codes.Aborted, "taskd: stream replaced or member dropped")
		case env := <-dl.ch:
			if err := send(env); err != nil {
				return err
			}
		}
	}
}

// routeLocked queues env for each of ranks, through the rank's proxy or its
// own stream, and returns the ranks it has no route to. A full queue drops
// the message: the sender's retry covers it.
func (m *Manager) routeLocked(env *pb.Envelope, ranks []int) (unrouted []int) {
	byProxy := make(map[int][]int32)
	var direct *pb.Envelope
	for _, r := range ranks {
		wm := m.reg.get(workerKey(r))
		if wm == nil {
			unrouted = append(unrouted, r)
			continue
		}
		if wm.via >= 0 {
			byProxy[wm.via] = append(byProxy[wm.via], int32(r))
			continue
		}
		dl := m.downlinks[wm.key]
		if dl == nil || dl.instance != wm.instance {
			unrouted = append(unrouted, r)
			continue
		}
		if direct == nil {
			direct = &pb.Envelope{Id: env.Id, Body: env.Body, Fence: m.token()}
		}
		m.push(dl, direct)
	}
	for node, rs := range byProxy {
		pm := m.reg.get(proxyKey(node))
		dl := m.downlinks[proxyKey(node)]
		if pm == nil || dl == nil || dl.instance != pm.instance {
			for _, r := range rs {
				unrouted = append(unrouted, int(r))
			}
			continue
		}
		m.push(dl, &pb.Envelope{Id: env.Id, Ranks: rs, Body: env.Body, Fence: m.token()})
	}
	return unrouted
}

func (m *Manager) push(dl *downlink, env *pb.Envelope) {
	select {
	case dl.ch <- env:
	default:
		m.met.dropped.Inc()
	}
}

// SetSwitch makes sw the job's profiling switch and fans it out to every
// worker. It returns the switch's version. With a StateDir, the switch is
// saved first; if that fails the switch in force stays and the error is
// returned.
func (m *Manager) SetSwitch(sw trace.Switch) (uint64, error) {
	now := time.Now()
	m.mu.Lock()
	if m.sw.version > 0 && m.sw.sw == sw {
		v := m.sw.version
		m.mu.Unlock()
		return v, nil
	}
	if m.cfg.StateDir != "" {
		if err := atomicfile.WriteFile(filepath.Join(m.cfg.StateDir, "switch.json"), []byte(sw.String()+"\n"), 0o644); err != nil {
			m.mu.Unlock()
			return 0, fmt.Errorf("taskd: save switch: %w", err)
		}
	}
	m.sw.set(sw, now)
	if m.fanSpan != nil {
		m.fanSpan.SetAttributes(attribute.Bool("taskd.superseded", true))
		m.fanSpan.End()
	}
	_, m.fanSpan = m.tracer.Start(context.Background(), "taskd.switch.fanout", oteltrace.WithTimestamp(now),
		oteltrace.WithAttributes(attribute.String("taskd.job", m.cfg.Job), attribute.Int64("taskd.switch.version", int64(m.sw.version)), attribute.String("taskd.switch", sw.String())))
	for ch := range m.swSubs {
		select {
		case <-ch:
		default:
		}
		ch <- sw
	}
	v := m.sw.version
	m.mu.Unlock()
	m.log.Info("taskd: profiling switch set", "switch", sw.String(), "version", v)
	m.events.push(Event{Kind: EventSwitch, Time: now, Switch: sw})
	m.step(now)
	return v, nil
}

// SetSwitchDocument parses a profilingSwitch document as trace.ParseSwitch
// does and sets it. A bad document leaves the switch in force.
func (m *Manager) SetSwitchDocument(doc []byte) (uint64, error) {
	sw, err := trace.ParseSwitch(doc)
	if err != nil {
		return 0, err
	}
	return m.SetSwitch(sw)
}

// SwitchStatus returns the job's switch and each worker's state of it.
func (m *Manager) SwitchStatus() SwitchStatus {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.sw.status()
}

// subscribeSwitch returns a channel that holds the newest switch after each
// change, and a func to stop.
func (m *Manager) subscribeSwitch() (<-chan trace.Switch, func()) {
	ch := make(chan trace.Switch, 1)
	m.mu.Lock()
	m.swSubs[ch] = struct{}{}
	m.mu.Unlock()
	return ch, func() {
		m.mu.Lock()
		delete(m.swSubs, ch)
		m.mu.Unlock()
	}
}

func (m *Manager) liveWorkers() []int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.resolveLocked(AllWorkers())
}

// spare reports whether pos is on one of the job's spare nodes
// (ManagerConfig.SpareNodes).
func (m *Manager) spare(pos Position) bool {
	return m.cfg.SpareNodes > 0 && pos.Node >= m.cfg.Nodes
}

// jobWorkersLocked counts the live workers of the job, spares left out.
func (m *Manager) jobWorkersLocked() int {
	n := m.reg.count(RoleWorker)
	if m.cfg.SpareNodes > 0 {
		for _, mm := range m.reg.list() {
			if mm.key.role == RoleWorker && m.spare(mm.pos) {
				n--
			}
		}
	}
	return n
}

// isLive reports whether instance is the live worker of rank.
func (m *Manager) isLive(rank int, instance string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	wm := m.reg.get(workerKey(rank))
	return wm != nil && wm.instance == instance
}

// liveInstances returns the instance of each live worker, by rank.
func (m *Manager) liveInstances() map[int]string {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make(map[int]string)
	for _, mm := range m.reg.list() {
		if mm.key.role == RoleWorker && !m.spare(mm.pos) {
			out[mm.key.id] = mm.instance
		}
	}
	return out
}

// evict drops the live instances of ranks, whose processes recovery is
// about to restart or replace, so that their successors may register at
// once, and refuses those instances from now on. It returns the instance
// it evicted of each rank, "" for a rank it found none of.
func (m *Manager) evict(ranks []int, why string) map[int]string {
	m.mu.Lock()
	defer m.mu.Unlock()
	evicted := make(map[int]string, len(ranks))
	for _, r := range ranks {
		wm := m.reg.get(workerKey(r))
		evicted[r] = ""
		if wm == nil {
			continue
		}
		evicted[r] = wm.instance
		m.evicted.add(wm.instance)
		m.reg.remove(wm.key, wm.instance)
		m.ids.revoke(wm.key, wm.instance)
		m.sw.gone(r)
		m.departedLocked(wm.pos, time.Now())
		if dl := m.downlinks[wm.key]; dl != nil && dl.instance == wm.instance {
			dl.detach()
			delete(m.downlinks, wm.key)
		}
		m.log.Info("taskd: member evicted", "member", wm.key.String(), "instance", wm.instance, "why", why)
	}
	m.updateMemberGaugesLocked()
	return evicted
}

// MemberInfo describes a live member.
type MemberInfo struct {
	Role     Role
	Position Position
	Instance string
	// Via is the node of the proxy the member is reached through, -1 when
	// it is attached to the manager directly.
	Via      int
	Hostname string
	PID      int
	Since    time.Time
	LastSeen time.Time
}

// Members returns the live members, proxies first, each in rank order.
func (m *Manager) Members() []MemberInfo {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []MemberInfo
	for _, mm := range m.reg.list() {
		out = append(out, MemberInfo{Role: mm.key.role, Position: mm.pos, Instance: mm.instance, Via: mm.via, Hostname: mm.hostname, PID: mm.pid, Since: mm.since, LastSeen: mm.lastSeen})
	}
	return out
}

// loadState reads the fault log, switch and orchestration state kept in
// StateDir. The orchestration state is read first: one that this manager
// cannot take over stops it before it changes anything there.
func (m *Manager) loadState() error {
	dir := m.cfg.StateDir
	if dir == "" {
		return nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("taskd: state dir: %w", err)
	}
	// Read whether orchestration is on or not: another job's state is
	// refused either way. The job's mark then says whose the folder is
	// even where no orchestration state was ever written (the fault log
	// and the switch carry no job of their own); writeStateFile refuses
	// another job's mark without writing.
	orch, err := readOrchestration(dir, m.cfg.Job, m.token())
	if err != nil {
		return err
	}
	if err := writeStateFile(filepath.Join(dir, jobMarkFile), m.cfg.Job, m.token(), []byte("{}")); err != nil {
		return err
	}
	swFile := filepath.Join(dir, "switch.json")
	if data, err := os.ReadFile(swFile); err == nil {
		sw, err := trace.ParseSwitch(data)
		if err != nil {
			return fmt.Errorf("taskd: state file %s: %w", swFile, err)
		}
		m.sw.set(sw, time.Now())
	} else if !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("taskd: state file: %w", err)
	}
	if err := m.faults.load(dir); err != nil {
		return err
	}
	if m.orch != nil {
		m.orch.take(orch, m.faults)
	}
	return nil
}

// closeState closes the state file of a manager that never ran.
func (m *Manager) closeState() { m.faults.closeFile() }

func randomUint64() uint64 {
	var b [8]byte
	rand.Read(b[:])
	return binary.LittleEndian.Uint64(b[:])
}

// newInstanceID returns a random identifier for one process start.
func newInstanceID() string {
	var b [16]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// idSet remembers the last n ids seen.
type idSet struct {
	ring []string
	next int
	set  map[string]struct{}
}

func newIDSet(n int) *idSet {
	return &idSet{ring: make([]string, n), set: make(map[string]struct{}, n)}
}

// has reports whether id was seen.
func (s *idSet) has(id string) bool {
	_, ok := s.set[id]
	return ok
}

// add reports false when id was seen already.
func (s *idSet) add(id string) bool {
	if _, ok := s.set[id]; ok {
		return false
	}
	if old := s.ring[s.next]; old != "" {
		delete(s.set, old)
	}
	s.ring[s.next] = id
	s.next = (s.next + 1) % len(s.ring)
	s.set[id] = struct{}{}
	return true
}
