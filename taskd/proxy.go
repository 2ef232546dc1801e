package taskd

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	oteltrace "go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/faultline-ml/faultline/internal/promreg"
	pb "github.com/faultline-ml/faultline/internal/taskdpb"
)

// DefaultDottingRoot is where trace writes dotting files.
const DefaultDottingRoot = "/user/cluster-info/profiling"

// ProxyConfig configures a Proxy. The zero value of each field but Job,
// Node, Upstream and Security means its documented default.
type ProxyConfig struct {
	// Job is the job's identifier; required.
	Job string
	// Node is this node's rank.
	Node int
	// Upstream is the manager's address; required. With a standby
	// manager, it is the address of a Service that reaches the leader, or
	// the managers' addresses separated by commas: only the leader
	// listens, and the proxy follows it.
	Upstream string
	// Listen is where the node's workers connect; default "127.0.0.1:9602".
	Listen string
	// Security applies to both sides: the manager and the workers.
	Security Security
	// UpstreamToken, when set, is the token presented to the manager in
	// place of Security.Token: the manager's ProxyToken.
	UpstreamToken string
	// AckTimeout bounds each call to the manager (default 3 s).
	AckTimeout time.Duration
	// MaxMessageBytes caps each message (default 4 MiB).
	MaxMessageBytes int
	// RateLimit is calls per second allowed on each worker connection
	// (default 2000, burst RateBurst default twice that); negative means
	// unlimited.
	RateLimit float64
	RateBurst int
	// MaxConnections bounds the workers' connections open at once
	// (default half the process's open-file limit, at most 16384), and
	// MaxConnectionsPerPeer those from one peer address that authenticated
	// (default 256), and apart from them those that have not yet.
	MaxConnections, MaxConnectionsPerPeer int
	// ReconnectMax caps the backoff between attempts to register with the
	// manager again (default 5 s).
	ReconnectMax time.Duration
	// DottingRoot holds the node's dotting files as <root>/<job>/<rank>/...
	// (default "/user/cluster-info/profiling"); StackRoot holds stack files
	// as <root>/<job>/... (empty: none). Collect ships only what is under
	// the job's folder of each, and never follows a symlink.
	DottingRoot, StackRoot string
	// QueueSize bounds the proxy's own reports waiting for the manager
	// (default 1024).
	QueueSize int
	// Observability; nil means off.
	Registerer     prometheus.Registerer
	TracerProvider oteltrace.TracerProvider
	Logger         *slog.Logger
}

// Validate reports the first field that is wrong.
func (c ProxyConfig) Validate() error {
	switch {
	case c.Job == "":
		return errors.New("taskd: ProxyConfig.Job: empty")
	case strings.ContainsAny(c.Job, "/\\\x00") || c.Job == "." || c.Job == "..":
		return fmt.Errorf("taskd: ProxyConfig.Job: %q is not a single path element", c.Job)
	case c.Node < 0:
		return fmt.Errorf("taskd: ProxyConfig.Node: %d is negative", c.Node)
	case c.Upstream == "":
		return errors.New("taskd: ProxyConfig.Upstream: empty")
	case negative(c.AckTimeout, c.ReconnectMax):
		return negativeDuration("ProxyConfig", "AckTimeout", c.AckTimeout, "ReconnectMax", c.ReconnectMax)
	case c.MaxMessageBytes < 0 || (c.MaxMessageBytes > 0 && c.MaxMessageBytes < 64<<10):
		return fmt.Errorf("taskd: ProxyConfig.MaxMessageBytes: %d is below 64 KiB", c.MaxMessageBytes)
	case c.QueueSize < 0:
		return fmt.Errorf("taskd: ProxyConfig.QueueSize: %d is negative", c.QueueSize)
	case c.MaxConnections < 0:
		return fmt.Errorf("taskd: ProxyConfig.MaxConnections: %d is negative", c.MaxConnections)
	case c.MaxConnectionsPerPeer < 0:
		return fmt.Errorf("taskd: ProxyConfig.MaxConnectionsPerPeer: %d is negative", c.MaxConnectionsPerPeer)
	}
	if err := checkToken("ProxyConfig.Security.Token", c.Security.Token); err != nil {
		return err
	}
	if err := checkToken("ProxyConfig.UpstreamToken", c.UpstreamToken); err != nil {
		return err
	}
	return c.Security.Validate()
}

