package ckpt

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

func TestPickPeers(t *testing.T) {
	nodes := []string{"n0", "n1", "n2", "n3", "n4", "n5"}
	asw := map[string]string{"n0": "A", "n1": "A", "n2": "A", "n3": "B", "n4": "B", "n5": "C"}
	for _, tc := range []struct {
		self string
		dom  map[string]string
		k    int
		want []string
	}{
		{"n0", nil, 1, []string{"n1"}},
		{"n5", nil, 2, []string{"n0", "n1"}},
		{"n0", asw, 1, []string{"n3"}},
		{"n0", asw, 2, []string{"n3", "n4"}},
		{"n4", asw, 2, []string{"n5", "n0"}},
		{"n0", asw, 4, []string{"n3", "n4", "n5", "n1"}},
		{"n0", asw, 10, []string{"n3", "n4", "n5", "n1", "n2"}},
		{"n0", map[string]string{"n0": "A", "n1": "A"}, 2, []string{"n2", "n3"}}, // unknown before same
		{"x", asw, 1, []string{"n0"}},                                            // self not listed
		{"n0", asw, 0, nil},
	} {
		got := PickPeers(tc.self, nodes, tc.dom, tc.k)
		if !slices.Equal(got, tc.want) {
			t.Errorf("PickPeers(%s, k=%d) = %v, want %v", tc.self, tc.k, got, tc.want)
		}
	}
}

func TestPickPeersProperties(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for range 500 {
		n := 1 + r.IntN(12)
		var nodes []string
		dom := map[string]string{}
		for i := range n {
			name := fmt.Sprintf("node-%02d", i)
			nodes = append(nodes, name)
			if r.IntN(5) > 0 {
				dom[name] = fmt.Sprintf("asw-%d", r.IntN(3))
			}
		}
		r.Shuffle(len(nodes), func(i, j int) { nodes[i], nodes[j] = nodes[j], nodes[i] })
		self := nodes[r.IntN(n)]
		k := r.IntN(4)
		got := PickPeers(self, nodes, dom, k)
		if len(got) != min(k, n-1) {
			t.Fatalf("%d peers of %d nodes for k=%d", len(got), n, k)
		}
		seen := map[string]bool{}
		others := 0
		for _, p := range nodes {
			if d, ok := dom[p]; ok && dom[self] != "" && d != dom[self] {
				others++
			}
		}
		for i, p := range got {
			if p == self || seen[p] {
				t.Fatalf("peers %v of %s repeat or hold self", got, self)
			}
			seen[p] = true
			// While other-domain nodes remain, only they are picked.
			if i < others {
				if d, ok := dom[p]; !ok || d == dom[self] {
					t.Fatalf("peer %s (%q) picked for %s (%q) while %d nodes sit in other domains: %v", p, d, self, dom[self], others, got)
				}
			}
		}
		if again := PickPeers(self, slices.Clone(nodes), dom, k); !slices.Equal(again, got) {
			t.Fatalf("not deterministic: %v then %v", got, again)
		}
	}
	// Spread: with no domains, each node is the first peer of exactly one.
	var nodes []string
	for i := range 9 {
		nodes = append(nodes, fmt.Sprint("n", i))
	}
	picked := map[string]int{}
	for _, self := range nodes {
		picked[PickPeers(self, nodes, nil, 1)[0]]++
	}
	for _, n := range nodes {
		if picked[n] != 1 {
			t.Fatalf("picks %v are not spread evenly", picked)
		}
	}
}

// running starts o.Run and stops it at the end of the test.
func running(t *testing.T, o *Owner) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- o.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
	})
}

