package ckpt

import (
	"cmp"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// childBenchNode is the agent of BenchmarkSaveWithReplicas's node: two
// owners of shard 0 in FAULTLINE_CKPT_SHM, both sealing each save, of
// which "repl" also sends each to the peer at FAULTLINE_CKPT_PEER and
// "base" does not.
func childBenchNode() error {
	ctx := context.Background()
	shm, size := os.Getenv("FAULTLINE_CKPT_SHM"), benchSize()+1<<20
	base, err := NewOwner(OwnerConfig{ShmDir: shm, Name: "base", Shards: []int{0}, Capacity: size, PollInterval: 10 * time.Millisecond})
	if err != nil {
		return err
	}
	repl, err := NewOwner(OwnerConfig{ShmDir: shm, Name: "repl", Node: "a", Shards: []int{0}, Capacity: size, PollInterval: 10 * time.Millisecond,
		Peers: map[string]string{"a": "", "p": os.Getenv("FAULTLINE_CKPT_PEER")}})
	if err != nil {
		return err
	}
	go base.Run(ctx)
	go repl.Run(ctx)
	fmt.Println("ready")
	select {}
}

// childBenchPeer holds the node's replicas: it listens on
// FAULTLINE_CKPT_LISTEN and says ready with its port.
func childBenchPeer() error {
	o, err := NewOwner(OwnerConfig{ShmDir: os.Getenv("FAULTLINE_CKPT_SHM"), Name: "peer", Node: "p", Shards: []int{9}, Capacity: 4096,
		ListenAddr: os.Getenv("FAULTLINE_CKPT_LISTEN")})
	if err != nil {
		return err
	}
	_, port, _ := net.SplitHostPort(o.Addr().String())
	fmt.Println("ready", port)
	return o.Run(context.Background())
}

// BenchmarkSaveWithReplicas times what blocks the trainer, a Save of
// benchSize bytes, into the segment of an agent that sends each save to
// a peer in the background, beside a Save of the same blobs into the
// segment of an agent that does not, iteration by iteration: x-no-replicas
// is the baseline's time over the replicated save's (1 when replicas cost
// a save nothing). The agents and the peer are processes of their own,
// as in a job. Saves follow each other as fast as they go, faster than
// a transfer at 1 Gbit/s: peer-lag-steps is how many steps the peer's
// newest copy is behind the newest save when the loop ends, and
// catch-up-s how long the newest save then takes to reach the peer.
//
// "loopback" runs all three on this host, over loopback TCP;
// "tc-1gbit" runs the node's agent and the peer on two hosts apart
// (network namespaces with their own /dev/shm, testkit.Fabric), the
// node's link shaped to FAULTLINE_CKPT_BENCH_LINK (default 1gbit) with
// tc; it needs root and skips without it.
func BenchmarkSaveWithReplicas(b *testing.B) {
	b.Run("loopback", func(b *testing.B) {
		nodeShm, peerShm := shmDir(b), shmDir(b)
		peer := startBenchChild(b, testkit.Command(b, "benchpeer"), "FAULTLINE_CKPT_SHM="+peerShm, "FAULTLINE_CKPT_LISTEN=127.0.0.1:0")
		startBenchChild(b, testkit.Command(b, "benchnode"), "FAULTLINE_CKPT_SHM="+nodeShm, "FAULTLINE_CKPT_PEER=127.0.0.1:"+peer)
		benchSaveWithReplicas(b, nodeShm, peerShm)
	})
	b.Run("tc-1gbit", func(b *testing.B) {
		f := testkit.NewFabric(b, 2)
		node, host := f.Hosts[0], f.Hosts[1]
		node.Shape(cmp.Or(os.Getenv("FAULTLINE_CKPT_BENCH_LINK"), "1gbit"))
		peer := startBenchChild(b, hostCommand(b, host, "benchpeer"), "FAULTLINE_CKPT_SHM=/dev/shm", "FAULTLINE_CKPT_LISTEN=:0")
		startBenchChild(b, hostCommand(b, node, "benchnode"), "FAULTLINE_CKPT_SHM=/dev/shm", "FAULTLINE_CKPT_PEER="+net.JoinHostPort(host.IP, peer))
		benchSaveWithReplicas(b, node.Shm, host.Shm)
	})
}

// hostCommand runs this test binary in role on h.
func hostCommand(b *testing.B, h *testkit.Host, role string) *exec.Cmd {
	exe, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	cmd := h.Command(exe, "-test.run=^$", "-test.bench=^$")
	cmd.Env = append(os.Environ(), testkit.RoleEnv(role))
	return cmd
}

// startBenchChild starts cmd with env and returns the words after its
// "ready".
func startBenchChild(b *testing.B, cmd *exec.Cmd, env ...string) string {
	b.Helper()
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	cmd.Env = append(cmd.Env, env...)
	for line := range testkit.Start(b, cmd) {
		if rest, ok := strings.CutPrefix(line, "ready"); ok {
			return strings.TrimSpace(rest)
		}
	}
	b.Fatalf("%v exited before it was ready", cmd.Args)
	return ""
}

// peerStep is the newest step the peer holds intact of shard 0, or -1.
func peerStep(peerShm string) int64 {
	r, err := InspectSegment(ReplicaPath(peerShm, "peer", 0))
	if err != nil || r.NewestHalf < 0 || r.Halves[r.NewestHalf].Err != nil {
		return -1
	}
	return r.Halves[r.NewestHalf].Meta.Step
}

func benchSaveWithReplicas(b *testing.B, nodeShm, peerShm string) {
	ctx := context.Background()
	src := benchBlobs(b)
	writer := func(name string) *Writer {
		w, err := NewWriter(WriterConfig{Path: SegmentPath(nodeShm, name, 0)})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { w.Close() })
		return w
	}
	base, repl := writer("base"), writer("repl")
	p := paired{name: "x-no-replicas"}
	b.SetBytes(benchSize())
	b.ResetTimer()
	step := int64(0)
	for b.Loop() {
		step++
		baseline := func() {
			p.baseline(b, func() {
				if err := base.Save(ctx, step, src...); err != nil {
					b.Fatal(err)
				}
			})
		}
		// Each goes first every other step: the second of two saves runs
		// beside the first one's seal.
		if step%2 == 0 {
			baseline()
		}
		p.timed(func() {
			if err := repl.Save(ctx, step, src...); err != nil {
				b.Fatal(err)
			}
		})
		if step%2 == 1 {
			baseline()
		}
	}
	b.StopTimer()
	p.report(b)
	got := peerStep(peerShm)
	b.ReportMetric(float64(step-got), "peer-lag-steps")
	start := time.Now()
	for deadline := start.Add(2 * time.Minute); peerStep(peerShm) != step; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			b.Fatalf("the peer holds step %d, not step %d, 2 minutes after it was saved", peerStep(peerShm), step)
		}
	}
	b.ReportMetric(time.Since(start).Seconds(), "catch-up-s")
}
