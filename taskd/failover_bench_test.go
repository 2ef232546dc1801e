package taskd

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/taskd/lease"
)

// BenchmarkFailover measures how long a job of 1,000 workers behind 8
// proxies (all in this process) goes without a manager when its leader,
// one of two manager processes sharing a lease file, is killed with
// SIGKILL: from the kill until the standby leads and every worker and
// proxy is registered with it (failover-s). Beside it, in the same run,
// the time the leader takes to declare a worker process killed with
// SIGKILL lost (lost-s): the heartbeat deadline as members see it. The
// goal is failover-s at most twice lost-s (ratio).
func BenchmarkFailover(b *testing.B) {
	const nodes, perNode = 8, 125
	workers := nodes * perNode
	dir := b.TempDir()
	base := childArgs{Job: "job-f", Interval: 500 * time.Millisecond, Deadline: 2 * time.Second, Ack: defaultAckTimeout,
		StateDir: filepath.Join(dir, "state"), LeaseFile: filepath.Join(dir, "manager.lease"), LeaseRetry: lease.DefaultRetryPeriod}
	addrs := []string{freeAddr(b), freeAddr(b)}
	upstream := strings.Join(addrs, ",")
	managers := make([]*child, 2)
	startManager := func(i int) {
		a := base
		a.Listen, a.Name = addrs[i], fmt.Sprintf("mgr-%d", i)
		managers[i] = startChild(b, "manager", a)
		managers[i].expect(0, "standby", 60*time.Second)
	}
	startManager(0)
	managers[0].expect(0, "ready", 60*time.Second)
	startManager(1)
	leader := 0

	// The fleet, with the defaults of proxies and workers.
	c := &cluster{t: b, sec: insecureSec(), job: base.Job, ack: defaultAckTimeout, proxies: map[int]*Proxy{}, workers: map[int]*Worker{}, cancels: map[any]context.CancelFunc{}}
	b.Cleanup(c.close)
	for n := range nodes {
		p, err := NewProxy(ProxyConfig{Job: c.job, Node: n, Upstream: upstream, Listen: "127.0.0.1:0", Security: c.sec, UpstreamToken: c.mcfg.ProxyToken})
		if err != nil {
			b.Fatal(err)
		}
		c.proxies[n] = p
		c.run(p, p.Run)
	}
	for r := range workers {
		w, err := NewWorker(WorkerConfig{Job: c.job, Node: r / perNode, Rank: r, Upstream: c.proxies[r/perNode].Addr().String(), Security: c.sec})
		if err != nil {
			b.Fatal(err)
		}
		c.workers[r] = w
		c.run(w, w.Run)
	}
	// A connection per poll, closed after it: kept open, they would run
	// into the manager's cap of connections per peer, and one reused
	// across a manager's death would wait out gRPC's reconnect backoff.
	admin := func(addr string, call func(pb.AdminClient, context.Context)) {
		conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			b.Fatal(err)
		}
		defer conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		call(pb.NewAdminClient(conn), ctx)
	}
	total := func(addr string) int {
		n := -1
		admin(addr, func(a pb.AdminClient, ctx context.Context) {
			if res, err := a.ListMembers(ctx, &pb.ListMembersReq{JobNsName: base.Job}); err == nil {
				n = int(res.GetTotal())
			}
		})
		return n
	}
	faults := func(addr string) []*pb.Fault {
		var fs []*pb.Fault
		admin(addr, func(a pb.AdminClient, ctx context.Context) {
			if res, err := a.ListFaults(ctx, &pb.ListFaultsReq{JobNsName: base.Job}); err == nil {
				fs = res.GetFaults()
			}
		})
		return fs
	}
	testkit.WaitForWithin(b, 2*time.Minute, "every member registered", func() bool { return total(addrs[leader]) == workers+nodes })

	var failover, lost time.Duration
	b.ResetTimer()
	for i := range b.N {
		// The baseline: a worker process attached to the managers, killed.
		a := base
		a.Node, a.Rank, a.Upstream = nodes, workers+i, upstream
		probe := startChild(b, "worker", a)
		probe.expect(0, "connected", 60*time.Second)
		before := len(faults(addrs[leader]))
		killed := time.Now()
		probe.kill()
		var at time.Time
		testkit.WaitFor(b, "the killed worker declared lost", func() bool {
			fs := faults(addrs[leader])
			if len(fs) < before {
				return false // the call failed: ask again
			}
			for _, f := range fs[before:] {
				if f.GetKind() == string(FaultLost) && int(f.GetRank()) == a.Rank {
					at = time.Unix(0, f.GetReceivedUnixNano())
					return true
				}
			}
			return false
		})
		lost += at.Sub(killed)

		// The failover.
		next := 1 - leader
		from := managers[next].nlines()
		killed = time.Now()
		managers[leader].kill()
		var first time.Duration
		for n := total(addrs[next]); n != workers+nodes; n = total(addrs[next]) {
			if n >= 0 && first == 0 {
				first = time.Since(killed)
			}
			time.Sleep(2 * time.Millisecond)
		}
		failover += time.Since(killed)
		b.Logf("iteration %d: serving after %v, all after %v", i, first, time.Since(killed))
		managers[next].expect(from, "ready", time.Second)
		b.StopTimer()
		startManager(leader)
		leader = next
		b.StartTimer()
	}
	n := float64(b.N)
	b.ReportMetric(failover.Seconds()/n, "failover-s")
	b.ReportMetric(lost.Seconds()/n, "lost-s")
	b.ReportMetric(failover.Seconds()/lost.Seconds(), "ratio")
}
