package ckpt

import (
	"bufio"
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"net"
	"os"
	"runtime/debug"
	"slices"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// The replica protocol, over one TCP connection per transfer, little-endian:
//
//	request:  "FLRP" u8 version=2, u8 op (1 put, 2 get), u16 0,
//	          u32 shard, u32 meta length (put) or 0, i64 step (get: -1 newest)
//	put:      then the sealed StepMeta bytes (MarshalBinary) and each blob's bytes
//	          in table order
//	response: u8 status (0 ok, 1 error), 3 bytes 0, u32 length, then the
//	          error text, or for a get the StepMeta bytes and the blob bytes
//
// Both sides check the meta checksum and every blob's CRC32C as the bytes
// arrive, and write into the inactive half of a segment, so a transfer cut
// short leaves the previous copy intact.
const (
	replicaMagic   = "FLRP"
	replicaVersion = 2 // 1 sent the layout.StepMeta of segment layout version 1
	opPut          = 1
	opGet          = 2
	reqSize        = 24
	respSize       = 8
	maxMetaLen     = 64 << 20
)

type replicaReq struct {
	op      byte
	shard   int
	metaLen int
	step    int64
}

func (r replicaReq) marshal() []byte {
	b := make([]byte, reqSize)
	copy(b, replicaMagic)
	b[4], b[5] = replicaVersion, r.op
	binary.LittleEndian.PutUint32(b[8:], uint32(r.shard))
	binary.LittleEndian.PutUint32(b[12:], uint32(r.metaLen))
	binary.LittleEndian.PutUint64(b[16:], uint64(r.step))
	return b
}

func readReq(r io.Reader) (replicaReq, error) {
	b := make([]byte, reqSize)
	if _, err := io.ReadFull(r, b); err != nil {
		return replicaReq{}, err
	}
	if string(b[:4]) != replicaMagic || b[4] != replicaVersion || (b[5] != opPut && b[5] != opGet) {
		return replicaReq{}, formatErr(0, "request", "bad magic, version or op % x", b[:6])
	}
	q := replicaReq{op: b[5], shard: int(binary.LittleEndian.Uint32(b[8:])),
		metaLen: int(binary.LittleEndian.Uint32(b[12:])), step: int64(binary.LittleEndian.Uint64(b[16:]))}
	if q.metaLen > maxMetaLen || q.shard >= layout.MaxShards {
		return replicaReq{}, formatErr(8, "request", "shard %d or meta length %d out of range", q.shard, q.metaLen)
	}
	return q, nil
}

func writeResp(w io.Writer, err error, body []byte) error {
	b := make([]byte, respSize)
	if err != nil {
		b[0] = 1
		body = []byte(err.Error())
	}
	binary.LittleEndian.PutUint32(b[4:], uint32(len(body)))
	if _, err := w.Write(b); err != nil {
		return err
	}
	_, err = w.Write(body)
	return err
}

// errPeer is an error the peer reported.
type errPeer struct{ msg string }

func (e *errPeer) Error() string { return "peer: " + e.msg }

// readResp reads a response header; for an error it reads the text too.
func readResp(r io.Reader) (int, error) {
	b := make([]byte, respSize)
	if _, err := io.ReadFull(r, b); err != nil {
		return 0, err
	}
	n := binary.LittleEndian.Uint32(b[4:])
	if n > maxMetaLen {
		return 0, formatErr(4, "response length", "value %d out of range", n)
	}
	if b[0] != 0 {
		msg := make([]byte, n)
		if _, err := io.ReadFull(r, msg); err != nil {
			return 0, err
		}
		return 0, &errPeer{string(msg)}
	}
	return int(n), nil
}

// deadlineConn renews the connection's deadline before each read and
// write, so a transfer fails only when it stalls, however large it is.
type deadlineConn struct {
	net.Conn
	timeout time.Duration
}

func (c deadlineConn) Read(p []byte) (int, error) {
	c.Conn.SetReadDeadline(time.Now().Add(c.timeout))
	return c.Conn.Read(p)
}

func (c deadlineConn) Write(p []byte) (int, error) {
	c.Conn.SetWriteDeadline(time.Now().Add(c.timeout))
	return c.Conn.Write(p)
}

// sendHalf writes the meta and blobs of the sealed half i of seg to w,
// pinned, and verifies the CRCs of what it sent. head, if not nil, is
// written first with the meta length.
func sendHalf(w io.Writer, seg *segment, i int, head func(metaLen int) []byte) (layout.StepMeta, int64, error) {
	var sent int64
	var meta layout.StepMeta
	err := seg.read(i, true, func(m layout.StepMeta, half []byte, valid func() error) error {
		if !m.Sealed {
			return fmt.Errorf("ckpt: step %d in %s half %d is not sealed", m.Step, seg.path, i)
		}
		meta = m
		mb, err := m.MarshalBinary()
		if err != nil {
			return err
		}
		if _, err := w.Write(append(head(len(mb)), mb...)); err != nil {
			return err
		}
		for k, e := range m.Blobs {
			data := half[e.Offset : e.Offset+e.Size]
			var c uint32
			for o := 0; o < len(data); o += persistChunk {
				chunk := data[o:min(o+persistChunk, len(data))]
				c = crc32.Update(c, castagnoli, chunk)
				if _, err := w.Write(chunk); err != nil {
					return err
				}
				sent += int64(len(chunk))
			}
			if c != e.CRC32C {
				return crcMismatch(k, e, c)
			}
		}
		return valid()
	})
	return meta, sent, err
}

// recvHalf reads a sealed meta of metaLen bytes and its blobs from r into
// a new save of the segment that open returns (given the half size the
// step needs), checking every CRC before the save completes, which it
// writes sealed.
func recvHalf(r io.Reader, metaLen int, open func(need int64) (*segment, error)) (layout.StepMeta, error) {
	if metaLen < layout.StepHeaderSize {
		return layout.StepMeta{}, formatErr(12, "meta length", "value %d is shorter than a step header", metaLen)
	}
	mb := make([]byte, metaLen)
	if _, err := io.ReadFull(r, mb); err != nil {
		return layout.StepMeta{}, fmt.Errorf("read meta: %w", err)
	}
	m, err := layout.ParseStepMeta(mb, layout.MaxHalfSize)
	if err != nil {
		return layout.StepMeta{}, err
	}
	if int(m.MetaSize()) != metaLen {
		return layout.StepMeta{}, formatErr(44, "table_size", "meta of %d bytes holds a table of %d and %d blobs", metaLen, m.TableSize(), len(m.Blobs))
	}
	if !m.Sealed {
		return layout.StepMeta{}, formatErr(layout.OffSeal, "seal", "the peer sent an unsealed step, whose CRCs are unknown")
	}
	seg, err := open(m.End())
	if err != nil {
		return layout.StepMeta{}, err
	}
	hw, err := seg.begin(m)
	if err != nil {
		return layout.StepMeta{}, err
	}
	crcs := make([]uint32, len(m.Blobs))
	for k := range m.Blobs {
		dst := hw.blob(k)
		for o := 0; o < len(dst); o += fuseChunk {
			e := min(o+fuseChunk, len(dst))
			if _, err := io.ReadFull(r, dst[o:e]); err != nil {
				return layout.StepMeta{}, fmt.Errorf("blob %q at byte %d of %d: %w", m.Blobs[k].Name, o, len(dst), err)
			}
			crcs[k] = crc32.Update(crcs[k], castagnoli, dst[o:e])
		}
		if crcs[k] != m.Blobs[k].CRC32C {
			return layout.StepMeta{}, crcMismatch(k, m.Blobs[k], crcs[k])
		}
	}
	return m, hw.commit(crcs)
}

// putReplica sends half i of seg to the replica server at addr.
func putReplica(conn net.Conn, seg *segment, i int, timeout time.Duration) (layout.StepMeta, int64, error) {
	c := deadlineConn{conn, timeout}
	bw := bufio.NewWriterSize(c, 1<<20)
	m, n, err := sendHalf(bw, seg, i, func(metaLen int) []byte {
		return replicaReq{op: opPut, shard: seg.hdr.Shard, metaLen: metaLen}.marshal()
	})
	if err == nil {
		err = bw.Flush()
	}
	if err != nil {
		return m, n, err
	}
	if _, err := readResp(bufio.NewReader(c)); err != nil {
		return m, n, err
	}
	return m, n, nil
}

// getReplica asks the server at conn for its copy of shard at step (-1:
// newest) and writes it into the segment open returns.
func getReplica(conn net.Conn, shard int, step int64, timeout time.Duration, open func(need int64) (*segment, error)) (layout.StepMeta, error) {
	c := deadlineConn{conn, timeout}
	if _, err := c.Write(replicaReq{op: opGet, shard: shard, step: step}.marshal()); err != nil {
		return layout.StepMeta{}, err
	}
	br := bufio.NewReaderSize(c, 1<<20)
	n, err := readResp(br)
	if err != nil {
		return layout.StepMeta{}, err
	}
	m, err := recvHalf(br, n, open)
	if err != nil {
		return layout.StepMeta{}, err
	}
	if m.Step != step && step >= 0 {
		return layout.StepMeta{}, fmt.Errorf("peer sent step %d, asked for %d", m.Step, step)
	}
	return m, nil
}

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

type replicaSlot struct {
	mu  sync.Mutex // one transfer at a time
	seg *segment
}

// replicaTargets are the peers that receive this node's saves.
func (o *Owner) replicaTargets() []string {
	return o.peers[:min(max(o.cfg.Replicas, 0), len(o.peers))]
}

// Replicate copies shard's newest step to its peers (PickPeers), sealing
// it first if need be. It returns the errors of the peers that did not
// take it.
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
	peers := o.replicaTargets()
	if len(peers) == 0 {
		return errors.New("ckpt: replicate: no peers")
	}
	c := seg.newest()
	if len(c) == 0 {
		return fmt.Errorf("%w in memory to replicate shard %d", ErrNoStep, shard)
	}
	ctx, span := o.tracer.Start(ctx, "ckpt.Replicate", trace.WithAttributes(attribute.Int("ckpt.shard", shard)))
	defer span.End()
	if err := o.sealHalf(ctx, seg, c[0], nil); err != nil {
		return err
	}
	var errs []error
	for _, p := range peers {
		m, n, err := o.withConn(ctx, o.cfg.Peers[p], func(conn net.Conn) (layout.StepMeta, int64, error) {
			return putReplica(conn, seg, c[0], o.cfg.IOTimeout)
		})
		o.m.replicaBytes.WithLabelValues("sent").Add(float64(n))
		if err != nil {
			o.m.replicaFailures.Inc()
			errs = append(errs, fmt.Errorf("peer %s (%s): %w", p, o.cfg.Peers[p], err))
			continue
		}
		o.log.Debug("ckpt: replica sent", "shard", shard, "step", m.Step, "peer", p, "bytes", n)
	}
	if err := errors.Join(errs...); err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
		return fmt.Errorf("ckpt: replicate shard %d: %w", shard, err)
	}
	return nil
}