// Proxy is a node's hop between its workers and the manager: it forwards
// registrations, reports and acknowledgements up, routes messages down to
// the workers they name, sends one heartbeat for the node that carries each
// worker's, and ships the node's dotting and stack files on request.
type Proxy struct {
	cfg     ProxyConfig
	log     *slog.Logger
	tracer  oteltrace.Tracer
	met     *proxyMetrics
	metrics *promreg.Registrar
	lis     net.Listener
	srv     *grpc.Server
	conn    *grpc.ClientConn
	up      pb.ControlClient
	self    *pb.Member
	upq     *uplink
	acks    chan *pb.Ack
	cred    *memberCred // the proxy's secret, issued by the manager
	ids     *identities // the workers' secrets, issued by the proxy
	fence   memberFence

	mu       sync.Mutex
	workers  map[int]*proxyWorker // by rank
	upReady  bool
	joined   bool          // registered with the manager at least once
	mgr      string        // the manager's instance
	deadline time.Duration // the manager's heartbeat deadline
	collect  chan *pb.CollectRequest

	lifecycle
}

type proxyWorker struct {
	req      *pb.RegisterRequest // as forwarded, for registering again
	instance string
	lastBeat time.Time
	dl       *downlink // from registration on
	// registered is set once the manager took the registration; only then
	// does the node's heartbeat carry the worker's.
	registered bool
	// gone is set when the worker's stream ended because the worker went
	// away (its process died): a new instance may take the rank at once.
	gone bool
}

// NewProxy validates cfg, listens on cfg.Listen and prepares the
// connection to the manager; Run serves.
func NewProxy(cfg ProxyConfig) (*Proxy, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Listen = orDefault(cfg.Listen, DefaultProxyAddr)
	cfg.AckTimeout = orDefault(cfg.AckTimeout, defaultAckTimeout)
	cfg.MaxMessageBytes = orDefault(cfg.MaxMessageBytes, defaultMaxMessageBytes)
	cfg.RateLimit = orDefault(cfg.RateLimit, defaultRateLimit)
	cfg.RateBurst = orDefault(cfg.RateBurst, int(2*cfg.RateLimit))
	cfg.MaxConnections = orDefault(cfg.MaxConnections, defaultMaxConnections())
	cfg.MaxConnectionsPerPeer = orDefault(cfg.MaxConnectionsPerPeer, defaultMaxConnectionsPerPeer)
	cfg.ReconnectMax = orDefault(cfg.ReconnectMax, 5*time.Second)
	cfg.DottingRoot = orDefault(cfg.DottingRoot, DefaultDottingRoot)
	cfg.QueueSize = orDefault(cfg.QueueSize, 1024)
	log := discardIfNil(cfg.Logger).With("component", "taskd-proxy", "job", cfg.Job, "node", cfg.Node)
	tp := cfg.TracerProvider
	if tp == nil {
		tp = noop.NewTracerProvider()
	}
	metrics := promreg.New(cfg.Registerer, "taskd: ProxyConfig.Registerer")
	met := newProxyMetrics(metrics)
	if err := metrics.Err(); err != nil {
		return nil, err
	}
	p := &Proxy{
		cfg:      cfg,
		log:      log,
		tracer:   tp.Tracer("github.com/faultline-ml/faultline/taskd"),
		met:      met,
		metrics:  metrics,
		self:     memberPB(RoleProxy, Position{Node: cfg.Node, Rank: -1}, newInstanceID()),
		acks:     make(chan *pb.Ack, 16384),
		workers:  make(map[int]*proxyWorker),
		ids:      newIdentities(),
		cred:     &memberCred{},
		deadline: DefaultHeartbeatDeadline,
		collect:  make(chan *pb.CollectRequest, 16),
	}
	p.init()
	p.upq = &uplink{job: cfg.Job, self: p.self, queue: newReportQueue(cfg.QueueSize), maxMsg: cfg.MaxMessageBytes, ackTimeout: cfg.AckTimeout, log: log,
		overflow: func() {}, queued: func(int) {}}
	upSec := cfg.Security
	if cfg.UpstreamToken != "" {
		upSec.Token = cfg.UpstreamToken
	}
	conn, err := dial(cfg.Upstream, upSec, cfg.MaxMessageBytes, log, p.cred.dialOptions()...)
	if err != nil {
		metrics.UnregisterAll()
		return nil, fmt.Errorf("taskd: proxy dial %s: %w", cfg.Upstream, err)
	}
	p.conn, p.up = conn, pb.NewControlClient(conn)
	lis, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		conn.Close()
		metrics.UnregisterAll()
		return nil, fmt.Errorf("taskd: proxy listen on %s: %w", cfg.Listen, err)
	}
	g := newGuard(guardConfig{tokens: map[string]credential{cfg.Security.Token: credMember}, open: cfg.Security.Token == "",
		maxConns: cfg.MaxConnections, maxPerPeer: cfg.MaxConnectionsPerPeer, maxMsg: cfg.MaxMessageBytes, ids: p.ids, met: p.met.guard, log: log})
	p.lis = g.listen(lis)
	p.srv = newServer(cfg.Security, limits{maxMsg: cfg.MaxMessageBytes, rate: cfg.RateLimit, burst: cfg.RateBurst, limited: p.met.rateLimited.Inc}, g, log)
	pb.RegisterControlServer(p.srv, &proxyControl{p: p})
	return p, nil
}

