package ckpt

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// errNoReplica is the server's answer when it holds no such copy.
var errNoReplica = errors.New("no intact replica")

// PickPeers chooses up to k nodes, other than self, to hold self's
// replicas. Nodes in another failure domain (domain[node], such as the ASW
// a node hangs under) come first, then nodes whose domain is unknown, then
// nodes in self's domain, so a switch failure does not take a shard and
// its copies together. Within each group, the choice starts after self in
// sorted order and wraps around, which spreads replicas evenly when every
// node picks this way. The result is deterministic, so a replaced node
// with self's name asks the same peers.
func PickPeers(self string, nodes []string, domain map[string]string, k int) []string {
	all := slices.Clone(nodes)
	slices.Sort(all)
	all = slices.Compact(all)
	// Rotate so that the nodes after self come first.
	pos, _ := slices.BinarySearch(all, self)
	ring := append(slices.Clone(all[pos:]), all[:pos]...)
	mine, known := domain[self]
	rank := func(n string) int {
		d, ok := domain[n]
		switch {
		case !known || !ok:
			return 1
		case d != mine:
			return 0
		}
		return 2
	}
	var cands []string
	for _, n := range ring {
		if n != self {
			cands = append(cands, n)
		}
	}
	slices.SortStableFunc(cands, func(a, b string) int { return cmp.Compare(rank(a), rank(b)) })
	if k < len(cands) {
		cands = cands[:max(k, 0)]
	}
	return cands
}

// peerSet is the job's nodes as the owner knows them now.
type peerSet struct {
	addrs map[string]string // node -> replica server address
	// order is the other nodes in PickPeers's order of preference: the
	// first Replicas of them receive this node's saves.
	order []string
	gen   uint64 // counts SetPeers
}

// targets are the peers that receive this node's saves.
func (p *peerSet) targets(replicas int) []string {
	return p.order[:min(max(replicas, 0), len(p.order))]
}

func newPeerSet(self string, peers, domains map[string]string, gen uint64) *peerSet {
	return &peerSet{addrs: maps.Clone(peers), gen: gen,
		order: PickPeers(self, slices.Collect(maps.Keys(peers)), domains, len(peers))}
}

// SetPeers replaces OwnerConfig.Peers and Domains while the owner runs,
// as when a node of the job is replaced on a new address: transfers that
// start from then on, Run's, Replicate's and the fetches of Load,
// LoadStep and Restore, use the new ones, and Run sends each shard's
// newest step to the peers it now picks even if it sent that step
// before. Transfers under way finish with the peers they began with. The
// maps are copied. It is safe to call at any time.
func (o *Owner) SetPeers(peers, domains map[string]string) error {
	if len(peers) > 0 && o.cfg.Node == "" {
		return errors.New("ckpt: SetPeers: OwnerConfig.Node is empty, so this node is none of the peers")
	}
	o.mu.Lock()
	ps := newPeerSet(o.cfg.Node, peers, domains, o.peers.Load().gen+1)
	o.peers.Store(ps)
	o.mu.Unlock()
	o.log.Info("ckpt: peers changed", "peers", len(peers), "targets", ps.targets(o.cfg.Replicas))
	return nil
}

// replicaHalf returns the half of seg whose step Replicate sends, or -1:
// the newest step; but while the other half holds a step newer than the
// last one sent that is held for a persist (which the writer leaves alone
// until the persist is done), that one, whose transfer has no writer to
// give way to meanwhile. Under a lag, the steps persisted are then the
// ones replicated.
func (o *Owner) replicaHalf(seg *segment) int {
	c := seg.newest()
	if len(c) == 0 {
		return -1
	}
	if len(c) == 2 && seg.held(c[1]) {
		if seg.seq(c[1]) > o.sentSeqs(seg.hdr.Shard)[0] {
			return c[1]
		}
	}
	return c[0]
}

