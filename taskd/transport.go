package taskd

import (
	"context"
	"log/slog"
	"strings"
	"time"

	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
)

// Defaults shared by the three roles, for the flags of their commands.
const (
	DefaultHeartbeatInterval = time.Second
	DefaultHeartbeatDeadline = 5 * time.Second
	DefaultManagerAddr       = ":9601"
	DefaultProxyAddr         = "127.0.0.1:9602"
)

// Defaults that the configs' documentation states.
const (
	defaultAckTimeout      = 3 * time.Second
	defaultMaxMessageBytes = 4 << 20
	defaultRateLimit       = 2000 // calls per second per connection
	// defaultMaxWorkers bounds ranks and nodes when a job's shape is not
	// known.
	defaultMaxWorkers = 16384
)

// limits are a server's per-connection rate limit and message size cap.
type limits struct {
	maxMsg  int
	rate    float64 // calls per second; <= 0 unlimited
	burst   int
	limited func() // counts a refused call
}

type connLimiterKey struct{}

// connLimits attaches a rate limiter to each connection's context, from
// which every call on that connection inherits it.
type connLimits struct{ l limits }

func (h connLimits) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	if h.l.rate <= 0 {
		return ctx
	}
	return context.WithValue(ctx, connLimiterKey{}, rate.NewLimiter(rate.Limit(h.l.rate), h.l.burst))
}
func (connLimits) HandleConn(context.Context, stats.ConnStats)                     {}
func (connLimits) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }

// HandleRPC stops the body clock of a call that names no member as its
// message arrives.
func (connLimits) HandleRPC(ctx context.Context, s stats.RPCStats) {
	if _, ok := s.(*stats.InPayload); ok {
		messageArrived(ctx)
	}
}

func (l limits) allow(ctx context.Context) error {
	lim, _ := ctx.Value(connLimiterKey{}).(*rate.Limiter)
	if lim == nil || lim.Allow() {
		return nil
	}
	if l.limited != nil {
		l.limited()
	}
	return status.Error(codes.ResourceExhausted, "taskd: rate limit of this connection exceeded")
}

// newServer builds a gRPC server with security, the guard's admission of
// each call before its body is read, size cap, rate limit, bounds on
// streams, headers and handshakes, and keepalive settings that find dead
// peers within seconds and close idle connections.
func newServer(sec Security, l limits, g *guard, log *slog.Logger) *grpc.Server {
	opts := []grpc.ServerOption{
		grpc.Creds(limitCreds{TransportCredentials: sec.serverCreds(log), g: g}),
		grpc.InTapHandle(g.tap),
		grpc.MaxConcurrentStreams(maxStreamsPerConn),
		grpc.MaxHeaderListSize(maxHeaderBytes),
		grpc.ConnectionTimeout(handshakeTimeout),
		grpc.MaxRecvMsgSize(l.maxMsg),
		grpc.MaxSendMsgSize(l.maxMsg),
		grpc.StatsHandler(connLimits{l}),
		grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			if err := l.allow(ctx); err != nil {
				return nil, err
			}
			return h(ctx, req)
		}),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			if err := l.allow(ss.Context()); err != nil {
				return err
			}
			return h(srv, ss)
		}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 2 * time.Second, PermitWithoutStream: true}),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: 10 * time.Second, Timeout: 5 * time.Second, MaxConnectionIdle: idleTimeout}),
	}
	return grpc.NewServer(opts...)
}

// dial returns a client connection to addr; gRPC connects lazily and
// reconnects by itself. addr may list addresses separated by commas (the
// job's managers, of which only the leader listens): the connection is to
// the first that accepts, in order, and moves on when it fails.
func dial(addr string, sec Security, maxMsg int, log *slog.Logger, extra ...grpc.DialOption) (*grpc.ClientConn, error) {
	addrs := splitAddrs(addr)
	opts := append(sec.dialOptions(addrs, log), extra...)
	opts = append(opts,
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMsg), grpc.MaxCallSendMsgSize(maxMsg)),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: 10 * time.Second, Timeout: 5 * time.Second, PermitWithoutStream: true}),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 2 * time.Second},
			MinConnectTimeout: 2 * time.Second,
		}),
	)
	if len(addrs) == 1 {
		return grpc.NewClient("passthrough:///"+addr, opts...)
	}
	// gRPC's pick_first policy tries the addresses in order.
	r := manual.NewBuilderWithScheme("taskd")
	var state resolver.State
	for _, a := range addrs {
		state.Addresses = append(state.Addresses, resolver.Address{Addr: a})
	}
	r.InitialState(state)
	return grpc.NewClient(r.Scheme()+":///managers", append(opts, grpc.WithResolvers(r))...)
}

// splitAddrs returns the addresses of a list separated by commas, blanks
// trimmed and empty ones left out.
func splitAddrs(list string) []string {
	var out []string
	for a := range strings.SplitSeq(list, ",") {
		if a = strings.TrimSpace(a); a != "" {
			out = append(out, a)
		}
	}
	if len(out) == 0 {
		return []string{list}
	}
	return out
}

func orDefault[T comparable](v, def T) T {
	var zero T
	if v == zero {
		return def
	}
	return v
}

func discardIfNil(l *slog.Logger) *slog.Logger {
	if l == nil {
		return slog.New(slog.DiscardHandler)
	}
	return l
}
