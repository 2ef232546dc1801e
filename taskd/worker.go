package taskd

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/faultline-ml/faultline/internal/promreg"
	pb "github.com/faultline-ml/faultline/internal/taskdpb"
	"github.com/faultline-ml/faultline/trace"
)

// WorkerConfig configures a Worker. The zero value of each field but Job,
// Node, Rank and Security means its documented default.
type WorkerConfig struct {
	// Job is the job's identifier; required.
	Job string
	// Node and Rank are the worker's node rank and global process rank.
	Node, Rank int
	// Upstream is the node's proxy, or the manager for a job without
	// proxies (with a standby, the managers' addresses separated by
	// commas, as ProxyConfig.Upstream); default "127.0.0.1:9602".
	Upstream string
	Security Security
	// OnSwitch applies a new profiling switch (a trace recorder, a Python
	// trainer's hook). An error is reported to the manager as the worker's
	// failure to apply it; the switch in force is the caller's to keep. Nil
	// accepts every switch.
	OnSwitch func(trace.Switch) error
	// OnMessage handles an application message from the manager; its error
	// is reported back. Nil acknowledges every message.
	OnMessage func(Message) error
	// Trainer is the training loop that orchestration (recovery, link
	// switch, stress test) pauses, repairs and resumes; see Trainer. The
	// worker starts it (Resume with Step -1) once registered, unless a
	// recovery holds the job. Nil: the worker refuses orchestration
	// messages, and recovery treats its rank as one it cannot pause.
	Trainer Trainer
	// QueueSize bounds the reports waiting for the manager (default 1024);
	// past it ReportFault and Send return ErrQueueFull.
	QueueSize int
	// AckTimeout bounds each upward call (default 3 s).
	AckTimeout time.Duration
	// MaxMessageBytes caps each message (default 4 MiB).
	MaxMessageBytes int
	// ReconnectMax caps the backoff between attempts to register again
	// (default 5 s).
	ReconnectMax time.Duration
	// Observability; nil means off.
	Registerer prometheus.Registerer
	Logger     *slog.Logger
}

// Validate reports the first field that is wrong.
func (c WorkerConfig) Validate() error {
	switch {
	case c.Job == "":
		return errors.New("taskd: WorkerConfig.Job: empty")
	case c.Node < 0:
		return fmt.Errorf("taskd: WorkerConfig.Node: %d is negative", c.Node)
	case c.Rank < 0:
		return fmt.Errorf("taskd: WorkerConfig.Rank: %d is negative", c.Rank)
	case c.QueueSize < 0:
		return fmt.Errorf("taskd: WorkerConfig.QueueSize: %d is negative", c.QueueSize)
	case negative(c.AckTimeout, c.ReconnectMax):
		return negativeDuration("WorkerConfig", "AckTimeout", c.AckTimeout, "ReconnectMax", c.ReconnectMax)
	case c.MaxMessageBytes < 0 || (c.MaxMessageBytes > 0 && c.MaxMessageBytes < 64<<10):
		return fmt.Errorf("taskd: WorkerConfig.MaxMessageBytes: %d is below 64 KiB", c.MaxMessageBytes)
	}
	return c.Security.Validate()
}

// Worker is the control plane's end inside a training process: it
// registers its rank, sends heartbeats, applies the profiling switch and
// messages pushed to it, and reports faults. It reconnects and registers
// again on its own after a proxy or manager restart, keeping the reports
// not yet acknowledged.
type Worker struct {
	cfg     WorkerConfig
	log     *slog.Logger
	met     *workerMetrics
	metrics *promreg.Registrar
	conn    *grpc.ClientConn
	client  pb.ControlClient
	up      *uplink
	self    *pb.Member
	acks    chan *pb.Ack
	cred    *memberCred // the secret its upstream issued
	fence   memberFence

	ops chan trainerOp // trainer calls, one at a time

	mu         sync.Mutex
	sw         trace.Switch
	hasSwitch  bool
	swVersion  uint64
	results    map[uint64]msgResult // recent message ids -> their outcome
	resultRing []uint64
	ringNext   int
	done       *idSet // keys of the commands carried out (orchMsg.Once)
	registered int    // registrations so far
	started    bool   // the trainer was started, or left for a recovery to start
	// held is set while an orchestration holds the trainer: paused by
	// it, or left unstarted for it to start; heldBy is the instance of
	// the manager that holds it.
	held   bool
	heldBy string

	connected atomic.Bool
	taken     atomic.Bool // the manager answered the last registration: another live instance holds the rank
	otherJob  atomic.Pointer[string]
	finished  atomic.Bool
	lifecycle
}

