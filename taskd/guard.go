package taskd

import (
	"context"
	"crypto/subtle"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
)

// Bounds every server applies before it reads a call's body.
const (
	// maxStreamsPerConn bounds the calls in flight on one connection
	// (HTTP/2 MAX_CONCURRENT_STREAMS); a client queues past it.
	maxStreamsPerConn = 100
	// maxAnonCallsPerPeer bounds the calls in flight from one peer
	// address that name no member (registrations, operators' calls), over
	// all its connections; more are refused. The members' own calls do
	// not draw on it, so that a token holder's stalled registrations do
	// not refuse the heartbeats of the members sharing its address.
	maxAnonCallsPerPeer = 64
	// anonBodyDeadline bounds how long a call that names no member takes
	// to send its first message: a registration is a few hundred bytes,
	// and one that stalls gives its place back.
	anonBodyDeadline = 2 * time.Second
	// maxCallsPerWorker bounds the calls in flight of one worker, as its
	// secret names it, whatever connections and addresses it uses; a
	// proxy, which relays its node's workers, has maxCallsPerProxy.
	maxCallsPerWorker = 32
	maxCallsPerProxy  = 1000
	// maxHeaderBytes caps a call's header list, which is read before the
	// token is checked.
	maxHeaderBytes = 16 << 10
	// handshakeTimeout bounds a new connection's TLS and HTTP/2 handshake.
	handshakeTimeout = 5 * time.Second
	// idleTimeout closes a connection that has had no call in flight for
	// that long; a member always has its stream open.
	idleTimeout = 30 * time.Second
	// A peer address may fail authentication authFailureBurst times, and
	// then once every authFailureEvery; past that budget a connection that
	// fails is closed, and each new one may fail once. The address itself
	// is never shut out: the members of a node share it, and a call with
	// valid credentials is served whatever others from there got wrong.
	authFailureBurst = 10
	authFailureEvery = time.Second
	// authCheckDelay is how long, while its address is past that budget,
	// a call on a connection that has not authenticated waits before its
	// token is checked, right or wrong alike, so that the wait says
	// nothing of the token: a guesser there gets an answer a second on
	// each connection, and at most its address's pending connections at
	// once; a call carrying a member's secret does not wait.
	authCheckDelay = time.Second
	// silentGrace is how long a connection that has not sent a byte is
	// spared from being closed first for a newer one: a member's first
	// bytes follow its connect at once.
	silentGrace = 100 * time.Millisecond
	// The bytes of the messages begun and not yet whole, which gRPC holds
	// until they are, are bounded per worker and per peer address, in
	// messages of the largest size (MaxMessageBytes): a connection that
	// would pass either bound is closed.
	unfinishedPerWorker = 2
	unfinishedPerPeer   = 16
	// defaultMaxConnectionsPerPeer bounds the connections from one peer
	// address that authenticated, and apart from them those that have not
	// yet.
	defaultMaxConnectionsPerPeer = 256
)

// credential is what a call proved by its authorization header.
type credential int

const (
	// credOpen: the server takes no token; the transport (mutual TLS, or
	// plaintext when asked) is all there is.
	credOpen credential = iota
	// credMember: the job's token, which every member holds.
	credMember
	// credProxy: ManagerConfig.ProxyToken, which only proxies hold.
	credProxy
	// credAdmin: ManagerConfig.AdminToken, the operators'.
	credAdmin
)

// guardMetrics are the counters a guard keeps; the manager and the proxy
// register them under their own names.
type guardMetrics struct {
	authFailures prometheus.Counter
	calls        *prometheus.CounterVec // refused calls, by reason
	conns        *prometheus.CounterVec // refused connections, by reason
	open         prometheus.Gauge       // connections open
}

