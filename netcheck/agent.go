package netcheck

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/faultline-ml/faultline/internal/promreg"
)

// Defaults of AgentConfig.
const (
	// DefaultAgentAddr is where an agent listens unless told otherwise.
	DefaultAgentAddr = ":9700"
	// DefaultAgentMaxBytes is the most one request moves each way.
	DefaultAgentMaxBytes = 1 << 30
)

// AgentConfig configures an Agent. The zero value of every field is a
// documented default.
type AgentConfig struct {
	// Listen is the TCP address to serve on. Default DefaultAgentAddr.
	Listen string
	// MaxBytes is the most one request moves each way, all its repeats
	// together, so that a stray client cannot keep the link busy.
	// Default DefaultAgentMaxBytes, 1 GiB.
	MaxBytes int64
	// IdleTimeout closes a connection on which nothing moves for this
	// long. Default 30 s.
	IdleTimeout time.Duration
	// MaxProbeTimeout caps the deadline a checker may give a probe this
	// agent runs to a peer. Default 2 min.
	MaxProbeTimeout time.Duration
	// MaxConns bounds the connections served at once; more are closed at
	// once, so that stray clients cannot pile up buffers. A check needs
	// two per agent at a time. Default 256.
	MaxConns int
	// Logger receives failed requests at debug level; nil discards them.
	Logger *slog.Logger
	// Registerer receives the agent's metrics; nil means none.
	Registerer prometheus.Registerer
}

// Validate reports a field that cannot work.
func (c AgentConfig) Validate() error {
	var errs []error
	if c.MaxBytes < 0 {
		errs = append(errs, fmt.Errorf("AgentConfig.MaxBytes = %d: must not be negative", c.MaxBytes))
	}
	if c.IdleTimeout < 0 {
		errs = append(errs, fmt.Errorf("AgentConfig.IdleTimeout = %v: must not be negative", c.IdleTimeout))
	}
	if c.MaxProbeTimeout < 0 {
		errs = append(errs, fmt.Errorf("AgentConfig.MaxProbeTimeout = %v: must not be negative", c.MaxProbeTimeout))
	}
	if c.MaxConns < 0 {
		errs = append(errs, fmt.Errorf("AgentConfig.MaxConns = %d: must not be negative", c.MaxConns))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("netcheck: %w", err)
	}
	return nil
}

// Agent is the probe endpoint that runs on every node: it answers
// transfers from peers and checkers, and runs the probes a checker asks it
// to run to a peer. It serves whoever reaches it, within MaxBytes and
// MaxProbeTimeout, so listen on the cluster network only.
type Agent struct {
	cfg      AgentConfig
	log      *slog.Logger
	ln       net.Listener
	reg      *promreg.Registrar
	requests *prometheus.CounterVec
	bytes    *prometheus.CounterVec

	mu      sync.Mutex
	conns   map[net.Conn]struct{}
	closed  bool
	running bool
	wg      sync.WaitGroup
	stop    chan struct{} // closed by Close
	done    chan struct{} // closed when Run returns
}

// NewAgent listens on cfg.Listen; serve with Run.
func NewAgent(cfg AgentConfig) (*Agent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Listen = cmp.Or(cfg.Listen, DefaultAgentAddr)
	cfg.MaxBytes = cmp.Or(cfg.MaxBytes, DefaultAgentMaxBytes)
	cfg.IdleTimeout = cmp.Or(cfg.IdleTimeout, 30*time.Second)
	cfg.MaxProbeTimeout = cmp.Or(cfg.MaxProbeTimeout, 2*time.Minute)
	cfg.MaxConns = cmp.Or(cfg.MaxConns, 256)
	log := cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	r := promreg.New(cfg.Registerer, "netcheck: AgentConfig.Registerer")
	f := promauto.With(r)
	a := &Agent{
		cfg: cfg,
		log: log,
		reg: r,
		requests: f.NewCounterVec(prometheus.CounterOpts{
			Name: "faultline_netcheck_agent_requests_total",
			Help: "Requests served by the netcheck agent, by operation (transfer, probe; connect for connections past MaxConns) and result (ok, error, refused).",
		}, []string{"op", "result"}),
		bytes: f.NewCounterVec(prometheus.CounterOpts{
			Name: "faultline_netcheck_agent_bytes_total",
			Help: "Probe payload bytes moved by the netcheck agent, by direction (received, sent).",
		}, []string{"direction"}),
		conns: make(map[net.Conn]struct{}),
		stop:  make(chan struct{}),
		done:  make(chan struct{}),
	}
	if err := r.Err(); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		r.UnregisterAll()
		return nil, fmt.Errorf("netcheck: agent: %w", err)
	}
	a.ln = ln
	return a, nil
}

