package main

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
	"github.com/faultline-ml/faultline/internal/testkit"
)

// gauge returns the value of metric, unlabelled, that the manager serves
// on addr; -1 when it serves none.
func gauge(t *testing.T, addr, metric string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), metric+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("%s: %v", metric, err)
			}
			return f
		}
	}
	return -1
}

// TestSpeakingConnectionsSpareNewcomers: connections that send a byte
// and say nothing more, as many as an address may hold pending, refuse
// none of the newcomers from that address: each makes room by closing the
// oldest (a peer that kept every pending connection within a grace of
// 1 s, by a byte on each of 600 connections a second, refused 9 of 30).
func TestSpeakingConnectionsSpareNewcomers(t *testing.T) {
	const token = "member-token-0123456789"
	addr, metrics := freeAddr(t), freeAddr(t)
	startManagerEnv(t, "--insecure --job j --listen "+addr+" --metrics-listen "+metrics, "TASKD_TOKEN="+token)
	testkit.WaitFor(t, "the manager listening", func() bool { return listening(addr) && gauge(t, metrics, "faultline_taskd_connections") >= 0 })
	for i := range 5 {
		var speaking []net.Conn
		for range 256 { // the pending connections an address may hold
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			speaking = append(speaking, c)
			c.Write([]byte("P"))
		}
		// Until the manager holds them all; on a machine so loaded that
		// the first reach their 5 s handshake timeout before the last are
		// counted, the newcomer goes with what is held by then.
		for deadline := time.Now().Add(5 * time.Second); gauge(t, metrics, "faultline_taskd_connections") < 256 && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
		conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+token), 20*time.Second)
		_, err = pb.NewControlClient(conn).Register(ctx, &pb.RegisterRequest{Job: "j", Member: &pb.Member{
			Role: pb.Role_ROLE_WORKER, Position: &pb.Position{Node: 0, Rank: int32(i)}, Instance: fmt.Sprint("worker-", i)}})
		cancel()
		conn.Close()
		if err != nil {
			t.Fatalf("newcomer %d beside 256 connections that spoke a byte: %v", i, err)
		}
		for _, c := range speaking {
			c.Close()
		}
		// The next batch finds these gone, not pending beside it: past the
		// budget, its own would be the ones closed to make room.
		testkit.WaitFor(t, "the speaking connections closed", func() bool { return gauge(t, metrics, "faultline_taskd_connections") == 0 })
	}
}