// guard admits connections to a server (its listener), and calls before
// their body is read (a gRPC tap handle, run as a call's headers arrive):
// it bounds the connections in all and from each peer address, checks the
// one token a call carries, rate-limits each address's failures, and
// bounds the calls in flight of each member, and apart from them those
// from each address that name no member. A refused call costs its
// headers, never its body.
//
// A connection is pending until a call on it authenticates. The pending
// connections of a peer address draw on a budget of their own, and a new
// one past it closes the oldest: connections that never authenticate (a
// peer that dials and stays silent, or keeps guessing) cannot shut out a
// member that shares their address, as every rank of a node or every pod
// behind one NAT does.
type guard struct {
	log *slog.Logger
	met guardMetrics
	// tokens maps an authorization value to what it proves; open says
	// that a call may carry none.
	tokens map[string]credential
	open   bool
	// maxConns bounds the connections open, maxPerPeer those from one
	// peer address.
	maxConns, maxPerPeer int
	// ids are the member secrets the server issued: every Control call
	// but Register must carry one.
	ids    *identities
	policy func(method string, cred credential) error

	mu        sync.Mutex
	peers     map[string]*peerState    // by peer IP, while it has connections or calls
	penalties map[string]*rate.Limiter // failures budget, by peer IP
	calls     map[identity]int         // calls in flight, by member
	// Bytes of messages begun and not yet whole, by peer IP and by
	// member, and their bounds.
	heldByPeer   map[string]int
	heldByMember map[identity]int
	maxMsg       int
	conns        int
	lastConn     uint64 // the number of the newest connection admitted

	refusals sync.Map // reason -> *refusalLog
}

// peerState is what a guard holds of one peer address.
type peerState struct {
	conns   map[string]*connState // open, by remote address
	pending []string              // remote addresses not yet authenticated, oldest first
	anon    int                   // calls in flight that name no member
}

// connState is what a guard holds of one connection.
type connState struct {
	c      net.Conn
	id     uint64    // its number, never reused (connOf)
	at     time.Time // accepted then
	spoke  bool      // it sent a byte
	authed bool      // a call on it authenticated
}

// authedLocked returns how many of ps's connections authenticated.
func (ps *peerState) authedLocked() int { return len(ps.conns) - len(ps.pending) }

// guardConfig is what a server's guard enforces.
type guardConfig struct {
	// tokens maps each token the server takes to what it proves; open
	// says that a call may carry none (credOpen): members hold no token.
	tokens               map[string]credential
	open                 bool
	maxConns, maxPerPeer int
	// maxMsg is the server's bound on a message (MaxMessageBytes).
	maxMsg int
	ids    *identities
	// policy, if set, refuses a call to method with cred.
	policy func(method string, cred credential) error
	met    guardMetrics
	log    *slog.Logger
}

func newGuard(c guardConfig) *guard {
	g := &guard{log: c.log, met: c.met, maxConns: c.maxConns, maxPerPeer: c.maxPerPeer, ids: c.ids, policy: c.policy, open: c.open,
		peers: make(map[string]*peerState), penalties: make(map[string]*rate.Limiter), calls: make(map[identity]int),
		heldByPeer: make(map[string]int), heldByMember: make(map[identity]int), maxMsg: orDefault(c.maxMsg, defaultMaxMessageBytes)}
	for token, cred := range c.tokens {
		if token == "" {
			continue
		}
		if g.tokens == nil {
			g.tokens = make(map[string]credential)
		}
		g.tokens["Bearer "+token] = cred
	}
	return g
}

// authKey carries a call's credential in its context.
type authKey struct{}

// connKey carries the number of a call's connection in its context.
type connKey struct{}

// connOf returns the number of the connection the call of ctx came on,
// unique for the server's life; 0 when unknown.
func connOf(ctx context.Context) uint64 {
	n, _ := ctx.Value(connKey{}).(uint64)
	return n
}

// callCredential returns what the call of ctx proved.
func callCredential(ctx context.Context) credential {
	c, _ := ctx.Value(authKey{}).(credential)
	return c
}

// peerLocked returns the state of ip, making it.
func (g *guard) peerLocked(ip string) *peerState {
	ps := g.peers[ip]
	if ps == nil {
		ps = &peerState{conns: make(map[string]*connState)}
		g.peers[ip] = ps
	}
	return ps
}

