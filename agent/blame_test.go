package agent

import (
	"math/bits"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func TestBlame(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	rank := func(r int) *int { return &r }
	exit := func(r, code, ms int) IncidentFault {
		return IncidentFault{Kind: "process_exit", Rank: r, Code: code, Message: "exit", Time: at(ms)}
	}
	opErr := func(r, ms int) IncidentFault {
		return IncidentFault{Kind: "op_error", Rank: r, Message: "op error", Time: at(ms)}
	}
	naming := func(r, ms int, peer string, held *int) IncidentFault {
		f := opErr(r, ms)
		f.Peer, f.PeerRank = peer, held
		return f
	}
	closing := func(r, ms int, peer string, closed, port int) IncidentFault {
		f := naming(r, ms, peer, rank(closed))
		f.PeerClosedPort = port
		return f
	}
	hung := IncidentFault{Kind: "hang", Rank: 2, Message: "hang", Time: at(0)}
	for _, tc := range []struct {
		name     string
		faults   []IncidentFault
		want     IncidentFault
		evidence string
	}{
		{"one exit", []IncidentFault{exit(1, 7, 0)}, exit(1, 7, 0), "the first fault seen"},
		// The report's case: the peer's exit seen 300 ms after the error.
		{"an exit beats the earlier collective error of a peer", []IncidentFault{opErr(0, 0), exit(1, 7, 300)}, exit(1, 7, 300),
			"rank 1 ended without a failed collective of its own; the collective errors of ranks [0] follow from its end"},
		{"an exit long after still beats it", []IncidentFault{opErr(0, 0), opErr(2, 5), exit(1, 7, 5000)}, exit(1, 7, 5000),
			"rank 1 ended without a failed collective of its own; the collective errors of ranks [0 2] follow from its end"},
		{"the exit of a rank whose collective failed follows from it", []IncidentFault{opErr(0, 0), exit(0, 1, 50)}, opErr(0, 0),
			"the first of 2 faults seen; none names another rank"},
		{"a killed rank beats the collective errors", []IncidentFault{opErr(0, 0), exit(1, 137, 20)}, exit(1, 137, 20),
			"rank 1 ended without a failed collective of its own; the collective errors of ranks [0] follow from its end"},
		{"the error names the rank, which exited too", []IncidentFault{naming(0, 0, "127.0.0.1:14772", rank(1)), exit(0, 1, 10), exit(1, 7, 300)}, exit(1, 7, 300),
			"rank 0's collective error names 127.0.0.1:14772, a socket of rank 1"},
		{"the error names the rank, which the agent stopped",
			[]IncidentFault{naming(0, 0, "127.0.0.1:14772", rank(1))},
			IncidentFault{Kind: "peer", Rank: 1, Message: "rank 1: rank 0's collective failed on its connection to it", Time: at(0)},
			"rank 0's collective error names 127.0.0.1:14772, a socket of rank 1"},
		{"the address outweighs an exit elsewhere", []IncidentFault{exit(3, 2, 0), naming(0, 10, "127.0.0.1:1", rank(1)), opErr(1, 20)}, opErr(1, 20),
			"rank 0's collective error names 127.0.0.1:1, a socket of rank 1"},
		{"errors naming peers are followed to the last", []IncidentFault{naming(0, 0, "127.0.0.1:1", rank(1)), naming(1, 5, "127.0.0.1:2", rank(2)), exit(2, 9, 9)}, exit(2, 9, 9),
			"rank 0's collective error names 127.0.0.1:1, a socket of rank 1, whose own names 127.0.0.1:2, a socket of rank 2"},
		{"a cycle of errors ends", []IncidentFault{naming(0, 0, "127.0.0.1:1", rank(1)), naming(1, 5, "127.0.0.1:2", rank(0))}, naming(0, 0, "127.0.0.1:1", rank(1)),
			"rank 0's collective error names 127.0.0.1:1, a socket of rank 1, whose own names 127.0.0.1:2, a socket of rank 0"},
		{"the error names an address no rank held, and a connection's closed end names the rank",
			[]IncidentFault{closing(0, 0, "127.0.0.1:45468", 1, 40968)},
			IncidentFault{Kind: "peer", Rank: 1, Message: "rank 1: rank 0's collective failed on its connection to it", Time: at(0)},
			"rank 0's collective error names 127.0.0.1:45468, which no rank of this node held; of rank 0's connections with this node's ranks, only rank 1's end (port 40968) was closed when the error came"},
		{"an address of another node", []IncidentFault{naming(0, 0, "10.0.0.9:4000", nil)}, naming(0, 0, "10.0.0.9:4000", nil),
			"the first fault seen; rank 0's error names 10.0.0.9:4000, which no rank of this node held: the cause may be on another node"},
		{"a hang is left to the stacks", []IncidentFault{hung, exit(1, 7, 10)}, hung,
			"a collective ran past its timeout: the merged stacks name the rank (see verdict)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, evidence := blame(tc.faults)
			if d := cmp.Diff(tc.want, got); d != "" {
				t.Errorf("fault (-want +got):\n%s", d)
			}
			if evidence != tc.evidence {
				t.Errorf("evidence %q, want %q", evidence, tc.evidence)
			}
		})
	}
}

