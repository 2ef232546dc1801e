package taskd

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/trace"
)

// rawMember is a member that speaks the protocol itself, as a buggy or
// hostile peer would.
type rawMember struct {
	t      testing.TB
	job    string
	conn   *grpc.ClientConn
	client pb.ControlClient
	self   *pb.Member
	cred   *memberCred
}

func newRawMember(t testing.TB, addr, job string, sec Security, role Role, pos Position) *rawMember {
	t.Helper()
	cred := &memberCred{}
	conn, err := dial(addr, sec, defaultMaxMessageBytes, discardIfNil(nil), cred.dialOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &rawMember{t: t, job: job, conn: conn, client: pb.NewControlClient(conn), self: memberPB(role, pos, newInstanceID()), cred: cred}
}

func (r *rawMember) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	r.t.Cleanup(cancel)
	return ctx
}

// register registers the member and keeps the secret it is issued.
func (r *rawMember) register() error {
	resp, err := r.client.Register(r.ctx(), &pb.RegisterRequest{Job: r.job, Member: r.self})
	if err == nil {
		r.cred.set(resp.GetSecret())
	}
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
	testkit.WaitFor(t, "the silent member lost", func() bool { return len(c.m.Members()) == 0 })
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

// h2Conn is a bare HTTP/2 client connection, for calls no gRPC client
// would make: a body that never ends, headers beyond any sane size.
type h2Conn struct {
	t   testing.TB
	c   net.Conn
	fr  *http2.Framer
	hb  bytes.Buffer
	enc *hpack.Encoder // one per connection: HPACK is stateful
	// settings are the server's first SETTINGS.
	settings map[http2.SettingID]uint32
}

func newH2Conn(t testing.TB, addr string) *h2Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.WriteString(c, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	h := &h2Conn{t: t, c: c, fr: http2.NewFramer(c, c), settings: map[http2.SettingID]uint32{}}
	h.enc = hpack.NewEncoder(&h.hb)
	h.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	if err := h.fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	for {
		f, err := h.fr.ReadFrame()
		if err != nil {
			t.Fatal(err)
		}
		if sf, ok := f.(*http2.SettingsFrame); ok && !sf.IsAck() {
			sf.ForeachSetting(func(s http2.Setting) error { h.settings[s.ID] = s.Val; return nil })
			h.fr.WriteSettingsAck()
			return h
		}
	}
}

// call opens stream id for method with the given authorization and extra
// headers, and sends the first bytes of a gRPC message that declares
// length bytes and never ends. A write the server refused (it may hang up
// on a call) shows in what status reads.
func (h *h2Conn) call(id uint32, method, auth string, extra map[string]string, length uint32, sent int) {
	h.send(id, method, auth, extra, length, sent)
}

// tryCall is call without extra headers; it reports whether every write
// went through.
func (h *h2Conn) tryCall(id uint32, method, auth string, length uint32, sent int) bool {
	return h.send(id, method, auth, nil, length, sent) == nil
}

func (h *h2Conn) send(id uint32, method, auth string, extra map[string]string, length uint32, sent int) error {
	h.hb.Reset()
	enc := h.enc
	for _, kv := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":path", method}, {":authority", "x"}, {"content-type", "application/grpc"}, {"te", "trailers"}} {
		enc.WriteField(hpack.HeaderField{Name: kv[0], Value: kv[1]})
	}
	if auth != "" {
		enc.WriteField(hpack.HeaderField{Name: "authorization", Value: auth})
	}
	for k, v := range extra {
		enc.WriteField(hpack.HeaderField{Name: k, Value: v})
	}
	block := h.hb.Bytes()
	first := min(len(block), 16<<10)
	if err := h.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: block[:first], EndHeaders: first == len(block)}); err != nil {
		return err
	}
	for rest := block[first:]; len(rest) > 0; {
		n := min(len(rest), 16<<10)
		if err := h.fr.WriteContinuation(id, n == len(rest), rest[:n]); err != nil {
			return err
		}
		rest = rest[n:]
	}
	msg := make([]byte, 5+sent)
	binary.BigEndian.PutUint32(msg[1:], length)
	for len(msg) > 0 {
		n := min(len(msg), 16<<10)
		if err := h.fr.WriteData(id, false, msg[:n]); err != nil {
			return err
		}
		msg = msg[n:]
	}
	return nil
}

// status reads frames until stream id ends, and returns its grpc-status
// ("" when the server reset the stream or hung up without one).
func (h *h2Conn) status(id uint32) string {
	h.t.Helper()
	for {
		f, err := h.fr.ReadFrame()
		if err != nil {
			return ""
		}
		switch f := f.(type) {
		case *http2.MetaHeadersFrame:
			if f.StreamID == id {
				if s := f.PseudoValue("status"); s != "" && s != "200" {
					return "http " + s
				}
				for _, hf := range f.RegularFields() {
					if hf.Name == "grpc-status" {
						return hf.Value
					}
				}
			}
		case *http2.RSTStreamFrame:
			if f.StreamID == id {
				return ""
			}
		case *http2.GoAwayFrame:
			return ""
		}
	}
}

// statuses reads frames until each of streams 1, 3, … 2n-1 has ended, and
// returns their grpc-status by stream ("" for a reset without one); it
// stops early when the server hangs up.
func (h *h2Conn) statuses(n int) map[uint32]string {
	h.t.Helper()
	got := map[uint32]string{}
	for len(got) < n {
		f, err := h.fr.ReadFrame()
		if err != nil {
			return got
		}
		switch f := f.(type) {
		case *http2.MetaHeadersFrame:
			if _, done := got[f.StreamID]; done {
				continue
			}
			if s := f.PseudoValue("status"); s != "" && s != "200" {
				got[f.StreamID] = "http " + s
				continue
			}
			for _, hf := range f.RegularFields() {
				if hf.Name == "grpc-status" {
					got[f.StreamID] = hf.Value
				}
			}
		case *http2.RSTStreamFrame:
			if _, done := got[f.StreamID]; !done {
				got[f.StreamID] = ""
			}
		case *http2.GoAwayFrame:
			return got
		}
	}
	return got
}

