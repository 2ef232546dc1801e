package taskd

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
	"github.com/faultline-ml/faultline/internal/testkit"
)

// BenchmarkAbuse measures what each abuse of the control plane does to a
// legitimate worker: a manager process with a token and a state folder
// serves a worker on 127.0.0.1 that registers again and sends a heartbeat
// (one iteration), while an attacker on 127.0.0.2 runs the abuse, or on
// 127.0.0.1, the worker's own address, where the abuse is of a node's
// shared address (-shared). There the worker reconnects each iteration
// (a new connection, its registration again with its secret, a
// heartbeat), as after a proxy's or manager's restart, and every attempt
// should succeed. The baselines, "none" and "none-reconnecting", run no
// abuse, in the same run. It reports the worker's latency (p50, p99, max),
// the share of its attempts that succeeded and the manager process's peak
// resident memory, and beside the baseline of its kind measured before it
// in the same run, the ratio of its p50 and p99 to the baseline's. Run
// with -benchtime=1000x.
func BenchmarkAbuse(b *testing.B) {
	const token = "bench-token-0123456789abcdef"
	none := func(_ *abuser, ctx context.Context) { <-ctx.Done() }
	abuses := []struct {
		name string
		run  func(a *abuser, ctx context.Context)
		// shared: the attacker is on the worker's address, which
		// reconnects each iteration.
		shared bool
		// state fills the manager's state folder before it starts.
		state func(b *testing.B, dir string)
	}{
		{name: "none", run: none},
		{name: "none-reconnecting", run: none, shared: true},
		// The members' own address, shared with the attacker.
		{name: "guessing-shared", run: (*abuser).guessing, shared: true},
		{name: "pipelined-guessing-shared", run: (*abuser).pipelinedGuessing, shared: true},
		{name: "silent-connections-shared", run: (*abuser).silentConns, shared: true},
		{name: "speaking-connections-shared", run: (*abuser).speakingConns, shared: true},
		{name: "stalled-registers-shared", run: (*abuser).stalledSmallRegisters, shared: true},
		// With the token.
		{name: "stalled-4MiB-registers", run: (*abuser).stalledRegisters},
		{name: "stalled-4MiB-sends", run: (*abuser).stalledSends},
		{name: "worker-token-as-proxy", run: (*abuser).asProxy},
		{name: "outsider-ranks", run: (*abuser).outsiders},
		{name: "restart-30000-faults", run: none, state: faultFile},
		// Without the token.
		{name: "half-open-streams", run: (*abuser).halfOpenStreams},
		{name: "big-bodies-wrong-token", run: (*abuser).bigBodies},
		{name: "guessing", run: (*abuser).guessing},
		{name: "silent-connections", run: (*abuser).silentConns},
		{name: "idle-http2-connections", run: (*abuser).idleConns},
		// With the token, as any training process holds it.
		{name: "forged-faults", run: (*abuser).forgedFaults},
		{name: "fault-flood", run: (*abuser).faultFlood},
		{name: "megabyte-faults", run: (*abuser).bigFaults},
		{name: "register-flood", run: (*abuser).registerFlood},
		{name: "heartbeat-age-overflow", run: (*abuser).ageOverflow},
		{name: "megabyte-ack-errors", run: (*abuser).bigAcks},
		{name: "megabyte-messages", run: (*abuser).bigMessages},
	}
	// The baselines' p50 and p99, by whether the worker reconnects.
	base := map[bool][2]time.Duration{}
	for _, ab := range abuses {
		b.Run(ab.name, func(b *testing.B) {
			addr := freeAddr(b)
			dir := b.TempDir()
			if ab.state != nil {
				ab.state(b, dir)
			}
			mgr := startChild(b, "manager", childArgs{Job: "bench", Listen: addr, StateDir: dir, Token: token, Interval: time.Second, Deadline: 5 * time.Second, Ack: 3 * time.Second})
			mgr.expect(0, "ready", 60*time.Second)
			sec := Security{Insecure: true, Token: token}
			legit := newRawMember(b, addr, "bench", sec, RoleWorker, Position{Node: 0, Rank: 0})
			testkit.WaitFor(b, "the legitimate worker registered", func() bool { return legit.register() == nil })
			a := &abuser{b: b, addr: addr, job: "bench", token: token, from: attacker}
			if ab.shared {
				a.from = "127.0.0.1"
			}
			ctx, cancel := context.WithCancel(context.Background())
			var wg sync.WaitGroup
			wg.Go(func() { ab.run(a, ctx) })
			time.Sleep(time.Second) // the abuse under way before the first sample
			lat := make([]time.Duration, 0, b.N)
			failed := 0
			b.ResetTimer()
			for range b.N {
				start := time.Now()
				if ab.shared {
					again := newRawMember(b, addr, "bench", sec, RoleWorker, Position{Node: 0, Rank: 0})
					again.self = legit.self
					again.cred.set(*legit.cred.secret.Load())
					legit.conn.Close()
					legit = again
				}
				err := legit.register()
				if err == nil {
					_, err = legit.client.Heartbeat(legit.ctx(), &pb.HeartbeatRequest{Job: "bench", Beats: []*pb.Beat{{Member: legit.self}}})
				}
				if err != nil {
					// Counted, not fatal: the share refused is the figure.
					failed++
					b.Logf("the legitimate worker: %v", err)
					legit = newRawMember(b, addr, "bench", sec, RoleWorker, Position{Node: 0, Rank: 0})
					testkit.WaitFor(b, "the legitimate worker registered", func() bool { return legit.register() == nil })
					continue
				}
				lat = append(lat, time.Since(start))
				time.Sleep(2 * time.Millisecond)
			}
			b.StopTimer()
			peak := procKiB(b, mgr.cmd.Process.Pid, "VmHWM")
			cancel()
			wg.Wait()
			if len(lat) == 0 {
				b.Fatalf("every one of %d attempts of the legitimate worker failed", failed)
			}
			sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
			ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
			p50, p99 := lat[len(lat)/2], lat[len(lat)*99/100]
			b.ReportMetric(ms(p50), "p50-ms")
			b.ReportMetric(ms(p99), "p99-ms")
			b.ReportMetric(ms(lat[len(lat)-1]), "max-ms")
			b.ReportMetric(float64(peak)/1024, "peak-rss-MiB")
			b.ReportMetric(100*float64(b.N-failed)/float64(b.N), "ok-%")
			if strings.HasPrefix(ab.name, "none") {
				base[ab.shared] = [2]time.Duration{p50, p99}
			} else if bl, ok := base[ab.shared]; ok {
				b.ReportMetric(float64(p50)/float64(bl[0]), "p50-x-none")
				b.ReportMetric(float64(p99)/float64(bl[1]), "p99-x-none")
			}
			b.ReportMetric(0, "ns/op")
		})
	}
}

