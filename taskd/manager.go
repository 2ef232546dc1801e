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

	"github.com/prometheus/client_golang/prometheus"
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

// SwitchSource feeds the manager profiling switches from outside the
// control plane, such as a mounted ConfigMap file. Watch calls set with the
// source's switch at once and after each change until ctx ends; a document
// that does not parse is the source's to report, and the switch in force
// stays.
type SwitchSource interface {
	Watch(ctx context.Context, set func(trace.Switch)) error
}

// ManagerConfig configures a Manager. The zero value of each field but Job
// means its documented default.
type ManagerConfig struct {
	// Job is the job's identifier (MINDX_TASK_ID); required. Members of
	// another job are refused.
	Job string
	// Listen is the address to serve on; default ":9601".
	Listen string
	// Nodes and ProcsPerNode give the job's shape, so that ranks that never
	// registered show as waiting in the switch status, and positions
	// outside it are refused. Zero: unknown, and nodes and ranks must be
	// below MaxWorkers (default 16384).
	Nodes, ProcsPerNode int
	MaxWorkers          int
	// Security: mutual TLS, token, or plaintext when asked; required.
	Security Security
	// AdminToken is the operators' credential: the Admin and
	// TrainingDataTrace services take a call only with it, and it serves
	// nothing else. Empty: with Security.Token set, those services refuse
	// every call; without any token they take whoever the transport
	// admits (logged at start).
	AdminToken string
	// ProxyToken, when set, is the proxies' credential: only a call with
	// it registers as a proxy, so that a worker's token cannot. Proxies
	// present it as ProxyConfig.UpstreamToken.
	ProxyToken string
	// HeartbeatInterval is how often members send heartbeats (default 1 s);
	// a member not heard from within HeartbeatDeadline (default 5 s) is
	// declared lost and a FaultLost is raised.
	HeartbeatInterval, HeartbeatDeadline time.Duration
	// AckTimeout is how long a downward message waits for its
	// acknowledgement before it is sent again (default 3 s, backing off to
	// 30 s). DeliveryTimeout bounds Broadcast (default 30 s).
	AckTimeout, DeliveryTimeout time.Duration
	// MaxMessageBytes caps every message received or sent (default 4 MiB).
	MaxMessageBytes int
	// RateLimit is calls per second allowed on each connection (default
	// 2000, burst RateBurst default twice that); negative means unlimited.
	RateLimit float64
	RateBurst int
	// MaxConnections bounds the connections open at once (default half
	// the process's open-file limit, at most 16384), and
	// MaxConnectionsPerPeer those from one peer address (default 256);
	// more are closed at once, counted and logged.
	MaxConnections, MaxConnectionsPerPeer int
	// StateDir, when set, keeps the fault log (faults.jsonl), the switch
	// (switch.json) and the orchestration state (orchestration.json and
	// orchestration-history.json) across restarts, so that a manager that
	// restarts, or a standby that takes the lease over on a shared
	// filesystem, finishes the orchestration in progress. Faults are
	// acknowledged to reporters only after they are synced there, and
	// every change of an orchestration is written there before the
	// manager acts on it. A state of another job, of an unknown version
	// or of a newer lease term is refused (*StateFileError) and left as
	// it is.
	StateDir string
	// MaxFaults bounds the fault log; the oldest go first (default 10000).
	MaxFaults int
	// CollectDir receives collected dotting and stack files as
	// <CollectDir>/<job>/node-<n>/...; empty refuses collection.
	// MaxCollectBytes caps the bytes one Collect takes in (default 1 GiB).
	CollectDir      string
	MaxCollectBytes int64
	// SwitchSource, when set, is watched for switch changes.
	SwitchSource SwitchSource
	// Handlers run on every event (see Handler).
	Handlers []Handler
	// Orchestration, when set, turns on process-level recovery from the
	// faults taken in, and link switches and stress tests on request
	// (see OrchestrationConfig); nil: off.
	Orchestration *OrchestrationConfig
	// Term, when set, is the lease term under which this manager leads the
	// job, one of several (see package lease): the manager serves until
	// the term ends, and Run then returns its cause (wrapping
	// lease.ErrLost). Every command it sends carries the term's fencing
	// token, and members refuse the commands of an older term than the
	// newest they have seen; it confirms the term (Term.Check) before each
	// act of an orchestration, and writes its state in StateDir only over
	// a state of no newer term. Nil: this manager leads alone.
	Term lease.Term
	// Observability; nil means off.
	Registerer     prometheus.Registerer
	TracerProvider oteltrace.TracerProvider
	Logger         *slog.Logger
}