// TestRefusedBeforeTheBody: a call with a wrong token is refused from its
// headers, while its body is still coming; headers are capped; streams per
// connection are bounded.
func TestRefusedBeforeTheBody(t *testing.T) {
	token := "0123456789abcdef0123456789abcdef"
	c := newCluster(t, Security{Insecure: true, Token: token}, ManagerConfig{})
	h := newH2Conn(t, c.m.Addr().String())
	if n, ok := h.settings[http2.SettingMaxConcurrentStreams]; !ok || n > maxStreamsPerConn {
		t.Fatalf("the server allows %d streams per connection (set: %v)", n, ok)
	}
	if n, ok := h.settings[http2.SettingMaxHeaderListSize]; !ok || n > maxHeaderBytes {
		t.Fatalf("the server takes a header list of %d bytes (set: %v)", n, ok)
	}
	// 4 MiB declared, 16 KiB sent, never more: refused at once.
	h.call(1, "/faultline.taskd.v1.Control/Send", "Bearer wrong", nil, 4<<20, 16<<10)
	if got := h.status(1); got != fmt.Sprint(int(codes.Unauthenticated)) {
		t.Fatalf("a wrong token with a body still coming: status %q, want Unauthenticated", got)
	}
	h.call(3, "/faultline.taskd.v1.Control/Send", "", nil, 4<<20, 16<<10)
	if got := h.status(3); got != fmt.Sprint(int(codes.Unauthenticated)) {
		t.Fatalf("no token: status %q, want Unauthenticated", got)
	}
	// Two authorization values: the right one is not enough.
	h.call(5, "/faultline.taskd.v1.Control/Send", "Bearer wrong", map[string]string{"authorization": "Bearer " + token}, 4<<20, 16<<10)
	if got := h.status(5); got != fmt.Sprint(int(codes.Unauthenticated)) {
		t.Fatalf("two authorization values: status %q, want Unauthenticated", got)
	}
	if n := counterValue(c.m.met.guard.authFailures); n != 3 {
		t.Fatalf("auth failures counted: %v", n)
	}
	// 20 KiB of headers with the right token: refused.
	big := newH2Conn(t, c.m.Addr().String())
	big.call(1, "/faultline.taskd.v1.Control/Send", "Bearer "+token, map[string]string{"x-pad": strings.Repeat("x", 20<<10)}, 10, 10)
	if got := big.status(1); got == "0" {
		t.Fatal("a header list of 20 KiB was taken")
	}
}

// TestStreamsPerPeerBounded: the calls in flight that name no member (a
// registration) have a small budget of each peer address, apart from the
// members' calls, which are bounded per member: a token holder's 1,000
// stalled registrations, from the address the members share, refuse none
// of their calls, and each ends at its body deadline, freeing its place.
func TestStreamsPerPeerBounded(t *testing.T) {
	const token = "0123456789abcdef0123456789abcdef"
	sec := Security{Insecure: true, Token: token}
	reg := prometheus.NewRegistry()
	// The members that open the calls never beat: a long deadline keeps
	// them registered however slow the machine.
	c := newCluster(t, sec, ManagerConfig{Registerer: reg, HeartbeatDeadline: 10 * time.Minute})
	addr := c.m.Addr().String()
	live := newRawMember(t, addr, c.job, sec, RoleWorker, Position{Rank: 0})
	other := newRawMember(t, addr, c.job, sec, RoleWorker, Position{Rank: 2})
	for _, r := range []*rawMember{live, other} {
		if err := r.register(); err != nil {
			t.Fatal(err)
		}
	}
	// 10 connections of 100 registrations with the token, each declaring
	// a body it never sends.
	var attack []*h2Conn
	for range 10 {
		h := newH2Conn(t, addr)
		for id := uint32(1); id < 2*maxStreamsPerConn; id += 2 {
			h.call(id, pb.Control_Register_FullMethodName, "Bearer "+token, nil, 100, 0)
		}
		attack = append(attack, h)
	}
	refused := func() float64 {
		return gathered(t, reg)[`faultline_taskd_calls_refused_total{reason="anonymous_calls"}`]
	}
	testkit.WaitFor(t, "the stalled registrations past their budget refused", func() bool { return refused() >= 500 })
	for i := range 10 {
		if _, err := live.client.Heartbeat(live.ctx(), &pb.HeartbeatRequest{Job: c.job, Beats: []*pb.Beat{{Member: live.self}}}); err != nil {
			t.Fatalf("heartbeat %d of a member beside the stalled registrations: %v", i, err)
		}
	}
	again := newRawMember(t, addr, c.job, sec, RoleWorker, Position{Rank: 0})
	again.self = live.self
	again.cred.set(*live.cred.secret.Load())
	if err := again.register(); err != nil {
		t.Fatalf("a member reconnecting with its secret beside the stalled registrations: %v", err)
	}
	// A member's calls are bounded per member, from whatever address.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for range maxCallsPerWorker {
		if _, err := live.client.Upload(ctx); err != nil {
			t.Fatal(err)
		}
	}
	testkit.WaitFor(t, "a member's call past its bound refused", func() bool {
		_, err := live.client.Heartbeat(live.ctx(), &pb.HeartbeatRequest{Job: c.job, Beats: []*pb.Beat{{Member: live.self}}})
		return status.Code(err) == codes.ResourceExhausted
	})
	if _, err := other.client.Heartbeat(other.ctx(), &pb.HeartbeatRequest{Job: c.job, Beats: []*pb.Beat{{Member: other.self}}}); err != nil {
		t.Fatalf("another member on the address: %v", err)
	}
	// The stalled registrations end at their body deadline, each admitted
	// one cancelled and each other refused; a newcomer from the address is
	// then served. Which were admitted is the server's readers' race, one
	// per connection: none need be on a given connection.
	ended := map[string]int{}
	for _, h := range attack {
		for id, st := range h.statuses(maxStreamsPerConn) {
			if st != fmt.Sprint(int(codes.Canceled)) && st != fmt.Sprint(int(codes.ResourceExhausted)) {
				t.Fatalf("a stalled registration (stream %d): status %q, want Canceled or ResourceExhausted", id, st)
			}
			ended[st]++
		}
	}
	if n := ended[fmt.Sprint(int(codes.Canceled))]; n < maxAnonCallsPerPeer || ended[fmt.Sprint(int(codes.ResourceExhausted))]+n != 10*maxStreamsPerConn {
		t.Fatalf("the stalled registrations ended %v (by grpc-status), want at least %d cancelled at their deadline and the rest refused", ended, maxAnonCallsPerPeer)
	}
	newcomer := newRawMember(t, addr, c.job, sec, RoleWorker, Position{Rank: 1})
	testkit.WaitFor(t, "a newcomer served once the stalled registrations ended", func() bool { return newcomer.register() == nil })
}