// Addr returns the address workers connect to.
func (p *Proxy) Addr() net.Addr { return p.lis.Addr() }

// ReportFault queues a fault of this node for the manager: of the whole
// node (Position.Rank -1, and this node, when Position is zero) or of one
// of its workers.
func (p *Proxy) ReportFault(f Fault) error {
	if f.Position == (Position{}) {
		f.Position = Position{Node: p.cfg.Node, Rank: -1}
	}
	if f.Position.Node != p.cfg.Node {
		return fmt.Errorf("taskd: Fault.Position: node %d is not this proxy's (%d)", f.Position.Node, p.cfg.Node)
	}
	return p.upq.reportFault(f)
}

// Run serves the node's workers and keeps the proxy registered with the
// manager until ctx ends or Close is called; then it leaves the job and
// returns nil.
func (p *Proxy) Run(ctx context.Context) error {
	if err := p.begin("Proxy"); err != nil {
		return err
	}
	defer p.end()
	defer p.conn.Close()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	g, ctx := errgroup.WithContext(ctx)
	p.serveGRPC(ctx, g, cancel, p.srv, p.lis, "proxy")
	defer p.leave()
	g.Go(func() error { return p.runUpstream(ctx) })
	g.Go(func() error { return runAcks(ctx, p.up, p.cfg.Job, p.acks, p.cfg.AckTimeout, p.log) })
	g.Go(func() error {
		for {
			select {
			case <-ctx.Done():
				return nil
			case req := <-p.collect:
				res := p.collectFiles(ctx, p.up, req)
				cctx, cancel := context.WithTimeout(ctx, p.cfg.AckTimeout)
				if _, err := p.up.CollectDone(cctx, res); err != nil && ctx.Err() == nil {
					p.log.Warn("taskd: collection result not delivered", "collection", req.GetCollection(), "err", err)
				}
				cancel()
			}
		}
	})
	return g.Wait()
}

// Close stops the proxy, waits for Run to return and unregisters the
// proxy's metrics. Call it also after Run returned on its own. It is
// idempotent.
func (p *Proxy) Close() error {
	p.close(func() {
		p.lis.Close()
		p.conn.Close()
	}, p.metrics.UnregisterAll)
	return nil
}

// leave tells the manager that the proxy is going, so that its silence is
// not taken for a fault. Its workers stay members until they leave or are
// lost: a node's proxy is meant to outlive them.
func (p *Proxy) leave() {
	p.mu.Lock()
	joined := p.joined
	p.mu.Unlock()
	if !joined {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), min(closeGrace, p.cfg.AckTimeout))
	defer cancel()
	if _, err := p.up.Leave(ctx, &pb.LeaveRequest{Job: p.cfg.Job, Member: p.self}); err != nil {
		p.log.Warn("taskd: could not tell the manager that the proxy leaves; it will be declared lost", "err", err)
	}
}