// Replicate copies a step of shard to its peers (PickPeers), sealing it
// first if need be: the newest, or a newer one than they hold that waits
// for a persist (see Run). It returns the errors of the peers that did not
// take it. The trainer's saves never wait for a transfer: while the half
// being sent is the only one a save could write (the other waits for a
// persist), the transfer lets it go, and if a save takes it, the
// transfer is given up (an error wrapping ErrSuperseded; the peers keep
// their previous copy), and the next one sends the newest step.
func (o *Owner) Replicate(ctx context.Context, shard int) (err error) {
	defer recoverFault(&err, debug.SetPanicOnFault(true))
	if err := o.acquire(); err != nil {
		return err
	}
	defer o.ops.RUnlock()
	seg, err := o.seg(shard)
	if err != nil {
		return err
	}
	ps := o.peers.Load()
	peers := ps.targets(o.cfg.Replicas)
	if len(peers) == 0 {
		return fmt.Errorf("ckpt: replicate shard %d: no peers", shard)
	}
	i := o.replicaHalf(seg)
	if i < 0 {
		return fmt.Errorf("%w in memory to replicate shard %d", ErrNoStep, shard)
	}
	m, _ := seg.metaOK(i)
	ctx, span := o.tracer.Start(ctx, "ckpt.Replicate", trace.WithAttributes(attribute.Int("ckpt.shard", shard), attribute.Int64("ckpt.step", m.Step)))
	defer span.End()
	if err := o.sealHalf(ctx, seg, i, nil); err != nil {
		return err
	}
	var errs []error
	took := 0 // peers that took the step
	began, before := time.Now(), seg.newestSeq()
	held := o.sentSeqs(shard) // what the peers held before
	for _, p := range peers {
		addr := ps.addrs[p]
		n, err := o.putReplica(ctx, addr, seg, i, m.Step)
		o.m.replicaBytes.WithLabelValues("sent").Add(float64(n))
		if err != nil {
			errs = append(errs, fmt.Errorf("peer %s (%s): %w", p, addr, err))
			if errors.Is(err, ErrSuperseded) {
				o.m.replicaAbandoned.Inc()
				o.log.Info("ckpt: replica given up: the trainer saved over the step being sent", "shard", shard, "step", m.Step, "peer", p, "bytes_sent", n)
				break // the step is gone; the next transfer sends the newest
			}
			o.m.replicaFailures.Inc()
			continue
		}
		if took++; took == 1 {
			o.noteLag(seg, m, held, before, time.Since(began))
		}
		o.noteSent(shard, m.Seq)
		o.log.Debug("ckpt: replica sent", "shard", shard, "step", m.Step, "peer", p, "bytes", n)
	}
	if err := errors.Join(errs...); err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
		return fmt.Errorf("ckpt: replicate shard %d step %d: %w", shard, m.Step, err)
	}
	return nil
}

// noteLag says, as a transfer of m lands (the first peer took it, after
// took), when the replicas of a shard stop keeping up with its saves and
// when they keep up again: held are the saves the peers held before, and
// before the newest save when the transfer began. The writer keeps the
// half being sent, so a single save during a transfer overwrites the
// newest step the peers hold; unless the other one waits for a persist,
// from then until m lands no step is held both by this node's rank and by
// its peers, and a node lost meanwhile resumes from an older step, mostly
// from disk. A transfer that lands after the steps the peers held are
// gone is what is said.
func (o *Owner) noteLag(seg *segment, m layout.StepMeta, held sentSeqs, before uint64, took time.Duration) {
	shard := seg.hdr.Shard
	newest := seg.newestSeq()
	o.m.replicaBehind.WithLabelValues(strconv.Itoa(shard)).Set(float64(newest - min(newest, m.Seq)))
	if held[0] == 0 || held[0] >= m.Seq {
		return // the first step sent, or the same one again to new peers
	}
	kept := seg.holds(held[0]) || held[1] != 0 && seg.holds(held[1])
	_, was := o.lagging.Load(shard)
	switch {
	case !kept && !was:
		o.lagging.Store(shard, true)
		o.log.Warn("ckpt: replicas cannot keep up with the saves: the trainer saved over the step its peers held before a newer one reached them, so meanwhile no step was held both here and by the peers, and a node lost then resumes from an older step, mostly from disk; save to memory less often than a transfer takes, or give the link more bandwidth",
			"shard", shard, "step", m.Step, "bytes", m.DataSize(), "transfer", took.Round(time.Millisecond), "saves_meanwhile", newest-min(newest, before))
	case kept && was:
		o.lagging.Delete(shard)
		o.log.Info("ckpt: replicas keep up with the saves again", "shard", shard, "step", m.Step, "transfer", took.Round(time.Millisecond))
	}
}