func TestReplicaRestoresReplacedNode(t *testing.T) {
	ctx := context.Background()
	tb := newTestBlobs(100 << 10)
	b := newNode(t, OwnerConfig{Node: "b", Shards: []int{1}, ListenAddr: "127.0.0.1:0"}, 1)
	running(t, b.o)
	peers := map[string]string{"a": "127.0.0.1:1", "b": b.o.Addr().String()}
	domains := map[string]string{"a": "asw-1", "b": "asw-2"}
	a := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, Capacity: 4 << 20, Peers: peers, Domains: domains}, 1)
	for step := int64(1); step <= 2; step++ {
		if err := a.ws[0].Save(ctx, step, tb.step(step)...); err != nil {
			t.Fatal(err)
		}
		if err := a.o.Replicate(ctx, 0); err != nil {
			t.Fatal(err)
		}
	}
	// Node a is replaced: its shared memory is gone.
	a.ws[0].Close()
	a.o.Remove()
	a2 := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, Capacity: 4 << 20, Peers: peers, Domains: domains}, 1)
	ck, rep, err := a2.o.Load(ctx, 0)
	if err != nil || rep.Tier != TierReplica {
		t.Fatalf("Load = %s, %v; want replica", rep, err)
	}
	if err := tb.check(ck); err != nil || ck.Step != 2 {
		t.Fatalf("step %d: %v", ck.Step, err)
	}
	t.Logf("%s", rep)
	// The replica is back in local memory for the trainer.
	if ck, err := a2.ws[0].Load(ctx); err != nil || ck.Step != 2 {
		t.Fatalf("trainer's Load after restore = %v, %v", ck, err)
	}
	// A given step the peer does not hold.
	if _, rep, err := a2.o.LoadStep(ctx, 0, 7); !errors.Is(err, ErrNoStep) || !strings.Contains(rep.String(), "no intact replica") {
		t.Fatalf("LoadStep(7) = %s, %v", rep, err)
	}
}

func TestRunReplicatesNewSaves(t *testing.T) {
	ctx := context.Background()
	b := newNode(t, OwnerConfig{Node: "b", Shards: []int{1}, ListenAddr: "127.0.0.1:0"}, 1)
	running(t, b.o)
	a := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, PollInterval: 5 * time.Millisecond,
		Peers: map[string]string{"a": "", "b": b.o.Addr().String()}}, 1)
	running(t, a.o)
	if err := a.ws[0].Save(ctx, 3, blobs(3)...); err != nil {
		t.Fatal(err)
	}
	// Wait for the copy to land on b, by asking b for it.
	c := newNode(t, OwnerConfig{Node: "c", Shards: []int{0}, Peers: map[string]string{"c": "", "b": b.o.Addr().String()}}, 1)
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, rep, err := c.o.LoadStep(ctx, 0, 3)
		if err == nil && rep.Tier == TierReplica {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no replica of step 3 on b within 30s: %s", rep)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// proxy forwards TCP connections to target and calls cut once a
// connection has carried more than after bytes toward it, then drops it:
// a transfer killed halfway at a known point. A gate (startGate) calls it
// and forwards the rest: a transfer held up halfway.
type proxy struct {
	ln     net.Listener
	wg     sync.WaitGroup
	cutAt  int64
	cut    func()
	gate   bool
	target string
	cuts   atomic.Int32
}

func startProxy(t *testing.T, target string, after int64, cut func()) *proxy {
	return newProxy(t, target, after, cut, false)
}

// startGate forwards TCP connections to target; once a connection has
// carried more than after bytes toward it, it calls pause, forwarding
// nothing more until pause returns. Its own receive buffer is small, so
// that a sender of many more bytes than after is held up mid-transfer.
func startGate(t *testing.T, target string, after int64, pause func()) *proxy {
	return newProxy(t, target, after, pause, true)
}

func newProxy(t *testing.T, target string, after int64, cut func(), gate bool) *proxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{ln: ln, cutAt: after, cut: cut, gate: gate, target: target}
	p.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.wg.Go(func() { p.forward(c) })
		}
	})
	t.Cleanup(func() {
		ln.Close()
		p.wg.Wait()
	})
	return p
}

func (p *proxy) forward(c net.Conn) {
	defer c.Close()
	u, err := net.Dial("tcp", p.target)
	if err != nil {
		return
	}
	defer u.Close()
	p.wg.Go(func() { io.Copy(c, u); c.Close() })
	if p.gate {
		c.(*net.TCPConn).SetReadBuffer(64 << 10)
	}
	var n int64
	buf := make([]byte, 64<<10)
	for {
		k, err := c.Read(buf)
		if k > 0 {
			if p.gate && n <= p.cutAt && n+int64(k) > p.cutAt {
				p.cuts.Add(1)
				p.cut()
			}
			if !p.gate && n+int64(k) > p.cutAt {
				u.Write(buf[:p.cutAt-n])
				p.cuts.Add(1)
				p.cut()
				return
			}
			if _, err := u.Write(buf[:k]); err != nil {
				return
			}
			n += int64(k)
		}
		if err != nil {
			return
		}
	}
}

