package ckpt

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
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

	"github.com/faultline-ml/faultline/ckpt/layout"
	"go.uber.org/goleak"
)

// checkLoaded loads shard's newest step through the trainer's writer and
// checks that it is step, bitwise what tb saved.
func checkLoaded(t *testing.T, w *Writer, tb *testBlobs, step int64) {
	t.Helper()
	ck, err := w.Load(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if ck.Step != step {
		t.Fatalf("the trainer loads step %d, want %d", ck.Step, step)
	}
	if err := tb.check(ck); err != nil {
		t.Fatal(err)
	}
}

// waitFor polls cond until it holds; what it waits for is a transfer in
// the background, whose end nothing else signals.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(60 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no %s within 60s", what)
		}
	}
}

// TestRestoreTiers restores into an empty node from each tier in turn:
// memory, then a peer's replica, then disk, each refusal in the report.
func TestRestoreTiers(t *testing.T) {
	ctx := context.Background()
	tb := newTestBlobs(2 << 10)
	dir := t.TempDir()
	b := newNode(t, OwnerConfig{Node: "b", Shards: []int{1}, ListenAddr: "127.0.0.1:0"}, 1)
	running(t, b.o)
	peers := map[string]string{"a": "", "b": b.o.Addr().String()}
	cfg := OwnerConfig{Node: "a", Shards: []int{0}, Capacity: 64 << 10, Dir: dir, Peers: peers}
	a := newNode(t, cfg, 1)
	save := func(step int64) {
		t.Helper()
		if err := a.ws[0].Save(ctx, step, tb.step(step)...); err != nil {
			t.Fatal(err)
		}
	}
	save(1)
	if step, err := a.o.PersistNewest(ctx); err != nil || step != 1 {
		t.Fatalf("PersistNewest = %d, %v", step, err)
	}
	save(2)
	if err := a.o.Replicate(ctx, 0); err != nil {
		t.Fatal(err)
	}
	save(3)

	rep, err := a.o.Restore(ctx, 0, 3)
	if err != nil || rep.Tier != TierMemory || len(rep.Refused) != 0 {
		t.Fatalf("Restore(3) on the node = %s, %v; want memory", rep, err)
	}

	for _, tc := range []struct {
		step    int64
		tier    Tier
		refused []Tier
		why     string // in the report
	}{
		{2, TierReplica, []Tier{TierMemory}, "holds no step 2 intact"},
		{1, TierDisk, []Tier{TierMemory, TierReplica}, "no intact replica of shard 0 at step 1 here (intact: steps [2])"},
		{9, "", []Tier{TierMemory, TierReplica, TierDisk}, "no such file"},
	} {
		t.Run(fmt.Sprint("step ", tc.step), func(t *testing.T) {
			// A replacement node: empty memory, halves too small for the
			// step (the restore grows them).
			c := cfg
			c.Capacity = 4096
			a2 := newNode(t, c, 1)
			rep, err := a2.o.Restore(ctx, 0, tc.step)
			t.Logf("%s", rep)
			var refused []Tier
			for _, e := range rep.Refused {
				refused = append(refused, e.Tier)
			}
			if rep.Tier != tc.tier || !slices.Equal(refused, tc.refused) || !strings.Contains(rep.String(), tc.why) {
				t.Fatalf("Restore(%d) = %s, %v; want tier %q after refusals %v, saying %q", tc.step, rep, err, tc.tier, tc.refused, tc.why)
			}
			if tc.tier == "" {
				if !errors.Is(err, ErrNoStep) || rep.Step != -1 {
					t.Fatalf("Restore(%d) = %v, step %d; want ErrNoStep", tc.step, err, rep.Step)
				}
				return
			}
			if err != nil || rep.Step != tc.step {
				t.Fatalf("Restore(%d) = %s, %v", tc.step, rep, err)
			}
			checkLoaded(t, a2.ws[0], tb, tc.step)
			// Memory now holds it.
			if rep, err := a2.o.Restore(ctx, 0, tc.step); err != nil || rep.Tier != TierMemory {
				t.Fatalf("Restore(%d) again = %s, %v", tc.step, rep, err)
			}
		})
	}
	if _, err := a.o.Restore(ctx, 5, 1); err == nil || !strings.Contains(err.Error(), "not a local shard") {
		t.Fatalf("Restore of a shard not held here = %v", err)
	}
}

