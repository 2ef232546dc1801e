package taskd

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
)

// rawMember is a member that speaks the protocol itself, as a buggy or
// hostile peer would.
type rawMember struct {
	t      testing.TB
	job    string
	conn   *grpc.ClientConn
	client pb.ControlClient
	self   *pb.Member
}

func newRawMember(t testing.TB, addr, job string, sec Security, role Role, pos Position) *rawMember {
	t.Helper()
	conn, err := dial(addr, sec, DefaultMaxMessageBytes, discardIfNil(nil))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &rawMember{t: t, job: job, conn: conn, client: pb.NewControlClient(conn), self: memberPB(role, pos, newInstanceID())}
}

func (r *rawMember) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	r.t.Cleanup(cancel)
	return ctx
}

func (r *rawMember) register() error {
	_, err := r.client.Register(r.ctx(), &pb.RegisterRequest{Job: r.job, Member: r.self})
	return err
}

// TestHeartbeatAgeClamped: a heartbeat's age is clamped to the deadline
// and never moves a member's last sight past now, so that a member sending
// an absurd age still expires.
func TestHeartbeatAgeClamped(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{})
	r := newRawMember(t, c.m.Addr().String(), c.job, insecureSec(), RoleWorker, Position{Node: 0, Rank: 0})
	if err := r.register(); err != nil {
		t.Fatal(err)
	}
	for _, age := range []int64{-1 << 62, 1 << 62, 9_300_000_000_000} {
		if _, err := r.client.Heartbeat(r.ctx(), &pb.HeartbeatRequest{Job: c.job, From: r.self, Beats: []*pb.Beat{{Member: r.self, AgeMs: age}}}); err != nil {
			t.Fatal(err)
		}
		for _, mi := range c.m.Members() {
			if mi.LastSeen.After(time.Now()) {
				t.Fatalf("age %d: last seen %v, in the future", age, mi.LastSeen)
			}
		}
	}
	waitFor(t, 20*time.Second, "the silent member lost", func() bool { return len(c.m.Members()) == 0 })
}