// sentSeqs are the two newest saves of a shard that peers took, newest
// first, 0 for none: what a peer's replica segment holds, a half each.
type sentSeqs [2]uint64

func (o *Owner) sentSeqs(shard int) sentSeqs {
	last, _ := o.sent.Load(shard)
	s, _ := last.(sentSeqs)
	return s
}

// noteSent remembers that a peer took shard's save seq.
func (o *Owner) noteSent(shard int, seq uint64) {
	for {
		last, loaded := o.sent.LoadOrStore(shard, sentSeqs{seq})
		if !loaded {
			return
		}
		s := last.(sentSeqs)
		if s[0] >= seq || o.sent.CompareAndSwap(shard, last, sentSeqs{seq, s[0]}) {
			return
		}
	}
}

// exchange dials a replica server, runs the handshake for q and then f,
// with a connection that ctx closes.
func (o *Owner) exchange(ctx context.Context, addr string, q replicaReq, f func(*bufio.Reader, *bufio.Writer) error) error {
	d := net.Dialer{Timeout: o.cfg.IOTimeout}
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	defer conn.Close()
	if q.op == opPut {
		markBulk(conn) // a recovery's fetch is not: the job waits for it
	}
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	c := deadlineConn{conn, o.cfg.IOTimeout}
	br, bw := bufio.NewReaderSize(c, 1<<20), bufio.NewWriterSize(c, 1<<20)
	if err := clientHandshake(br, bw, o.cfg.ReplicaKey, q); err != nil {
		return err
	}
	return f(br, bw)
}

// putReplica sends half i of seg, which holds step, to the replica server
// at addr, and returns the blob bytes sent.
func (o *Owner) putReplica(ctx context.Context, addr string, seg *segment, i int, step int64) (int64, error) {
	var sent int64
	err := o.exchange(ctx, addr, replicaReq{op: opPut, shard: seg.hdr.Shard, step: step}, func(br *bufio.Reader, bw *bufio.Writer) error {
		_, n, err := sendStep(bw, seg, i, step, true)
		sent = n
		if err == nil {
			err = bw.Flush()
		}
		if errors.Is(err, ErrSuperseded) {
			return err // the unfinished frame tells the peer to drop it
		}
		if err != nil {
			// The peer may have stopped reading to say why.
			var pe *peerError
			if _, merr := readMsg(br, 0); errors.As(merr, &pe) {
				return merr
			}
			return err
		}
		_, err = readMsg(br, 0)
		return err
	})
	return sent, err
}

// getReplica asks the replica server at addr for its copy of shard at
// step (-1: the newest) and writes it into the segment open returns.
func (o *Owner) getReplica(ctx context.Context, addr string, shard int, step int64, open func(need int64) (*segment, error)) (layout.StepMeta, error) {
	var m layout.StepMeta
	err := o.exchange(ctx, addr, replicaReq{op: opGet, shard: shard, step: step}, func(br *bufio.Reader, _ *bufio.Writer) error {
		var err error
		m, _, _, err = recvStep(br, step, open)
		return err
	})
	return m, err
}

// serve accepts peers until the listener closes.
func (o *Owner) serve(ctx context.Context, wg *sync.WaitGroup) {
	for {
		conn, err := o.ln.Accept()
		if err != nil {
			return
		}
		o.mu.Lock()
		o.conns[conn] = true
		o.mu.Unlock()
		// Run's end and Close close the registered connections after they
		// mark themselves: one registered too late for them is closed here.
		select {
		case <-ctx.Done():
			conn.Close()
		case <-o.closing:
			conn.Close()
		default:
		}
		wg.Go(func() {
			defer func() {
				o.mu.Lock()
				delete(o.conns, conn)
				o.mu.Unlock()
				conn.Close()
			}()
			switch err := o.handle(conn); {
			case errors.Is(err, ErrRefused):
				o.log.Warn("ckpt: replica transfer refused", "peer", conn.RemoteAddr().String(), "err", err)
			case err != nil:
				o.log.Warn("ckpt: replica transfer failed", "peer", conn.RemoteAddr().String(), "err", err)
			}
		})
	}
}

func (o *Owner) closeConns() {
	o.mu.Lock()
	defer o.mu.Unlock()
	for c := range o.conns {
		c.Close()
	}
}