// procKiB returns a field of /proc/PID/status, in KiB.
func procKiB(t testing.TB, pid int, field string) int {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			n, _ := strconv.Atoi(strings.Fields(v)[0])
			return n
		}
	}
	return 0
}

// abuser runs one abuse from its address until its context ends.
type abuser struct {
	b     *testing.B
	addr  string
	job   string
	token string
	from  string // the attacker's address: 127.0.0.2, or the worker's
}

const attacker = "127.0.0.2"

// loop runs f on n goroutines until ctx ends.
func loop(ctx context.Context, n int, f func(ctx context.Context)) {
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			for ctx.Err() == nil {
				f(ctx)
			}
		})
	}
	wg.Wait()
}

// h2 opens a bare HTTP/2 connection from the attacker's address, nil when
// refused.
func (a *abuser) h2(ctx context.Context) *h2Conn {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(a.from)}}
	c, err := d.DialContext(ctx, "tcp", a.addr)
	if err != nil {
		return nil
	}
	context.AfterFunc(ctx, func() { c.Close() })
	c.SetDeadline(time.Now().Add(10 * time.Second))
	h := &h2Conn{t: a.b, c: c, fr: http2.NewFramer(c, c), settings: map[http2.SettingID]uint32{}}
	h.enc = hpack.NewEncoder(&h.hb)
	if _, err := c.Write([]byte(http2.ClientPreface)); err != nil || h.fr.WriteSettings() != nil {
		c.Close()
		return nil
	}
	return h
}