// childPeer is a node agent that holds replicas, until it is killed. It
// says ready with its address and the replicas it holds at its start.
func childPeer() error {
	o, err := NewOwner(OwnerConfig{ShmDir: os.Getenv("FAULTLINE_CKPT_SHM"), Name: "peer", Node: "p",
		Shards: []int{9}, Capacity: 4096, ListenAddr: "127.0.0.1:0", ReplicaKey: []byte(os.Getenv("FAULTLINE_CKPT_KEY"))})
	if err != nil {
		return err
	}
	held, err := heldWords(o)
	if err != nil {
		return err
	}
	fmt.Println("ready", o.Addr(), "held", strings.Join(held, " "))
	return o.Run(context.Background())
}

// TestReplicaPeerKilledMidTransfer sends a shard to two peers; one is a
// process SIGKILLed halfway through the transfer. The other keeps the
// copy, and a replaced node restores from it.
func TestReplicaPeerKilledMidTransfer(t *testing.T) {
	ctx := context.Background()
	tb := newTestBlobs(1 << 20) // ~13 MiB a step
	shm := shmDir(t)
	victim, addr := startChild(t, "peer", "FAULTLINE_CKPT_SHM="+shm)
	px := startProxy(t, addr[0], 4<<20, victim.kill)
	good := newNode(t, OwnerConfig{Node: "good", Shards: []int{1}, ListenAddr: "127.0.0.1:0"}, 1)
	running(t, good.o)
	peers := map[string]string{"a": "", "victim": px.ln.Addr().String(), "good": good.o.Addr().String()}
	a := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, Capacity: 16 << 20, Peers: peers, Replicas: 2}, 1)
	if err := a.ws[0].Save(ctx, 4, tb.step(4)...); err != nil {
		t.Fatal(err)
	}
	err := a.o.Replicate(ctx, 0)
	if err == nil || !strings.Contains(err.Error(), "peer victim") || strings.Contains(err.Error(), "peer good") {
		t.Fatalf("Replicate = %v, want an error for the killed peer only", err)
	}
	if px.cuts.Load() != 1 {
		t.Fatalf("proxy cut %d transfers", px.cuts.Load())
	}
	t.Logf("sender saw: %v", err)

	a.ws[0].Close()
	a.o.Remove()
	a2 := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, Capacity: 16 << 20, Peers: peers, Replicas: 2}, 1)
	ck, rep, err := a2.o.Load(ctx, 0)
	if err != nil || rep.Tier != TierReplica {
		t.Fatalf("Load = %s, %v", rep, err)
	}
	if err := tb.check(ck); err != nil || ck.Step != 4 {
		t.Fatalf("step %d: %v", ck.Step, err)
	}
	t.Logf("%s", rep)

	// The killed peer left the larger segment it was receiving into (unless
	// it died before reading the request); its successor, which serves
	// replicas as it did, removes it, freeing the shared memory.
	next := filepath.Join(shm, "peer-replica-0.next")
	if _, err := os.Stat(next); err != nil {
		t.Logf("the peer died before it made %s; planting one", next)
		if err := os.WriteFile(next, []byte("cut"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	o, err := NewOwner(OwnerConfig{ShmDir: shm, Name: "peer", Shards: []int{9}, Capacity: 4096, ListenAddr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Remove()
	if _, err := os.Stat(next); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("%s is left after a new owner started: %v", next, err)
	}
}

// childSender is a node agent that saves step 1, copies it to its peer,
// says ready, then saves a larger step 2 and copies it: the test kills it
// during that copy.
func childSender() error {
	ctx := context.Background()
	o, err := NewOwner(OwnerConfig{ShmDir: os.Getenv("FAULTLINE_CKPT_SHM"), Name: "sender", Node: "s", Shards: []int{0},
		Capacity: 16 << 20, Peers: map[string]string{"s": "", "b": os.Getenv("FAULTLINE_CKPT_PEER")}})
	if err != nil {
		return err
	}
	w, err := NewWriter(WriterConfig{Path: o.SegmentPath(0)})
	if err != nil {
		return err
	}
	small, large := newTestBlobs(10<<10), newTestBlobs(1<<20)
	if err := w.Save(ctx, 1, small.step(1)...); err != nil {
		return err
	}
	if err := o.Replicate(ctx, 0); err != nil {
		return err
	}
	fmt.Println("ready")
	if err := w.Save(ctx, 2, large.step(2)...); err != nil {
		return err
	}
	if err := o.Replicate(ctx, 0); err != nil {
		return err
	}
	select {} // the test kills it before this
}

// TestReplicaSenderKilledMidTransfer kills the sending agent halfway
// through a copy: the receiver reports it and keeps the previous copy,
// whether the new step was going into its segment or into a larger one.
func TestReplicaSenderKilledMidTransfer(t *testing.T) {
	for _, tc := range []struct {
		name     string
		capacity int64
	}{{"in place", 16 << 20}, {"into a larger segment", 1 << 20}} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			b := newNode(t, OwnerConfig{Node: "b", Shards: []int{1}, Capacity: tc.capacity, ListenAddr: "127.0.0.1:0"}, 1)
			running(t, b.o)
			started := make(chan *child, 1) // the cut may come before startChild returns
			px := startProxy(t, b.o.Addr().String(), 4<<20, func() {
				c := <-started
				started <- c
				c.kill()
			})
			sender, _ := startChild(t, "sender", "FAULTLINE_CKPT_SHM="+shmDir(t), "FAULTLINE_CKPT_PEER="+px.ln.Addr().String())
			started <- sender
			<-sender.exited
			if sender.cmd.ProcessState.Success() || px.cuts.Load() != 1 {
				t.Fatalf("sender exited with %v after %d cuts", sender.cmd.ProcessState, px.cuts.Load())
			}
			// b holds step 1, intact.
			c := newNode(t, OwnerConfig{Node: "c", Shards: []int{0}, Capacity: 16 << 20, Peers: map[string]string{"c": "", "b": b.o.Addr().String()}}, 1)
			ck, rep, err := c.o.Load(ctx, 0)
			if err != nil || rep.Tier != TierReplica {
				t.Fatalf("Load = %s, %v", rep, err)
			}
			if err := newTestBlobs(10 << 10).check(ck); err != nil || ck.Step != 1 {
				t.Fatalf("step %d: %v", ck.Step, err)
			}
			seg := ReplicaPath(b.o.cfg.ShmDir, b.o.cfg.Name, 0)
			r, err := InspectSegment(seg)
			if err != nil {
				t.Fatal(err)
			}
			states := []uint32{r.Halves[0].State, r.Halves[1].State}
			if tc.capacity > 1<<20 && !slices.Contains(states, layout.StateWriting) {
				t.Fatalf("replica halves in states %v, want one cut short", states)
			}
			if _, err := os.Stat(seg + ".next"); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("the larger segment of the cut transfer is left: %v", err)
			}
			if err := Verify("", seg); err != nil {
				t.Fatalf("a cut transfer is no corruption: %v", err)
			}
		})
	}
}