// handle serves one replica request. The handshake comes first, holding
// nothing, so that a client that stalls or fails it keeps no other
// transfer waiting.
func (o *Owner) handle(conn net.Conn) (err error) {
	defer recoverFault(&err, debug.SetPanicOnFault(true))
	c := deadlineConn{conn, o.cfg.IOTimeout}
	q, refuse, err := serverHandshake(c, o.cfg.ReplicaKey)
	if errors.Is(err, ErrRefused) {
		o.m.replicaRefused.Inc()
	}
	if refuse != nil {
		refuse()
	}
	if err != nil {
		return err
	}
	if err := o.acquire(); err != nil {
		writeMsg(c, statusError, []byte(err.Error()))
		return err
	}
	defer o.ops.RUnlock()
	if q.op == opGet {
		if seg, ok := o.segs[q.shard]; ok {
			return o.serveOwn(c, seg, q)
		}
		return o.serveCopy(c, q)
	}
	m, err := o.takeReplica(conn, c, q)
	if err != nil {
		o.m.replicaFailures.Inc()
		if errors.Is(err, layout.ErrCorrupt) {
			o.m.crcFailures.Inc()
		}
		err = fmt.Errorf("receive shard %d step %d: %w", q.shard, q.step, err)
		writeMsg(c, statusError, []byte(err.Error()))
		return err
	}
	o.m.replicaBytes.WithLabelValues("received").Add(float64(m.DataSize()))
	o.log.Debug("ckpt: replica received", "shard", q.shard, "step", m.Step, "bytes", m.DataSize())
	return writeMsg(c, statusOK, nil)
}

// takeReplica takes the copy a peer puts, holding the slot until it is
// written and no longer: the peer is answered once the slot is free, so
// a restore that follows the put's return finds it free and removes the
// copy then (dropReplica), rather than leave that to the put.
func (o *Owner) takeReplica(conn net.Conn, c io.ReadWriter, q replicaReq) (layout.StepMeta, error) {
	slot := o.replicaSlot(q.shard)
	slot.mu.Lock()
	defer o.unlockSlot(slot, q.shard)
	markBulk(conn)
	if err := writeMsg(c, statusOK, nil); err != nil {
		return layout.StepMeta{}, err
	}
	return o.receiveReplica(bufio.NewReaderSize(c, 1<<20), slot, q)
}

// serveCopy answers a get of a peer's shard from the copy held here.
func (o *Owner) serveCopy(c io.Writer, q replicaReq) error {
	seg, i, err := o.openCopy(q.shard, q.step)
	if err != nil {
		writeMsg(c, statusError, []byte(err.Error()))
		return err
	}
	defer seg.close()
	return o.serveHalf(c, seg, i, q, false)
}

// serveHalf answers a get with half i of seg, which holds the step asked
// for; yield as sendStep's.
func (o *Owner) serveHalf(c io.Writer, seg *segment, i int, q replicaReq, yield bool) error {
	if err := writeMsg(c, statusOK, nil); err != nil {
		return err
	}
	bw := bufio.NewWriterSize(c, 1<<20)
	_, n, err := sendStep(bw, seg, i, q.step, yield)
	if err == nil {
		err = bw.Flush()
	}
	o.m.replicaBytes.WithLabelValues("sent").Add(float64(n))
	if err != nil {
		return fmt.Errorf("%s: send: %w", q, err)
	}
	return nil
}

// serveOwn answers a get of a shard this owner holds, from its own
// segment: a peer whose shard goes on from this one's state (Adopt) asks
// for it so. The half is sealed first if need be, and a save that takes
// it meanwhile ends the transfer, which the peer then gives up
// (ErrSuperseded).
func (o *Owner) serveOwn(c io.ReadWriter, seg *segment, q replicaReq) error {
	i := -1
	held, _ := o.intactHalves(q.shard)
	for _, h := range held {
		if q.step < 0 || h.Step == q.step {
			i = h.Half
			break
		}
	}
	if i < 0 {
		err := fmt.Errorf("%w of shard %d at step %d here: its segment holds %v", errNoReplica, q.shard, q.step, held)
		writeMsg(c, statusError, []byte(err.Error()))
		return err
	}
	if err := o.sealHalf(context.Background(), seg, i, nil); err != nil {
		writeMsg(c, statusError, []byte(err.Error()))
		return err
	}
	return o.serveHalf(c, seg, i, q, true)
}

