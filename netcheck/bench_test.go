package netcheck

import (
	"context"
	"fmt"
	"io"
	"net"
	"testing"
	"time"
)

// benchBytes is moved each way per operation, by the probe and by the
// baseline alike.
const benchBytes = 64 << 20

// copyTransfer is the baseline: the probe's transfer (n bytes up, an
// acknowledgement, n bytes down) done with plain io.Copy over TCP.
func copyTransfer(addr string, n int64) error {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	if _, err := fmt.Fprintf(c, "%08x", n); err != nil {
		return err
	}
	if _, err := io.Copy(c, io.LimitReader(zeros{}, n)); err != nil {
		return err
	}
	var ack [1]byte
	if _, err := io.ReadFull(c, ack[:]); err != nil {
		return err
	}
	got, err := io.Copy(io.Discard, c)
	if err == nil && got != n {
		err = fmt.Errorf("baseline received %d of %d bytes", got, n)
	}
	return err
}

// benchBandwidth alternates a probe and the baseline against the same
// host, so that both see the same load, and reports each one's throughput
// and their ratio.
func benchBandwidth(b *testing.B, agentAddr, copyAddr string) {
	p := &TCPProber{Bytes: benchBytes, Pings: 1, Repeats: 1}
	var probeTime, copyTime time.Duration
	for b.Loop() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		t := time.Now()
		_, err := p.Probe(ctx, Node{}, Node{Name: "bench", Addr: agentAddr})
		probeTime += time.Since(t)
		cancel()
		if err != nil {
			b.Fatal(err)
		}
		t = time.Now()
		if err := copyTransfer(copyAddr, benchBytes); err != nil {
			b.Fatal(err)
		}
		copyTime += time.Since(t)
	}
	mbps := func(d time.Duration) float64 { return float64(2*benchBytes*b.N) / d.Seconds() / 1e6 }
	b.ReportMetric(mbps(probeTime), "probe-MB/s")
	b.ReportMetric(mbps(copyTime), "io.Copy-MB/s")
	b.ReportMetric(copyTime.Seconds()/probeTime.Seconds(), "probe/io.Copy")
}

// BenchmarkBandwidthLoopback compares a probe's transfer with io.Copy over
// loopback TCP, both ends in this process.
func BenchmarkBandwidthLoopback(b *testing.B) {
	a := startAgent(b, AgentConfig{})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	done := make(chan struct{})
	go func() { serveCopy(ln); close(done) }()
	b.Cleanup(func() { ln.Close(); <-done })
	benchBandwidth(b, a.Addr().String(), ln.Addr().String())
}

// BenchmarkBandwidthVeth compares them over an unshaped veth pair and a
// bridge: the far end is an agent in its own network namespace.
func BenchmarkBandwidthVeth(b *testing.B) {
	f := newFabric(b, 1, true)
	benchBandwidth(b, f.hosts[0].addr, f.hosts[0].copy)
}