func (c *ManagerConfig) setDefaults() {
	c.Listen = orDefault(c.Listen, DefaultManagerAddr)
	c.HeartbeatInterval = orDefault(c.HeartbeatInterval, DefaultHeartbeatInterval)
	c.HeartbeatDeadline = orDefault(c.HeartbeatDeadline, DefaultHeartbeatDeadline)
	c.AckTimeout = orDefault(c.AckTimeout, DefaultAckTimeout)
	c.DeliveryTimeout = orDefault(c.DeliveryTimeout, 30*time.Second)
	c.MaxMessageBytes = orDefault(c.MaxMessageBytes, DefaultMaxMessageBytes)
	c.RateLimit = orDefault(c.RateLimit, DefaultRateLimit)
	c.RateBurst = orDefault(c.RateBurst, int(2*c.RateLimit))
	c.MaxConnections = orDefault(c.MaxConnections, defaultMaxConnections())
	c.MaxConnectionsPerPeer = orDefault(c.MaxConnectionsPerPeer, DefaultMaxConnectionsPerPeer)
	c.MaxFaults = orDefault(c.MaxFaults, 10000)
	c.MaxWorkers = orDefault(c.MaxWorkers, DefaultMaxWorkers)
	c.MaxCollectBytes = orDefault(c.MaxCollectBytes, 1<<30)
}

// negative reports whether any of ds is negative.
func negative(ds ...time.Duration) bool {
	return slices.ContainsFunc(ds, func(d time.Duration) bool { return d < 0 })
}

// negativeDuration returns the error that names the first negative one of
// the fields of config given as name, value pairs.
func negativeDuration(config string, fields ...any) error {
	for i := 0; i+1 < len(fields); i += 2 {
		if d, _ := fields[i+1].(time.Duration); d < 0 {
			return fmt.Errorf("taskd: %s.%s: %v is negative", config, fields[i], d)
		}
	}
	return nil
}

