package taskd

import (
	"context"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
)

// memberHeader carries a member's secret on every call after its
// registration.
const memberHeader = "taskd-member"

// identity is who a member secret proves a caller to be: the member that
// registered and was issued it.
type identity struct {
	key      memberKey
	instance string
	node     int
}

// is reports whether the identity is mem.
func (id *identity) is(mem *pb.Member) bool {
	return id != nil && keyOf(mem) == id.key && mem.GetInstance() == id.instance
}

// identities holds the secrets a server issued to the members that
// registered with it. Its lock is its own: the guard looks a secret up as
// a call's headers arrive.
type identities struct {
	mu       sync.RWMutex
	bySecret map[string]identity
	byKey    map[memberKey]string // the secret of the member at each key
}

func newIdentities() *identities {
	return &identities{bySecret: make(map[string]identity), byKey: make(map[memberKey]string)}
}

// issue returns the secret of id: the one it holds when the same instance
// registers again, else a new one, which replaces what its key held.
func (ids *identities) issue(id identity) string {
	ids.mu.Lock()
	defer ids.mu.Unlock()
	if old, ok := ids.byKey[id.key]; ok {
		if ids.bySecret[old].instance == id.instance {
			return old
		}
		delete(ids.bySecret, old)
	}
	secret := newInstanceID() + newInstanceID() // 256 random bits
	ids.bySecret[secret] = id
	ids.byKey[id.key] = secret
	return secret
}

// revoke forgets the secret of the member at key, if instance holds it.
func (ids *identities) revoke(key memberKey, instance string) {
	ids.mu.Lock()
	defer ids.mu.Unlock()
	if old, ok := ids.byKey[key]; ok && ids.bySecret[old].instance == instance {
		delete(ids.bySecret, old)
		delete(ids.byKey, key)
	}
}

// lookup returns the member that secret was issued to.
func (ids *identities) lookup(secret string) (identity, bool) {
	ids.mu.RLock()
	defer ids.mu.RUnlock()
	id, ok := ids.bySecret[secret]
	return id, ok
}

type callerKey struct{}

// callerOf returns the member that a call's secret proved, nil when it
// carried none (a registration).
func callerOf(ctx context.Context) *identity {
	id, _ := ctx.Value(callerKey{}).(*identity)
	return id
}

// errUnknownMember is what a call with a secret the server does not know
// gets (it restarted, or the member was dropped): register again.
var errUnknownMember = status.Error(codes.Unauthenticated, "taskd: unknown member credential: register again")

// permission is the error of a call that claims to act for another member.
func permission(format string, args ...any) error {
	return status.Errorf(codes.PermissionDenied, "taskd: "+format, args...)
}

// memberCred attaches a member's secret to every call it makes.
type memberCred struct{ secret atomic.Pointer[string] }

func (c *memberCred) set(secret string) { c.secret.Store(&secret) }

func (c *memberCred) attach(ctx context.Context) context.Context {
	if s := c.secret.Load(); s != nil && *s != "" {
		return metadata.AppendToOutgoingContext(ctx, memberHeader, *s)
	}
	return ctx
}

// dialOptions make every call on a connection carry the secret.
func (c *memberCred) dialOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			return invoker(c.attach(ctx), method, req, reply, cc, opts...)
		}),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			return streamer(c.attach(ctx), desc, cc, method, opts...)
		}),
	}
}