// halfOpenStreams opens streams without a token and without ending them.
func (a *abuser) halfOpenStreams(ctx context.Context) {
	loop(ctx, 8, func(ctx context.Context) {
		h := a.h2(ctx)
		if h == nil {
			return
		}
		defer h.c.Close()
		for id := uint32(1); id < 2*2000 && ctx.Err() == nil; id += 2 {
			if !h.tryCall(id, "/faultline.taskd.v1.Control/Register", "", 4<<20, 0) {
				return
			}
		}
	})
}

// bigBodies sends most of a 4 MiB message on each stream, with a wrong
// token.
func (a *abuser) bigBodies(ctx context.Context) {
	loop(ctx, 8, func(ctx context.Context) {
		h := a.h2(ctx)
		if h == nil {
			return
		}
		defer h.c.Close()
		for id := uint32(1); id < 2*96 && ctx.Err() == nil; id += 2 {
			if !h.tryCall(id, "/faultline.taskd.v1.Control/Send", "Bearer wrong", 4<<20, 4<<20-1<<10) {
				return
			}
		}
	})
}

// guessing tries tokens as fast as it can, a new connection when one is
// closed on it.
func (a *abuser) guessing(ctx context.Context) {
	loop(ctx, 8, func(ctx context.Context) {
		conn := dialFrom(a.b, a.from, a.addr, Security{Insecure: true, Token: "guess-" + strconv.Itoa(int(time.Now().UnixNano()))})
		defer conn.Close()
		client := pb.NewControlClient(conn)
		for ctx.Err() == nil {
			cctx, cancel := context.WithTimeout(ctx, time.Second)
			_, err := client.Register(cctx, &pb.RegisterRequest{Job: a.job})
			cancel()
			if err != nil && strings.Contains(err.Error(), "Unavailable") {
				return
			}
		}
	})
}

// silentConns holds 1,000 TCP connections that never speak, each opened
// again once the server closes it; on the worker's own address, as many
// as an address may hold pending (a storm of more, opened again at once,
// still refuses newcomers from there).
func (a *abuser) silentConns(ctx context.Context) {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(a.from)}}
	n := 1000
	if a.from != attacker {
		n = defaultMaxConnectionsPerPeer
	}
	loop(ctx, n, func(ctx context.Context) {
		c, err := d.DialContext(ctx, "tcp", a.addr)
		if err != nil {
			time.Sleep(10 * time.Millisecond)
			return
		}
		stop := context.AfterFunc(ctx, func() { c.Close() })
		io.Copy(io.Discard, c) // until the server closes it
		stop()
		c.Close()
	})
}

// idleConns holds 2,000 HTTP/2 connections that never make a call.
func (a *abuser) idleConns(ctx context.Context) {
	loop(ctx, 4, func(ctx context.Context) {
		for range 500 {
			a.h2(ctx) // closed when ctx ends
		}
		<-ctx.Done()
	})
}

// member registers a member of the attacker as a token holder would.
func (a *abuser) member(ctx context.Context, rank int) *rawMember {
	r := newRawMember(a.b, a.addr, a.job, Security{Insecure: true, Token: a.token}, RoleWorker, Position{Node: 0, Rank: rank})
	for ctx.Err() == nil && r.register() != nil {
		time.Sleep(10 * time.Millisecond)
	}
	return r
}

// sendFaults sends calls of n faults of kind about rank, from r, until
// ctx ends.
func (a *abuser) sendFaults(ctx context.Context, r *rawMember, n, rank int, msg string) {
	seq := 0
	for ctx.Err() == nil {
		req := &pb.SendRequest{Job: a.job}
		for range n {
			seq++
			req.Reports = append(req.Reports, &pb.Report{Id: fmt.Sprintf("%s/%d", r.self.GetInstance(), seq), From: r.self,
				Body: &pb.Report_Fault{Fault: &pb.FaultReport{Kind: string(FaultProcessExit), Rank: int32(rank), Message: msg}}})
		}
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		r.client.Send(cctx, req)
		cancel()
	}
}

// forgedFaults reports process exits of the legitimate worker's rank.
func (a *abuser) forgedFaults(ctx context.Context) {
	r := a.member(ctx, 1)
	loop(ctx, 4, func(ctx context.Context) { a.sendFaults(ctx, r, 1, 0, "forged") })
}

// faultFlood reports its own faults, 1,000 a call.
func (a *abuser) faultFlood(ctx context.Context) {
	r := a.member(ctx, 1)
	loop(ctx, 4, func(ctx context.Context) { a.sendFaults(ctx, r, 1000, 1, "flood") })
}

