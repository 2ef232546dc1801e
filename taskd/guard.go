package taskd

import (
	"context"
	"crypto/subtle"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"
)

// Bounds every server applies before it reads a call's body.
const (
	// maxStreamsPerConn bounds the calls in flight on one connection
	// (HTTP/2 MAX_CONCURRENT_STREAMS); a client queues past it.
	maxStreamsPerConn = 100
	// maxStreamsPerPeer bounds the calls in flight from one peer address
	// over all its connections; more are refused.
	maxStreamsPerPeer = 1000
	// maxHeaderBytes caps a call's header list, which is read before the
	// token is checked.
	maxHeaderBytes = 16 << 10
	// handshakeTimeout bounds a new connection's TLS and HTTP/2 handshake.
	handshakeTimeout = 5 * time.Second
	// idleTimeout closes a connection that has had no call in flight for
	// that long; a member always has its stream open.
	idleTimeout = 30 * time.Second
)

// credential is what a call proved by its authorization header.
type credential int

const (
	// credOpen: the server takes no token; the transport (mutual TLS, or
	// plaintext when asked) is all there is.
	credOpen credential = iota
	// credMember: the job's token, which every member holds.
	credMember
)

// guardMetrics are the counters a guard keeps; the manager and the proxy
// register them under their own names.
type guardMetrics struct {
	authFailures prometheus.Counter
	calls        *prometheus.CounterVec // refused calls, by reason
}

// guard admits calls to a server before their body is read (a gRPC tap
// handle, run as a call's headers arrive): it checks the one token the
// call carries and bounds the calls in flight from each peer address. A
// refused call costs its headers, never its body.
type guard struct {
	log *slog.Logger
	met guardMetrics
	// tokens maps an authorization value to what it proves; empty when the
	// server takes no token.
	tokens map[string]credential

	mu    sync.Mutex
	peers map[string]*peerState // by peer IP

	refusals sync.Map // reason -> *refusalLog
}

// peerState is what a guard holds of one peer address.
type peerState struct {
	streams int // calls in flight
}

func newGuard(sec Security, met guardMetrics, log *slog.Logger) *guard {
	g := &guard{log: log, met: met, peers: make(map[string]*peerState)}
	if sec.Token != "" {
		g.tokens = map[string]credential{"Bearer " + sec.Token: credMember}
	}
	return g
}

// authKey carries a call's credential in its context.
type authKey struct{}

// callCredential returns what the call of ctx proved.
func callCredential(ctx context.Context) credential {
	c, _ := ctx.Value(authKey{}).(credential)
	return c
}

// tap admits a call or refuses it, from its headers alone.
func (g *guard) tap(ctx context.Context, info *tap.Info) (context.Context, error) {
	ip := peerIP(ctx)
	cred, err := g.authenticate(info.Header.Get("authorization"))
	if err != nil {
		g.met.authFailures.Inc()
		g.refuse("unauthenticated", ip, info.FullMethodName)
		return nil, err
	}
	g.mu.Lock()
	ps := g.peers[ip]
	if ps == nil {
		ps = &peerState{}
		g.peers[ip] = ps
	}
	if ps.streams >= maxStreamsPerPeer {
		g.mu.Unlock()
		g.refuse("streams", ip, info.FullMethodName)
		return nil, status.Errorf(codes.ResourceExhausted, "taskd: %d calls in flight from %s, at most %d", maxStreamsPerPeer, ip, maxStreamsPerPeer)
	}
	ps.streams++
	g.mu.Unlock()
	ctx = context.WithValue(ctx, authKey{}, cred)
	// The call's context ends with the call, whatever ends it.
	context.AfterFunc(ctx, func() { g.release(ip) })
	return ctx, nil
}

func (g *guard) release(ip string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if ps := g.peers[ip]; ps != nil {
		ps.streams--
		if ps.streams <= 0 {
			delete(g.peers, ip)
		}
	}
}

// authenticate checks the call's authorization values: exactly one, equal
// to a token the server knows, compared in constant time.
func (g *guard) authenticate(values []string) (credential, error) {
	if g.tokens == nil {
		return credOpen, nil
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

// refuse counts a refused call and logs it, at most once every ten
// seconds for each reason, with how many were refused since.
func (g *guard) refuse(reason, ip, method string) {
	g.met.calls.WithLabelValues(reason).Inc()
	v, _ := g.refusals.LoadOrStore(reason, &refusalLog{s: rate.Sometimes{Interval: 10 * time.Second}})
	rl := v.(*refusalLog)
	n := rl.n.Add(1)
	rl.s.Do(func() {
		g.log.Warn("taskd: calls refused", "reason", reason, "count", n-rl.logged.Swap(n), "last_peer", ip, "last_method", method)
	})
}

type refusalLog struct {
	s      rate.Sometimes
	n      atomic.Int64 // refused so far
	logged atomic.Int64 // n when last logged
}

// peerIP returns the address of the call's peer without its port.
func peerIP(ctx context.Context) string {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return ""
	}
	return peerHost(p.Addr.String())
}