// TestPersistReplica: node a is lost; node b, the last one standing,
// persists its own shard and the replica it holds of a's at the same step,
// and the step commits with every shard on disk, a's as a had saved it.
func TestPersistReplica(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	tb := newTestBlobs(100 << 10)
	b := newNode(t, OwnerConfig{Node: "b", Shards: []int{1}, NumShards: 2, Dir: dir, ListenAddr: "127.0.0.1:0"}, 1)
	running(t, b.o)
	peers := map[string]string{"a": "127.0.0.1:1", "b": b.o.Addr().String()}
	a := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, NumShards: 2, Dir: dir, Capacity: 4 << 20, Peers: peers}, 1)
	for step := int64(1); step <= 2; step++ {
		if err := a.ws[0].Save(ctx, step, tb.step(step)...); err != nil {
			t.Fatal(err)
		}
		if err := a.o.Replicate(ctx, 0); err != nil {
			t.Fatal(err)
		}
		if err := b.ws[0].Save(ctx, step, tb.step(step)...); err != nil {
			t.Fatal(err)
		}
	}
	a.ws[0].Close()
	a.o.Remove()
	if _, err := b.o.PersistStep(ctx, 1, 2); err != nil {
		t.Fatal(err)
	}
	if steps, _ := CommittedSteps(dir); len(steps) != 0 {
		t.Fatalf("committed %v with shard 0 missing", steps)
	}
	if _, err := b.o.PersistReplica(ctx, 0, 7); !errors.Is(err, ErrNoStep) || !strings.Contains(err.Error(), "intact: steps [2 1]") {
		t.Fatalf("PersistReplica(step 7) = %v, want ErrNoStep naming the steps held", err)
	}
	if _, err := b.o.PersistReplica(ctx, 0, 2); err != nil {
		t.Fatal(err)
	}
	if steps, err := CommittedSteps(dir); err != nil || len(steps) != 1 || steps[0] != 2 {
		t.Fatalf("committed steps %v (%v), want [2]", steps, err)
	}
	ck, err := LoadDiskStep(dir, 2, 0)
	if err != nil || ck.Step != 2 {
		t.Fatalf("shard 0 from disk: %v, %v", ck, err)
	}
	if err := tb.check(ck); err != nil {
		t.Fatal(err)
	}
}