// NewWorker validates cfg and prepares a worker; Run connects it.
func NewWorker(cfg WorkerConfig) (*Worker, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Upstream = orDefault(cfg.Upstream, DefaultProxyAddr)
	cfg.QueueSize = orDefault(cfg.QueueSize, 1024)
	cfg.AckTimeout = orDefault(cfg.AckTimeout, defaultAckTimeout)
	cfg.MaxMessageBytes = orDefault(cfg.MaxMessageBytes, defaultMaxMessageBytes)
	cfg.ReconnectMax = orDefault(cfg.ReconnectMax, 5*time.Second)
	log := discardIfNil(cfg.Logger).With("component", "taskd-worker", "job", cfg.Job, "rank", cfg.Rank)
	metrics := promreg.New(cfg.Registerer, "taskd: WorkerConfig.Registerer")
	met := newWorkerMetrics(metrics)
	if err := metrics.Err(); err != nil {
		return nil, err
	}
	cred := &memberCred{}
	conn, err := dial(cfg.Upstream, cfg.Security, cfg.MaxMessageBytes, log, cred.dialOptions()...)
	if err != nil {
		metrics.UnregisterAll()
		return nil, fmt.Errorf("taskd: worker dial %s: %w", cfg.Upstream, err)
	}
	w := &Worker{
		cred:       cred,
		cfg:        cfg,
		log:        log,
		met:        met,
		metrics:    metrics,
		conn:       conn,
		client:     pb.NewControlClient(conn),
		self:       memberPB(RoleWorker, Position{Node: cfg.Node, Rank: cfg.Rank}, newInstanceID()),
		acks:       make(chan *pb.Ack, 4096),
		ops:        make(chan trainerOp, 64),
		results:    make(map[uint64]msgResult),
		resultRing: make([]uint64, 1024),
		done:       newIDSet(64),
	}
	w.init()
	w.up = &uplink{
		job: cfg.Job, self: w.self, queue: newReportQueue(cfg.QueueSize), maxMsg: cfg.MaxMessageBytes, ackTimeout: cfg.AckTimeout, log: log,
		overflow: w.met.overflow.Inc, queued: func(n int) { w.met.queued.Set(float64(n)) },
	}
	return w, nil
}

// ReportFault queues a fault for the manager. An empty ID is filled in; a
// zero Position means this worker's, a zero Time now. A worker reports its
// own faults only: the manager takes a fault about a rank from that rank,
// its node's proxy or the manager's embedder. It returns ErrQueueFull
// when the queue is full.
func (w *Worker) ReportFault(f Fault) error {
	own := Position{Node: w.cfg.Node, Rank: w.cfg.Rank}
	if f.Position == (Position{}) {
		f.Position = own
	}
	if f.Position != own {
		return fmt.Errorf("taskd: Fault.Position: %s is not this worker's (%s); a fault about a rank is that rank's, its node's proxy's or the manager's to report", f.Position, own)
	}
	return w.up.reportFault(f)
}

// Send queues an application message for the manager's handlers.
func (w *Worker) Send(kind string, payload []byte) error { return w.up.send(kind, payload) }

// Switch returns the profiling switch the worker applied last, and false
// when it has applied none.
func (w *Worker) Switch() (trace.Switch, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.sw, w.hasSwitch
}

// Finish records that this rank ran its last step. The worker leaves the
// job when it stops (Close, or the end of Run's context), and its leave
// then says it finished: once every rank of the job left finished, the
// manager records the job complete (EventJobComplete). Without Finish, the
// leave only says that the worker's silence is no fault.
func (w *Worker) Finish() { w.finished.Store(true) }

// Connected reports whether the worker is registered and streaming now.
func (w *Worker) Connected() bool { return w.connected.Load() }