// Addr returns the address the agent listens on.
func (a *Agent) Addr() net.Addr { return a.ln.Addr() }

// Run serves until ctx ends (it returns ctx.Err()) or Close is called (it
// returns nil), then closes every connection and waits for their
// goroutines. It may be called once.
func (a *Agent) Run(ctx context.Context) error {
	a.mu.Lock()
	if a.running {
		a.mu.Unlock()
		return errors.New("netcheck: Agent.Run called twice")
	}
	a.running = true
	a.mu.Unlock()
	defer close(a.done)

	parent := ctx
	ctx, cancel := context.WithCancel(ctx)
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		select {
		case <-ctx.Done():
		case <-a.stop:
		}
		a.shutdown()
	}()
	for {
		conn, err := a.ln.Accept()
		if err != nil {
			cancel()
			<-watched
			a.wg.Wait()
			select {
			case <-a.stop:
				return nil
			default:
			}
			if err := parent.Err(); err != nil {
				return err
			}
			return fmt.Errorf("netcheck: agent: %w", err)
		}
		if tracked, full := a.track(conn); !tracked {
			if full {
				a.requests.WithLabelValues("connect", "refused").Inc()
				a.log.Debug("netcheck agent: too many connections", "peer", conn.RemoteAddr().String(), "max", a.cfg.MaxConns)
			}
			conn.Close()
			continue
		}
		a.wg.Add(1)
		go func() {
			defer a.wg.Done()
			defer a.untrack(conn)
			a.serve(ctx, conn)
		}()
	}
}

// shutdown stops accepting and unblocks every connection.
func (a *Agent) shutdown() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return
	}
	a.closed = true
	a.ln.Close()
	for c := range a.conns {
		c.Close()
	}
}

// track adds c to the connections served, unless the agent is closed or
// serves MaxConns already (full).
func (a *Agent) track(c net.Conn) (tracked, full bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	switch {
	case a.closed:
		return false, false
	case len(a.conns) >= a.cfg.MaxConns:
		return false, true
	}
	a.conns[c] = struct{}{}
	return true, false
}

func (a *Agent) untrack(c net.Conn) {
	a.mu.Lock()
	delete(a.conns, c)
	a.mu.Unlock()
	c.Close()
}

// Close stops Run and waits for it, or, if Run was never called, closes
// the listener; then it unregisters the agent's metrics. It is safe to
// call more than once.
func (a *Agent) Close() error {
	a.mu.Lock()
	running := a.running
	select {
	case <-a.stop:
	default:
		close(a.stop)
	}
	a.mu.Unlock()
	if running {
		<-a.done
	} else {
		a.shutdown()
	}
	a.reg.UnregisterAll()
	return nil
}

// idleConn extends the deadline before every read and write, so that a
// long transfer lives as long as it moves.
type idleConn struct {
	net.Conn
	idle time.Duration
}

func (c idleConn) Read(b []byte) (int, error) {
	c.Conn.SetDeadline(time.Now().Add(c.idle))
	return c.Conn.Read(b)
}

func (c idleConn) Write(b []byte) (int, error) {
	c.Conn.SetDeadline(time.Now().Add(c.idle))
	return c.Conn.Write(b)
}

func (a *Agent) serve(ctx context.Context, raw net.Conn) {
	conn := idleConn{Conn: raw, idle: a.cfg.IdleTimeout}
	op, err := readOp(conn)
	if err != nil {
		a.failed("unknown", raw, err)
		return
	}
	switch op {
	case opTransfer:
		err = a.serveTransfer(conn)
		a.count("transfer", raw, err)
	case opProbe:
		err = a.serveProbe(ctx, raw)
		a.count("probe", raw, err)
	default:
		a.failed("unknown", raw, fmt.Errorf("unknown operation %q", op))
	}
}