// Validate reports the first field that is wrong.
func (c ManagerConfig) Validate() error {
	switch {
	case c.Job == "":
		return errors.New("taskd: ManagerConfig.Job: empty")
	case strings.ContainsAny(c.Job, "/\\\x00") || c.Job == "." || c.Job == "..":
		return fmt.Errorf("taskd: ManagerConfig.Job: %q is not a single path element", c.Job)
	case c.Nodes < 0:
		return fmt.Errorf("taskd: ManagerConfig.Nodes: %d is negative", c.Nodes)
	case c.ProcsPerNode < 0:
		return fmt.Errorf("taskd: ManagerConfig.ProcsPerNode: %d is negative", c.ProcsPerNode)
	case c.MaxWorkers < 0:
		return fmt.Errorf("taskd: ManagerConfig.MaxWorkers: %d is negative", c.MaxWorkers)
	case negative(c.HeartbeatInterval, c.HeartbeatDeadline, c.AckTimeout, c.DeliveryTimeout):
		return negativeDuration("ManagerConfig", "HeartbeatInterval", c.HeartbeatInterval, "HeartbeatDeadline", c.HeartbeatDeadline,
			"AckTimeout", c.AckTimeout, "DeliveryTimeout", c.DeliveryTimeout)
	case c.HeartbeatDeadline != 0 && c.HeartbeatDeadline <= c.HeartbeatInterval:
		return fmt.Errorf("taskd: ManagerConfig.HeartbeatDeadline: %v is not above HeartbeatInterval %v", c.HeartbeatDeadline, orDefault(c.HeartbeatInterval, DefaultHeartbeatInterval))
	case c.MaxMessageBytes < 0 || (c.MaxMessageBytes > 0 && c.MaxMessageBytes < 64<<10):
		return fmt.Errorf("taskd: ManagerConfig.MaxMessageBytes: %d is below 64 KiB", c.MaxMessageBytes)
	case c.MaxConnections < 0:
		return fmt.Errorf("taskd: ManagerConfig.MaxConnections: %d is negative", c.MaxConnections)
	case c.MaxConnectionsPerPeer < 0:
		return fmt.Errorf("taskd: ManagerConfig.MaxConnectionsPerPeer: %d is negative", c.MaxConnectionsPerPeer)
	case c.MaxFaults < 0:
		return fmt.Errorf("taskd: ManagerConfig.MaxFaults: %d is negative", c.MaxFaults)
	case c.MaxCollectBytes < 0:
		return fmt.Errorf("taskd: ManagerConfig.MaxCollectBytes: %d is negative", c.MaxCollectBytes)
	}
	for i, h := range c.Handlers {
		if h.Name == "" || h.Handle == nil {
			return fmt.Errorf("taskd: ManagerConfig.Handlers[%d]: needs a Name and a Handle func", i)
		}
	}
	tokens := []struct{ field, token string }{{"ManagerConfig.Security.Token", c.Security.Token}, {"ManagerConfig.AdminToken", c.AdminToken}, {"ManagerConfig.ProxyToken", c.ProxyToken}}
	for i, t := range tokens {
		if err := checkToken(t.field, t.token); err != nil {
			return err
		}
		for _, u := range tokens[:i] {
			if t.token != "" && t.token == u.token {
				return fmt.Errorf("taskd: %s: the same as %s; each credential needs a token of its own", t.field, u.field)
			}
		}
	}
	if c.Orchestration != nil {
		if err := c.Orchestration.validate(); err != nil {
			return err
		}
	}
	return c.Security.Validate()
}

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
	completedAt time.Time   // when every rank left finished; zero until then

	state     atomic.Int32 // 0 new, 1 running, 2 closed
	closed    chan struct{}
	closeOnce sync.Once
	runDone   chan struct{}
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
		closed:      make(chan struct{}),
		runDone:     make(chan struct{}),
	}
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
	}
	if err := metrics.Err(); err != nil {
		return nil, err
	}
	if cfg.Nodes > 0 && cfg.ProcsPerNode > 0 {
		for r := range cfg.Nodes * cfg.ProcsPerNode {
			m.sw.expect(r, r/cfg.ProcsPerNode)
		}
	}
	if err := m.loadState(); err != nil {
		metrics.UnregisterAll()
		return nil, err
	}
	lis, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		m.closeState()
		metrics.UnregisterAll()
		return nil, fmt.Errorf("taskd: manager listen on %s: %w", cfg.Listen, err)
	}
	g := newGuard(guardConfig{
		tokens: map[string]credential{cfg.Security.Token: credMember, cfg.ProxyToken: credProxy, cfg.AdminToken: credAdmin},
		open:   cfg.Security.Token == "", maxConns: cfg.MaxConnections, maxPerPeer: cfg.MaxConnectionsPerPeer,
		ids: m.ids, policy: m.policy, met: m.met.guard, log: m.log,
	})
	switch {
	case cfg.AdminToken == "" && cfg.Security.Token != "":
		m.log.Info("taskd: the Admin and TrainingDataTrace services are off: no AdminToken")
	case cfg.AdminToken == "":
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

// Addr returns the address the manager listens on.
func (m *Manager) Addr() net.Addr { return m.lis.Addr() }

// Job returns the job the manager serves.
func (m *Manager) Job() string { return m.cfg.Job }

// Run serves until ctx ends or Close is called. It returns nil then, or the
// first error that stopped it. Run may be called once.
func (m *Manager) Run(ctx context.Context) error {
	if !m.state.CompareAndSwap(0, 1) {
		return errors.New("taskd: Manager.Run called twice or after Close")
	}
	defer close(m.runDone)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if t := m.cfg.Term; t != nil {
		// A deposed manager stops at once: its listener and every
		// connection close, and its orchestration's actions end.
		stop := context.AfterFunc(t.Context(), cancel)
		defer stop()
	}
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		if err := m.srv.Serve(m.lis); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			return fmt.Errorf("taskd: manager serve: %w", err)
		}
		return nil
	})
	g.Go(func() error {
		select {
		case <-ctx.Done():
		case <-m.closed:
		}
		m.srv.Stop()
		cancel()
		return nil
	})
	g.Go(func() error { return m.housekeep(ctx) })
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
	m.closeOnce.Do(func() {
		close(m.closed)
		if m.state.CompareAndSwap(0, 2) { // never ran
			m.lis.Close()
			m.closeState()
			close(m.runDone)
		}
		<-m.runDone
		m.metrics.UnregisterAll()
	})
	<-m.runDone
	return nil
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
	for _, lm := range m.reg.expire(now) {
		m.ids.revoke(lm.key, lm.instance)
		if dl := m.downlinks[lm.key]; dl != nil && dl.instance == lm.instance {
			dl.detach()
			delete(m.downlinks, lm.key)
		}
		if lm.key.role == RoleWorker {
			m.sw.gone(lm.key.id)
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

// ReportFault takes f into the job's fault log as the manager's own report,
// for a detector embedded beside the manager (a launcher that saw a
// process exit, a hang detector). An empty ID is filled in, a zero Time
// means now, and an empty ReporterRole means the manager. It returns the
// fault as logged, and false when a fault with its ID was logged already.
func (m *Manager) ReportFault(f Fault) (Fault, bool, error) {
	if err := checkKind(f.Kind); err != nil {
		return Fault{}, false, fmt.Errorf("taskd: Fault.Kind: %w", err)
	}
	now := time.Now()
	if f.ID == "" {
		f.ID = fmt.Sprintf("manager/%s/%d", m.instance, m.nextID.Add(1))
	}
	if f.Time.IsZero() {
		f.Time = now
	}
	if f.ReporterRole == 0 {
		f.ReporterRole, f.Reporter = RoleManager, Position{Node: -1, Rank: -1}
	}
	stored, fresh := m.faults.add(f, now)
	if err := m.faults.wait(context.Background(), stored.Seq); err != nil {
		return stored, fresh, err
	}
	if !fresh {
		m.met.faultDups.Inc()
		return stored, false, nil
	}
	m.met.faults.WithLabelValues(kindLabel(stored.Kind)).Inc()
	m.log.Warn("taskd: fault", "seq", stored.Seq, "kind", stored.Kind, "position", stored.Position.String(), "code", stored.Code, "message", stored.Message)
	m.events.push(Event{Kind: EventFault, Time: now, Role: stored.ReporterRole, Position: stored.Reporter, Fault: stored})
	return stored, true, nil
}

// liveWorkers returns the ranks of the live workers, sorted.
func (m *Manager) liveWorkers() []int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.resolveLocked(AllWorkers())
}

// isLive reports whether instance is the live worker of rank.
func (m *Manager) isLive(rank int, instance string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	wm := m.reg.get(workerKey(rank))
	return wm != nil && wm.instance == instance
}

// evict drops the live instances of ranks, whose processes recovery is
// about to restart or replace, so that their successors may register at
// once, and refuses those instances from now on.
func (m *Manager) evict(ranks []int, why string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, r := range ranks {
		wm := m.reg.get(workerKey(r))
		if wm == nil {
			continue
		}
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
}

// Faults returns the job's faults with Seq above after, oldest first.
func (m *Manager) Faults(after uint64) []Fault { return m.faults.after(after) }

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

// Delivery is the outcome of a message for one rank.
type Delivery struct {
	Rank int
	// Err is nil when the worker acknowledged the message as applied,
	// *DeliveryError when it refused it, ErrNotConnected when no route to it
	// existed, or ErrAckTimeout.
	Err error
	// reply is the worker's answer to an orchestration message.
	reply []byte
}

// Errors of Broadcast.
var (
	ErrNotConnected = errors.New("taskd: worker not connected")
	ErrAckTimeout   = errors.New("taskd: no acknowledgement before the deadline")
	ErrTooLarge     = errors.New("taskd: message exceeds the size cap")
	ErrClosed       = errors.New("taskd: closed")
)

// DeliveryError is a worker's refusal of a message.
type DeliveryError struct {
	Rank int
	Msg  string
}

func (e *DeliveryError) Error() string { return fmt.Sprintf("taskd: rank %d: %s", e.Rank, e.Msg) }

type delivery struct {
	waiting map[int]time.Time // rank -> last sent, zero when never routed
	results map[int]error
	replies map[int][]byte
	done    chan struct{}
}

// Broadcast sends an application message to the targeted workers and waits
// until each acknowledged it, re-sending with backoff to those that did
// not, for at most DeliveryTimeout or until ctx ends. It returns one
// Delivery per targeted rank, in rank order.
func (m *Manager) Broadcast(ctx context.Context, to Target, kind string, payload []byte) ([]Delivery, error) {
	ctx, cancel := context.WithTimeout(ctx, m.cfg.DeliveryTimeout)
	defer cancel()
	return m.broadcast(ctx, to, kind, payload)
}

// broadcast is Broadcast bounded by ctx alone.
func (m *Manager) broadcast(ctx context.Context, to Target, kind string, payload []byte) ([]Delivery, error) {
	if len(kind)+len(payload) > m.cfg.MaxMessageBytes-1024 {
		return nil, fmt.Errorf("%w: %d bytes, cap %d", ErrTooLarge, len(kind)+len(payload), m.cfg.MaxMessageBytes-1024)
	}
	id := m.nextID.Add(1)
	env := &pb.Envelope{Id: id, Body: &pb.Envelope_Message{Message: &pb.UserMessage{Kind: kind, Payload: payload}}}
	d := &delivery{waiting: make(map[int]time.Time), results: make(map[int]error), replies: make(map[int][]byte), done: make(chan struct{})}
	m.mu.Lock()
	ranks := m.resolveLocked(to)
	for _, r := range ranks {
		d.waiting[r] = time.Time{}
	}
	if len(ranks) == 0 {
		close(d.done)
	}
	m.deliveries[id] = d
	m.mu.Unlock()
	defer func() {
		m.mu.Lock()
		delete(m.deliveries, id)
		m.mu.Unlock()
	}()
	bo := newBackoff(m.cfg.AckTimeout, 30*time.Second)
	wait := time.Duration(0)
	for {
		timer := time.NewTimer(wait)
		select {
		case <-d.done:
			timer.Stop()
			return m.results(d, ranks), nil
		case <-ctx.Done():
			timer.Stop()
			m.mu.Lock()
			for r, at := range d.waiting {
				if at.IsZero() {
					d.results[r] = ErrNotConnected
				} else {
					d.results[r] = ErrAckTimeout
				}
				m.met.acks.WithLabelValues("timeout").Inc()
			}
			m.mu.Unlock()
			select {
			case <-m.closed:
				return m.results(d, ranks), ErrClosed
			default:
			}
			return m.results(d, ranks), nil
		case <-m.closed:
			timer.Stop()
			return nil, ErrClosed
		case <-timer.C:
		}
		now := time.Now()
		m.mu.Lock()
		pending := make([]int, 0, len(d.waiting))
		for r := range d.waiting {
			pending = append(pending, r)
		}
		unrouted := m.routeLocked(env, pending)
		skip := make(map[int]bool, len(unrouted))
		for _, r := range unrouted {
			skip[r] = true
		}
		for _, r := range pending {
			if !skip[r] {
				d.waiting[r] = now
			}
		}
		m.met.messages.WithLabelValues("down", "message").Add(float64(len(pending) - len(unrouted)))
		m.mu.Unlock()
		wait = bo.NextBackOff()
		if len(unrouted) > 0 {
			wait = min(wait, m.cfg.HeartbeatInterval)
		}
	}
}

func (m *Manager) results(d *delivery, ranks []int) []Delivery {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]Delivery, 0, len(ranks))
	for _, r := range ranks {
		out = append(out, Delivery{Rank: r, Err: d.results[r], reply: d.replies[r]})
	}
	return out
}