// Taken reports whether the manager refused this worker's last
// registration because another live instance holds its rank: a process
// that replaced this one elsewhere, say, while this one was cut off. It
// is false again once a registration succeeds.
func (w *Worker) Taken() bool { return w.taken.Load() }

// OtherJob returns the job the upstream serves when it refused this
// worker's last registration as one of a job it does not serve (a job
// that went on under another name, an elastic job's new shape, without
// this worker), and "" otherwise: "" again once a registration succeeds.
// The worker keeps registering under its own job.
func (w *Worker) OtherJob() string {
	if p := w.otherJob.Load(); p != nil {
		return *p
	}
	return ""
}

// Pending returns how many reports wait for the manager's acknowledgement.
func (w *Worker) Pending() int { return w.up.queue.len() }

// Run keeps the worker registered until ctx ends or Close is called, then
// returns nil; or until the manager refuses this instance as evicted by
// recovery, then returns ErrEvicted, or refuses its position (one the
// job's shape does not hold), then returns an error wrapping
// ErrPosition. On the way out it lets a trainer
// call in progress end, sends what is queued and leaves the job (see
// Close). Run may be called once.
func (w *Worker) Run(ctx context.Context) error {
	if err := w.begin("Worker"); err != nil {
		return err
	}
	defer w.end()
	defer w.conn.Close()
	// Sessions end at once; the trainer's context outlives them by up to
	// closeGrace, so that a call that is ending (a Stop, after which the
	// process exits) is acknowledged rather than cut short.
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	tctx, tcancel := context.WithCancel(context.WithoutCancel(ctx))
	defer tcancel()
	stopping := make(chan struct{})
	watched := make(chan struct{})
	served := make(chan struct{}) // serve returned: evicted, or ctx ended
	go func() {
		defer close(watched)
		select {
		case <-w.closed:
		case <-ctx.Done():
		case <-served:
		}
		close(stopping)
		cancel()
	}()
	trainerDone := make(chan struct{})
	go func() {
		defer close(trainerDone)
		w.runTrainer(tctx, stopping)
	}()
	err := w.serve(sctx)
	close(served)
	<-watched
	grace := time.NewTimer(closeGrace)
	select {
	case <-trainerDone:
	case <-grace.C:
		tcancel()
		<-trainerDone
	}
	grace.Stop()
	if err == nil {
		w.flush() // an evicted instance can send nothing more, nor leave
	}
	return err
}

// registrations returns how many times the worker registered.
func (w *Worker) registrations() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.registered
}

// closeGrace bounds how long a worker that stops waits for a trainer call
// in progress, and then how long it spends sending what is queued.
const closeGrace = time.Second