type replicaSlot struct {
	mu   sync.Mutex // one transfer at a time
	seg  *segment
	drop atomic.Bool // the copy is to be removed: its shard is local now
}

// unlockSlot unlocks slot, removing the copy of shard when that was asked
// for while the slot was held.
func (o *Owner) unlockSlot(slot *replicaSlot, shard int) {
	slot.mu.Unlock()
	if slot.drop.Load() {
		o.dropReplica(shard)
	}
}

func (o *Owner) replicaSlot(shard int) *replicaSlot {
	o.mu.Lock()
	defer o.mu.Unlock()
	s := o.replicas[shard]
	if s == nil {
		s = &replicaSlot{}
		o.replicas[shard] = s
	}
	return s
}

// dropReplica removes the copy of shard held here, or has the transfer
// that holds the slot remove it as it ends: a restore does not wait on
// a put (see openCopy).
func (o *Owner) dropReplica(shard int) {
	slot := o.replicaSlot(shard)
	slot.drop.Store(true)
	if !slot.mu.TryLock() {
		return
	}
	defer slot.mu.Unlock()
	if !slot.drop.Swap(false) {
		return
	}
	if slot.seg != nil {
		slot.seg.close()
		slot.seg = nil
	}
	if err := os.Remove(ReplicaPath(o.cfg.ShmDir, o.cfg.Name, shard)); err != nil && !errors.Is(err, os.ErrNotExist) {
		o.log.Warn("ckpt: a replica of a shard now local not removed", "shard", shard, "err", err)
	}
}

// replicaSeg returns the segment holding the copy of a peer's shard, or
// an error wrapping errNoReplica.
func (o *Owner) replicaSeg(slot *replicaSlot, shard int) (*segment, error) {
	if slot.seg != nil {
		return slot.seg, nil
	}
	seg, err := openSegment(ReplicaPath(o.cfg.ShmDir, o.cfg.Name, shard), false)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%w of shard %d here", errNoReplica, shard)
	}
	if err != nil {
		return nil, err
	}
	if err := seg.writable(); err != nil {
		// A copy an earlier release received: the next one replaces it.
		seg.close()
		return nil, fmt.Errorf("%w of shard %d here: %w", errNoReplica, shard, err)
	}
	slot.seg = seg
	return seg, nil
}

// intactReplica returns the segment and half of the newest copy of shard
// at step (-1: any) whose every CRC holds, or an error wrapping
// errNoReplica that says why there is none.
func (o *Owner) intactReplica(slot *replicaSlot, shard int, step int64) (*segment, int, error) {
	seg, err := o.replicaSeg(slot, shard)
	if err != nil {
		return nil, 0, err
	}
	i, err := o.intactHalf(seg, shard, step)
	if err != nil {
		return nil, 0, err
	}
	return seg, i, nil
}

// openCopy is intactReplica through a read-only mapping of the copy of
// its own, which the caller closes, rather than the slot's: a reader
// takes no transfer's turn, so a restore never waits on a put (one from
// a node cut off mid-transfer, say, holds its slot until its I/O
// timeout). A put meanwhile writes the half not holding the newest step
// (segment.begin), or over the half read, which the reader sees
// (ErrSuperseded): a read-only mapping pins nothing, so no reader keeps
// a put out, nor leaves a pin behind when it dies. A larger copy that
// replaces the file leaves this mapping whole.
func (o *Owner) openCopy(shard int, step int64) (*segment, int, error) {
	seg, err := openCopyFile(ReplicaPath(o.cfg.ShmDir, o.cfg.Name, shard), shard)
	if errors.Is(err, os.ErrNotExist) {
		return nil, 0, fmt.Errorf("%w of shard %d here", errNoReplica, shard)
	}
	if errors.Is(err, errNotCopy) {
		return nil, 0, fmt.Errorf("%w of shard %d here: %w", errNoReplica, shard, err)
	}
	if err != nil {
		return nil, 0, err
	}
	i, err := o.intactHalf(seg, shard, step)
	if err != nil {
		seg.close()
		return nil, 0, err
	}
	return seg, i, nil
}