func TestPeerAddr(t *testing.T) {
	for _, tc := range []struct {
		msg  string
		want string
	}{
		{"RuntimeError: [./gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:14772", "127.0.0.1:14772"},
		{"RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:575] Read error [10.1.2.3]:58112: Connection reset by peer", "10.1.2.3:58112"},
		{"Connection closed by peer [::1]:4000", "[::1]:4000"},
		{"Connection closed by peer [::ffff:10.0.0.1]:4000", "10.0.0.1:4000"},
		{"[pair.cc:598] no address here", ""},
		{"[1.2.3.4]:99999", ""},
	} {
		got, ok := peerAddr(tc.msg)
		if s := got.String(); ok != (tc.want != "") || ok && s != tc.want {
			t.Errorf("peerAddr(%q) = %v, %v; want %q", tc.msg, got, ok, tc.want)
		}
	}
}

func TestPeerPorts(t *testing.T) {
	// gloo printed rank 1's port 46137 (0xb439) as 14772 (0x39b4).
	if got := peerPorts(14772); !cmp.Equal(got, []uint16{14772, 46137}) {
		t.Errorf("peerPorts(14772) = %v", got)
	}
	if got := peerPorts(0x1111); !cmp.Equal(got, []uint16{0x1111}) {
		t.Errorf("peerPorts(0x1111) = %v", got)
	}
}

// procTCP is /proc/<pid>/net/tcp as Linux writes it.
const procTCP = `  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:DA7B 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5505 1 0000000000000000 100 0 0 10 0
   1: 0100007F:B439 0100007F:BE38 01 00000000:00000000 00:00000000 00000000     0        0 5523 1 0000000000000000 20 4 30 10 -1
   2: 0100007F:C350 0100007F:DA7B 01 00000000:00000000 00:00000000 00000000     0        0 9999 1 0000000000000000 20 4 30 10 -1
   3: garbage
`

func TestTCPSockets(t *testing.T) {
	got := tcpSockets([]byte(procTCP), map[string]bool{"5505": true, "5523": true})
	want := []tcpSocket{{inode: "5505", local: 0xDA7B}, {inode: "5523", local: 0xB439, remote: 0xBE38}}
	if d := cmp.Diff(want, got, cmp.AllowUnexported(tcpSocket{})); d != "" {
		t.Errorf("tcpSockets (-want +got):\n%s", d)
	}
}