// serve registers again after each session ends, with backoff, until ctx
// ends (nil), the instance is evicted (ErrEvicted) or its position is
// refused (ErrPosition).
func (w *Worker) serve(ctx context.Context) error {
	retry := newRetry(50*time.Millisecond, w.cfg.ReconnectMax)
	for {
		start, n := time.Now(), w.registrations()
		err := w.session(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if errors.Is(err, ErrEvicted) {
			w.log.Info("taskd: this instance was evicted by recovery; its successor takes the rank")
			return ErrEvicted
		}
		if errors.Is(err, ErrPosition) {
			w.log.Error("taskd: the manager refuses this worker's position", "err", err)
			return err
		}
		retry.ended(w.registrations() > n, time.Since(start) > 2*w.cfg.ReconnectMax)
		wait := retry.wait(err, time.Now())
		if served, ok := servedJob(err); ok {
			w.otherJob.Store(&served)
		}
		if status.Code(err) == codes.AlreadyExists {
			w.taken.Store(true)
			w.met.refused.Inc()
			w.log.Warn("taskd: registration refused: another live instance holds this rank", "err", err)
		} else {
			w.log.Info("taskd: disconnected; registering again", "err", err, "in", wait)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
	}
}

// flush sends the reports and then the acknowledgements still queued (a
// fault the trainer reported before its call returned is logged before
// the call is acknowledged), and then the leave, for at most closeGrace
// (AckTimeout if shorter). What does not get through is lost: the manager
// re-sends its messages and times out its calls, and a worker whose leave
// is lost is declared lost.
func (w *Worker) flush() {
	ctx, cancel := context.WithTimeout(context.Background(), min(closeGrace, w.cfg.AckTimeout))
	defer cancel()
	for n := w.up.queue.len(); n > 0; {
		if err := w.up.sendBatch(ctx, w.client); err != nil {
			w.log.Debug("taskd: reports not delivered on close", "pending", n, "err", err)
			break
		}
		left := w.up.queue.len()
		if left >= n {
			break
		}
		n = left
	}
	for {
		var acks []*pb.Ack
	drain:
		for len(acks) < maxAckBatch {
			select {
			case a := <-w.acks:
				acks = append(acks, a)
			default:
				break drain
			}
		}
		if len(acks) == 0 {
			break
		}
		if _, err := w.client.Acknowledge(ctx, &pb.AckRequest{Job: w.cfg.Job, Acks: acks}); err != nil {
			w.log.Debug("taskd: acknowledgements not delivered on close", "count", len(acks), "err", err)
			break
		}
	}
	w.mu.Lock()
	registered := w.registered > 0
	w.mu.Unlock()
	if !registered {
		return
	}
	finished := w.finished.Load()
	if _, err := w.client.Leave(ctx, &pb.LeaveRequest{Job: w.cfg.Job, Member: w.self, Finished: finished}); err != nil {
		w.log.Warn("taskd: could not tell the manager that the worker leaves; it will be declared lost", "err", err)
		return
	}
	w.log.Info("taskd: left the job", "finished", finished)
}

// Close stops the worker and waits for Run to return. A trainer call in
// progress gets up to a second to end, its context still live; then the
// acknowledgements and reports queued are sent, and the worker leaves the
// job, for up to a second more (AckTimeout if shorter), so that a trainer
// that exits right after a Stop does not leave the manager waiting out its
// deadline, and a worker that stops on purpose is not taken for a lost
// one. Then it unregisters the worker's metrics; call it also after Run
// returned on its own. It is idempotent.
func (w *Worker) Close() error {
	w.close(func() { w.conn.Close() }, w.metrics.UnregisterAll)
	return nil
}

var (
	errReregister     = errors.New("taskd: upstream does not know this member")
	errManagerChanged = errors.New("taskd: another manager instance serves the job")
)

// holder returns the manager instance whose orchestration holds the
// trainer, "" when none does.
func (w *Worker) holder() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.held {
		return ""
	}
	return w.heldBy
}

// session registers, opens the stream and serves until something breaks.
func (w *Worker) session(ctx context.Context) error {
	w.mu.Lock()
	bits, has := w.sw.Bits(), w.hasSwitch
	w.mu.Unlock()
	host, _ := os.Hostname()
	rctx, cancel := context.WithTimeout(ctx, w.cfg.AckTimeout)
	resp, err := w.client.Register(rctx, &pb.RegisterRequest{Job: w.cfg.Job, Member: w.self, SwitchBits: bits, HasSwitch: has, Hostname: host, Pid: int64(os.Getpid()), Fence: w.fence.newest()}, grpc.WaitForReady(true))
	cancel()
	switch status.Code(err) {
	case codes.FailedPrecondition:
		return fmt.Errorf("%w: %v", ErrEvicted, err)
	case codes.InvalidArgument:
		return fmt.Errorf("%w: %v", ErrPosition, err)
	}
	if err != nil {
		return err
	}
	if err := w.fence.admit(resp.GetFence()); err != nil {
		w.met.fenced.Inc()
		return err
	}
	w.cred.set(resp.GetSecret())
	mgr, held := resp.GetManagerInstance(), resp.GetHeld()
	w.mu.Lock()
	if held && !w.started && w.cfg.Trainer != nil {
		// Noted at once, even if the stream does not open: the hold is
		// then known when the worker registers again.
		w.held, w.heldBy, w.started = true, mgr, true
		w.log.Info("taskd: an orchestration holds the job; the trainer waits for it to resume")
	}
	w.mu.Unlock()
	interval := time.Duration(resp.GetHeartbeatIntervalMs()) * time.Millisecond
	deadline := time.Duration(resp.GetHeartbeatDeadlineMs()) * time.Millisecond
	if interval <= 0 || deadline <= interval {
		interval, deadline = DefaultHeartbeatInterval, DefaultHeartbeatDeadline
	}
	sctx, scancel := context.WithCancel(ctx)
	defer scancel()
	stream, err := w.client.Stream(sctx, &pb.StreamRequest{Job: w.cfg.Job, Member: w.self})
	if err != nil {
		return err
	}
	w.mu.Lock()
	w.registered++
	if w.registered > 1 {
		w.met.reconnects.Inc()
	}
	var op *trainerOp
	switch {
	case w.cfg.Trainer == nil:
	case !w.started:
		op = &trainerOp{kind: kindResume, payload: []byte(`{"resume":{"step":-1}}`), mgr: mgr}
	default:
		// Registered again: after the trainer calls queued so far, see
		// whether the manager serving now still holds what holds the
		// trainer (see runTrainer).
		op = &trainerOp{kind: kindResume, payload: []byte(`{"resume":{"step":-1,"released":true}}`), mgr: mgr, check: checkHold, held: held}
	}
	w.started = true
	w.mu.Unlock()
	if op != nil {
		select {
		case w.ops <- *op:
		case <-ctx.Done():
			return nil
		}
	}
	w.connected.Store(true)
	w.taken.Store(false)
	w.otherJob.Store(nil)
	defer w.connected.Store(false)
	w.log.Debug("taskd: registered", "upstream", w.cfg.Upstream)
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
			w.handle(env, mgr)
		}
	})
	// Behind a proxy, a manager restart does not end this session: the
	// proxy registers its workers again on their behalf. A held trainer
	// needs the new manager's word on the hold, which registering gives.
	answered := func(resp *pb.HeartbeatResponse) error {
		if unknowsSelf(resp, w.self) {
			return errReregister
		}
		if err := w.fence.admit(resp.GetFence()); err != nil {
			w.met.fenced.Inc()
			return err
		}
		if instance := resp.GetManagerInstance(); instance != "" && instance != mgr && w.holder() != "" {
			return errManagerChanged
		}
		return nil
	}
	g.Go(func() error {
		return heartbeats(gctx, w.client, w.cfg.Job, w.self, &w.fence, interval, deadline, nil, answered)
	})
	g.Go(func() error { return w.up.run(gctx, w.client) })
	g.Go(func() error { return runAcks(gctx, w.client, w.cfg.Job, w.acks, w.cfg.AckTimeout, w.log) })
	return g.Wait()
}