func (a *Agent) count(op string, conn net.Conn, err error) {
	if err != nil {
		a.failed(op, conn, err)
		return
	}
	a.requests.WithLabelValues(op, "ok").Inc()
}

func (a *Agent) failed(op string, conn net.Conn, err error) {
	a.requests.WithLabelValues(op, "error").Inc()
	a.log.Debug("netcheck agent: request failed", "op", op, "peer", conn.RemoteAddr().String(), "err", err)
}

func (a *Agent) serveTransfer(conn idleConn) error {
	var b [transferLen]byte
	if _, err := io.ReadFull(conn, b[:]); err != nil {
		return err
	}
	h := parseTransferHeader(b[:])
	// Divide rather than multiply, so that no header can overflow.
	perRepeat := uint64(a.cfg.MaxBytes) / uint64(max(h.repeats, 1))
	if h.pings > maxPings || h.repeats > maxRepeats || max(h.up, h.down) > perRepeat {
		msg := fmt.Sprintf("transfer of %d up and %d down bytes × %d repeats, %d pings exceeds %d bytes each way, %d pings or %d repeats",
			h.up, h.down, h.repeats, h.pings, a.cfg.MaxBytes, maxPings, maxRepeats)
		refuse(conn, msg)
		return errors.New(msg)
	}
	if _, err := conn.Write([]byte{0}); err != nil {
		return err
	}
	var ping [8]byte
	for range h.pings {
		if _, err := io.ReadFull(conn, ping[:]); err != nil {
			return err
		}
		if _, err := conn.Write(ping[:]); err != nil {
			return err
		}
	}
	buf := make([]byte, chunk)
	for r := range h.repeats {
		got, err := receive(conn, buf, int64(h.up))
		a.bytes.WithLabelValues("received").Add(float64(got))
		if r > 0 && got == 0 && errors.Is(err, io.ErrUnexpectedEOF) {
			return nil // the client had enough repeats
		}
		if err != nil {
			return err
		}
		if _, err := conn.Write(ping[:1]); err != nil {
			return err
		}
		sent, err := send(conn, buf, int64(h.down))
		a.bytes.WithLabelValues("sent").Add(float64(sent))
		if err != nil {
			return err
		}
	}
	return nil
}

func (a *Agent) serveProbe(ctx context.Context, conn net.Conn) error {
	conn.SetDeadline(time.Now().Add(a.cfg.IdleTimeout))
	var req probeRequest
	if err := readJSON(conn, &req); err != nil {
		return fmt.Errorf("read probe request: %w", err)
	}
	var m Measurement
	switch {
	case req.Pings < 0 || req.Pings > maxPings:
		m.Error = fmt.Sprintf("probe with %d pings: want 0 to %d", req.Pings, maxPings)
	case req.Repeats < 1 || req.Repeats > maxRepeats:
		m.Error = fmt.Sprintf("probe with %d repeats: want 1 to %d", req.Repeats, maxRepeats)
	case req.Bytes <= 0 || req.Bytes > a.cfg.MaxBytes/int64(req.Repeats):
		m.Error = fmt.Sprintf("probe of %d bytes × %d repeats: want 1 to %d bytes in all", req.Bytes, req.Repeats, a.cfg.MaxBytes)
	case req.Timeout <= 0:
		m.Error = fmt.Sprintf("probe timeout %v: must be positive", req.Timeout)
	default:
		timeout := min(req.Timeout, a.cfg.MaxProbeTimeout)
		conn.SetDeadline(time.Now().Add(timeout + a.cfg.IdleTimeout))
		pctx, cancel := context.WithTimeout(ctx, timeout)
		var err error
		m, err = measure(pctx, &net.Dialer{}, req.Peer, load{bytes: req.Bytes, pings: req.Pings, repeats: req.Repeats})
		cancel()
		if err != nil {
			m.Error = err.Error()
		}
	}
	if err := writeJSON(conn, m); err != nil {
		return fmt.Errorf("answer probe request: %w", err)
	}
	if m.Error != "" {
		return errors.New(m.Error)
	}
	return nil
}
