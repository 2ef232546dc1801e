package taskd

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
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

// TestHeartbeatsDoNotWaitForFaults: the fault log has a lock of its own
// and is written off it, so that a heartbeat is served while fault work
// holds that lock; a fault is acknowledged once it is on disk.
func TestHeartbeatsDoNotWaitForFaults(t *testing.T) {
	dir := t.TempDir()
	c := newCluster(t, insecureSec(), ManagerConfig{StateDir: dir})
	a := newRawMember(t, c.m.Addr().String(), c.job, insecureSec(), RoleWorker, Position{Node: 0, Rank: 0})
	b := newRawMember(t, c.m.Addr().String(), c.job, insecureSec(), RoleWorker, Position{Node: 0, Rank: 1})
	for _, r := range []*rawMember{a, b} {
		if err := r.register(); err != nil {
			t.Fatal(err)
		}
	}
	c.m.faults.mu.Lock()
	sent := make(chan error, 1)
	go func() {
		_, err := a.client.Send(a.ctx(), &pb.SendRequest{Job: c.job, Reports: []*pb.Report{{Id: "f1", From: a.self, Body: &pb.Report_Fault{Fault: &pb.FaultReport{Kind: "hang", Rank: 0}}}}})
		sent <- err
	}()
	_, err := b.client.Heartbeat(b.ctx(), &pb.HeartbeatRequest{Job: c.job, From: b.self, Beats: []*pb.Beat{{Member: b.self}}})
	c.m.faults.mu.Unlock()
	if err != nil {
		t.Fatalf("heartbeat while the fault log is busy: %v", err)
	}
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(filepath.Join(dir, "faults.jsonl"))
	if err != nil || !strings.Contains(string(data), `"id":"f1"`) {
		t.Fatalf("acknowledged fault not on disk: %q %v", data, err)
	}
}

// TestFaultFileCompacted: the state file is rewritten with the faults
// kept once it holds twice as many, and a restart reads them back.
func TestFaultFileCompacted(t *testing.T) {
	dir := t.TempDir()
	cfg := ManagerConfig{Job: "j", Listen: "127.0.0.1:0", Security: insecureSec(), StateDir: dir, MaxFaults: 10}
	m, err := NewManager(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 45 {
		m.faults.add(Fault{ID: fmt.Sprint(i), Kind: FaultHang}, t0)
		if i%3 == 0 {
			m.faults.flush()
		}
	}
	m.faults.flush()
	m.Close()
	data, err := os.ReadFile(filepath.Join(dir, "faults.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(data), "\n"); n > 20 {
		t.Fatalf("%d lines in the file, kept 10", n)
	}
	m, err = NewManager(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if got := m.Faults(0); len(got) != 10 || got[0].ID != "35" || got[9].Seq != 45 {
		t.Fatalf("after restart: %d faults, first %+v", len(got), got[0])
	}
}