// TestReplicaLagSaid holds transfers up halfway (a gate before the peer)
// while the trainer saves, and checks what the owner says. One save during
// each transfer is enough for replicas not to keep up: it overwrites the
// step the peer holds before the newer one lands, and meanwhile no step
// is held both here and by the peer.
func TestReplicaLagSaid(t *testing.T) {
	ctx := context.Background()
	g := newGated(t, 1, nil)
	a, b, seg, logs, during, save := g.a, g.b, g.seg, g.logs, &g.during, g.save
	inMemory := func() (steps []int64) {
		for _, i := range seg.newest() {
			m, _ := seg.metaOK(i)
			steps = append(steps, m.Step)
		}
		return steps
	}
	onPeer := func() []int64 {
		held, _, err := b.o.Replicas()
		if err != nil {
			t.Error(err)
		}
		return held[0]
	}
	// replicate sends the newest step (or one held for a persist), the
	// trainer saving the steps saves while the transfer is held up: they
	// leave no step held both here and by the peer.
	replicate := func(saves ...int64) {
		t.Helper()
		done := make(chan struct{})
		f := func() {
			defer close(done)
			for _, step := range saves {
				save(step)
			}
			if len(saves) == 0 {
				return
			}
			mem, peer := inMemory(), onPeer()
			if slices.ContainsFunc(mem, func(s int64) bool { return slices.Contains(peer, s) }) {
				t.Errorf("while a transfer is under way: steps %v in memory, %v on the peer", mem, peer)
			}
		}
		during.Store(&f)
		if err := a.o.Replicate(ctx, 0); err != nil {
			t.Fatal(err)
		}
		if during.Swap(nil) == nil {
			<-done
		}
	}
	behind := func() float64 { return testutil.ToFloat64(a.o.m.replicaBehind.WithLabelValues("0")) }
	said := func(what string) int { return strings.Count(logs.String(), what) }
	const lag, again = "replicas cannot keep up", "replicas keep up with the saves again"

	// Step 2 waits for a persist that outlasts the next save: step 4 is
	// saved over step 3, which the peer holds, but the peer holds step 2
	// too, which is still here.
	for step := int64(1); step <= 4; step++ {
		save(step)
		if step == 2 {
			seg.setPersistSeq(seg.seq(seg.newest()[0]))
		}
		replicate()
	}
	if s := inMemory(); !slices.Equal(s, []int64{4, 2}) {
		t.Fatalf("steps %v in memory, want [4 2]", s)
	}
	if said(lag)+said(again) != 0 || behind() != 0 {
		t.Fatalf("transfers with no save meanwhile: %v saves behind, logs:\n%s", behind(), logs)
	}
	seg.donePersist(seg.persistSeq())
	// Step 6, saved while step 5 is sent, overwrites step 4, which the
	// peer holds (with step 3) until step 5 lands.
	save(5)
	replicate(6)
	if said(lag) != 1 || behind() != 1 {
		t.Fatalf("one save during a transfer: said %d times, %v saves behind, logs:\n%s", said(lag), behind(), logs)
	}
	for _, want := range []string{"step=5", "saves_meanwhile=1", "bytes=", "transfer="} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("the warning lacks %q:\n%s", want, logs)
		}
	}
	replicate(7) // step 6 sent, step 5 overwritten: said once while it lasts
	if said(lag) != 1 || said(again) != 0 {
		t.Fatalf("said %d times while it lasts, logs:\n%s", said(lag), logs)
	}
	replicate() // step 7, step 6 kept meanwhile
	if said(again) != 1 || behind() != 0 {
		t.Fatalf("caught up: %v saves behind, logs:\n%s", behind(), logs)
	}
	// Step 8 waits for a persist; steps 9 and 10 come before its transfer
	// begins (9 overwriting 7, which the peer holds with 6), and none
	// during it: the replicas did not keep up, though no save was made
	// meanwhile.
	save(8)
	seg.setPersistSeq(seg.seq(seg.newest()[0]))
	save(9)
	save(10)
	if s := inMemory(); !slices.Equal(s, []int64{10, 8}) {
		t.Fatalf("steps %v in memory, want [10 8]", s)
	}
	replicate()
	if s := onPeer(); !slices.Equal(s, []int64{8, 7}) {
		t.Fatalf("the peer holds %v, want [8 7]", s)
	}
	if said(lag) != 2 || !strings.Contains(logs.String(), "step=8 bytes=") || !strings.Contains(logs.String(), "saves_meanwhile=0") || behind() != 2 {
		t.Fatalf("the held step sent after two saves: %v saves behind, logs:\n%s", behind(), logs)
	}
}