func (p *Proxy) runUpstream(ctx context.Context) error {
	retry := newRetry(50*time.Millisecond, p.cfg.ReconnectMax)
	sessions := 0
	for {
		start, n := time.Now(), sessions
		err := p.upSession(ctx, &sessions)
		p.mu.Lock()
		p.upReady = false
		p.mu.Unlock()
		if ctx.Err() != nil {
			return nil
		}
		retry.ended(sessions > n, time.Since(start) > 2*p.cfg.ReconnectMax)
		wait := retry.wait(err, time.Now())
		p.log.Info("taskd: manager connection lost; registering again", "err", err, "in", wait)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
	}
}

func (p *Proxy) upSession(ctx context.Context, sessions *int) error {
	host, _ := os.Hostname()
	rctx, cancel := context.WithTimeout(ctx, p.cfg.AckTimeout)
	resp, err := p.up.Register(rctx, &pb.RegisterRequest{Job: p.cfg.Job, Member: p.self, Hostname: host, Pid: int64(os.Getpid()), Fence: p.fence.newest()}, grpc.WaitForReady(true))
	cancel()
	if err != nil {
		return err
	}
	if err := p.fence.admit(resp.GetFence()); err != nil {
		p.met.fenced.Inc()
		return err
	}
	p.cred.set(resp.GetSecret())
	interval := time.Duration(resp.GetHeartbeatIntervalMs()) * time.Millisecond
	deadline := time.Duration(resp.GetHeartbeatDeadlineMs()) * time.Millisecond
	if interval <= 0 || deadline <= interval {
		interval, deadline = DefaultHeartbeatInterval, DefaultHeartbeatDeadline
	}
	sctx, scancel := context.WithCancel(ctx)
	defer scancel()
	stream, err := p.up.Stream(sctx, &pb.StreamRequest{Job: p.cfg.Job, Member: p.self})
	if err != nil {
		return err
	}
	*sessions++
	if *sessions > 1 {
		p.met.reconnects.Inc()
	}
	p.mu.Lock()
	p.upReady, p.joined, p.mgr, p.deadline = true, true, resp.GetManagerInstance(), deadline
	ranks := make([]int, 0, len(p.workers))
	for r := range p.workers {
		ranks = append(ranks, r)
	}
	p.mu.Unlock()
	// A restarted manager knows none of this node's workers: register them
	// again on their behalf, so their streams to us stay up.
	for _, r := range sortedUnique(ranks) {
		if err := p.reregister(sctx, r); err != nil {
			return err
		}
	}
	p.log.Info("taskd: registered with the manager", "upstream", p.cfg.Upstream, "workers", len(ranks))
	g, gctx := errgroup.WithContext(sctx)
	// The stream lives on sctx: end it once any part of the session
	// fails, or its receive would hold the session up until the
	// connection breaks.
	context.AfterFunc(gctx, scancel)
	g.Go(func() error {
		for {
			env, err := stream.Recv()
			if err != nil {
				return err
			}
			p.route(env)
		}
	})
	again := make(chan []int, 1)
	g.Go(func() error { return p.heartbeats(gctx, interval, deadline, again) })
	g.Go(func() error {
		// Registering workers again takes calls; it runs beside the
		// heartbeats so that they never wait for it.
		for {
			select {
			case <-gctx.Done():
				return nil
			case ranks := <-again:
				for _, r := range ranks {
					if err := p.reregister(gctx, r); err != nil {
						return err
					}
				}
			}
		}
	})
	g.Go(func() error { return p.upq.run(gctx, p.up) })
	return g.Wait()
}