// dialFrom returns a gRPC connection to addr made from the loopback
// address local (127.0.0.0/8 is all loopback on Linux), as a peer on
// another host would be.
func dialFrom(t testing.TB, local, addr string, sec Security) *grpc.ClientConn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}}
	opts := append(sec.dialOptions([]string{addr}, discardIfNil(nil)), grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) {
		return d.DialContext(ctx, "tcp", a)
	}))
	conn, err := grpc.NewClient("passthrough:///"+addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// silent opens a TCP connection from local to addr that sends nothing and
// returns it.
func silent(t testing.TB, local, addr string) net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// closedByServer waits for the server to close c.
func closedByServer(t testing.TB, c net.Conn, what string) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(30 * time.Second))
	if _, err := io.Copy(io.Discard, c); err != nil {
		t.Fatalf("%s: not closed by the server: %v", what, err)
	}
}

// TestConnectionsBounded: the connections of one peer address that
// authenticated are bounded, and apart from them those that have not yet:
// connections that stay silent, reopened as they are closed, from the
// address every member of a node shares, cost them nothing. A new one
// past the budget of those pending closes the oldest, and a connection
// that never speaks is closed after the handshake timeout.
func TestConnectionsBounded(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := newCluster(t, insecureSec(), ManagerConfig{MaxConnectionsPerPeer: 4, Registerer: reg, HeartbeatDeadline: 10 * time.Minute})
	addr := c.m.Addr().String()
	open := func(n float64) func() bool {
		return func() bool { return gathered(t, reg)["faultline_taskd_connections"] == n }
	}
	first := silent(t, "127.0.0.1", addr)
	for range 3 {
		silent(t, "127.0.0.1", addr)
	}
	testkit.WaitFor(t, "4 silent connections open", open(4))
	for i := range 6 {
		silent(t, "127.0.0.1", addr) // one more, as a closed one is reopened
		r := newRawMember(t, addr, c.job, insecureSec(), RoleWorker, Position{Rank: 10 + i})
		if err := r.register(); err != nil {
			t.Fatalf("newcomer %d from the silent connections' address: %v", i, err)
		}
		r.conn.Close()
	}
	closedByServer(t, first, "the oldest silent connection, past the budget of those pending")
	if got := gathered(t, reg)[`faultline_taskd_connections_refused_total{reason="pending_limit"}`]; got < 6 {
		t.Fatalf("pending connections closed for newer ones: %v", got)
	}
	// Left: the silent connections that the last newcomer did not close.
	testkit.WaitFor(t, "the newcomers' connections closed", open(3))
	// Members on one address: past the bound, one more is refused.
	var members []*rawMember
	for rank := range 4 {
		r := newRawMember(t, addr, c.job, insecureSec(), RoleWorker, Position{Rank: rank})
		if err := r.register(); err != nil {
			t.Fatal(err)
		}
		members = append(members, r)
	}
	r := newRawMember(t, addr, c.job, insecureSec(), RoleWorker, Position{Rank: 4})
	if err := r.register(); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a fifth member's connection from one address: %v", err)
	}
	r.conn.Close()
	for _, m := range members {
		m.conn.Close()
	}
	closedByServer(t, silent(t, "127.0.0.3", addr), "a connection that never speaks")
}

// TestAuthFailuresSpareMembers: an address that keeps failing
// authentication has each failing connection closed, but a caller from
// that same address with valid credentials is served, a newcomer with the
// token and a live member reconnecting with its secret alike, for as long
// as the guessing goes on.
func TestAuthFailuresSpareMembers(t *testing.T) {
	token := "0123456789abcdef0123456789abcdef"
	reg := prometheus.NewRegistry()
	sec := Security{Insecure: true, Token: token}
	c := newCluster(t, sec, ManagerConfig{Registerer: reg, HeartbeatDeadline: 10 * time.Minute})
	addr := c.m.Addr().String()
	live := newRawMember(t, addr, c.job, sec, RoleWorker, Position{Rank: 0})
	if err := live.register(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	var closed atomic.Int64 // the guesser's connections closed on it
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			conn := dialFrom(t, "127.0.0.1", addr, Security{Insecure: true, Token: "guess-0123456789abcdef"})
			guesser := pb.NewControlClient(conn)
			for ctx.Err() == nil {
				if _, err := guesser.Register(ctx, &pb.RegisterRequest{Job: c.job}); status.Code(err) == codes.Unavailable {
					closed.Add(1)
					break // closed on it: dial again
				}
			}
			conn.Close()
		}
	}()
	defer func() { cancel(); <-done }()
	testkit.WaitFor(t, "the guesser's connections closed", func() bool { return closed.Load() >= 3 })
	for i := range 20 {
		r := newRawMember(t, addr, c.job, sec, RoleWorker, Position{Rank: 1 + i})
		if err := r.register(); err != nil {
			t.Fatalf("newcomer %d from the guesser's address: %v", i, err)
		}
		r.conn.Close()
		// The live member reconnects, as after a proxy's or manager's
		// restart, with its secret.
		again := newRawMember(t, addr, c.job, sec, RoleWorker, Position{Rank: 0})
		again.self = live.self
		again.cred.set(*live.cred.secret.Load())
		if err := again.register(); err != nil {
			t.Fatalf("the live member reconnecting from the guesser's address: %v", err)
		}
		again.conn.Close()
	}
	if n := gathered(t, reg)[`faultline_taskd_connections_refused_total{reason="auth_failures"}`]; n < 3 {
		t.Fatalf("guessing connections closed: %v", n)
	}
}

// TestGuessingBounded: past its address's budget of authentication
// failures, a connection that has not authenticated has a call checked
// only after a wait, whatever its token, and closed on its first failure,
// and the guesses it sent ahead are checked by none: a guesser gets one
// answer a second on each connection, where one that pipelined its
// guesses had them all checked (700 a second). A newcomer from the
// address with the token is served after the wait, and a member
// reconnecting with its secret without it.
func TestGuessingBounded(t *testing.T) {
	const token = "0123456789abcdef0123456789abcdef"
	sec := Security{Insecure: true, Token: token}
	c := newCluster(t, sec, ManagerConfig{HeartbeatDeadline: 10 * time.Minute})
	addr := c.m.Addr().String()
	live := newRawMember(t, addr, c.job, sec, RoleWorker, Position{Rank: 0})
	if err := live.register(); err != nil {
		t.Fatal(err)
	}
	failures := func() float64 { return counterValue(c.m.met.guard.authFailures) }
	// The budget spent, on a connection closed past it.
	h := newH2Conn(t, addr)
	for id := uint32(1); failures() < authFailureBurst+1; id += 2 {
		if !h.tryCall(id, pb.Control_Register_FullMethodName, "Bearer wrong", 10, 10) || h.status(id) == "" {
			break
		}
	}
	closedOn(t, h, "a connection past the budget of failures")
	before := failures()
	// 50 guesses sent at once on a new connection.
	h = newH2Conn(t, addr)
	for id := uint32(1); id < 100; id += 2 {
		h.tryCall(id, pb.Control_Register_FullMethodName, "Bearer wrong", 10, 10)
	}
	closedOn(t, h, "a connection that failed past the budget")
	testkit.WaitFor(t, "the first guess checked", func() bool { return failures() > before })
	// A newcomer from the address waits, and is served.
	newcomer := newRawMember(t, addr, c.job, sec, RoleWorker, Position{Rank: 1})
	if err := newcomer.register(); err != nil {
		t.Fatalf("a newcomer from the guesser's address: %v", err)
	}
	if n := failures() - before; n != 1 {
		t.Fatalf("of 50 guesses sent at once past the budget, %v checked, want 1", n)
	}
	again := newRawMember(t, addr, c.job, sec, RoleWorker, Position{Rank: 0})
	again.self = live.self
	again.cred.set(*live.cred.secret.Load())
	if err := again.register(); err != nil {
		t.Fatalf("a member reconnecting with its secret from the guesser's address: %v", err)
	}
}