// resolveLocked returns the ranks a target names: for All and Nodes the
// live workers, for Ranks the ranks as given.
func (m *Manager) resolveLocked(to Target) []int {
	var out []int
	nodes := make(map[int]bool, len(to.Nodes))
	for _, n := range to.Nodes {
		nodes[n] = true
	}
	if to.All || len(nodes) > 0 {
		for _, mm := range m.reg.list() {
			if mm.key.role == RoleWorker && (to.All || nodes[mm.pos.Node]) {
				out = append(out, mm.key.id)
			}
		}
	}
	out = append(out, to.Ranks...)
	return sortedUnique(out)
}

// ackLocked applies one acknowledgement from a worker or proxy.
func (m *Manager) ackLocked(a *pb.Ack, now time.Time) {
	rank := int(a.GetFrom().GetPosition().GetRank())
	result := "ok"
	// What a worker says is kept for as long as its rank is, so it is
	// cut to a bound.
	errMsg := cut(a.GetError(), maxAckErrorBytes)
	if errMsg != "" {
		result = "error"
	}
	if sent, ok := m.sw.ack(a.GetId(), rank, errMsg); ok {
		m.met.acks.WithLabelValues(result).Inc()
		m.met.ackLatency.Observe(now.Sub(sent).Seconds())
		if errMsg != "" {
			m.log.Warn("taskd: worker could not apply the switch", "rank", rank, "err", errMsg)
		}
		return
	}
	d := m.deliveries[a.GetId()]
	if d == nil {
		return
	}
	sent, ok := d.waiting[rank]
	if !ok {
		return
	}
	m.met.acks.WithLabelValues(result).Inc()
	if !sent.IsZero() {
		m.met.ackLatency.Observe(now.Sub(sent).Seconds())
	}
	delete(d.waiting, rank)
	if errMsg != "" {
		d.results[rank] = &DeliveryError{Rank: rank, Msg: errMsg}
	}
	switch reply := a.GetReply(); {
	case len(reply) > maxAckReplyBytes:
		d.results[rank] = &DeliveryError{Rank: rank, Msg: fmt.Sprintf("reply of %d bytes, at most %d", len(reply), maxAckReplyBytes)}
	case len(reply) > 0:
		d.replies[rank] = reply
	}
	if len(d.waiting) == 0 {
		close(d.done)
	}
}

// Bounds of what an acknowledgement may make the manager keep.
const (
	maxAckErrorBytes = 1 << 10
	maxAckReplyBytes = 64 << 10
)

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
	// refused either way.
	orch, err := readOrchestration(dir, m.cfg.Job, m.token())
	if err != nil {
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