// errNotCopy is the error of a file at a copy's path that holds no copy
// of its shard.
var errNotCopy = errors.New("another file at the copy's path")

// openCopyFile maps the copy of shard at path read-only, an error
// wrapping errNotCopy when the file holds another shard, or no copy.
func openCopyFile(path string, shard int) (*segment, error) {
	seg, err := openSegment(path, true)
	if err != nil {
		return nil, err
	}
	if seg.hdr.Shard != shard || seg.hdr.Flags&layout.FlagReplica == 0 {
		seg.close()
		return nil, fmt.Errorf("%w: %s holds shard %d with flags %d", errNotCopy, path, seg.hdr.Shard, seg.hdr.Flags)
	}
	return seg, nil
}

// intactHalf returns the half of seg that holds shard's newest step at
// step (-1: any) whose every CRC holds, or an error wrapping errNoReplica
// that says why there is none.
func (o *Owner) intactHalf(seg *segment, shard int, step int64) (int, error) {
	var held []int64
	var why []error
	for _, i := range seg.newest() {
		m, ok := seg.metaOK(i)
		if !ok {
			continue
		}
		if err := o.replicaIntact(seg, shard, i, m); err != nil {
			why = append(why, err)
			continue
		}
		if step < 0 || m.Step == step {
			return i, nil
		}
		held = append(held, m.Step)
	}
	at := ""
	if step >= 0 {
		at = fmt.Sprintf(" at step %d", step)
	}
	if len(why) == 0 {
		return 0, fmt.Errorf("%w of shard %d%s here (intact: steps %v)", errNoReplica, shard, at, held)
	}
	return 0, fmt.Errorf("%w of shard %d%s here (intact: steps %v): %w", errNoReplica, shard, at, held, errors.Join(why...))
}

// replicaIntact checks every CRC of half i of seg, a copy of shard whose
// meta is m, once per save: a half received here was checked as it
// arrived, and one that verified is not read again until it changes.
func (o *Owner) replicaIntact(seg *segment, shard, i int, m layout.StepMeta) error {
	key, version := halfKey{shard, i, true}, halfVersion{seg.gen(i), m.Seq, seg.ino}
	if v, ok := o.verified.Load(key); ok && v == version {
		return nil
	}
	if err := verifyHalf(seg, i); err != nil {
		if errors.Is(err, layout.ErrCorrupt) {
			o.m.crcFailures.Inc()
		}
		return fmt.Errorf("step %d: %w", m.Step, err)
	}
	o.verified.Store(key, version)
	return nil
}

// receiveReplica receives a peer's shard into its replica segment. A step
// that does not fit goes into a new, larger segment that replaces the old
// one only once the step is complete, so a transfer cut short never costs
// the previous copy.
func (o *Owner) receiveReplica(r io.Reader, slot *replicaSlot, q replicaReq) (layout.StepMeta, error) {
	shard := q.shard
	path := ReplicaPath(o.cfg.ShmDir, o.cfg.Name, shard)
	next := path + ".next"
	var fresh *segment
	m, seg, half, err := recvStep(r, q.step, func(need int64) (*segment, error) {
		seg, err := o.replicaSeg(slot, shard)
		if err == nil && seg.hdr.HalfSize >= need {
			return seg, nil
		}
		if err != nil && !errors.Is(err, errNoReplica) {
			o.log.Warn("ckpt: replacing unreadable replica segment", "path", path, "err", err)
		}
		os.Remove(next) // a leftover of an earlier cut transfer
		fresh, err = createSegment(next, shard, layout.FlagReplica, max(need, o.cfg.Capacity))
		return fresh, err
	})
	if fresh != nil {
		if err == nil {
			err = os.Rename(next, path)
		}
		if err != nil {
			fresh.close()
			os.Remove(next)
			return m, err
		}
		if slot.seg != nil {
			slot.seg.close()
		}
		fresh.path = path
		slot.seg = fresh
	}
	if err != nil {
		return m, err
	}
	// Checked as it arrived: no need to read it again.
	o.verified.Store(halfKey{shard, half, true}, halfVersion{seg.gen(half), m.Seq, seg.ino})
	return m, nil
}