// TestRegisterAnswerLost: a member whose registration answer came past its
// deadline (the manager registered it, the member never got its secret)
// registers again on the same connection and is taken, with the secret it
// missed: it is not shut out until the heartbeat deadline declares it
// lost, long enough for a restarted manager to take an orchestration over
// without its node's ranks. The same instance from another connection,
// without the secret, is still refused.
func TestRegisterAnswerLost(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{})
	addr := c.m.Addr().String()
	for _, role := range []Role{RoleWorker, RoleProxy} {
		sec, pos := insecureSec(), Position{Node: 0, Rank: 0}
		if role == RoleProxy {
			sec, pos = proxySec(), Position{Node: 0, Rank: -1}
		}
		m := newRawMember(t, addr, c.job, sec, role, pos)
		if err := m.register(); err != nil {
			t.Fatal(err)
		}
		secret := *m.cred.secret.Load()
		m.cred.set("") // the answer was lost
		if err := m.register(); err != nil {
			t.Fatalf("%s: registering again on its connection: %v", role, err)
		}
		if got := *m.cred.secret.Load(); got != secret {
			t.Fatalf("%s: issued %q, then %q", role, secret, got)
		}
		other := newRawMember(t, addr, c.job, sec, role, pos)
		other.self = m.self
		if err := other.register(); status.Code(err) != codes.PermissionDenied {
			t.Fatalf("%s: its live instance from another connection: %v", role, err)
		}
	}
}

// TestMemberIdentity: a member's secret, issued at registration, is the
// only proof of who it is; what ListMembers shows (the instance) proves
// nothing. A caller cannot take another member's stream, register its
// live instance again, beat, acknowledge or report for it, or report a
// fault about another rank or a rank that is not a member.
func TestMemberIdentity(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{Nodes: 2, ProcsPerNode: 2})
	addr := c.m.Addr().String()
	// The victim registers and then says nothing: a deaf, dying member.
	victim := newRawMember(t, addr, c.job, insecureSec(), RoleWorker, Position{Node: 0, Rank: 1})
	if err := victim.register(); err != nil {
		t.Fatal(err)
	}
	api := newAdminClient(t, addr, c.job)
	res, err := api.admin.ListMembers(api.ctx(), &pb.ListMembersReq{JobNsName: c.job})
	if err != nil || len(res.GetMembers()) != 1 {
		t.Fatalf("list: %v %v", res, err)
	}
	listed := res.GetMembers()[0].GetMember()
	if b, _ := proto.Marshal(res); bytes.Contains(b, []byte(*victim.cred.secret.Load())) {
		t.Fatal("ListMembers hands out the victim's secret")
	}
	thief := newRawMember(t, addr, c.job, insecureSec(), RoleWorker, Position{Node: 0, Rank: 0})
	if err := thief.register(); err != nil {
		t.Fatal(err)
	}
	want := func(err error, code codes.Code, what string) {
		t.Helper()
		if status.Code(err) != code {
			t.Fatalf("%s: %v, want %v", what, err, code)
		}
	}
	// The victim's instance, as listed, taken over.
	stolen := newRawMember(t, addr, c.job, insecureSec(), RoleWorker, Position{Node: 0, Rank: 1})
	stolen.self = listed
	want(stolen.register(), codes.PermissionDenied, "registering the victim's live instance again")
	st, err := thief.client.Stream(thief.ctx(), &pb.StreamRequest{Job: c.job, Member: listed})
	if err == nil {
		_, err = st.Recv()
	}
	want(err, codes.PermissionDenied, "opening the victim's stream")
	_, err = thief.client.Send(thief.ctx(), &pb.SendRequest{Job: c.job, Reports: []*pb.Report{{Id: "x", From: listed, Body: &pb.Report_Message{Message: &pb.UserMessage{Kind: "k"}}}}})
	want(err, codes.PermissionDenied, "sending as the victim")
	fault := func(id string, rank int32) *pb.SendRequest {
		return &pb.SendRequest{Job: c.job, Reports: []*pb.Report{{Id: id, From: thief.self, Body: &pb.Report_Fault{Fault: &pb.FaultReport{Kind: string(FaultProcessExit), Node: 0, Rank: rank}}}}}
	}
	_, err = thief.client.Send(thief.ctx(), fault("f1", 1))
	want(err, codes.PermissionDenied, "a fault about another rank")
	_, err = thief.client.Send(thief.ctx(), fault("f2", 999))
	want(err, codes.PermissionDenied, "a fault about a rank that is no member")
	if _, err := thief.client.Send(thief.ctx(), fault("f3", 0)); err != nil {
		t.Fatalf("a fault about itself: %v", err)
	}
	if fs := c.m.Faults(0); len(fs) != 1 || fs[0].ID != "f3" || fs[0].Reporter != (Position{Node: 0, Rank: 0}) {
		t.Fatalf("faults %+v", fs)
	}
	// The switch goes to the victim, which never acknowledges it; forged
	// acknowledgements do not count.
	if _, err := c.m.SetSwitch(trace.Switch{Step: true}); err != nil {
		t.Fatal(err)
	}
	var acks []*pb.Ack
	for id := range uint64(64) {
		acks = append(acks, &pb.Ack{Id: id, From: listed})
	}
	if _, err := thief.client.Acknowledge(thief.ctx(), &pb.AckRequest{Job: c.job, Acks: acks}); err != nil {
		t.Fatal(err)
	}
	for _, w := range c.m.SwitchStatus().Workers {
		if w.Position.Rank == 1 && w.Domains["default"] != DomainWaiting {
			t.Fatalf("the victim's switch is %v after forged acknowledgements", w.Domains)
		}
	}
	// Beats for the victim keep it alive no longer than its deadline.
	testkit.WaitFor(t, "the victim lost, while another member beats for it", func() bool {
		thief.client.Heartbeat(thief.ctx(), &pb.HeartbeatRequest{Job: c.job, Beats: []*pb.Beat{{Member: thief.self}, {Member: listed}}})
		for _, f := range c.m.Faults(0) {
			if f.Kind == FaultLost && f.Position.Rank == 1 {
				return true
			}
		}
		return false
	})
}