// reregister registers worker rank with the manager again. A worker whose
// rank another instance took is dropped; its stream ends and it learns why
// when it registers itself. One whose stream ended with its process is
// not registered on its behalf: a recovery may have restarted it, and its
// successor must not find the rank taken; one alive registers itself.
func (p *Proxy) reregister(ctx context.Context, rank int) error {
	p.mu.Lock()
	w := p.workers[rank]
	gone := w != nil && w.gone
	var req *pb.RegisterRequest
	if w != nil {
		req = proto.Clone(w.req).(*pb.RegisterRequest)
	}
	p.mu.Unlock()
	if w == nil || gone {
		return nil
	}
	req.Fence = max(req.GetFence(), p.fence.newest())
	rctx, cancel := context.WithTimeout(ctx, p.cfg.AckTimeout)
	_, err := p.up.Register(rctx, req)
	cancel()
	switch status.Code(err) {
	case codes.OK:
		return nil
	case codes.AlreadyExists, codes.FailedPrecondition, codes.InvalidArgument, codes.NotFound:
		p.dropWorker(rank, w.instance)
		return nil
	}
	return err
}

func (p *Proxy) dropWorker(rank int, instance string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if w := p.workers[rank]; w != nil && w.instance == instance {
		w.dl.detach()
		delete(p.workers, rank)
		p.ids.revoke(workerKey(rank), instance)
		p.met.workers.Set(float64(len(p.workers)))
	}
}

// heartbeats sends the node's heartbeat, carrying how long ago each worker
// was heard from, and drops workers silent past the deadline.
func (p *Proxy) heartbeats(ctx context.Context, interval, deadline time.Duration, again chan<- []int) error {
	beats := func() []*pb.Beat {
		now := time.Now()
		var beats []*pb.Beat
		var silent []*proxyWorker
		p.mu.Lock()
		for _, w := range p.workers {
			age := now.Sub(w.lastBeat)
			if age > deadline {
				silent = append(silent, w)
				continue
			}
			if !w.registered || w.gone {
				continue // one gone speaks for itself when it registers again
			}
			beats = append(beats, &pb.Beat{Member: w.req.GetMember(), AgeMs: age.Milliseconds()})
		}
		p.mu.Unlock()
		for _, w := range silent {
			p.log.Warn("taskd: worker silent past the deadline", "rank", w.req.GetMember().GetPosition().GetRank())
			p.dropWorker(int(w.req.GetMember().GetPosition().GetRank()), w.instance)
		}
		return beats
	}
	answered := func(resp *pb.HeartbeatResponse) error {
		if err := p.fence.admit(resp.GetFence()); err != nil {
			p.met.fenced.Inc()
			return err
		}
		if resp.GetManagerInstance() != p.managerInstance() {
			return errors.New("taskd: the manager restarted")
		}
		var ranks []int
		for _, u := range resp.GetUnknown() {
			if keyOf(u) == keyOf(p.self) {
				return errReregister
			}
			ranks = append(ranks, int(u.GetPosition().GetRank()))
		}
		if len(ranks) > 0 {
			select {
			case again <- ranks:
			default: // still busy with the last list; the next heartbeat repeats it
			}
		}
		return nil
	}
	return heartbeats(ctx, p.up, p.cfg.Job, p.self, &p.fence, interval, deadline, beats, answered)
}

func (p *Proxy) managerInstance() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mgr
}

// route hands a message from the manager to the workers it names, or
// takes it for the proxy itself.
func (p *Proxy) route(env *pb.Envelope) {
	if err := p.fence.admit(env.GetFence()); err != nil {
		// A deposed manager's command: its successor's may contradict it.
		p.met.fenced.Inc()
		p.log.Warn("taskd: message refused", "id", env.GetId(), "err", err)
		return
	}
	if len(env.GetRanks()) == 0 {
		if c := env.GetCollect(); c != nil {
			select {
			case p.collect <- c:
			default:
				p.log.Warn("taskd: collection request dropped: too many queued", "collection", c.GetCollection())
			}
		}
		return
	}
	out := &pb.Envelope{Id: env.GetId(), Body: env.GetBody(), Fence: env.GetFence()}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, r := range env.GetRanks() {
		w := p.workers[int(r)]
		if w == nil {
			continue // the manager re-sends to a worker that does not acknowledge
		}
		select {
		case w.dl.ch <- out:
			p.met.forwarded.WithLabelValues("down").Inc()
		default:
			p.met.dropped.Inc()
		}
	}
}