// heartbeats sends a heartbeat every interval until ctx ends, with the
// newest token that fence admitted. It returns errReregister when the
// upstream refuses self's credentials, and an error when no heartbeat got
// through for longer than deadline. beats, if set, adds the beats of
// members behind self, before each heartbeat; answered is told each
// answer, and its error ends the heartbeats.
func heartbeats(ctx context.Context, client pb.ControlClient, job string, self *pb.Member, fence *memberFence, interval, deadline time.Duration, beats func() []*pb.Beat, answered func(*pb.HeartbeatResponse) error) error {
	tick := time.NewTicker(interval)
	defer tick.Stop()
	lastOK := time.Now()
	for {
		req := &pb.HeartbeatRequest{Job: job, From: self, Beats: []*pb.Beat{{Member: self}}, Fence: fence.newest()}
		if beats != nil {
			req.Beats = append(req.Beats, beats()...)
		}
		cctx, cancel := context.WithTimeout(ctx, interval)
		resp, err := client.Heartbeat(cctx, req)
		cancel()
		switch {
		case err == nil:
			lastOK = time.Now()
			if err := answered(resp); err != nil {
				return err
			}
		case ctx.Err() != nil:
			return nil
		case status.Code(err) == codes.Unauthenticated:
			return fmt.Errorf("%w: %v", errReregister, err) // its secret is unknown: the upstream restarted
		case time.Since(lastOK) > deadline:
			return fmt.Errorf("taskd: no heartbeat through for %v: %w", deadline, err)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// unknowsSelf reports whether a heartbeat's answer says that the
// upstream no longer knows self.
func unknowsSelf(resp *pb.HeartbeatResponse, self *pb.Member) bool {
	return slices.ContainsFunc(resp.GetUnknown(), func(u *pb.Member) bool { return keyOf(u) == keyOf(self) })
}

// handle applies one envelope, received in a session with manager
// instance mgr, and queues its acknowledgement.
func (w *Worker) handle(env *pb.Envelope, mgr string) {
	if err := w.fence.admit(env.GetFence()); err != nil {
		// A deposed manager's command, which its successor may contradict:
		// not carried out, and not answered.
		w.met.fenced.Inc()
		w.log.Warn("taskd: message refused", "id", env.GetId(), "err", err)
		return
	}
	var errMsg, kind string
	var reply []byte
	switch body := env.GetBody().(type) {
	case *pb.Envelope_Switch:
		kind = "switch"
		errMsg = w.applySwitch(body.Switch.GetVersion(), body.Switch.GetDocument())
	case *pb.Envelope_Message:
		kind = "message"
		res := w.applyMessage(env.GetId(), env.GetFence(), body.Message, mgr)
		if !res.done {
			return // acknowledged when the trainer call ends
		}
		errMsg, reply = res.err, res.reply
	default:
		kind = "other"
		errMsg = "taskd: a worker does not handle this message"
	}
	w.ack(env.GetId(), kind, errMsg, reply)
}

// ack counts a message handled and queues its acknowledgement.
func (w *Worker) ack(id uint64, kind, errMsg string, reply []byte) {
	result := "ok"
	if errMsg != "" {
		result = "error"
	}
	w.met.applied.WithLabelValues(kind, result).Inc()
	select {
	case w.acks <- &pb.Ack{Id: id, From: w.self, Error: cut(errMsg, maxAckErrorBytes), Reply: reply}:
	default: // the manager re-sends what it does not see acknowledged
	}
}

// applySwitch applies a switch unless it is the one in force or older
// than it (a late copy that took another path).
func (w *Worker) applySwitch(version uint64, doc string) string {
	sw, err := trace.ParseSwitch([]byte(doc))
	if err != nil {
		return err.Error()
	}
	w.mu.Lock()
	skip := w.hasSwitch && (w.sw == sw || version < w.swVersion)
	w.mu.Unlock()
	if skip {
		return ""
	}
	if w.cfg.OnSwitch != nil {
		if err := w.cfg.OnSwitch(sw); err != nil {
			w.log.Warn("taskd: switch not applied", "switch", sw.String(), "err", err)
			return err.Error()
		}
	}
	w.mu.Lock()
	w.sw, w.hasSwitch, w.swVersion = sw, true, version
	w.mu.Unlock()
	w.log.Info("taskd: profiling switch applied", "switch", sw.String())
	return ""
}

// msgResult is the outcome of a message: its ack error and reply, or not
// done while a trainer call for it runs.
type msgResult struct {
	err   string
	reply []byte
	done  bool
}

// trainerOp is one call of the trainer: an orchestration message (id > 0)
// or one the worker makes itself (id 0): the start, or the check that
// follows a registration.
type trainerOp struct {
	id      uint64
	kind    string
	payload []byte
	// mgr is the manager instance of the session that asked.
	mgr string
	// fence is the fencing token the message came with: checked again
	// just before the call, since a newer term may have been admitted
	// while the call waited behind others.
	fence uint64
	check opCheck
	held  bool // checkHold: the manager said an orchestration holds the job
}

type opCheck int

const (
	// checkHold makes the call only if an orchestration of a manager
	// other than mgr holds the trainer and mgr holds nothing: the
	// manager restarted, and no resume will come.
	checkHold opCheck = iota + 1
)

// applyMessage hands a message to OnMessage, or an orchestration message
// to the trainer, once; a re-sent copy gets the first result again, or
// nothing while the trainer call runs.
func (w *Worker) applyMessage(id, fence uint64, msg *pb.UserMessage, mgr string) msgResult {
	w.mu.Lock()
	if res, seen := w.results[id]; seen {
		w.mu.Unlock()
		return res
	}
	w.mu.Unlock()
	if isOrchestration(msg.GetKind()) {
		if w.cfg.Trainer == nil {
			res := msgResult{err: "taskd: this worker has no trainer", done: true}
			w.remember(id, res)
			return res
		}
		w.remember(id, msgResult{})
		select {
		case w.ops <- trainerOp{id: id, kind: msg.GetKind(), payload: msg.GetPayload(), mgr: mgr, fence: fence}:
			return msgResult{}
		default:
			res := msgResult{err: "taskd: trainer busy: too many calls queued", done: true}
			w.remember(id, res)
			return res
		}
	}
	res := msgResult{done: true}
	if w.cfg.OnMessage != nil {
		if err := w.cfg.OnMessage(Message{ID: strconv.FormatUint(id, 10), Kind: msg.GetKind(), Payload: msg.GetPayload()}); err != nil {
			res.err = err.Error()
		}
	}
	w.remember(id, res)
	return res
}

// remember records the outcome of message id, replacing an earlier one.
func (w *Worker) remember(id uint64, res msgResult) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if _, ok := w.results[id]; ok {
		w.results[id] = res
		return
	}
	if old := w.resultRing[w.ringNext]; old != 0 {
		delete(w.results, old)
	}
	w.resultRing[w.ringNext] = id
	w.ringNext = (w.ringNext + 1) % len(w.resultRing)
	w.results[id] = res
}

// runTrainer makes the trainer calls one at a time until stopping is
// closed, and acknowledges each message when its call returns.
func (w *Worker) runTrainer(ctx context.Context, stopping <-chan struct{}) {
	for {
		var op trainerOp
		select {
		case <-stopping:
			return
		case op = <-w.ops:
		}
		select {
		case <-stopping:
			return // a call that came with the stop is not started
		default:
		}
		if op.check == checkHold && !w.releases(op) {
			continue
		}
		if err := w.fence.admit(op.fence); err != nil {
			// Admitted when it came, but a newer term was admitted while
			// it waited: its manager is deposed. Not carried out, and not
			// answered, as if refused on arrival.
			w.met.fenced.Inc()
			w.log.Warn("taskd: queued orchestration command refused", "id", op.id, "call", op.kind, "err", err)
			continue
		}
		once := onceOf(op.payload)
		w.mu.Lock()
		carried := once != "" && w.done.has(once)
		w.mu.Unlock()
		if carried {
			// A manager that took over sent it again: answered, not
			// carried out twice.
			w.log.Info("taskd: orchestration command carried out already", "call", op.kind, "once", once)
			w.remember(op.id, msgResult{done: true})
			w.ack(op.id, "message", "", nil)
			continue
		}
		start := time.Now()
		reply, err := callTrainer(ctx, w.cfg.Trainer, op.kind, op.payload)
		if err == nil {
			w.mu.Lock()
			if once != "" {
				w.done.add(once)
			}
			switch op.kind {
			case kindPause:
				w.held, w.heldBy = true, op.mgr
			case kindResume, kindStop:
				w.held = false
			}
			w.mu.Unlock()
		}
		if err != nil {
			w.log.Warn("taskd: trainer call failed", "call", op.kind, "took", time.Since(start), "err", err)
		} else {
			w.log.Debug("taskd: trainer call done", "call", op.kind, "took", time.Since(start))
		}
		if op.id == 0 {
			if err != nil && ctx.Err() == nil {
				w.log.Error("taskd: the trainer did not start", "err", err)
				if ferr := w.ReportFault(Fault{Kind: FaultOpError, Message: "trainer did not start: " + err.Error()}); ferr != nil {
					w.log.Error("taskd: fault not reported", "err", ferr)
				}
			}
			continue
		}
		res := msgResult{reply: reply, done: true}
		if err != nil {
			res.err = err.Error()
		}
		w.remember(op.id, res)
		w.ack(op.id, "message", res.err, res.reply)
	}
}

// releases decides a checkHold op: whether the trainer, held by an
// orchestration, is to be resumed because the manager that held it is
// gone and the one serving now (op.mgr) holds nothing. A manager that
// restarted has no orchestration in progress: nothing else would resume
// the trainer. When the new manager holds the job, its orchestration
// resumes the trainer with the other ranks: the hold is now its.
func (w *Worker) releases(op trainerOp) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case !w.held || w.heldBy == op.mgr:
		return false
	case op.held:
		w.heldBy = op.mgr
		return false
	}
	w.log.Warn("taskd: the manager whose orchestration held the trainer is gone, and the one serving now holds nothing; resuming the trainer from its own state",
		"held_by", w.heldBy, "manager", op.mgr)
	return true
}