// TestReplicaReplacedNode replaces node a, which held shard 0 and a
// replica of b's shard 1, by a node on another address with empty memory.
// The replacement restores shard 0 from b; b, told of the new address
// (SetPeers), sends its newest step to it without a new save; and the
// replacement's saves of shard 0 supersede those of the node it replaced
// on b, the older copy kept until the new one is whole.
func TestReplicaReplacedNode(t *testing.T) {
	ctx := context.Background()
	tb := newTestBlobs(4 << 10)
	fast := 5 * time.Millisecond
	a := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, ListenAddr: "127.0.0.1:0", PollInterval: fast}, 1)
	b := newNode(t, OwnerConfig{Node: "b", Shards: []int{1}, ListenAddr: "127.0.0.1:0", PollInterval: fast}, 1)
	peers := map[string]string{"a": a.o.Addr().String(), "b": b.o.Addr().String()}
	for _, n := range []*node{a, b} {
		if err := n.o.SetPeers(peers, nil); err != nil {
			t.Fatal(err)
		}
	}
	running(t, b.o)
	aCtx, stopA := context.WithCancel(ctx)
	aDone := make(chan error)
	go func() { aDone <- a.o.Run(aCtx) }()

	// holds says whether o holds the given newest steps of shard.
	holds := func(o *Owner, shard int, steps ...int64) func() bool {
		return func() bool {
			held, _, err := o.Replicas()
			return err == nil && len(held[shard]) >= len(steps) && slices.Equal(held[shard][:len(steps)], steps)
		}
	}
	for step := int64(1); step <= 5; step++ {
		if err := a.ws[0].Save(ctx, step, tb.step(step)...); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.ws[0].Save(ctx, 2, tb.step(2)...); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "replica of a's step 5 on b", holds(b.o, 0, 5))
	waitFor(t, "replica of b's step 2 on a", holds(a.o, 1, 2))

	// Node a is lost with its memory.
	stopA()
	<-aDone
	a.ws[0].Close()
	a.o.Remove()

	a2 := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, ListenAddr: "127.0.0.1:0", PollInterval: fast}, 1)
	peers = map[string]string{"a": a2.o.Addr().String(), "b": b.o.Addr().String()}
	if err := a2.o.SetPeers(peers, nil); err != nil {
		t.Fatal(err)
	}
	rep, err := a2.o.Restore(ctx, 0, 5)
	if err != nil || rep.Tier != TierReplica {
		t.Fatalf("Restore = %s, %v; want the replica", rep, err)
	}
	checkLoaded(t, a2.ws[0], tb, 5)
	running(t, a2.o)

	if err := b.o.SetPeers(peers, nil); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "replica of b's step 2 on the replacement", holds(a2.o, 1, 2))

	// The replacement trains on from step 5; its saves replace a's on b.
	for step := int64(6); step <= 7; step++ {
		if err := a2.ws[0].Save(ctx, step, tb.step(step)...); err != nil {
			t.Fatal(err)
		}
		waitFor(t, fmt.Sprintf("replica of the replacement's step %d on b", step), holds(b.o, 0, step, step-1))
	}
	if _, why, err := b.o.Replicas(); err != nil || len(why) != 0 {
		t.Fatalf("b's replicas: %v, %v", why, err)
	}
	a3 := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, Peers: peers}, 1)
	if rep, err := a3.o.Restore(ctx, 0, 7); err != nil || rep.Tier != TierReplica {
		t.Fatalf("Restore(7) = %s, %v", rep, err)
	}
	checkLoaded(t, a3.ws[0], tb, 7)
}

// TestOwnerRestartKeepsReplicas closes the owner that holds a peer's
// replica and starts another on the same shared memory: Close removes
// nothing, and the new owner lists and serves the replica.
func TestOwnerRestartKeepsReplicas(t *testing.T) {
	ctx := context.Background()
	tb := newTestBlobs(4 << 10)
	shm := shmDir(t)
	bcfg := OwnerConfig{ShmDir: shm, Node: "b", Shards: []int{1}, ListenAddr: "127.0.0.1:0"}
	b := newNode(t, bcfg, 1)
	running(t, b.o)
	peers := map[string]string{"a": "", "b": b.o.Addr().String()}
	a := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, Peers: peers}, 1)
	if err := a.ws[0].Save(ctx, 3, tb.step(3)...); err != nil {
		t.Fatal(err)
	}
	if err := a.o.Replicate(ctx, 0); err != nil {
		t.Fatal(err)
	}
	before, _ := filepath.Glob(filepath.Join(shm, "*"))
	b.ws[0].Close()
	if err := b.o.Close(); err != nil {
		t.Fatal(err)
	}
	if after, _ := filepath.Glob(filepath.Join(shm, "*")); !slices.Equal(before, after) {
		t.Fatalf("Close left %v of %v", after, before)
	}

	b2 := newNode(t, bcfg, 1)
	held, why, err := b2.o.Replicas()
	if err != nil || !maps.EqualFunc(held, map[int][]int64{0: {3}}, slices.Equal) || len(why) != 0 {
		t.Fatalf("Replicas after a restart = %v, %v, %v", held, why, err)
	}
	running(t, b2.o)
	peers["b"] = b2.o.Addr().String()
	a2 := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, Peers: peers}, 1)
	if rep, err := a2.o.Restore(ctx, 0, 3); err != nil || rep.Tier != TierReplica {
		t.Fatalf("Restore = %s, %v", rep, err)
	}
	checkLoaded(t, a2.ws[0], tb, 3)
}