// TestProxyIdentity: a worker behind a proxy reports only its own faults,
// and the proxy only its own node's; the manager takes a fault about a
// rank from that rank's node's proxy.
func TestProxyIdentity(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{Nodes: 2, ProcsPerNode: 2})
	addr := c.m.Addr().String()
	p := c.addProxy(0)
	testkit.WaitFor(t, "the proxy", func() bool { return len(c.m.Members()) == 1 })
	w := newRawMember(t, p.Addr().String(), c.job, insecureSec(), RoleWorker, Position{Node: 0, Rank: 0})
	testkit.WaitFor(t, "a worker behind the proxy", func() bool { return w.register() == nil })
	send := func(r *rawMember, id string, from *pb.Member, node, rank int32) error {
		_, err := r.client.Send(r.ctx(), &pb.SendRequest{Job: c.job, Reports: []*pb.Report{{Id: id, From: from, Body: &pb.Report_Fault{Fault: &pb.FaultReport{Kind: string(FaultHang), Node: node, Rank: rank}}}}})
		return err
	}
	if err := send(w, "w1", w.self, 0, 1); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("a worker's fault about another rank, through its proxy: %v", err)
	}
	if err := send(w, "w2", w.self, 0, 0); err != nil {
		t.Fatalf("a worker's own fault through its proxy: %v", err)
	}
	if err := p.ReportFault(Fault{Kind: FaultLink, Position: Position{Node: 1, Rank: 2}}); err == nil {
		t.Fatal("a proxy queued a fault of another node")
	}
	// A proxy of node 1 speaking for itself.
	p1 := newRawMember(t, addr, c.job, proxySec(), RoleProxy, Position{Node: 1, Rank: -1})
	if err := p1.register(); err != nil {
		t.Fatal(err)
	}
	if err := send(p1, "p1", p1.self, 0, 0); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("a proxy's fault about another node's rank: %v", err)
	}
	if err := send(p1, "p2", p1.self, 1, 3); err != nil {
		t.Fatalf("a proxy's fault about its node's rank: %v", err)
	}
	if err := send(p1, "p3", p1.self, 1, 7); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("a proxy's fault about a rank beyond the job: %v", err)
	}
	// The proxy of node 1 does not register node 0's workers.
	_, err := p1.client.Register(p1.ctx(), &pb.RegisterRequest{Job: c.job, Member: memberPB(RoleWorker, Position{Node: 0, Rank: 1}, newInstanceID()), Via: p1.self})
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("a proxy registering another node's worker: %v", err)
	}
	var ids []string
	for _, f := range c.m.Faults(0) {
		ids = append(ids, f.ID)
	}
	if !slices.Equal(ids, []string{"w2", "p2"}) {
		t.Fatalf("faults %v", ids)
	}
}

// TestFaultContentsBounded: a fault's message and attributes are cut to
// their bounds, a kind other than taskd's is one metric series ("other"),
// an odd kind is refused, and ListFaults pages by bytes, so that faults of
// a megabyte cost kilobytes and every page fits a message.
func TestFaultContentsBounded(t *testing.T) {
	reg := prometheus.NewRegistry()
	// The raw member sends no heartbeat: lost, it would add a fault.
	c := newCluster(t, insecureSec(), ManagerConfig{Registerer: reg, MaxMessageBytes: 256 << 10, HeartbeatDeadline: 10 * time.Minute})
	r := newRawMember(t, c.m.Addr().String(), c.job, insecureSec(), RoleWorker, Position{Node: 0, Rank: 0})
	if err := r.register(); err != nil {
		t.Fatal(err)
	}
	huge := strings.Repeat("é", 50<<10) // 100 KiB, two bytes a rune
	attrs := map[string]string{}
	for i := range 60 {
		attrs[fmt.Sprintf("k%03d", i)] = huge[:3<<9]
	}
	for i := range 40 {
		f := &pb.FaultReport{Kind: fmt.Sprintf("kind-%d", i), Rank: 0, Message: huge, Attrs: attrs}
		if _, err := r.client.Send(r.ctx(), &pb.SendRequest{Job: c.job, Reports: []*pb.Report{{Id: fmt.Sprint(i), From: r.self, Body: &pb.Report_Fault{Fault: f}}}}); err != nil {
			t.Fatalf("fault %d: %v", i, err)
		}
	}
	_, err := r.client.Send(r.ctx(), &pb.SendRequest{Job: c.job, Reports: []*pb.Report{{Id: "odd", From: r.self, Body: &pb.Report_Fault{Fault: &pb.FaultReport{Kind: "a kind\\nwith a line"}}}}})
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("an odd kind: %v", err)
	}
	for _, f := range c.m.Faults(0) {
		if len(f.Message) > MaxFaultMessageBytes || !utf8.ValidString(f.Message) || len(f.Attrs) != MaxFaultAttrs || len(f.Attrs["k000"]) > MaxFaultAttrBytes {
			t.Fatalf("fault %s kept: message %d bytes, %d attributes", f.ID, len(f.Message), len(f.Attrs))
		}
	}
	got := gathered(t, reg)
	if got[`faultline_taskd_faults_total{kind="other"}`] != 40 || got[`faultline_taskd_faults_total{kind="kind-1"}`] != 0 {
		t.Fatalf("fault metrics: %v", got)
	}
	api := newAdminClient(t, c.m.Addr().String(), c.job)
	var n int
	var after uint64
	for pages := 0; ; pages++ {
		res, err := api.admin.ListFaults(api.ctx(), &pb.ListFaultsReq{JobNsName: c.job, After: after})
		if err != nil {
			t.Fatalf("page %d: %v", pages, err)
		}
		if len(res.GetFaults()) == 0 {
			if pages < 2 {
				t.Fatalf("40 faults of %d KiB in %d pages", (MaxFaultMessageBytes+MaxFaultAttrs*MaxFaultAttrBytes)>>10, pages)
			}
			break
		}
		n += len(res.GetFaults())
		after = res.GetFaults()[len(res.GetFaults())-1].GetSeq()
	}
	if n != 40 {
		t.Fatalf("paged through %d faults", n)
	}
}