// bigFaults reports faults of a megabyte each.
func (a *abuser) bigFaults(ctx context.Context) {
	r := a.member(ctx, 1)
	msg := strings.Repeat("x", 1<<20)
	loop(ctx, 4, func(ctx context.Context) { a.sendFaults(ctx, r, 1, 1, msg) })
}

// registerFlood registers rank after rank.
func (a *abuser) registerFlood(ctx context.Context) {
	r := newRawMember(a.b, a.addr, a.job, Security{Insecure: true, Token: a.token}, RoleWorker, Position{})
	var next sync.Mutex
	rank := 1
	loop(ctx, 4, func(ctx context.Context) {
		next.Lock()
		rank = rank%(defaultMaxWorkers-1) + 1
		pos := Position{Node: rank / 8, Rank: rank}
		next.Unlock()
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		r.client.Register(cctx, &pb.RegisterRequest{Job: a.job, Member: memberPB(RoleWorker, pos, newInstanceID()), Hostname: strings.Repeat("h", maxHostnameBytes)})
		cancel()
	})
}

// ageOverflow beats with ages that overflow a duration.
func (a *abuser) ageOverflow(ctx context.Context) {
	r := a.member(ctx, 1)
	loop(ctx, 4, func(ctx context.Context) {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		r.client.Heartbeat(cctx, &pb.HeartbeatRequest{Job: a.job, Beats: []*pb.Beat{{Member: r.self, AgeMs: 1 << 62}}})
		cancel()
	})
}

// bigAcks acknowledges with errors of a megabyte.
func (a *abuser) bigAcks(ctx context.Context) {
	r := a.member(ctx, 1)
	e := strings.Repeat("e", 1<<20)
	loop(ctx, 4, func(ctx context.Context) {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		r.client.Acknowledge(cctx, &pb.AckRequest{Job: a.job, Acks: []*pb.Ack{{Id: 1, From: r.self, Error: e}, {Id: 2, From: r.self, Error: e}}})
		cancel()
	})
}

// bigMessages sends application messages of a megabyte each.
func (a *abuser) bigMessages(ctx context.Context) {
	r := a.member(ctx, 1)
	payload := make([]byte, 1<<20)
	seq := 0
	var mu sync.Mutex
	loop(ctx, 4, func(ctx context.Context) {
		mu.Lock()
		seq++
		id := fmt.Sprintf("%s/%d", r.self.GetInstance(), seq)
		mu.Unlock()
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		r.client.Send(cctx, &pb.SendRequest{Job: a.job, Reports: []*pb.Report{{Id: id, From: r.self, Body: &pb.Report_Message{Message: &pb.UserMessage{Kind: "k", Payload: payload}}}}})
		cancel()
	})
}

// stalledRegisters sends, with the members' token, Registers that declare
// 4 MiB - 1 KiB and send all but their last KiB, 24 a connection on 4
// connections.
func (a *abuser) stalledRegisters(ctx context.Context) {
	loop(ctx, 4, func(ctx context.Context) {
		h := a.h2(ctx)
		if h == nil {
			return
		}
		defer h.c.Close()
		for id := uint32(1); id < 2*24 && ctx.Err() == nil; id += 2 {
			if !h.tryCall(id, pb.Control_Register_FullMethodName, "Bearer "+a.token, 4<<20-1<<10, 4<<20-2<<10) {
				return
			}
		}
		<-ctx.Done()
	})
}

// stalledSmallRegisters sends, with the members' token, 10 connections
// of 100 Registers each that declare 100 bytes and send none, 100 more on
// each connection as the server ends them.
func (a *abuser) stalledSmallRegisters(ctx context.Context) {
	loop(ctx, 10, func(ctx context.Context) {
		h := a.h2(ctx)
		if h == nil {
			return
		}
		defer h.c.Close()
		for id := uint32(1); ctx.Err() == nil; id += 2 {
			if !h.tryCall(id, pb.Control_Register_FullMethodName, "Bearer "+a.token, 100, 0) {
				return
			}
			if id%(2*maxStreamsPerConn) == 2*maxStreamsPerConn-1 {
				select { // until the server has ended them
				case <-ctx.Done():
				case <-time.After(anonBodyDeadline + 100*time.Millisecond):
				}
			}
		}
	})
}