// TestOwnerCloseMidTransfer closes an owner while a peer's transfer into
// it stalls halfway: Close returns, leaves no goroutine, and keeps the
// previous copy, which the next owner serves.
func TestOwnerCloseMidTransfer(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	ctx := context.Background()
	tb := newTestBlobs(4 << 10)
	shm := shmDir(t)
	bcfg := OwnerConfig{ShmDir: shm, Node: "b", Shards: []int{1}, ListenAddr: "127.0.0.1:0"}
	b := newNode(t, bcfg, 1)
	bCtx, stopB := context.WithCancel(ctx)
	defer stopB()
	bDone := make(chan error)
	go func() { bDone <- b.o.Run(bCtx) }()
	peers := map[string]string{"a": "", "b": b.o.Addr().String()}
	a := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, Peers: peers}, 1)
	if err := a.ws[0].Save(ctx, 3, tb.step(3)...); err != nil {
		t.Fatal(err)
	}
	if err := a.o.Replicate(ctx, 0); err != nil {
		t.Fatal(err)
	}

	stallPut(t, b.o, a, tb, 4)
	if err := b.o.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-bDone; err != nil {
		t.Fatalf("Run after Close = %v", err)
	}
	if _, err := os.Stat(ReplicaPath(shm, b.o.cfg.Name, 0)); err != nil {
		t.Fatalf("Close removed the replica: %v", err)
	}
	b2 := newNode(t, bcfg, 1)
	if held, _, err := b2.o.Replicas(); err != nil || !slices.Equal(held[0], []int64{3}) {
		t.Fatalf("Replicas after a cut transfer = %v, %v", held, err)
	}
	b2.ws[0].Close()
	b2.o.Close()
	b.ws[0].Close()
	a.ws[0].Close()
	a.o.Close()
}

// stallPut has to receive, from node from (one shard), a put of step that
// stops after its meta and a few bytes, as one from a node cut off
// mid-transfer does, and returns the connection once to's slot is
// taken; the test closes it, or its end does.
func stallPut(t *testing.T, to *Owner, from *node, tb *testBlobs, step int64) net.Conn {
	t.Helper()
	ctx := context.Background()
	conn, err := net.Dial("tcp", to.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	br, bw := bufio.NewReader(conn), bufio.NewWriter(conn)
	shard := from.o.cfg.Shards[0]
	if err := clientHandshake(br, bw, nil, replicaReq{op: opPut, shard: shard, step: step}); err != nil {
		t.Fatal(err)
	}
	if err := from.ws[0].Save(ctx, step, tb.step(step)...); err != nil {
		t.Fatal(err)
	}
	seg := from.o.segs[shard]
	if err := from.o.Seal(ctx, shard); err != nil {
		t.Fatal(err)
	}
	m, _ := seg.metaOK(seg.newest()[0])
	mb, _ := m.MarshalBinary()
	bw.Write(binary.LittleEndian.AppendUint32(nil, uint32(len(mb))))
	bw.Write(mb)
	bw.Write(make([]byte, 1000))
	if err := bw.Flush(); err != nil {
		t.Fatal(err)
	}
	// The server is receiving once the slot is taken: wait for that.
	waitFor(t, "the stalled transfer to begin", func() bool {
		slot := to.replicaSlot(shard)
		if slot.mu.TryLock() {
			slot.mu.Unlock()
			return false
		}
		return true
	})
	return conn
}

// TestRestoreBesideStalledPut: node a is cut off while it sends its
// shard's step 4 to b, which holds step 3 of it; a's replacement
// restores step 3 from b at once, not after b's I/O timeout ends the
// stalled put.
func TestRestoreBesideStalledPut(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tb := newTestBlobs(4 << 10)
	b := newNode(t, OwnerConfig{Node: "b", Shards: []int{1}, ListenAddr: "127.0.0.1:0", IOTimeout: time.Hour}, 1)
	running(t, b.o)
	peers := map[string]string{"a": "", "b": b.o.Addr().String()}
	a := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, Peers: peers}, 1)
	if err := a.ws[0].Save(ctx, 3, tb.step(3)...); err != nil {
		t.Fatal(err)
	}
	if err := a.o.Replicate(ctx, 0); err != nil {
		t.Fatal(err)
	}
	stallPut(t, b.o, a, tb, 4)
	a2 := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, Peers: peers}, 1)
	if rep, err := a2.o.Restore(ctx, 0, 3); err != nil || rep.Tier != TierReplica {
		t.Fatalf("Restore beside a stalled put = %s, %v", rep, err)
	}
	checkLoaded(t, a2.ws[0], tb, 3)
}