// TestMembershipBounded: without a shape, ranks and nodes are bounded;
// hostnames are bounded; ListMembers pages by bytes; the switch status
// forgets a rank that is gone when the shape does not list it.
func TestMembershipBounded(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{MaxWorkers: 1000, MaxMessageBytes: 64 << 10, HeartbeatDeadline: 10 * time.Minute})
	r := newRawMember(t, c.m.Addr().String(), c.job, insecureSec(), RoleWorker, Position{})
	reg := func(role Role, pos Position, host string) error {
		_, err := r.client.Register(r.ctx(), &pb.RegisterRequest{Job: c.job, Member: memberPB(role, pos, newInstanceID()), Hostname: host})
		return err
	}
	for _, tc := range []struct {
		role Role
		pos  Position
		host string
	}{
		{RoleWorker, Position{Node: 0, Rank: 1000}, ""},
		{RoleWorker, Position{Node: 1000, Rank: 0}, ""},
		{RoleProxy, Position{Node: 1000, Rank: -1}, ""},
		{RoleWorker, Position{Node: 0, Rank: 0}, strings.Repeat("h", 256)},
	} {
		if err := reg(tc.role, tc.pos, tc.host); status.Code(err) != codes.InvalidArgument {
			t.Errorf("%v %v, a hostname of %d bytes: %v", tc.role, tc.pos, len(tc.host), err)
		}
	}
	host := strings.Repeat("h", maxHostnameBytes)
	for rank := range 600 {
		if err := reg(RoleWorker, Position{Node: rank / 8, Rank: rank}, host); err != nil {
			t.Fatal(err)
		}
	}
	api := newAdminClient(t, c.m.Addr().String(), c.job)
	if got := api.members(); len(got) != 600 {
		t.Fatalf("paged through %d of 600 members", len(got))
	}
	res, err := api.admin.ListMembers(api.ctx(), &pb.ListMembersReq{JobNsName: c.job})
	if err != nil || res.GetTotal() != 600 || len(res.GetMembers()) >= 600 {
		t.Fatalf("one page of 600 members with long hostnames: %d listed, total %d, %v", len(res.GetMembers()), res.GetTotal(), err)
	}
	// A rank that leaves is forgotten by the switch status.
	w := c.addWorker(80, 700)
	testkit.WaitFor(t, "rank 700", w.Connected)
	has := func() bool {
		return slices.ContainsFunc(c.m.SwitchStatus().Workers, func(ws WorkerSwitch) bool { return ws.Position.Rank == 700 })
	}
	if !has() {
		t.Fatal("rank 700 not in the switch status")
	}
	c.stop(w, w)
	testkit.WaitFor(t, "rank 700 forgotten", func() bool { return !has() })
}

// TestOtherBounds: what a worker says in an acknowledgement is kept cut to
// a bound, so that the switch status still fits a message; a Collect of
// more nodes than the job has is refused; a fault's time far off the
// manager's clock is not kept.
func TestOtherBounds(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{CollectDir: t.TempDir()})
	r := newRawMember(t, c.m.Addr().String(), c.job, insecureSec(), RoleWorker, Position{Node: 0, Rank: 0})
	if err := r.register(); err != nil {
		t.Fatal(err)
	}
	st, err := r.client.Stream(r.ctx(), &pb.StreamRequest{Job: c.job, Member: r.self})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.m.SetSwitch(trace.Switch{Step: true}); err != nil {
		t.Fatal(err)
	}
	env, err := st.Recv()
	if err != nil || env.GetSwitch() == nil {
		t.Fatalf("no switch: %v %v", env, err)
	}
	_, err = r.client.Acknowledge(r.ctx(), &pb.AckRequest{Job: c.job, Acks: []*pb.Ack{{Id: env.GetId(), From: r.self, Error: strings.Repeat("e", 900<<10)}}})
	if err != nil {
		t.Fatal(err)
	}
	api := newAdminClient(t, c.m.Addr().String(), c.job)
	res, err := api.admin.GetSwitchStatus(api.ctx(), &pb.DataStatusReq{JobNsName: c.job})
	if err != nil || len(res.GetWorkers()) != 1 || res.GetWorkers()[0].GetError() == "" || len(res.GetWorkers()[0].GetError()) > maxAckErrorBytes {
		t.Fatalf("switch status after a 900 KiB error: %d workers, %v", len(res.GetWorkers()), err)
	}
	nodes := make([]int32, 100000)
	for i := range nodes {
		nodes[i] = int32(i)
	}
	if res, err := api.admin.Collect(api.ctx(), &pb.CollectReq{JobNsName: c.job, Nodes: nodes}); err != nil || res.GetCode() != pb.Code_CODE_BAD_PARAMETER {
		t.Fatalf("a collection of 100000 nodes: %v %v", res, err)
	}
	for i, at := range []int64{math.MaxInt64, math.MinInt64, time.Now().Add(time.Hour).UnixNano()} {
		if _, err := r.client.Send(r.ctx(), &pb.SendRequest{Job: c.job, Reports: []*pb.Report{{Id: fmt.Sprint(i), From: r.self, TimeUnixNano: at, Body: &pb.Report_Fault{Fault: &pb.FaultReport{Kind: "hang"}}}}}); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range c.m.Faults(0) {
		if !f.Time.IsZero() {
			t.Fatalf("fault %s kept the time %v", f.ID, f.Time)
		}
	}
}

// TestEventQueueBounded: the events waiting for the handlers are bounded
// in number and in the bytes of the messages they carry.
func TestEventQueueBounded(t *testing.T) {
	dropped := 0
	q := newEventQueue(3, func() { dropped++ })
	q.maxBytes = 10
	msg := func(n int) Event { return Event{Kind: EventMessage, Message: Message{Payload: make([]byte, n)}} }
	q.push(msg(6), msg(6), msg(4), Event{Kind: EventSwitch}, Event{Kind: EventSwitch})
	if got := len(q.take()); got != 3 || dropped != 2 {
		t.Fatalf("%d events queued, %d dropped; want 3 and 2", got, dropped)
	}
	q.push(msg(10))
	if got := len(q.take()); got != 1 {
		t.Fatalf("after a take, %d events queued", got)
	}
}