// withConn dials addr and runs f with a connection that ctx closes.
func (o *Owner) withConn(ctx context.Context, addr string, f func(net.Conn) (layout.StepMeta, int64, error)) (layout.StepMeta, int64, error) {
	var d net.Dialer
	d.Timeout = o.cfg.IOTimeout
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return layout.StepMeta{}, 0, err
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	return f(conn)
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
			if err := o.handle(conn); err != nil {
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

// handle serves one replica request.
func (o *Owner) handle(conn net.Conn) (err error) {
	defer recoverFault(&err, debug.SetPanicOnFault(true))
	if err := o.acquire(); err != nil {
		return err
	}
	defer o.ops.RUnlock()
	c := deadlineConn{conn, o.cfg.IOTimeout}
	br := bufio.NewReaderSize(c, 1<<20)
	q, err := readReq(br)
	if err != nil {
		return err
	}
	slot := o.replicaSlot(q.shard)
	slot.mu.Lock()
	defer slot.mu.Unlock()
	switch q.op {
	case opPut:
		m, err := o.receiveReplica(br, slot, q.shard, q.metaLen)
		if err != nil {
			o.m.replicaFailures.Inc()
			if errors.Is(err, layout.ErrCorrupt) {
				o.m.crcFailures.Inc()
			}
			writeResp(c, err, nil)
			return fmt.Errorf("receive shard %d: %w", q.shard, err)
		}
		o.m.replicaBytes.WithLabelValues("received").Add(float64(m.DataSize()))
		o.log.Debug("ckpt: replica received", "shard", q.shard, "step", m.Step, "bytes", m.DataSize())
		return writeResp(c, nil, nil)
	default: // opGet
		seg, err := o.replicaSeg(slot, q.shard)
		if err != nil {
			writeResp(c, err, nil)
			return err
		}
		for _, i := range seg.newest() {
			if m, ok := seg.metaOK(i); !ok || (q.step >= 0 && m.Step != q.step) {
				continue
			}
			bw := bufio.NewWriterSize(c, 1<<20)
			_, n, err := sendHalf(bw, seg, i, func(metaLen int) []byte {
				h := make([]byte, respSize)
				binary.LittleEndian.PutUint32(h[4:], uint32(metaLen))
				return h
			})
			if err == nil {
				err = bw.Flush()
			}
			o.m.replicaBytes.WithLabelValues("sent").Add(float64(n))
			return err
		}
		err = fmt.Errorf("%w of shard %d %s", errNoReplica, q.shard, stepDesc(q.step))
		writeResp(c, err, nil)
		return err
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

// receiveReplica receives a peer's shard into its replica segment. A step
// that does not fit goes into a new, larger segment that replaces the old
// one only once the step is complete, so a transfer cut short never costs
// the previous copy.
func (o *Owner) receiveReplica(r io.Reader, slot *replicaSlot, shard, metaLen int) (layout.StepMeta, error) {
	path := ReplicaPath(o.cfg.ShmDir, o.cfg.Name, shard)
	next := path + ".next"
	var fresh *segment
	m, err := recvHalf(r, metaLen, func(need int64) (*segment, error) {
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
	if fresh == nil {
		return m, err
	}
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
	return m, nil
}