// proxyControl serves the node's workers.
type proxyControl struct {
	pb.UnimplementedControlServer
	p *Proxy
}

func (s *proxyControl) checkJob(job string) error {
	if job != s.p.cfg.Job {
		return unknownJob(job, "proxy", s.p.cfg.Job)
	}
	return nil
}

func (s *proxyControl) ready() error {
	s.p.mu.Lock()
	defer s.p.mu.Unlock()
	if !s.p.upReady {
		return status.Error(codes.Unavailable, "taskd: proxy is not connected to the manager")
	}
	return nil
}

func (s *proxyControl) Register(ctx context.Context, req *pb.RegisterRequest) (*pb.RegisterResponse, error) {
	p := s.p
	if err := s.checkJob(req.GetJob()); err != nil {
		return nil, err
	}
	mem := req.GetMember()
	if err := checkMember(mem, 0, 0, defaultMaxWorkers); err != nil {
		return nil, err
	}
	if roleFromPB(mem.GetRole()) != RoleWorker {
		return nil, status.Error(codes.InvalidArgument, "taskd: member.role: only workers register with a proxy")
	}
	if n := int(mem.GetPosition().GetNode()); n != p.cfg.Node {
		return nil, status.Errorf(codes.InvalidArgument, "taskd: member.position.node: %d, but this proxy serves node %d", n, p.cfg.Node)
	}
	rank, inst := int(mem.GetPosition().GetRank()), mem.GetInstance()
	if err := s.ready(); err != nil {
		return nil, err
	}
	fwd := proto.Clone(req).(*pb.RegisterRequest)
	fwd.Via = p.self
	fwd.Fence = max(fwd.GetFence(), p.fence.newest())
	// The worker's entry and queue exist before the manager hears of it, so
	// that what the manager sends it at once is not lost.
	p.mu.Lock()
	w := p.workers[rank]
	if w != nil && w.instance != inst && !w.gone && time.Since(w.lastBeat) <= p.deadline {
		p.mu.Unlock()
		return nil, status.Errorf(codes.AlreadyExists, "taskd: worker rank %d: %v", rank, ErrRankTaken)
	}
	if w != nil && w.instance == inst && !callerOf(ctx).is(mem) {
		p.mu.Unlock()
		return nil, permission("worker rank %d: instance %s is live; registering it again takes its credential", rank, inst)
	}
	created := w == nil || w.instance != inst
	if created {
		if w != nil {
			w.dl.detach()
			p.ids.revoke(workerKey(rank), w.instance)
		}
		w = &proxyWorker{instance: inst, dl: newDownlink(inst, workerQueue)}
		p.workers[rank] = w
	}
	w.req, w.lastBeat = fwd, time.Now()
	p.met.workers.Set(float64(len(p.workers)))
	p.mu.Unlock()
	cctx, cancel := context.WithTimeout(ctx, p.cfg.AckTimeout)
	resp, err := p.up.Register(cctx, fwd)
	cancel()
	if err != nil {
		if created {
			p.dropWorker(rank, inst)
		}
		return nil, err
	}
	p.mu.Lock()
	w.registered = true
	p.mu.Unlock()
	p.met.forwarded.WithLabelValues("up").Inc()
	// The worker's secret is the proxy's to issue and check; the manager
	// knows the worker through the proxy.
	resp.Secret = p.ids.issue(identity{key: workerKey(rank), instance: inst, node: p.cfg.Node})
	// The newest term the proxy has seen, which may be newer than the
	// manager's: the worker then refuses that manager's commands too.
	resp.Fence = max(resp.GetFence(), p.fence.newest())
	return resp, nil
}

func (s *proxyControl) Heartbeat(ctx context.Context, req *pb.HeartbeatRequest) (*pb.HeartbeatResponse, error) {
	p := s.p
	if err := s.checkJob(req.GetJob()); err != nil {
		return nil, err
	}
	caller := callerOf(ctx)
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	resp := &pb.HeartbeatResponse{ManagerInstance: p.mgr, Fence: p.fence.newest()}
	for _, b := range req.GetBeats() {
		m := b.GetMember()
		w := p.workers[int(m.GetPosition().GetRank())]
		if !caller.is(m) || w == nil || w.instance != m.GetInstance() {
			resp.Unknown = append(resp.Unknown, m)
			continue
		}
		w.lastBeat = now
	}
	return resp, nil
}