// TestFaultFileLoadStreamed: a restart reads the fault log a line at a
// time and keeps the newest MaxFaults, so that a file far longer than
// what is kept costs the manager what it keeps, not the file's size.
func TestFaultFileLoadStreamed(t *testing.T) {
	const kept = 100
	big := t.TempDir()
	var file []byte
	msg := strings.Repeat("m", MaxFaultMessageBytes-64)
	for i := range 10000 {
		b, err := marshalFault(Fault{Seq: uint64(i + 1), ID: fmt.Sprint(i), Kind: FaultHang, Message: msg, Time: t0, Received: t0})
		if err != nil {
			t.Fatal(err)
		}
		file = append(file, b...)
	}
	if err := os.WriteFile(filepath.Join(big, "faults.jsonl"), file, 0o644); err != nil {
		t.Fatal(err)
	}
	// The peak memory of a manager process that loads the file, beside one
	// that loads none.
	peak := func(dir string) int {
		mgr := startChild(t, "manager", childArgs{Job: "j", Listen: "127.0.0.1:0", StateDir: dir, MaxFaults: kept})
		mgr.expect(0, "ready", 60*time.Second)
		kib := procKiB(t, mgr.cmd.Process.Pid, "VmHWM")
		mgr.kill()
		return kib << 10
	}
	base, loaded := peak(t.TempDir()), peak(big)
	if grown := loaded - base; grown > len(file)/2 {
		t.Fatalf("loading a fault log of %d MiB, %d faults kept, took the manager from %d to %d MiB", len(file)>>20, kept, base>>20, loaded>>20)
	}
	m, err := NewManager(ManagerConfig{Job: "j", Listen: "127.0.0.1:0", Security: insecureSec(), StateDir: big, MaxFaults: kept})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if got := m.Faults(0); len(got) != kept || got[0].ID != "9900" || got[kept-1].Seq != 10000 {
		t.Fatalf("after the restart: %d faults, the oldest %s", len(got), got[0].ID)
	}
}

// TestOutsiderRefused: with orchestration on and no job shape, the ranks
// are those of the first complete rendezvous; a token holder that joins
// later as a rank of its own is refused, saying why, so that its silence
// cannot have the real ranks stopped by a recovery. A real rank's next
// instance registers meanwhile.
func TestOutsiderRefused(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{Orchestration: &OrchestrationConfig{}})
	for rank := range 2 {
		w := c.addWorker(0, rank)
		testkit.WaitFor(t, fmt.Sprintf("rank %d", rank), w.Connected)
	}
	// The rendezvous completes once no new rank has come for twice the
	// heartbeat deadline; a longer wait, on a loaded machine, changes
	// nothing.
	time.Sleep(2 * c.mcfg.HeartbeatDeadline)
	outsider := newRawMember(t, c.m.Addr().String(), c.job, insecureSec(), RoleWorker, Position{Node: 0, Rank: 2})
	if err := outsider.register(); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "first complete rendezvous, 0 to 1") {
		t.Fatalf("rank 2 joining after the rendezvous of ranks 0 and 1: %v", err)
	}
	again := newRawMember(t, c.m.Addr().String(), c.job, insecureSec(), RoleWorker, Position{Node: 0, Rank: 1})
	c.stop(c.workers[1], c.workers[1])
	testkit.WaitFor(t, "rank 1's next instance registered", func() bool { return again.register() == nil })
	if o := c.m.Orchestrations(0); o.Current != nil || len(o.History) > 0 {
		t.Fatalf("an orchestration started: %+v", o)
	}
}

// TestOutsiderPastGapRefused: a token holder's rank past the job's, with
// a gap, registered before the real ranks and gone silent, neither keeps
// the first rendezvous open nor has a recovery started: the rendezvous
// completes on ranks 0 and 1, the rank past the gap is dropped, and a
// later outsider is refused.
func TestOutsiderPastGapRefused(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{Orchestration: &OrchestrationConfig{}})
	gap := newRawMember(t, c.m.Addr().String(), c.job, insecureSec(), RoleWorker, Position{Node: 0, Rank: 7})
	if err := gap.register(); err != nil {
		t.Fatal(err)
	}
	for rank := range 2 {
		w := c.addWorker(0, rank)
		testkit.WaitFor(t, fmt.Sprintf("rank %d", rank), w.Connected)
	}
	testkit.WaitFor(t, "the first rendezvous complete", func() bool {
		c.m.mu.Lock()
		defer c.m.mu.Unlock()
		return c.m.members.world > 0
	})
	outsider := newRawMember(t, c.m.Addr().String(), c.job, insecureSec(), RoleWorker, Position{Node: 0, Rank: 2})
	if err := outsider.register(); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "first complete rendezvous, 0 to 1") {
		t.Fatalf("rank 2 joining after the rendezvous of ranks 0 and 1 (and 7, past a gap): %v", err)
	}
	for _, mi := range c.m.Members() {
		if mi.Position.Rank == 7 {
			t.Fatalf("rank 7, past the gap, still a member: %+v", mi)
		}
	}
	if o := c.m.Orchestrations(0); o.Current != nil || len(o.History) > 0 {
		t.Fatalf("an orchestration started: %+v", o)
	}
}

// TestMessageLimits: a call that needs a few hundred bytes (Register,
// Heartbeat and the like) declaring a message beyond its method's bound
// has its connection closed from the message's prefix, before its body
// arrives, even with the members' token; the calls in flight of one
// worker are bounded; a Send still takes a message of a megabyte.
func TestMessageLimits(t *testing.T) {
	token := "0123456789abcdef0123456789abcdef"
	sec := Security{Insecure: true, Token: token}
	reg := prometheus.NewRegistry()
	c := newCluster(t, sec, ManagerConfig{Registerer: reg, HeartbeatDeadline: 10 * time.Minute})
	addr := c.m.Addr().String()
	h := newH2Conn(t, addr)
	h.call(1, pb.Control_Register_FullMethodName, "Bearer "+token, nil, 4<<20-1<<10, 64<<10)
	h.c.SetReadDeadline(time.Now().Add(30 * time.Second))
	for {
		_, err := h.fr.ReadFrame()
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			t.Fatal("a Register declaring 4 MiB: the connection is still open")
		}
		if err != nil {
			break
		}
	}
	if got := gathered(t, reg)[`faultline_taskd_connections_refused_total{reason="message_limit"}`]; got != 1 {
		t.Fatalf("connections closed for a message beyond its bound: %v", got)
	}
	r := newRawMember(t, addr, c.job, sec, RoleWorker, Position{Rank: 0})
	if err := r.register(); err != nil {
		t.Fatal(err)
	}
	if _, err := r.client.Send(r.ctx(), &pb.SendRequest{Job: c.job, Reports: []*pb.Report{{Id: "m", From: r.self,
		Body: &pb.Report_Message{Message: &pb.UserMessage{Kind: "k", Payload: make([]byte, 1<<20)}}}}}); err != nil {
		t.Fatalf("a Send of a megabyte: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var streams []grpc.ClientStreamingClient[pb.UploadChunk, pb.UploadResponse]
	for range maxCallsPerWorker {
		s, err := r.client.Upload(ctx)
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, s)
	}
	testkit.WaitFor(t, "a worker's calls in flight bounded", func() bool {
		return status.Code(r.register()) == codes.ResourceExhausted
	})
	streams[0].CloseSend()
	streams[0].CloseAndRecv()
	testkit.WaitFor(t, "a call taken once one ended", func() bool { return r.register() == nil })
}