// TestMarkBulk checks the marks of a replica's connection, both ends: the
// TOS byte (the traffic class, for IPv6) and the socket priority that
// queues honoring them send last. A dual-stack listener's end of an IPv4
// connection is an IPv6 socket whose packets are IPv4, which take the TOS.
func TestMarkBulk(t *testing.T) {
	for _, tc := range []struct{ listen, addr, dial, host string }{
		{"tcp4", "127.0.0.1:0", "tcp4", "127.0.0.1"},
		{"tcp6", "[::1]:0", "tcp6", "::1"},
		{"tcp", ":0", "tcp4", "127.0.0.1"},
	} {
		t.Run(tc.listen+" "+tc.addr, func(t *testing.T) {
			ln, err := net.Listen(tc.listen, tc.addr)
			if err != nil {
				t.Skipf("no %s here: %v", tc.listen, err)
			}
			defer ln.Close()
			c, err := net.Dial(tc.dial, net.JoinHostPort(tc.host, strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			s, err := ln.Accept()
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			for _, conn := range []net.Conn{c, s} {
				markBulk(conn)
				raw, err := conn.(*net.TCPConn).SyscallConn()
				if err != nil {
					t.Fatal(err)
				}
				var domain, tos, class, prio int
				var errs [4]error
				raw.Control(func(fd uintptr) {
					domain, errs[0] = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_DOMAIN)
					tos, errs[1] = unix.GetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_TOS)
					prio, errs[2] = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PRIORITY)
					if domain == unix.AF_INET6 {
						class, errs[3] = unix.GetsockoptInt(int(fd), unix.IPPROTO_IPV6, unix.IPV6_TCLASS)
					} else {
						class = bulkTOS
					}
				})
				if err := errors.Join(errs[:]...); err != nil {
					t.Fatal(err)
				}
				if tos != bulkTOS || class != bulkTOS || prio != bulkPriority {
					t.Errorf("%s (domain %d): TOS %#x, traffic class %#x, priority %d, want %#x and %d", conn.LocalAddr(), domain, tos, class, prio, bulkTOS, bulkPriority)
				}
			}
		})
	}
}