// TestPeerFromSockets: of rank 0's connections with this node's ranks, the
// one whose far end closes names its rank and the port of that end;
// closed ends of two ranks name none, nor does a closed end of rank 0's
// connection with a rank of another agent on the host (a subgroup rank 1
// and rank 0 destroyed earlier must not take the blame for it); a rank
// whose process is gone has every end closed. rankOfPeer finds the far
// end of rank 0's failed connection to the port named, not a socket
// that holds the port (or its other reading) by chance. Real loopback connections,
// all in this process, stand for the ranks'.
func TestPeerFromSockets(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if _, err := os.Stat("/proc/self/net/tcp"); err != nil {
		t.Skipf("no /proc/self/net/tcp: %v", err)
	}
	// connect returns both ends of a new connection: rank 0's, its peer's.
	connect := func() (net.Conn, net.Conn) { return loopback(t, l) }
	note := func(s *slot, c net.Conn) { s.socks = append(s.socks, ownEnd(t, c)) }
	// agent has ranks 0 to 2 with connections 0-1 and 0-2, and one of
	// rank 0 with a rank no slot holds.
	agent := func() (a *Agent, to1, at1, to2, at2, toOther net.Conn) {
		a = threeRanks()
		to1, at1 = connect()
		to2, at2 = connect()
		toOther, _ = connect()
		note(a.slots[0], to1)
		note(a.slots[0], to2)
		note(a.slots[0], toOther)
		note(a.slots[1], at1)
		note(a.slots[2], at2)
		return a, to1, at1, to2, at2, toOther
	}
	port := func(c net.Conn) uint16 { return uint16(c.LocalAddr().(*net.TCPAddr).Port) }

	a, to1, at1, _, at2, _ := agent()
	if r, _ := a.closedPeer(0); r != -1 {
		t.Fatalf("closedPeer with every end open = rank %d", r)
	}
	at1.Close()
	to1.Close() // gloo closes the erring rank's end on the error
	if r, p := a.closedPeer(0); r != 1 || p != port(at1) {
		t.Fatalf("closedPeer = rank %d, port %d; want rank 1, port %d", r, p, port(at1))
	}
	at2.Close()
	if r, _ := a.closedPeer(0); r != -1 {
		t.Fatalf("closedPeer with two ranks' ends closed = rank %d, want none", r)
	}

	a, to1, at1, _, _, toOther := agent()
	to1.Close()
	at1.Close()
	toOther.Close()
	if r, _ := a.closedPeer(0); r != -1 {
		t.Fatalf("closedPeer with rank 0's connection elsewhere closed = rank %d, want none", r)
	}

	a, _, _, _, _, _ = agent()
	a.slots[2].proc = nil
	if r, _ := a.closedPeer(0); r != 2 {
		t.Fatalf("closedPeer with rank 2's process gone = rank %d, want 2", r)
	}

	// rankOfPeer follows rank 0's own connection to the port named. Each
	// rank listens on its own port, as gloo's ranks do.
	dial := func(a *Agent, s *slot) (net.Conn, net.Conn) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		c, d := loopback(t, l)
		note(a.slots[0], c)
		note(s, d)
		return c, d
	}
	a = threeRanks()
	c1, at1 := dial(a, a.slots[1])
	c2, at2 := dial(a, a.slots[2])
	p1, p2 := port(at1), port(at2)
	if r := a.rankOfPeer(p1, 0); r != -1 {
		t.Fatalf("rankOfPeer of a connection open at both ends = rank %d, want none", r)
	}
	// As in a CI run once: rank 1 holds rank 2's port in the other
	// reading (here closed), and rank 2's very port on a connection
	// elsewhere; neither is rank 0's connection.
	a.slots[1].socks = append(a.slots[1].socks,
		tcpSocket{inode: "1", local: bits.ReverseBytes16(p2), remote: 1},
		tcpSocket{inode: "2", local: p2, remote: 2})
	c2.Close() // gloo closes the erring rank's end on the error
	for _, q := range []uint16{p2, bits.ReverseBytes16(p2)} {
		if r := a.rankOfPeer(q, 0); r != 2 {
			t.Fatalf("rankOfPeer(%d) of rank 2's end with rank 1's decoys = rank %d, want 2", q, r)
		}
	}
	// rank 0's connection to rank 1 fails too, rank 1's end closing.
	c1.Close()
	at1.Close()
	if r := a.rankOfPeer(p1, 0); r != 1 {
		t.Fatalf("rankOfPeer of rank 1's closed end = rank %d, want 1", r)
	}
	// A failed connection to another rank in each reading names neither.
	a.slots[0].socks = append(a.slots[0].socks, tcpSocket{inode: "3", local: 7, remote: bits.ReverseBytes16(p2)})
	a.slots[1].socks = append(a.slots[1].socks, tcpSocket{inode: "4", local: bits.ReverseBytes16(p2), remote: 7})
	if r := a.rankOfPeer(p2, 0); r != -1 {
		t.Fatalf("rankOfPeer with a failed connection in each reading = rank %d, want none", r)
	}

	// Where rank 0 has no end to the port noted, the one rank holding it
	// (in either reading) on a socket closed now stands for it; one open
	// on it does not.
	a = threeRanks()
	_, at1 = dial(a, a.slots[1])
	_, at2 = dial(a, a.slots[2])
	a.slots[0].socks = nil
	at2.Close()
	for _, q := range []uint16{port(at2), bits.ReverseBytes16(port(at2))} {
		if r := a.rankOfPeer(q, 0); r != 2 {
			t.Fatalf("rankOfPeer(%d) with rank 0's end not noted, rank 2's closed = rank %d, want 2", q, r)
		}
	}
	if r := a.rankOfPeer(port(at1), 0); r != -1 {
		t.Fatalf("rankOfPeer with rank 0's end not noted, rank 1's open = rank %d, want none", r)
	}
}

