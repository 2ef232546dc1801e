package taskd

import (
	"context"
	"fmt"
	"net"
	"os"
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
// (one iteration), while an attacker on 127.0.0.2 runs the abuse. The
// baseline, "none", runs no abuse, in the same run. It reports the
// worker's register+heartbeat latency (p50, p99, max) and the manager
// process's peak resident memory. Run with -benchtime=1000x.
func BenchmarkAbuse(b *testing.B) {
	const token = "bench-token-0123456789abcdef"
	abuses := []struct {
		name string
		run  func(a *abuser, ctx context.Context)
	}{
		{"none", func(_ *abuser, ctx context.Context) { <-ctx.Done() }},
		// Without the token.
		{"half-open-streams", (*abuser).halfOpenStreams},
		{"big-bodies-wrong-token", (*abuser).bigBodies},
		{"guessing", (*abuser).guessing},
		{"silent-connections", (*abuser).silentConns},
		{"idle-http2-connections", (*abuser).idleConns},
		// With the token, as any training process holds it.
		{"forged-faults", (*abuser).forgedFaults},
		{"fault-flood", (*abuser).faultFlood},
		{"megabyte-faults", (*abuser).bigFaults},
		{"register-flood", (*abuser).registerFlood},
		{"heartbeat-age-overflow", (*abuser).ageOverflow},
		{"megabyte-ack-errors", (*abuser).bigAcks},
		{"megabyte-messages", (*abuser).bigMessages},
	}
	for _, ab := range abuses {
		b.Run(ab.name, func(b *testing.B) {
			addr := freeAddr(b)
			mgr := startChild(b, "manager", childArgs{Job: "bench", Listen: addr, StateDir: b.TempDir(), Token: token, Interval: time.Second, Deadline: 5 * time.Second, Ack: 3 * time.Second})
			mgr.expect(0, "ready", 60*time.Second)
			sec := Security{Insecure: true, Token: token}
			legit := newRawMember(b, addr, "bench", sec, RoleWorker, Position{Node: 0, Rank: 0})
			testkit.WaitFor(b, "the legitimate worker registered", func() bool { return legit.register() == nil })
			a := &abuser{b: b, addr: addr, job: "bench", token: token}
			ctx, cancel := context.WithCancel(context.Background())
			var wg sync.WaitGroup
			wg.Go(func() { ab.run(a, ctx) })
			time.Sleep(time.Second) // the abuse under way before the first sample
			lat := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for range b.N {
				start := time.Now()
				err := legit.register()
				if err == nil {
					_, err = legit.client.Heartbeat(legit.ctx(), &pb.HeartbeatRequest{Job: "bench", Beats: []*pb.Beat{{Member: legit.self}}})
				}
				if err != nil {
					b.Fatalf("the legitimate worker: %v", err)
				}
				lat = append(lat, time.Since(start))
				time.Sleep(2 * time.Millisecond)
			}
			b.StopTimer()
			peak := procKiB(b, mgr.cmd.Process.Pid, "VmHWM")
			cancel()
			wg.Wait()
			sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
			ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
			b.ReportMetric(ms(lat[len(lat)/2]), "p50-ms")
			b.ReportMetric(ms(lat[len(lat)*99/100]), "p99-ms")
			b.ReportMetric(ms(lat[len(lat)-1]), "max-ms")
			b.ReportMetric(float64(peak)/1024, "peak-rss-MiB")
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

// abuser runs one abuse from 127.0.0.2 until its context ends.
type abuser struct {
	b     *testing.B
	addr  string
	job   string
	token string
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
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(attacker)}}
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
		conn := dialFrom(a.b, attacker, a.addr, Security{Insecure: true, Token: "guess-" + strconv.Itoa(int(time.Now().UnixNano()))})
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

// silentConns holds 1,000 TCP connections that never speak.
func (a *abuser) silentConns(ctx context.Context) {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(attacker)}}
	loop(ctx, 4, func(ctx context.Context) {
		var cs []net.Conn
		for range 250 {
			if c, err := d.DialContext(ctx, "tcp", a.addr); err == nil {
				cs = append(cs, c)
			}
		}
		<-ctx.Done()
		for _, c := range cs {
			c.Close()
		}
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