// Replicas returns, by shard, the steps of peers' shards that this owner
// holds intact in ShmDir under its Name, newest first, and why each
// other copy found is not intact: what a node agent tells the job's
// manager so that it knows which node can serve which shard's step. Each
// half's CRCs are checked once per save (a copy received was checked as it
// arrived), as Held does for local shards; a half being received is
// passed over.
func (o *Owner) Replicas() (held map[int][]int64, why []error, err error) {
	if err := o.acquire(); err != nil {
		return nil, nil, err
	}
	defer o.ops.RUnlock()
	defer recoverFault(&err, debug.SetPanicOnFault(true))
	prefix := filepath.Base(ReplicaPath(o.cfg.ShmDir, o.cfg.Name, 0))
	prefix = prefix[:len(prefix)-1]
	names, err := filepath.Glob(filepath.Join(o.cfg.ShmDir, prefix+"*"))
	if err != nil {
		return nil, nil, err
	}
	held = map[int][]int64{}
	for _, name := range names {
		shard, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(name), prefix))
		if err != nil || shard < 0 || ReplicaPath(o.cfg.ShmDir, o.cfg.Name, shard) != name {
			continue // a larger copy being received (.next)
		}
		steps, whyNot := o.replicaSteps(name, shard)
		why = append(why, whyNot...)
		if len(steps) > 0 {
			held[shard] = steps
		}
	}
	return held, why, nil
}

// replicaSteps returns the steps the replica segment at path holds
// intact, newest first, and why its other halves hold none.
func (o *Owner) replicaSteps(path string, shard int) (steps []int64, why []error) {
	// A mapping of its own: a transfer may replace the slot's meanwhile.
	seg, err := openCopyFile(path, shard)
	if err != nil {
		return nil, []error{fmt.Errorf("replica of shard %d: %w", shard, err)}
	}
	defer seg.close()
	for _, i := range seg.newest() {
		m, ok := seg.metaOK(i)
		if !ok {
			continue
		}
		err := o.replicaIntact(seg, shard, i, m)
		switch {
		case errors.Is(err, ErrSuperseded):
		case err != nil:
			why = append(why, fmt.Errorf("replica of shard %d: %w", shard, err))
		default:
			steps = append(steps, m.Step)
		}
	}
	for i := range 2 {
		if st := seg.state(i); st != layout.StateEmpty && st != layout.StateWriting {
			if err := seg.whyNot(i); err != nil {
				why = append(why, fmt.Errorf("replica of shard %d: %w", shard, err))
			}
		}
	}
	return steps, why
}

// PersistReplica persists, into OwnerConfig.Dir, the copy of a peer's
// shard at step that this owner holds, every CRC checked first, and tells
// the committer as PersistStep does: what a node does with the replicas it
// keeps when the job cannot go on without the peer's node, so that the
// next run resumes from that step. It returns an error wrapping ErrNoStep
// when no intact copy of the step is held here.
func (o *Owner) PersistReplica(ctx context.Context, shard int, step int64) (man layout.ShardManifest, err error) {
	defer recoverFault(&err, debug.SetPanicOnFault(true))
	if o.cfg.Dir == "" {
		return layout.ShardManifest{}, errors.New("ckpt: persist a replica: OwnerConfig.Dir is empty")
	}
	if err := o.acquire(); err != nil {
		return layout.ShardManifest{}, err
	}
	defer o.ops.RUnlock()
	slot := o.replicaSlot(shard)
	slot.mu.Lock()
	defer o.unlockSlot(slot, shard)
	seg, i, err := o.intactReplica(slot, shard, step)
	if err != nil {
		return layout.ShardManifest{}, fmt.Errorf("ckpt: persist the replica of shard %d: %w: %w", shard, ErrNoStep, err)
	}
	if man, _, err = persistHalf(ctx, seg, i, o.cfg.Dir, o.cfg.NumShards); err != nil {
		return layout.ShardManifest{}, fmt.Errorf("ckpt: persist the replica of shard %d at step %d: %w", shard, step, err)
	}
	o.log.Info("ckpt: replica persisted", "shard", shard, "step", man.Step, "bytes", man.Size)
	if o.committer != nil {
		if err := o.committer.ShardDurable(ctx, man); err != nil {
			return man, fmt.Errorf("ckpt: commit step %d: %w", man.Step, err)
		}
	}
	return man, nil
}