// forgetLocked drops the state of ip once it holds nothing.
func (g *guard) forgetLocked(ip string, ps *peerState) {
	if len(ps.conns) == 0 && ps.anon <= 0 {
		delete(g.peers, ip)
	}
}

// listen wraps l so that the connections it accepts are admitted first.
func (g *guard) listen(l net.Listener) net.Listener { return &guardListener{Listener: l, g: g} }

type guardListener struct {
	net.Listener
	g *guard
}

// Accept returns the next connection admitted; one refused is closed at
// once, before any handshake.
func (l *guardListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		addr := c.RemoteAddr().String()
		ip := peerHost(addr)
		reason, evicted := l.g.admit(ip, addr, c)
		if evicted != nil {
			l.g.met.conns.WithLabelValues("pending_limit").Inc()
			evicted.Close()
			l.g.logRefusal("connections closed", "pending_limit", ip, "")
		}
		if reason != "" {
			// Counted before the close: whoever sees the close sees it counted.
			l.g.met.conns.WithLabelValues(reason).Inc()
			c.Close()
			l.g.logRefusal("connections refused", reason, ip, "")
			continue
		}
		return &guardConn{Conn: c, g: l.g, ip: ip, addr: addr}, nil
	}
}

// admit takes a connection from ip in, pending, or returns why not. When
// ip's pending connections are at their budget, the oldest makes room: it
// is returned, forgotten, for the caller to close. One that never spoke
// (no byte read or waiting) past silentGrace goes first. A newcomer is
// never refused for the budget: a member calls within milliseconds of its
// connect, long before the connections that came after it are as many as
// the budget, while a connection kept for a grace once it spoke let a
// peer that sends a byte on each of 600 connections a second refuse its
// address's newcomers.
func (g *guard) admit(ip, addr string, c net.Conn) (reason string, evicted net.Conn) {
	now := time.Now()
	g.mu.Lock()
	defer g.mu.Unlock()
	ps := g.peerLocked(ip)
	if len(ps.pending) >= g.maxPerPeer {
		victim := ps.pending[0]
		for _, a := range ps.pending {
			cs := ps.conns[a]
			if now.Sub(cs.at) < silentGrace {
				break // the rest are newer
			}
			if !cs.spoke && !hasBytes(cs.c) {
				victim = a
				break
			}
			cs.spoke = true
		}
		evicted = ps.conns[victim].c
		g.dropLocked(ps, victim)
	}
	if g.conns >= g.maxConns {
		g.forgetLocked(ip, ps)
		return "limit", evicted
	}
	g.lastConn++
	ps.conns[addr] = &connState{c: c, id: g.lastConn, at: now}
	ps.pending = append(ps.pending, addr)
	g.conns++
	g.met.open.Set(float64(g.conns))
	return "", evicted
}

// dropLocked forgets the connection from addr.
func (g *guard) dropLocked(ps *peerState, addr string) {
	cs, ok := ps.conns[addr]
	if !ok {
		return
	}
	delete(ps.conns, addr)
	if !cs.authed {
		ps.pending = slices.DeleteFunc(ps.pending, func(a string) bool { return a == addr })
	}
	g.conns--
	g.met.open.Set(float64(g.conns))
}

// authenticated takes in that a call on the connection from addr
// authenticated. It reports false when ip's authenticated connections
// are at their bound: the connection stays pending, and its call is to
// be refused.
func (g *guard) authenticated(ip, addr string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	ps := g.peers[ip]
	if ps == nil {
		return true
	}
	cs := ps.conns[addr]
	if cs == nil || cs.authed {
		return true
	}
	if ps.authedLocked() >= g.maxPerPeer {
		return false
	}
	cs.authed = true
	ps.pending = slices.DeleteFunc(ps.pending, func(a string) bool { return a == addr })
	return true
}

// guardConn gives its place back when it closes, and tells its guard
// when it first speaks.
type guardConn struct {
	net.Conn
	g        *guard
	ip, addr string
	spoke    atomic.Bool
	once     sync.Once
}