// TestPeerFromNotes: ends noted over several notes, as a rank that makes
// and ends groups leaves them. Sockets with made-up inodes are closed;
// the ranks' process is this one.
func TestPeerFromNotes(t *testing.T) {
	if _, err := os.Stat("/proc/self/net/tcp"); err != nil {
		t.Skipf("no /proc/self/net/tcp: %v", err)
	}
	const q = 45000
	for _, old := range []uint16{q, bits.ReverseBytes16(q)} {
		// Rank 0's connection with rank 1 ended with a group; the port went
		// to rank 0's new connection with a rank whose end was not noted.
		a := threeRanks()
		a.slots[0].note([]tcpSocket{{inode: "a", local: 40001, remote: old}})
		a.slots[1].note([]tcpSocket{{inode: "b", local: old, remote: 40001}})
		if r := a.rankOfPeer(q, 0); r != 1 {
			t.Fatalf("rankOfPeer of rank 0's one connection, closed, with rank 1 = %d, want 1", r)
		}
		a.slots[0].note([]tcpSocket{{inode: "c", local: 40002, remote: q}})
		if r := a.rankOfPeer(q, 0); r != -1 {
			t.Fatalf("rankOfPeer(%d) with rank 1's end (port %d) of a connection ended before = rank %d, want none", q, old, r)
		}
	}

	// Rank 0's connection with rank 1 ended before rank 0's last note;
	// the port went to rank 2, and rank 0's end of the connection that
	// failed was not noted: rank 1's old end names no one, rank 2's may.
	for _, noted2 := range []bool{false, true} {
		a := threeRanks()
		a.slots[0].note([]tcpSocket{{inode: "a", local: 40001, remote: q}})
		a.slots[1].note([]tcpSocket{{inode: "b", local: q, remote: 40001}})
		a.slots[0].note([]tcpSocket{{inode: "x", local: 40003, remote: 29500}})
		a.slots[0].note([]tcpSocket{{inode: "x", local: 40003, remote: 29500}}) // with the failing group's start
		want := -1
		if noted2 {
			a.slots[2].note([]tcpSocket{{inode: "c", local: q, remote: 40005}})
			want = 2
		}
		if r := a.rankOfPeer(q, 0); r != want {
			t.Fatalf("rankOfPeer with rank 1's end of a connection ended before rank 0's last note (rank 2's end noted: %v) = %d, want %d", noted2, r, want)
		}
	}

	// Rank 0 ended a group with rank 1 just before its last note, and rank
	// 1 noted again since: both ends were let go of, and name no one.
	a := threeRanks()
	a.slots[0].note([]tcpSocket{{inode: "a", local: 40001, remote: q}})
	a.slots[1].note([]tcpSocket{{inode: "b", local: q, remote: 40001}})
	a.slots[0].note([]tcpSocket{{inode: "x", local: 40003, remote: 29500}})
	a.slots[1].note([]tcpSocket{{inode: "y", local: 40004, remote: 29500}})
	if r := a.rankOfPeer(q, 0); r != -1 {
		t.Fatalf("rankOfPeer with both ends of a connection let go of before a note = %d, want none", r)
	}

	// Rank 0 noted no end to the port: rank 1's socket on it stands for
	// it only where rank 1 did not let go of it and go on.
	a = threeRanks()
	a.slots[1].note([]tcpSocket{{inode: "s", local: bits.ReverseBytes16(q), remote: 29500}})
	if r := a.rankOfPeer(q, 0); r != 1 {
		t.Fatalf("rankOfPeer with rank 1's socket on the port closed = %d, want 1", r)
	}
	a.slots[1].note([]tcpSocket{{inode: "t", local: 40100, remote: 29500}})
	if r := a.rankOfPeer(q, 0); r != -1 {
		t.Fatalf("rankOfPeer with rank 1's socket on the port closed before its last note = %d, want none", r)
	}
	// closedPeer passes over such an end too.
	a = threeRanks()
	a.slots[0].note([]tcpSocket{{inode: "m", local: 40001, remote: 40002}})
	a.slots[1].note([]tcpSocket{{inode: "k", local: 40002, remote: 40001}})
	a.slots[0].proc = nil
	if r, _ := a.closedPeer(0); r != 1 {
		t.Fatalf("closedPeer with rank 1's end closed = %d, want 1", r)
	}
	a.slots[1].note([]tcpSocket{{inode: "t", local: 40100, remote: 29500}})
	if r, _ := a.closedPeer(0); r != -1 {
		t.Fatalf("closedPeer with rank 1's end closed before its last note = %d, want none", r)
	}

	// Rank 0, running, ended a group with rank 2 before its last note;
	// its end of that connection, closed since, does not hide rank 1's
	// end of the one that failed.
	l, err := net.Listen("tcp", "127.0.0.1:0") // rank 0's process holds a socket
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	a = threeRanks()
	a.slots[0].note([]tcpSocket{{inode: "e", local: 40010, remote: 40011}})
	a.slots[2].note([]tcpSocket{{inode: "f", local: 40011, remote: 40010}})
	a.slots[0].note([]tcpSocket{{inode: "x", local: 40003, remote: 29500}})
	a.slots[2].note([]tcpSocket{{inode: "y", local: 40004, remote: 29500}})
	a.slots[0].note([]tcpSocket{{inode: "x", local: 40003, remote: 29500}, {inode: "m", local: 42000, remote: 42001}})
	a.slots[1].note([]tcpSocket{{inode: "k", local: 42001, remote: 42000}})
	a.slots[0].socks = slices.DeleteFunc(a.slots[0].socks, func(k tcpSocket) bool { return k.inode == "x" }) // of no slot
	if r, p := a.closedPeer(0); r != 1 || p != 42001 {
		t.Fatalf("closedPeer with rank 0's end of a group ended before = rank %d, port %d; want rank 1, port 42001", r, p)
	}

	// Rank 0's connection with rank 1 ended before its last note, rank 1
	// taking none since; rank 0's end of the connection that failed was
	// not noted: rank 1's end names no one.
	a = threeRanks()
	a.slots[0].note([]tcpSocket{{inode: "a", local: 40001, remote: 40002}})
	a.slots[1].note([]tcpSocket{{inode: "b", local: 40002, remote: 40001}})
	a.slots[0].note([]tcpSocket{{inode: "x", local: 40003, remote: 29500}})
	a.slots[0].note([]tcpSocket{{inode: "x", local: 40003, remote: 29500}})
	a.slots[0].socks = slices.DeleteFunc(a.slots[0].socks, func(k tcpSocket) bool { return k.inode == "x" })
	if r, _ := a.closedPeer(0); r != -1 {
		t.Fatalf("closedPeer with rank 1's end of a connection ended before rank 0's last note = rank %d, want none", r)
	}

	// Once rank 0's process is gone, its connection with rank 1, open at
	// rank 1's end, did not fail.
	c, d := loopback(t, l)
	p1 := uint16(d.LocalAddr().(*net.TCPAddr).Port)
	a = threeRanks()
	a.slots[0].note([]tcpSocket{ownEnd(t, c)})
	a.slots[1].note([]tcpSocket{ownEnd(t, d)})
	a.slots[0].proc = nil
	if r := a.rankOfPeer(p1, 0); r != -1 {
		t.Fatalf("rankOfPeer, rank 0 gone, of its connection open at rank 1's end = %d, want none", r)
	}
	d.Close()
	if r := a.rankOfPeer(p1, 0); r != 1 {
		t.Fatalf("rankOfPeer, rank 0 gone, of its connection closed at rank 1's end = %d, want 1", r)
	}

	// A job that makes and ends connections as it goes keeps maxGone of
	// the ended ones, and every one it holds.
	s := &slot{}
	held := tcpSocket{inode: "held", local: 1, remote: 2}
	for i := range 3 * maxGone {
		s.note([]tcpSocket{held, {inode: strconv.Itoa(i), local: 3, remote: 4}})
	}
	if len(s.socks) != maxGone+2 || !slices.ContainsFunc(s.socks, func(k tcpSocket) bool { return k.inode == "held" }) {
		t.Fatalf("after %d notes, %d sockets noted (held kept: %v); want %d", 3*maxGone, len(s.socks),
			slices.ContainsFunc(s.socks, func(k tcpSocket) bool { return k.inode == "held" }), maxGone+2)
	}
}