// closedOn waits for the server to close h's connection, reading what it
// sends meanwhile.
func closedOn(t testing.TB, h *h2Conn, what string) {
	t.Helper()
	h.c.SetReadDeadline(time.Now().Add(30 * time.Second))
	for {
		_, err := h.fr.ReadFrame()
		if ne, ok := err.(net.Error); ok && ne.Timeout() {
			t.Fatalf("%s: the connection is still open", what)
		}
		if err != nil {
			return
		}
	}
}

// TestUnfinishedBytesBounded: what the messages begun and not yet whole
// hold is bounded per worker and per address: a token holder's own ranks
// that stall their Sends, each within the method's bound, have their
// connections closed once a worker would hold more than two of the
// largest messages or their address more than 16, while a member on that
// address keeps beating; what the stalled messages held is given back as
// their connections close. Acknowledge and CollectDone have bounds of
// their own.
func TestUnfinishedBytesBounded(t *testing.T) {
	const token = "0123456789abcdef0123456789abcdef"
	sec := Security{Insecure: true, Token: token}
	reg := prometheus.NewRegistry()
	c := newCluster(t, sec, ManagerConfig{Registerer: reg, MaxMessageBytes: 256 << 10, HeartbeatDeadline: 10 * time.Minute})
	addr := c.m.Addr().String()
	g := c.m.lis.(*guardListener).g
	closed := func(reason string) float64 {
		return gathered(t, reg)[`faultline_taskd_connections_refused_total{reason="`+reason+`"}`]
	}
	live := newRawMember(t, addr, c.job, sec, RoleWorker, Position{Rank: 0})
	if err := live.register(); err != nil {
		t.Fatal(err)
	}
	beat := func() error {
		_, err := live.client.Heartbeat(live.ctx(), &pb.HeartbeatRequest{Job: c.job, Beats: []*pb.Beat{{Member: live.self}}})
		return err
	}
	// stall opens, as rank, calls of method that each declare a message
	// within the bound and send 60 KiB of it (a stream's first window).
	stall := func(rank, calls int, method string) *h2Conn {
		r := newRawMember(t, addr, c.job, sec, RoleWorker, Position{Rank: rank})
		if err := r.register(); err != nil {
			t.Fatal(err)
		}
		r.conn.Close()
		h := newH2Conn(t, addr)
		for i := range calls {
			h.call(uint32(2*i+1), method, "Bearer "+token, map[string]string{memberHeader: *r.cred.secret.Load()}, 200<<10, 60<<10)
		}
		return h
	}
	// A worker: 8 stalled Sends hold 480 KiB, within two messages; a
	// ninth passes them.
	closedOn(t, stall(1, 9, pb.Control_Send_FullMethodName), "a worker's ninth stalled Send of 60 KiB")
	if n := closed("unfinished_bytes"); n != 1 {
		t.Fatalf("connections closed for what their calls held: %v", n)
	}
	// An address: 8 workers of 8 stalled Sends hold 3.75 MiB, within 16
	// messages; a ninth worker's passes them.
	var held []*h2Conn
	for rank := 2; rank < 10; rank++ {
		held = append(held, stall(rank, 8, pb.Control_Send_FullMethodName))
	}
	testkit.WaitFor(t, "the stalled Sends held", func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		return g.heldByPeer["127.0.0.1"] >= 8*8*(60<<10)-16<<10
	})
	for i := range 10 {
		if err := beat(); err != nil {
			t.Fatalf("heartbeat %d of a member beside the stalled Sends: %v", i, err)
		}
	}
	closedOn(t, stall(10, 8, pb.Control_Send_FullMethodName), "stalled Sends past the address's bound")
	if n := closed("unfinished_bytes"); n != 2 {
		t.Fatalf("connections closed for what their calls held: %v", n)
	}
	for _, h := range held {
		h.c.Close()
	}
	testkit.WaitFor(t, "what the stalled Sends held given back", func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		return len(g.heldByPeer) == 0 && len(g.heldByMember) == 0
	})
	if err := beat(); err != nil {
		t.Fatal(err)
	}
	// Acknowledge and CollectDone declaring more than they carry.
	for i, m := range []string{pb.Control_Acknowledge_FullMethodName, pb.Control_CollectDone_FullMethodName} {
		h := newH2Conn(t, addr)
		h.call(1, m, "Bearer "+token, map[string]string{memberHeader: *live.cred.secret.Load()}, 2<<20, 1<<10)
		closedOn(t, h, m+" declaring 2 MiB")
		if n := closed("message_limit"); n != float64(i+1) {
			t.Fatalf("connections closed for a message beyond its method's bound: %v", n)
		}
	}
}

// TestLimiterForgetsServerEnded: a call the server ends is no longer
// followed by the connection's limiter, whether or not its client ends it
// too: 450 calls refused from their headers, one after another on one
// long-lived connection, leave it open (a limiter that followed them until
// the client ended them closed it past 400), and what they held is given
// back.
func TestLimiterForgetsServerEnded(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{HeartbeatDeadline: 10 * time.Minute})
	h := newH2Conn(t, c.m.Addr().String())
	want := fmt.Sprint(int(codes.Unauthenticated)) // no member secret
	for i := range 450 {
		id := uint32(2*i + 1)
		h.call(id, pb.Control_Send_FullMethodName, "", nil, 1000, 10)
		if got := h.status(id); got != want {
			t.Fatalf("call %d refused from its headers: status %q, want %s", i, got, want)
		}
	}
}

// TestLimiterEndStreamAcrossContinuation: a HEADERS frame that ends its
// stream ends it when its block does, on a CONTINUATION.
func TestLimiterEndStreamAcrossContinuation(t *testing.T) {
	var buf, hb bytes.Buffer
	buf.WriteString(h2Preface)
	fr := http2.NewFramer(&buf, nil)
	enc := hpack.NewEncoder(&hb)
	for _, kv := range [][2]string{{":method", "POST"}, {":path", pb.Control_Register_FullMethodName}, {"content-type", "application/grpc"}} {
		enc.WriteField(hpack.HeaderField{Name: kv[0], Value: kv[1]})
	}
	block := hb.Bytes()
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block[:3], EndStream: true})
	fr.WriteContinuation(1, true, block[3:])
	l := newMsgLimiter(nil, &countBudget{max: 1 << 20})
	if err := l.feed(buf.Bytes()); err != nil {
		t.Fatal(err)
	}
	if len(l.calls) != 0 {
		t.Fatalf("calls followed after one that ended: %d", len(l.calls))
	}
}