// TestRestoreFromReplicaHeldBesideStalledPut: node c, which took node
// a's place, restores shard 0 from the replica a sent it while a's
// last put to it stalls, and drops the copy once that put ends.
func TestRestoreFromReplicaHeldBesideStalledPut(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tb := newTestBlobs(4 << 10)
	c := newNode(t, OwnerConfig{Node: "c", Shards: []int{0}, NumShards: 2, ListenAddr: "127.0.0.1:0", IOTimeout: time.Hour}, 1)
	running(t, c.o)
	a := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, NumShards: 2,
		Peers: map[string]string{"a": "127.0.0.1:1", "c": c.o.Addr().String()}}, 1)
	if err := a.ws[0].Save(ctx, 3, tb.step(3)...); err != nil {
		t.Fatal(err)
	}
	if err := a.o.Replicate(ctx, 0); err != nil {
		t.Fatal(err)
	}
	conn := stallPut(t, c.o, a, tb, 4)
	if rep, err := c.o.Restore(ctx, 0, 3); err != nil || rep.Tier != TierReplica {
		t.Fatalf("Restore beside a stalled put = %+v, %v; want step 3 from the replica held here", rep, err)
	}
	checkLoaded(t, c.ws[0], tb, 3)
	path := ReplicaPath(c.o.cfg.ShmDir, c.o.cfg.Name, 0)
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("the copy went while the put into it went on: %v", err)
	}
	conn.Close()
	waitFor(t, "the copy, the shard's own now, to go with the put's end", func() bool {
		_, err := os.Stat(path)
		return errors.Is(err, os.ErrNotExist)
	})
}

// TestCopyReadBesidePuts: node a saves step after step and puts each to
// b, while c gets the step before the newest from b's copy and b adopts
// it into its own shard from the copy: whatever a get or an adopt
// serves is bitwise the step it says, however the puts overtake it.
func TestCopyReadBesidePuts(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tb := newTestBlobs(2 << 10)
	b := newNode(t, OwnerConfig{Node: "b", Shards: []int{1}, ListenAddr: "127.0.0.1:0", IOTimeout: 5 * time.Second}, 1)
	running(t, b.o)
	addr := b.o.Addr().String()
	a := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, Peers: map[string]string{"a": "", "b": addr}}, 1)
	c := newNode(t, OwnerConfig{Node: "c", Shards: []int{2}}, 1)
	scratch, err := createSegment(filepath.Join(shmDir(t), "scratch"), 0, 0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer scratch.close()

	var latest atomic.Int64
	var served atomic.Int64
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		defer close(done)
		for s := int64(1); s <= 80; s++ {
			if err := a.ws[0].Save(ctx, s, tb.step(s)...); err != nil {
				t.Error(err)
				return
			}
			if err := a.o.Replicate(ctx, 0); err == nil {
				latest.Store(s)
			}
		}
	})
	// each runs read(step) until the puts end; read returns the step it
	// served, or an error when the copy no longer held it.
	each := func(read func(step int64) (*Checkpoint, error)) {
		tb := newTestBlobs(2 << 10) // one of its own: step writes its cache
		for {
			select {
			case <-done:
				return
			default:
			}
			l := latest.Load()
			if l < 2 {
				time.Sleep(time.Millisecond)
				continue
			}
			ck, err := read(l - 1)
			if err != nil {
				continue // overtaken: the copy holds newer steps
			}
			if ck.Step != l-1 {
				t.Errorf("asked for step %d, served step %d", l-1, ck.Step)
			} else if err := tb.check(ck); err != nil {
				t.Errorf("served: %v", err)
			}
			served.Add(1)
		}
	}
	wg.Go(func() {
		each(func(step int64) (*Checkpoint, error) {
			if _, err := c.o.getReplica(ctx, addr, 0, step, func(int64) (*segment, error) { return scratch, nil }); err != nil {
				return nil, err
			}
			ck, _, err := scratch.loadHalf(scratch.newest()[0], 1, nil, false)
			return ck, err
		})
	})
	wg.Go(func() {
		each(func(step int64) (*Checkpoint, error) {
			if err := b.o.Adopt(ctx, 1, 0, step); err != nil {
				return nil, err
			}
			return b.ws[0].Load(ctx)
		})
	})
	wg.Wait()
	if served.Load() == 0 {
		t.Fatal("no get or adopt was served")
	}
	// No reader pins a copy: none keeps a put out, or leaves a pin when
	// it dies.
	cp, err := openSegment(ReplicaPath(b.o.cfg.ShmDir, b.o.cfg.Name, 0), true)
	if err != nil {
		t.Fatal(err)
	}
	defer cp.close()
	for i := range 2 {
		if p := *cp.u32(cp.halfBase(i) + layout.OffPin); p != 0 {
			t.Errorf("half %d of the copy is pinned %d times after its readers ended", i, p)
		}
	}
}