// TestReplicaGivenUpNoLag: with two peers, a transfer that the trainer
// saves over at the first one, while the other half waits for a persist,
// is given up for every peer: no peer took the step, so it says nothing
// of whether replicas keep up (the peers still hold the step the persist
// waits for, in memory too).
func TestReplicaGivenUpNoLag(t *testing.T) {
	ctx := context.Background()
	g := newGated(t, 2, map[string]string{"c": "127.0.0.1:1"})
	a, seg, logs, during, save := g.a, g.seg, g.logs, &g.during, g.save
	save(1)
	if err := a.o.Replicate(ctx, 0); err == nil || !strings.Contains(err.Error(), "peer c") {
		t.Fatalf("Replicate step 1 = %v, want c's error alone", err)
	}
	// Step 1 waits for a persist; step 2 is sent, and the trainer saves
	// steps 3 and 4 over it meanwhile.
	seg.setPersistSeq(seg.seq(seg.newest()[0]))
	save(2)
	done := make(chan struct{})
	f := func() { defer close(done); save(3); save(4) }
	during.Store(&f)
	err := a.o.Replicate(ctx, 0)
	<-done
	if !errors.Is(err, ErrSuperseded) || strings.Contains(err.Error(), "peer c") {
		t.Fatalf("Replicate step 2 = %v, want it given up at b, c left alone", err)
	}
	if strings.Contains(logs.String(), "keep up") {
		t.Errorf("a transfer no peer took is judged:\n%s", logs)
	}
	if n := testutil.CollectAndCount(a.o.m.replicaBehind); n != 1 {
		t.Errorf("%d saves_behind series", n)
	}
	if v := testutil.ToFloat64(a.o.m.replicaBehind.WithLabelValues("0")); v != 0 {
		t.Errorf("saves_behind = %v after a transfer no peer took, want 0 as after step 1's", v)
	}
}

// gated is an owner "a" of shard 0 whose transfers to peer "b" pass a gate
// that calls during (once set) after 1 MiB, with steps of ~24 MiB: many
// times what the gate lets through before it calls.
type gated struct {
	a, b   *node
	seg    *segment
	logs   *syncBuffer
	during atomic.Pointer[func()]
	save   func(step int64)
}

// newGated starts b and a, a sending to b through the gate and to the
// other peers given (node name to address), replicas of them each.
func newGated(t *testing.T, replicas int, others map[string]string) *gated {
	t.Helper()
	g := &gated{logs: &syncBuffer{}}
	tb := newTestBlobs(2 << 20)
	g.b = newNode(t, OwnerConfig{Node: "b", Shards: []int{1}, Capacity: 32 << 20, ListenAddr: "127.0.0.1:0"}, 1)
	running(t, g.b.o)
	gate := startGate(t, g.b.o.Addr().String(), 1<<20, func() {
		if f := g.during.Swap(nil); f != nil {
			(*f)()
		}
	})
	peers := map[string]string{"a": "", "b": gate.ln.Addr().String()}
	maps.Copy(peers, others)
	g.a = newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, Capacity: 32 << 20, Replicas: replicas, Peers: peers,
		Logger: slog.New(slog.NewTextHandler(g.logs, nil)), Registerer: prometheus.NewRegistry()}, 1)
	var err error
	if g.seg, err = g.a.o.seg(0); err != nil {
		t.Fatal(err)
	}
	g.save = func(step int64) {
		if err := g.a.ws[0].Save(context.Background(), step, tb.step(step)...); err != nil {
			t.Error(err)
		}
	}
	return g
}