func (c *guardConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 && !c.spoke.Load() {
		c.spoke.Store(true)
		c.g.mu.Lock()
		if ps := c.g.peers[c.ip]; ps != nil && ps.conns[c.addr] != nil {
			ps.conns[c.addr].spoke = true
		}
		c.g.mu.Unlock()
	}
	return n, err
}

func (c *guardConn) Close() error {
	c.once.Do(func() {
		g := c.g
		g.mu.Lock()
		if ps := g.peers[c.ip]; ps != nil {
			if cs := ps.conns[c.addr]; cs != nil && cs.c == c.Conn {
				g.dropLocked(ps, c.addr)
			}
			g.forgetLocked(c.ip, ps)
		}
		g.mu.Unlock()
	})
	return c.Conn.Close()
}

// failed takes in an authentication failure of the call from addr: past
// the address's budget, or when the address was past it as the check
// began (late), that connection is closed. Other connections from the
// address, and new ones, are not: each may still authenticate.
func (g *guard) failed(ip, addr string, late bool) {
	now := time.Now()
	g.mu.Lock()
	budget := g.penalties[ip]
	if budget == nil {
		if len(g.penalties) >= 4096 {
			// Addresses whose budget is full again are forgotten, so
			// that the table stays bounded.
			for k, b := range g.penalties {
				if b.TokensAt(now) >= authFailureBurst {
					delete(g.penalties, k)
				}
			}
		}
		budget = rate.NewLimiter(rate.Every(authFailureEvery), authFailureBurst)
		g.penalties[ip] = budget
	}
	var c net.Conn
	if !budget.AllowN(now, 1) || late {
		if ps := g.peers[ip]; ps != nil && ps.conns[addr] != nil {
			c = ps.conns[addr].c
			g.dropLocked(ps, addr)
		}
	}
	g.mu.Unlock()
	if c != nil {
		g.met.conns.WithLabelValues("auth_failures").Inc()
		c.Close()
		g.logRefusal("connection closed: too many authentication failures", "auth_failures", ip, "")
	}
}

// connOpen reports whether the guard still holds the connection from addr
// open; true when it never knew it.
func (g *guard) connOpen(ip, addr string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	ps := g.peers[ip]
	return addr == "" || (ps != nil && ps.conns[addr] != nil)
}

// guessedLately reports whether ip is past its budget of authentication
// failures and the connection from addr has not authenticated.
func (g *guard) guessedLately(ip, addr string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	b := g.penalties[ip]
	if b == nil || b.TokensAt(time.Now()) >= 1 {
		return false
	}
	ps := g.peers[ip]
	return ps == nil || ps.conns[addr] == nil || !ps.conns[addr].authed
}

// memberSecret returns the one secret of a call's member header, "" for
// none or several.
func memberSecret(values []string) string {
	if len(values) != 1 {
		return ""
	}
	return values[0]
}