// childNode is a node agent and its trainer: it saves steps 1 to
// FAULTLINE_CKPT_STEPS, copies each to its peer, and says ready with the
// newest step, then waits to be killed.
func childNode() error {
	ctx := context.Background()
	o, err := NewOwner(OwnerConfig{ShmDir: os.Getenv("FAULTLINE_CKPT_SHM"), Name: "node", Node: "a", Shards: []int{0},
		Capacity: 16 << 20, Peers: map[string]string{"a": "", "p": os.Getenv("FAULTLINE_CKPT_PEER")},
		ReplicaKey: []byte(os.Getenv("FAULTLINE_CKPT_KEY"))})
	if err != nil {
		return err
	}
	w, err := NewWriter(WriterConfig{Path: o.SegmentPath(0)})
	if err != nil {
		return err
	}
	tb := newTestBlobs(1 << 20)
	n := envInt("FAULTLINE_CKPT_STEPS")
	for step := int64(1); step <= n; step++ {
		if err := w.Save(ctx, step, tb.step(step)...); err != nil {
			return err
		}
		if err := o.Replicate(ctx, 0); err != nil {
			return err
		}
	}
	fmt.Println("ready", n)
	select {}
}

// TestReplicaSurvivesSIGKILL kills node a's agent, and then the peer's
// agent that holds a's replica, each with SIGKILL; the peer's next agent,
// a new process on the same shared memory, lists the replica and serves
// it over TCP to a's replacement, which holds the step bitwise.
func TestReplicaSurvivesSIGKILL(t *testing.T) {
	ctx := context.Background()
	key := "a job's key, of more than 16 bytes"
	shmP := shmDir(t)
	peer, addr := startChild(t, "peer", "FAULTLINE_CKPT_SHM="+shmP, "FAULTLINE_CKPT_KEY="+key)
	shmA := shmDir(t)
	node, ready := startChild(t, "node", "FAULTLINE_CKPT_SHM="+shmA, "FAULTLINE_CKPT_PEER="+addr[0],
		"FAULTLINE_CKPT_KEY="+key, "FAULTLINE_CKPT_STEPS=3")
	if ready[0] != "3" {
		t.Fatalf("node ready at step %s", ready[0])
	}
	node.kill()
	os.RemoveAll(shmA) // the node's memory goes with it
	peer.kill()

	_, again := startChild(t, "peer", "FAULTLINE_CKPT_SHM="+shmP, "FAULTLINE_CKPT_KEY="+key)
	if want := []string{"held", "0:3,2"}; !slices.Equal(again[1:], want) {
		t.Fatalf("the restarted peer says %v, want %v", again[1:], want)
	}
	a2 := newNode(t, OwnerConfig{Node: "a", Shards: []int{0}, Capacity: 4096, ReplicaKey: []byte(key),
		Peers: map[string]string{"a": "", "p": again[0]}}, 1)
	rep, err := a2.o.Restore(ctx, 0, 3)
	if err != nil || rep.Tier != TierReplica {
		t.Fatalf("Restore = %s, %v", rep, err)
	}
	t.Logf("%s", rep)
	checkLoaded(t, a2.ws[0], newTestBlobs(1<<20), 3)
}

// heldWords says which steps of which shards an owner's Replicas lists,
// as "shard:step,step" words.
func heldWords(o *Owner) ([]string, error) {
	held, _, err := o.Replicas()
	var words []string
	for _, s := range slices.Sorted(maps.Keys(held)) {
		var steps []string
		for _, st := range held[s] {
			steps = append(steps, strconv.FormatInt(st, 10))
		}
		words = append(words, fmt.Sprintf("%d:%s", s, strings.Join(steps, ",")))
	}
	return words, err
}
