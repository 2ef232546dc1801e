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
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/trace"
)

// BenchmarkSwitchFanout flips the switch of a job of 1,000 in-process
// workers (8 proxies of 125, or all attached to the manager) over gRPC on
// loopback and measures the time until every worker applied it. Run with
// -benchtime=50x for a p99.
func BenchmarkSwitchFanout(b *testing.B) {
	for _, proxies := range []int{8, 0} {
		b.Run(fmt.Sprintf("workers=1000/proxies=%d", proxies), func(b *testing.B) { benchFanout(b, 1000, proxies) })
	}
}

func benchFanout(b *testing.B, workers, proxies int) {
	// Every worker dials from loopback, one peer to the manager: without
	// proxies, all of them are more than a peer's default share.
	c := newCluster(b, insecureSec(), ManagerConfig{HeartbeatInterval: time.Second, HeartbeatDeadline: 5 * time.Second, AckTimeout: 3 * time.Second,
		MaxConnectionsPerPeer: workers + proxies + 1})
	c.ack = defaultAckTimeout
	perNode := workers
	if proxies > 0 {
		perNode = workers / proxies
		for n := range proxies {
			c.addProxy(n)
		}
	}
	var applied atomic.Int64
	var want atomic.Int64
	done := make(chan struct{}, 1)
	c.onApply = func(int, trace.Switch) {
		if applied.Add(1) == want.Load() {
			done <- struct{}{}
		}
	}
	for r := range workers {
		c.addWorker(r/perNode, r)
	}
	testkit.WaitForWithin(b, 120*time.Second, "every worker registered", func() bool { return c.liveWorkers() == workers })
	testkit.WaitForWithin(b, 120*time.Second, "every worker streaming", func() bool {
		for _, w := range c.workers {
			if !w.Connected() {
				return false
			}
		}
		return true
	})
	sws := []trace.Switch{trace.AllOn(), {Step: true}}
	var lat []time.Duration
	b.ResetTimer()
	for i := range b.N {
		applied.Store(0)
		want.Store(int64(workers))
		start := time.Now()
		if _, err := c.m.SetSwitch(sws[i%2]); err != nil {
			b.Fatal(err)
		}
		select {
		case <-done:
		case <-time.After(60 * time.Second):
			b.Fatalf("only %d of %d workers applied the switch", applied.Load(), workers)
		}
		lat = append(lat, time.Since(start))
	}
	b.StopTimer()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds())/1000, "p50-ms")
	b.ReportMetric(float64(lat[(len(lat)*99)/100].Microseconds())/1000, "p99-ms")
}

// BenchmarkBaselineUnaryEcho is the baseline of the benchmarks above and
// below: one bare unary gRPC round trip (the health check) on loopback.
func BenchmarkBaselineUnaryEcho(b *testing.B) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	srv := grpc.NewServer()
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go srv.Serve(lis)
	defer srv.Stop()
	conn, err := grpc.NewClient("passthrough:///"+lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	client := healthpb.NewHealthClient(conn)
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if _, err := client.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkHeartbeatCPU measures the CPU a manager process spends on 1,000
// workers sending 1 heartbeat/s each (1,000 heartbeats/s), beside a bare
// gRPC health server process answering 1,000 calls/s from 1,000
// connections. Each iteration is a one-second window; run with
// -benchtime=5x.
func BenchmarkHeartbeatCPU(b *testing.B) {
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		b.Skip("needs /proc")
	}
	b.Run("manager", func(b *testing.B) {
		addr := freeAddr(b)
		mgr := startChild(b, "manager", childArgs{Job: "bench", Listen: addr, Interval: time.Second, Deadline: 5 * time.Second, Ack: 3 * time.Second})
		mgr.expect(0, "ready", 60*time.Second)
		api := newAdminClient(b, addr, "bench")
		var ws []*Worker
		for r := range 1000 {
			w, err := NewWorker(WorkerConfig{Job: "bench", Node: 0, Rank: r, Upstream: addr, Security: insecureSec()})
			if err != nil {
				b.Fatal(err)
			}
			ws = append(ws, w)
			go w.Run(context.Background())
		}
		defer func() {
			for _, w := range ws {
				w.Close()
			}
		}()
		testkit.WaitForWithin(b, 120*time.Second, "1000 workers", func() bool { return len(api.members()) == 1000 })
		measureCPU(b, mgr)
	})
	b.Run("baseline-echo", func(b *testing.B) {
		addr := freeAddr(b)
		echo := startChild(b, "echo", childArgs{Listen: addr})
		echo.expect(0, "ready", 60*time.Second)
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		defer func() { cancel(); wg.Wait() }()
		for range 1000 {
			conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				b.Fatal(err)
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer conn.Close()
				client := healthpb.NewHealthClient(conn)
				tick := time.NewTicker(time.Second)
				defer tick.Stop()
				for {
					client.Check(ctx, &healthpb.HealthCheckRequest{})
					select {
					case <-ctx.Done():
						return
					case <-tick.C:
					}
				}
			}()
		}
		time.Sleep(2 * time.Second) // every connection up and ticking
		measureCPU(b, echo)
	})
}

// measureCPU reports the child's CPU time per second of wall time, over
// b.N one-second windows.
func measureCPU(b *testing.B, c *child) {
	b.ResetTimer()
	start, t0 := procCPU(b, c.cmd.Process.Pid), time.Now()
	for range b.N {
		time.Sleep(time.Second)
	}
	used, wall := procCPU(b, c.cmd.Process.Pid)-start, time.Since(t0)
	b.StopTimer()
	b.ReportMetric(float64(used.Milliseconds())/wall.Seconds(), "cpu-ms/s")
}

// procCPU returns a process's user plus system CPU time from /proc.
func procCPU(b *testing.B, pid int) time.Duration {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		b.Fatal(err)
	}
	// Fields after the parenthesised command name; utime and stime are
	// the 14th and 15th fields, in clock ticks of 1/100 s on Linux.
	f := strings.Fields(string(data[strings.LastIndexByte(string(data), ')')+2:]))
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * 10 * time.Millisecond
}

// BenchmarkSwitchAcks measures the manager's bookkeeping of the
// acknowledgements of one switch fan-out to 1,000 workers: each recorded
// and the fan-out checked for completion after it, as the Acknowledge
// call does. The baseline records the same acknowledgements in a bare
// map.
func BenchmarkSwitchAcks(b *testing.B) {
	const workers = 1000
	b.Run("tracker", func(b *testing.B) {
		tr := newSwitchTracker(3*time.Second, 30*time.Second)
		for r := range workers {
			tr.registered(r, r/8, 0, false)
		}
		now := time.Unix(1_000_000, 0)
		sws := []trace.Switch{trace.AllOn(), {Step: true}}
		b.ReportAllocs()
		b.ResetTimer()
		for i := range b.N {
			b.StopTimer()
			now = now.Add(time.Second)
			tr.set(sws[i%2], now)
			tr.due(now)
			tr.sent(uint64(i+1), now)
			b.StartTimer()
			for r := range workers {
				tr.ack(uint64(i+1), r, "")
				if tr.complete(now) != (r == workers-1) {
					b.Fatalf("complete after %d acks", r+1)
				}
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*workers), "ns/ack")
	})
	b.Run("baseline-map", func(b *testing.B) {
		acked := make(map[int]uint64, workers)
		b.ReportAllocs()
		b.ResetTimer()
		for i := range b.N {
			for r := range workers {
				acked[r] = uint64(i + 1)
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*workers), "ns/ack")
	})
}