// threeRanks returns an agent of ranks 0 to 2, their process this one.
func threeRanks() *Agent {
	a := &Agent{cfg: Config{ProcsPerNode: 3}}
	for r := range 3 {
		a.slots = append(a.slots, &slot{rank: r, proc: &rankProc{pid: os.Getpid()}})
	}
	return a
}

// loopback returns both ends of a new connection to l, closed at the
// test's end.
func loopback(t *testing.T, l net.Listener) (net.Conn, net.Conn) {
	t.Helper()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	d, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(); d.Close() })
	return c, d
}

// ownEnd returns c's socket as /proc/self/net/tcp shows it.
func ownEnd(t *testing.T, c net.Conn) tcpSocket {
	t.Helper()
	b, err := os.ReadFile("/proc/self/net/tcp")
	if err != nil {
		t.Fatal(err)
	}
	local, remote := uint16(c.LocalAddr().(*net.TCPAddr).Port), uint16(c.RemoteAddr().(*net.TCPAddr).Port)
	for _, k := range tcpSockets(b, socketInodes(os.Getpid())) {
		if k.local == local && k.remote == remote {
			return k
		}
	}
	t.Fatalf("no socket %d -> %d of this process in /proc/self/net/tcp", local, remote)
	return tcpSocket{}
}

func FuzzPeerAddr(f *testing.F) {
	f.Add("Connection closed by peer [127.0.0.1]:14772")
	f.Add("[::1]:1 [x]:2")
	f.Fuzz(func(t *testing.T, msg string) {
		addr, ok := peerAddr(msg)
		if ok && !strings.Contains(msg, ":") {
			t.Fatalf("peerAddr(%q) = %v from a message without a port", msg, addr)
		}
		if ok && addr != netip.AddrPortFrom(addr.Addr().Unmap(), addr.Port()) {
			t.Fatalf("peerAddr(%q) = %v, not unmapped", msg, addr)
		}
	})
}

func FuzzTCPSockets(f *testing.F) {
	f.Add([]byte(procTCP), "5505")
	f.Fuzz(func(t *testing.T, table []byte, inode string) {
		got := tcpSockets(table, map[string]bool{inode: true})
		if len(got) > strings.Count(string(table), "\n")+1 {
			t.Fatalf("%d sockets from %d lines", len(got), strings.Count(string(table), "\n")+1)
		}
		for _, k := range got {
			if k.inode != inode {
				t.Fatalf("socket %+v, not of inode %q", k, inode)
			}
		}
	})
}