// tap admits a call or refuses it, from its headers alone.
func (g *guard) tap(ctx context.Context, info *tap.Info) (context.Context, error) {
	ip, addr := peerAddr(ctx)
	if !g.connOpen(ip, addr) {
		// Closed by the guard (failures, or for a newer one): the calls
		// it had sent are not checked, so that guesses sent ahead on it
		// are answered by none.
		return nil, status.Error(codes.Unavailable, "taskd: connection closed")
	}
	late := g.guessedLately(ip, addr) && g.member(memberSecret(info.Header.Get(memberHeader))) == nil
	if late {
		t := time.NewTimer(authCheckDelay)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, status.FromContextError(ctx.Err()).Err()
		}
		if !g.connOpen(ip, addr) {
			return nil, status.Error(codes.Unavailable, "taskd: connection closed")
		}
	}
	cred, err := g.authenticate(info.Header.Get("authorization"))
	if err != nil {
		g.met.authFailures.Inc()
		g.refuse("unauthenticated", ip, info.FullMethodName)
		g.failed(ip, addr, late)
		return nil, err
	}
	if g.policy != nil {
		if err := g.policy(info.FullMethodName, cred); err != nil {
			g.refuse("permission", ip, info.FullMethodName)
			return nil, err
		}
	}
	caller, err := g.identify(info.FullMethodName, info.Header.Get(memberHeader))
	if err != nil {
		g.refuse("unknown_member", ip, info.FullMethodName)
		return nil, err
	}
	if !g.authenticated(ip, addr) {
		g.refuse("peer_limit", ip, info.FullMethodName)
		return nil, status.Errorf(codes.ResourceExhausted, "taskd: %d connections from %s authenticated, at most %d", g.maxPerPeer, ip, g.maxPerPeer)
	}
	g.mu.Lock()
	if caller == nil {
		ps := g.peerLocked(ip)
		if ps.anon >= maxAnonCallsPerPeer {
			g.mu.Unlock()
			g.refuse("anonymous_calls", ip, info.FullMethodName)
			return nil, status.Errorf(codes.ResourceExhausted, "taskd: %d calls in flight from %s that name no member, at most %d", maxAnonCallsPerPeer, ip, maxAnonCallsPerPeer)
		}
		ps.anon++
	} else {
		bound := maxCallsPerWorker
		if caller.key.role == RoleProxy {
			bound = maxCallsPerProxy
		}
		if g.calls[*caller] >= bound {
			g.mu.Unlock()
			g.refuse("member_calls", ip, info.FullMethodName)
			return nil, status.Errorf(codes.ResourceExhausted, "taskd: %s has %d calls in flight, at most %d", caller.key, bound, bound)
		}
		g.calls[*caller]++
	}
	var conn uint64
	if ps := g.peers[ip]; ps != nil && ps.conns[addr] != nil {
		conn = ps.conns[addr].id
	}
	g.mu.Unlock()
	ctx = context.WithValue(ctx, authKey{}, cred)
	ctx = context.WithValue(ctx, connKey{}, conn)
	stop := func() bool { return false }
	if caller != nil {
		ctx = context.WithValue(ctx, callerKey{}, caller)
	} else {
		// A call that names no member has anonBodyDeadline to send its
		// message (the server's stats handler stops the clock as it
		// arrives), so that a stalled one ends and frees its place.
		var cancel context.CancelCauseFunc
		ctx, cancel = context.WithCancelCause(ctx)
		t := time.AfterFunc(anonBodyDeadline, func() { cancel(errBodyDeadline) })
		stop = t.Stop
		ctx = context.WithValue(ctx, bodyClockKey{}, t)
	}
	// The call's context ends with the call, whatever ends it.
	context.AfterFunc(ctx, func() { stop(); g.release(ip, caller) })
	return ctx, nil
}

// errBodyDeadline is why a call that names no member and did not send its
// message within anonBodyDeadline was cancelled.
var errBodyDeadline = fmt.Errorf("taskd: no message within %v of the call's headers", anonBodyDeadline)

// bodyClockKey carries, in the context of a call that names no member,
// the timer that ends it unless its message arrives first.
type bodyClockKey struct{}

// messageArrived stops the body clock of the call of ctx, if it has one.
func messageArrived(ctx context.Context) {
	if t, _ := ctx.Value(bodyClockKey{}).(*time.Timer); t != nil {
		t.Stop()
	}
}

// release takes in the end of a call from ip, made by caller (nil for
// none).
func (g *guard) release(ip string, caller *identity) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if caller == nil {
		if ps := g.peers[ip]; ps != nil {
			ps.anon--
			g.forgetLocked(ip, ps)
		}
	} else {
		if g.calls[*caller]--; g.calls[*caller] <= 0 {
			delete(g.calls, *caller)
		}
	}
}

// authenticate checks the call's authorization values: none when the
// server is open, else exactly one, equal to a token the server knows,
// compared in constant time.
func (g *guard) authenticate(values []string) (credential, error) {
	if len(values) == 0 && (g.open || g.tokens == nil) {
		return credOpen, nil
	}
	if g.tokens == nil {
		return credOpen, nil // a token sent to a server that takes none
	}
	if len(values) != 1 {
		return 0, status.Errorf(codes.Unauthenticated, "taskd: %d authorization values, want exactly one", len(values))
	}
	got := []byte(values[0])
	found, cred := 0, credential(0)
	for want, c := range g.tokens {
		// Every token is compared, so that the time taken says nothing
		// of which one matched.
		if subtle.ConstantTimeCompare(got, []byte(want)) == 1 {
			found, cred = 1, c
		}
	}
	if found == 0 {
		return 0, status.Error(codes.Unauthenticated, "taskd: missing or wrong token")
	}
	return cred, nil
}