// stalledSends registers three ranks of its own with the members' token,
// and sends, as each, 32 Sends that declare 4 MiB - 1 KiB and send all but
// their last KiB, again as a connection is closed on it.
func (a *abuser) stalledSends(ctx context.Context) {
	var wg sync.WaitGroup
	for rank := 500; rank < 503; rank++ {
		r := a.member(ctx, rank)
		secret := *r.cred.secret.Load()
		wg.Go(func() {
			loop(ctx, 1, func(ctx context.Context) {
				h := a.h2(ctx)
				if h == nil {
					return
				}
				defer h.c.Close()
				for id := uint32(1); id < 2*maxCallsPerWorker && ctx.Err() == nil; id += 2 {
					if h.send(id, pb.Control_Send_FullMethodName, "Bearer "+a.token, map[string]string{memberHeader: secret}, 4<<20-1<<10, 4<<20-2<<10) != nil {
						return
					}
				}
				<-ctx.Done()
			})
		})
	}
	wg.Wait()
}

// speakingConns opens 600 connections a second that each send a byte and
// nothing more, each held until the server closes it.
func (a *abuser) speakingConns(ctx context.Context) {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(a.from)}}
	tick := time.NewTicker(time.Second / 600)
	defer tick.Stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		wg.Go(func() {
			c, err := d.DialContext(ctx, "tcp", a.addr)
			if err != nil {
				return
			}
			stop := context.AfterFunc(ctx, func() { c.Close() })
			defer stop()
			defer c.Close()
			c.Write([]byte("P"))
			io.Copy(io.Discard, c) // until the server closes it
		})
	}
}

// pipelinedGuessing sends 50 wrong-token Registers at once on each
// connection, a new connection when one is closed on it.
func (a *abuser) pipelinedGuessing(ctx context.Context) {
	loop(ctx, 8, func(ctx context.Context) {
		h := a.h2(ctx)
		if h == nil {
			return
		}
		defer h.c.Close()
		for id := uint32(1); id < 100; id += 2 {
			if !h.tryCall(id, pb.Control_Register_FullMethodName, "Bearer guess-0123456789abcdef", 10, 10) {
				return
			}
		}
		io.Copy(io.Discard, h.c) // until the server closes it
	})
}

// asProxy registers, with the members' token, as the proxy of node 0.
func (a *abuser) asProxy(ctx context.Context) {
	r := newRawMember(a.b, a.addr, a.job, Security{Insecure: true, Token: a.token}, RoleProxy, Position{Node: 0, Rank: -1})
	loop(ctx, 4, func(ctx context.Context) {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		r.client.Register(cctx, &pb.RegisterRequest{Job: a.job, Member: memberPB(RoleProxy, Position{Node: 0, Rank: -1}, newInstanceID())})
		cancel()
	})
}

// outsiders join as ranks of their own, one after another, and go silent.
func (a *abuser) outsiders(ctx context.Context) {
	r := newRawMember(a.b, a.addr, a.job, Security{Insecure: true, Token: a.token}, RoleWorker, Position{})
	rank := 0
	loop(ctx, 1, func(ctx context.Context) {
		rank = rank%(defaultMaxWorkers-2) + 2
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		r.client.Register(cctx, &pb.RegisterRequest{Job: a.job, Member: memberPB(RoleWorker, Position{Node: 0, Rank: rank}, newInstanceID())})
		cancel()
		time.Sleep(10 * time.Millisecond)
	})
}

// faultFile writes a fault log of 30,000 faults of 4 KiB, more than the
// manager keeps, for it to read as it starts.
func faultFile(b *testing.B, dir string) {
	f, err := os.Create(filepath.Join(dir, "faults.jsonl"))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	w := bufio.NewWriter(f)
	msg := strings.Repeat("m", MaxFaultMessageBytes-64)
	for i := range 30000 {
		line, err := marshalFault(Fault{Seq: uint64(i + 1), ID: fmt.Sprint(i), Kind: FaultHang, Message: msg, Time: t0, Received: t0})
		if err != nil {
			b.Fatal(err)
		}
		w.Write(line)
	}
	if err := w.Flush(); err != nil {
		b.Fatal(err)
	}
}