// TestAdopt: node b holds a replica of node a's shard 0; b's shard 1,
// which saved nothing, adopts its step 2 (a data-parallel rank going on
// from another's state) and then holds it, blob for blob, as its own. A
// step b holds no copy of is ErrNoStep.
func TestAdopt(t *testing.T) {
	ctx := context.Background()
	tb := newTestBlobs(100 << 10)
	b := newNode(t, OwnerConfig{Node: "b", Shards: []int{1}, NumShards: 2, ListenAddr: "127.0.0.1:0"}, 1)
	running(t, b.o)
	a := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, NumShards: 2, Capacity: 4 << 20,
		Peers: map[string]string{"a": "127.0.0.1:1", "b": b.o.Addr().String()}}, 1)
	for step := int64(1); step <= 2; step++ {
		if err := a.ws[0].Save(ctx, step, tb.step(step)...); err != nil {
			t.Fatal(err)
		}
		if err := a.o.Replicate(ctx, 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.o.Adopt(ctx, 1, 0, 7); !errors.Is(err, ErrNoStep) {
		t.Fatalf("Adopt(step 7) = %v, want ErrNoStep", err)
	}
	if err := b.o.Adopt(ctx, 1, 0, 2); err != nil {
		t.Fatal(err)
	}
	ck, _, err := b.o.Load(ctx, 1)
	if err != nil || ck.Step != 2 {
		t.Fatalf("shard 1 after adopting shard 0's step 2: %v, %v", ck, err)
	}
	if err := tb.check(ck); err != nil {
		t.Fatal(err)
	}
}

// TestAdoptFromPeer: node j's shard 2 goes on from shard 0's state,
// which no replica here holds: Adopt asks the peers, and node a serves
// step 2 of its own shard 0 from its segment (sealing the save first); a
// step a no longer holds is ErrNoStep, naming what each peer holds.
func TestAdoptFromPeer(t *testing.T) {
	ctx := context.Background()
	tb := newTestBlobs(100 << 10)
	a := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, NumShards: 3, Capacity: 4 << 20, ListenAddr: "127.0.0.1:0", Replicas: -1}, 1)
	for step := int64(1); step <= 3; step++ {
		if err := a.ws[0].Save(ctx, step, tb.step(step)...); err != nil {
			t.Fatal(err)
		}
	}
	running(t, a.o)
	j := newNode(t, OwnerConfig{Node: "j", Shards: []int{2}, NumShards: 3,
		Peers: map[string]string{"a": a.o.Addr().String(), "j": "127.0.0.1:1"}}, 1)
	if err := j.o.Adopt(ctx, 2, 0, 3); err != nil {
		t.Fatal(err)
	}
	ck, _, err := j.o.Load(ctx, 2)
	if err != nil || ck.Step != 3 {
		t.Fatalf("shard 2 after adopting shard 0's step 3 from a peer: %v, %v", ck, err)
	}
	if err := tb.check(ck); err != nil {
		t.Fatal(err)
	}
	err = j.o.Adopt(ctx, 2, 0, 1) // a's halves hold steps 2 and 3
	if !errors.Is(err, ErrNoStep) || !strings.Contains(err.Error(), "peer a") || !strings.Contains(err.Error(), "step 1") {
		t.Fatalf("Adopt(step 1) = %v, want ErrNoStep naming peer a", err)
	}
}

// TestRestoreFromReplicaHeld: node c holds a replica of shard 0, which it
// now owns too (a spare that took node a's place): Restore serves shard
// 0's step from that replica, with no peer to ask, and drops the copy.
func TestRestoreFromReplicaHeld(t *testing.T) {
	ctx := context.Background()
	tb := newTestBlobs(100 << 10)
	c := newNode(t, OwnerConfig{Node: "c", Shards: []int{0}, NumShards: 2, ListenAddr: "127.0.0.1:0"}, 1)
	running(t, c.o)
	a := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, NumShards: 2, Capacity: 4 << 20,
		Peers: map[string]string{"a": "127.0.0.1:1", "c": c.o.Addr().String()}}, 1)
	if err := a.ws[0].Save(ctx, 3, tb.step(3)...); err != nil {
		t.Fatal(err)
	}
	if err := a.o.Replicate(ctx, 0); err != nil {
		t.Fatal(err)
	}
	rep, err := c.o.Restore(ctx, 0, 3)
	if err != nil || rep.Tier != TierReplica {
		t.Fatalf("Restore = %+v, %v; want step 3 from the replica held here", rep, err)
	}
	if _, err := os.Stat(ReplicaPath(c.o.cfg.ShmDir, c.o.cfg.Name, 0)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the replica, now the shard's own, is still held: %v", err)
	}
	ck, _, err := c.o.Load(ctx, 0)
	if err != nil || ck.Step != 3 {
		t.Fatalf("shard 0 after the restore: %v, %v", ck, err)
	}
	if err := tb.check(ck); err != nil {
		t.Fatal(err)
	}
}