// identify returns the member a call's secret names. Every Control call
// but Register must carry a secret the server issued; a registration may,
// to prove that the instance registering again is the one it names.
func (g *guard) identify(method string, values []string) (*identity, error) {
	if g.ids == nil {
		return nil, nil
	}
	if len(values) == 1 {
		if id, ok := g.ids.lookup(values[0]); ok {
			return &id, nil
		}
	}
	if strings.HasPrefix(method, "/"+pb.Control_ServiceDesc.ServiceName+"/") && method != pb.Control_Register_FullMethodName {
		return nil, errUnknownMember
	}
	return nil, nil
}

// hold takes in that n more bytes (fewer, when n is negative) of messages
// not yet whole are held for who (nil: a call that names no member) from
// ip. It takes nothing, and reports false, when that would pass ip's
// bound or who's; a proxy, which relays its node's workers, holds what its
// address may.
func (g *guard) hold(ip string, who *identity, n int) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if n > 0 {
		if g.heldByPeer[ip]+n > unfinishedPerPeer*g.maxMsg {
			return false
		}
		if who != nil && who.key.role != RoleProxy && g.heldByMember[*who]+n > unfinishedPerWorker*g.maxMsg {
			return false
		}
	}
	if g.heldByPeer[ip] += n; g.heldByPeer[ip] <= 0 {
		delete(g.heldByPeer, ip)
	}
	if who != nil {
		if g.heldByMember[*who] += n; g.heldByMember[*who] <= 0 {
			delete(g.heldByMember, *who)
		}
	}
	return true
}

// member returns who secret names, nil when no member.
func (g *guard) member(secret string) *identity {
	if g.ids == nil || secret == "" {
		return nil
	}
	if id, ok := g.ids.lookup(secret); ok {
		return &id
	}
	return nil
}

// messageLimit counts and logs a connection closed for a call that
// declared a message beyond its method's bound (reason message_limit), or
// whose bytes held would pass its member's or its address's bound
// (unfinished_bytes).
func (g *guard) messageLimit(ip, method, reason string) {
	msg := "connection closed: a message beyond its method's bound"
	if reason == "unfinished_bytes" {
		msg = "connection closed: messages not yet whole beyond their member's or address's bound"
	}
	g.met.conns.WithLabelValues(reason).Inc()
	g.logRefusal(msg, reason, ip, method)
}

// refuse counts a refused call and logs it.
func (g *guard) refuse(reason, ip, method string) {
	g.met.calls.WithLabelValues(reason).Inc()
	g.logRefusal("calls refused", reason, ip, method)
}

// logRefusal logs a refusal at most once every ten seconds for each
// reason, with how many there were since.
func (g *guard) logRefusal(msg, reason, ip, method string) {
	v, _ := g.refusals.LoadOrStore(msg+"/"+reason, &refusalLog{s: rate.Sometimes{Interval: 10 * time.Second}})
	rl := v.(*refusalLog)
	n := rl.n.Add(1)
	rl.s.Do(func() {
		attrs := []any{"reason", reason, "count", n - rl.logged.Swap(n), "last_peer", ip}
		if method != "" {
			attrs = append(attrs, "last_method", method)
		}
		g.log.Warn("taskd: "+msg, attrs...)
	})
}

type refusalLog struct {
	s      rate.Sometimes
	n      atomic.Int64 // refused so far
	logged atomic.Int64 // n when last logged
}

// peerAddr returns the address of the call's peer, without and with its
// port.
func peerAddr(ctx context.Context) (ip, addr string) {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return "", ""
	}
	addr = p.Addr.String()
	return peerHost(addr), addr
}