func (s *proxyControl) Send(ctx context.Context, req *pb.SendRequest) (*pb.SendResponse, error) {
	if err := s.checkJob(req.GetJob()); err != nil {
		return nil, err
	}
	caller := callerOf(ctx)
	for i, r := range req.GetReports() {
		if !caller.is(r.GetFrom()) {
			return nil, permission("reports[%d].from: a worker sends only its own reports", i)
		}
		if f := r.GetFault(); f != nil && (int(f.GetNode()) != caller.node || int(f.GetRank()) != caller.key.id) {
			return nil, permission("reports[%d].fault: about node %d rank %d, but %s reports only its own faults", i, f.GetNode(), f.GetRank(), caller.key)
		}
	}
	if err := s.ready(); err != nil {
		return nil, err
	}
	s.p.met.forwarded.WithLabelValues("up").Add(float64(len(req.GetReports())))
	return s.p.up.Send(ctx, req)
}

func (s *proxyControl) Stream(req *pb.StreamRequest, stream grpc.ServerStreamingServer[pb.Envelope]) error {
	p := s.p
	if err := s.checkJob(req.GetJob()); err != nil {
		return err
	}
	rank := int(req.GetMember().GetPosition().GetRank())
	if !callerOf(stream.Context()).is(req.GetMember()) {
		return permission("worker rank %d: a worker opens only its own stream", rank)
	}
	p.mu.Lock()
	w := p.workers[rank]
	if w == nil || w.instance != req.GetMember().GetInstance() {
		p.mu.Unlock()
		return status.Errorf(codes.FailedPrecondition, "taskd: worker rank %d: register before opening the stream", rank)
	}
	stop := w.dl.attach()
	w.gone = false
	p.mu.Unlock()
	err := serveDownlink(stream.Context(), stop, w.dl, func(env *pb.Envelope) error {
		// Checked again as it leaves the queue: a newer term may have
		// been admitted since it was queued.
		if err := p.fence.admit(env.GetFence()); err != nil {
			p.met.fenced.Inc()
			p.log.Warn("taskd: queued message refused", "id", env.GetId(), "rank", rank, "err", err)
			return nil
		}
		return stream.Send(env)
	})
	if stream.Context().Err() != nil {
		p.mu.Lock()
		if p.workers[rank] == w && w.dl.stop == stop {
			w.gone = true
		}
		p.mu.Unlock()
	}
	return err
}

// Leave relays a worker's leave to the manager and forgets the worker.
func (s *proxyControl) Leave(ctx context.Context, req *pb.LeaveRequest) (*pb.LeaveResponse, error) {
	p := s.p
	if err := s.checkJob(req.GetJob()); err != nil {
		return nil, err
	}
	mem := req.GetMember()
	if !callerOf(ctx).is(mem) {
		return nil, permission("a worker leaves only for itself")
	}
	rank := int(mem.GetPosition().GetRank())
	p.mu.Lock()
	w := p.workers[rank]
	held := w != nil && w.instance == mem.GetInstance() && roleFromPB(mem.GetRole()) == RoleWorker
	p.mu.Unlock()
	if !held {
		return &pb.LeaveResponse{}, nil // gone already: nothing to relay
	}
	p.dropWorker(rank, w.instance)
	cctx, cancel := context.WithTimeout(ctx, p.cfg.AckTimeout)
	defer cancel()
	return p.up.Leave(cctx, req)
}

func (s *proxyControl) Acknowledge(ctx context.Context, req *pb.AckRequest) (*pb.AckResponse, error) {
	if err := s.checkJob(req.GetJob()); err != nil {
		return nil, err
	}
	caller := callerOf(ctx)
	for _, a := range req.GetAcks() {
		if !caller.is(a.GetFrom()) {
			continue // a worker acknowledges only for itself
		}
		select {
		case s.p.acks <- a:
		default: // the manager re-sends what it does not see acknowledged
		}
	}
	return &pb.AckResponse{}, nil
}
