package ckpt

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// The replica protocol, version 3: one TCP connection per transfer,
// integers little-endian.
//
//	request    "FLRP" u8 version=3, u8 op (1 put, 2 get), u16 flags (bit 0:
//	           the client holds a replica key; others 0), u32 shard, u32 0,
//	           i64 step (put: the step sent; get: the step wanted, -1 the
//	           newest), then the client's nonce: 32 random bytes
//	challenge  a message whose body is the server's nonce (32 random bytes)
//	           and its proof: HMAC-SHA256(key, "FLRP3 server" || request ||
//	           client nonce || server nonce)
//	proof      32 bytes from the client: HMAC-SHA256(key, "FLRP3 client" ||
//	           request || client nonce || server nonce)
//	verdict    a message from the server: empty to go on, else the error
//	           (a proof that does not hold, no such replica)
//	put        the client sends a step frame; the server answers with a
//	           message, empty or the error
//	get        the server sends a step frame: of the shard's own segment
//	           when the shard is one of its own (a peer that adopts its
//	           state), else of the replica of the shard it holds
//
//	message    u8 status (0 ok, 1 error, 2 refused: another key or
//	           version), 3 bytes 0, u32 length, then the body or the
//	           error's text
//	step frame u32 meta length, the sealed StepMeta (MarshalBinary), each
//	           blob's bytes in table order, then u8 1: the sender read every
//	           byte from a half that no writer touched meanwhile
//
// The client checks the server's proof before it sends its own, and the
// server checks the client's before it reads or sends a shard byte, each
// over the other's fresh nonce: neither a stranger nor a recorded
// transfer played again reads or writes a shard. The key is
// OwnerConfig.ReplicaKey; without one on both sides the proofs are HMACs
// with an empty key, which anyone can compute. A server refuses a request
// of version 2 (which had no handshake) with a message of status 2
// naming both versions, and a server of version 2 closes the connection
// on a request of version 3, which the client reports as such.
//
// The receiver checks the meta checksum and every blob's CRC32C as the
// bytes arrive (the sender checks the meta and that no writer touched the
// half), and writes into the inactive half of a segment, committing the
// save only after the frame's last byte: a transfer cut short, or one
// whose sender gave it up (a trainer saved over the half being sent),
// leaves the previous copy intact.
const (
	replicaMagic   = "FLRP"
	replicaVersion = 3 // 2 had no handshake; 1 sent the StepMeta of segment layout version 1
	opPut          = 1
	opGet          = 2
	flagKey        = 1 // request flags: the client holds a replica key
	reqSize        = 24
	nonceSize      = 32
	proofSize      = sha256.Size
	msgSize        = 8
	maxMetaLen     = 64 << 20
	maxErrLen      = 64 << 10
	stepEnd        = 1 // the last byte of a step frame: commit

	statusOK      = 0
	statusError   = 1
	statusRefused = 2
)

// ErrRefused is returned by a replica transfer that the peer refused, or
// that this owner refused to make, before any shard byte moved: the two do
// not hold the same OwnerConfig.ReplicaKey, or do not speak one protocol
// version.
var ErrRefused = errors.New("ckpt: replica transfer refused")

type replicaReq struct {
	op    byte
	flags uint16
	shard int
	step  int64
}

func (r replicaReq) marshal() []byte {
	b := make([]byte, reqSize)
	copy(b, replicaMagic)
	b[4], b[5] = replicaVersion, r.op
	binary.LittleEndian.PutUint16(b[6:], r.flags)
	binary.LittleEndian.PutUint32(b[8:], uint32(r.shard))
	binary.LittleEndian.PutUint64(b[16:], uint64(r.step))
	return b
}

func (r replicaReq) String() string {
	op := "put"
	if r.op == opGet {
		op = "get"
	}
	if r.step < 0 {
		return fmt.Sprintf("%s of shard %d, newest step", op, r.shard)
	}
	return fmt.Sprintf("%s of shard %d step %d", op, r.shard, r.step)
}

// versionError is a request of another protocol version.
type versionError struct{ version byte }

func (e *versionError) Error() string {
	return fmt.Sprintf("replica protocol version %d is not spoken here: this owner speaks version %d, in which both sides prove they hold the replica key; run one release on every node",
		e.version, replicaVersion)
}

// parseRequest decodes the reqSize bytes of a request, nonce excluded.
// Every field is checked, so that marshal gives b back.
func parseRequest(b []byte) (replicaReq, error) {
	if len(b) != reqSize {
		return replicaReq{}, formatErr(0, "request", "%d bytes, want %d", len(b), reqSize)
	}
	if string(b[:4]) != replicaMagic {
		return replicaReq{}, formatErr(0, "magic", "%q is not %q: not a replica request", b[:4], replicaMagic)
	}
	if b[4] != replicaVersion {
		return replicaReq{}, &versionError{b[4]}
	}
	q := replicaReq{op: b[5], flags: binary.LittleEndian.Uint16(b[6:]),
		shard: int(binary.LittleEndian.Uint32(b[8:])), step: int64(binary.LittleEndian.Uint64(b[16:]))}
	switch {
	case q.op != opPut && q.op != opGet:
		return replicaReq{}, formatErr(5, "op", "value %d, want %d (put) or %d (get)", q.op, opPut, opGet)
	case q.flags&^flagKey != 0:
		return replicaReq{}, formatErr(6, "flags", "value %#x has unknown bits", q.flags)
	case q.shard >= layout.MaxShards:
		return replicaReq{}, formatErr(8, "shard", "value %d, want 0..%d", q.shard, layout.MaxShards-1)
	case binary.LittleEndian.Uint32(b[12:]) != 0:
		return replicaReq{}, formatErr(12, "reserved", "value %d, want 0", binary.LittleEndian.Uint32(b[12:]))
	case q.step < -1 || (q.op == opPut && q.step < 0):
		return replicaReq{}, formatErr(16, "step", "value %d out of range for a %s", q.step, q)
	}
	return q, nil
}

// writeMsg writes a message: status, and the body or an error's text.
func writeMsg(w io.Writer, status byte, body []byte) error {
	b := make([]byte, msgSize, msgSize+len(body))
	b[0] = status
	binary.LittleEndian.PutUint32(b[4:], uint32(len(body)))
	_, err := w.Write(append(b, body...))
	return err
}

// peerError is an error the peer sent.
type peerError struct {
	msg     string
	refused bool
}

func (e *peerError) Error() string { return "the peer says: " + e.msg }

// Is makes a refusal match ErrRefused.
func (e *peerError) Is(target error) bool { return e.refused && target == ErrRefused }

// readMsg reads a message whose body has at most max bytes and returns
// the body, or the peer's error.
func readMsg(r io.Reader, max int) ([]byte, error) {
	h := make([]byte, msgSize)
	if _, err := io.ReadFull(r, h); err != nil {
		return nil, err
	}
	n := int64(binary.LittleEndian.Uint32(h[4:]))
	switch {
	case h[1] != 0 || h[2] != 0 || h[3] != 0:
		return nil, formatErr(1, "message reserved bytes", "% x, want 0", h[1:4])
	case h[0] == statusOK && n > int64(max):
		return nil, formatErr(4, "message length", "value %d, want at most %d", n, max)
	case h[0] == statusOK:
		body := make([]byte, n)
		_, err := io.ReadFull(r, body)
		return body, err
	case h[0] != statusError && h[0] != statusRefused:
		return nil, formatErr(0, "message status", "value %d is no known status", h[0])
	case n > maxErrLen:
		return nil, formatErr(4, "message length", "error text of %d bytes, want at most %d", n, maxErrLen)
	}
	msg := make([]byte, n)
	if _, err := io.ReadFull(r, msg); err != nil {
		return nil, err
	}
	return nil, &peerError{msg: string(msg), refused: h[0] == statusRefused}
}

func newNonce() []byte {
	b := make([]byte, nonceSize)
	rand.Read(b) // never fails (crypto/rand)
	return b
}

// proof is the HMAC by which the side named label proves that it holds
// key, over the request and both nonces.
func proof(key []byte, label string, req, clientNonce, serverNonce []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(label))
	m.Write(req)
	m.Write(clientNonce)
	m.Write(serverNonce)
	return m.Sum(nil)
}

const (
	serverLabel = "FLRP3 server"
	clientLabel = "FLRP3 client"
)

// clientHandshake sends request q and proves, over the server's nonce,
// that it holds key, once the server proved it over the client's. w is
// flushed before each read; r may buffer, since the server sends nothing
// the client did not ask for.
func clientHandshake(r io.Reader, w interface {
	io.Writer
	Flush() error
}, key []byte, q replicaReq) error {
	if len(key) > 0 {
		q.flags |= flagKey
	}
	req := q.marshal()
	nc := newNonce()
	w.Write(req)
	w.Write(nc)
	if err := w.Flush(); err != nil {
		return err
	}
	body, err := readMsg(r, nonceSize+proofSize)
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) {
		return fmt.Errorf("%w: the peer closed the connection instead of answering a request of replica protocol version %d: it runs an older release (version 2, without authentication), or it is no replica server",
			ErrRefused, replicaVersion)
	}
	if err != nil {
		return err
	}
	if len(body) != nonceSize+proofSize {
		return formatErr(msgSize, "challenge", "%d bytes, want %d", len(body), nonceSize+proofSize)
	}
	ns, ps := body[:nonceSize], body[nonceSize:]
	if !hmac.Equal(ps, proof(key, serverLabel, req, nc, ns)) {
		return fmt.Errorf("%w: the peer did not prove that it holds this owner's replica key (it holds another key, or none; OwnerConfig.ReplicaKey)", ErrRefused)
	}
	w.Write(proof(key, clientLabel, req, nc, ns))
	if err := w.Flush(); err != nil {
		return err
	}
	_, err = readMsg(r, 0)
	return err
}

// serverHandshake reads a request from rw, sends its challenge and
// checks the client's proof. It returns the request, or why it refused
// it, wrapping ErrRefused when the client speaks another version or does
// not prove that it holds key; refuse then sends the verdict, and the
// caller counts it. It reads no byte past the proof.
func serverHandshake(rw io.ReadWriter, key []byte) (q replicaReq, refuse func() error, err error) {
	req := make([]byte, reqSize)
	if _, err := io.ReadFull(rw, req); err != nil {
		return q, nil, fmt.Errorf("read request: %w", err)
	}
	q, err = parseRequest(req)
	if err != nil {
		var ve *versionError
		if errors.As(err, &ve) {
			err = fmt.Errorf("%w: %w", ErrRefused, err)
		} else {
			err = fmt.Errorf("%w: bad request: %w", ErrRefused, err)
		}
		return q, func() error { return writeMsg(rw, statusRefused, []byte(err.Error())) }, err
	}
	nc := make([]byte, nonceSize)
	if _, err := io.ReadFull(rw, nc); err != nil {
		return q, nil, fmt.Errorf("read the nonce of a %s: %w", q, err)
	}
	// One side without a key fails the other's proof anyway: say so
	// plainly, to both, before the challenge.
	if clientKey := q.flags&flagKey != 0; clientKey != (len(key) > 0) {
		why := "the client holds no replica key, and this owner requires one (OwnerConfig.ReplicaKey)"
		if clientKey {
			why = "the client holds a replica key, and this owner none (OwnerConfig.ReplicaKey): give every node the same key"
		}
		err = fmt.Errorf("%w: %s: %s", ErrRefused, q, why)
		return q, func() error { return writeMsg(rw, statusRefused, []byte(err.Error())) }, err
	}
	ns := newNonce()
	if err := writeMsg(rw, statusOK, append(ns, proof(key, serverLabel, req, nc, ns)...)); err != nil {
		return q, nil, err
	}
	pc := make([]byte, proofSize)
	if _, err := io.ReadFull(rw, pc); err != nil {
		// Both hold a key or neither: the client found that this owner's
		// proof does not hold, which another key explains.
		return q, nil, fmt.Errorf("%w: %s: the client closed the connection after the challenge, before its proof: it holds another replica key (or it died): %w", ErrRefused, q, err)
	}
	if hmac.Equal(pc, proof(key, clientLabel, req, nc, ns)) {
		return q, nil, nil
	}
	why := "the client's proof does not hold: it holds another replica key, or plays a recorded transfer again"
	err = fmt.Errorf("%w: %s: %s", ErrRefused, q, why)
	return q, func() error { return writeMsg(rw, statusRefused, []byte(err.Error())) }, err
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

// yieldPoll is how often a replica sender looks whether it must give way
// to a writer.
const yieldPoll = time.Millisecond

// halfHold keeps writers off half i of seg while a step frame is sent
// from it, the pin of the read protocol (FORMAT). With yield (a trainer's
// segment), it gives way to the trainer: it holds the pin only while the
// other half is free, and lets it go while that one is held (a persist
// asked for or under way), so that a save finds a half to write instead
// of being skipped; it takes the pin again once the other half is free,
// if no writer took this one meanwhile. It looks at each chunk sent, and
// every yieldPoll besides, so that a stalled peer does not hold the pin.
// A writer that took the half makes the transfer ErrSuperseded. A
// read-only mapping (a copy's reader, openCopy) pins nothing: every
// writer may take its half.
type halfHold struct {
	seg   *segment
	i     int
	gen   uint64
	yield bool

	mu       sync.Mutex
	pinned   bool
	lost     bool
	stop     chan struct{}
	done     chan struct{}
	once     sync.Once
	released error // release's result
}

func holdHalf(seg *segment, i int, yield bool) (*halfHold, error) {
	h := &halfHold{seg: seg, i: i, yield: yield, stop: make(chan struct{}), done: make(chan struct{})}
	if !yield {
		h.pin() // before gen, as the read protocol has it
	}
	// gen before state: see segment.read.
	h.gen = seg.gen(i)
	if st := seg.state(i); st != layout.StateComplete {
		h.unpin()
		return nil, seg.notComplete(i, st)
	}
	if !yield {
		close(h.done)
		return h, nil
	}
	h.adjust()
	go func() {
		defer close(h.done)
		t := time.NewTicker(yieldPoll)
		defer t.Stop()
		for {
			select {
			case <-h.stop:
				return
			case <-t.C:
				h.adjust()
			}
		}
	}()
	return h, nil
}

func (h *halfHold) pinWord() *uint32 { return h.seg.u32(h.seg.halfBase(h.i) + layout.OffPin) }

func (h *halfHold) pin() {
	if h.seg.ro {
		return // a reader of a copy gives way to every put (openCopy)
	}
	atomic.AddUint32(h.pinWord(), 1)
	h.pinned = true
}

func (h *halfHold) unpin() {
	if h.pinned {
		atomic.AddUint32(h.pinWord(), ^uint32(0))
		h.pinned = false
	}
}

// intact says whether no writer has touched the half since holdHalf:
// state before gen (see segment.read's valid).
func (h *halfHold) intact() bool {
	return h.seg.state(h.i) == layout.StateComplete && h.seg.gen(h.i) == h.gen
}

// adjust pins or unpins the half as the other half is free or held.
func (h *halfHold) adjust() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.lost {
		return
	}
	switch busy := h.seg.held(1 - h.i); {
	case busy && h.pinned:
		h.unpin()
	case !busy && !h.pinned:
		// Pin, then look: a writer that claimed the half before shows in
		// its state or gen; one after sees the pin.
		h.pin()
	}
	if !h.intact() {
		h.lost = true
		h.unpin()
	}
}

// check returns an error wrapping ErrSuperseded once a writer has taken
// the half.
func (h *halfHold) check() error {
	if h.yield {
		h.adjust()
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.lost || !h.intact() {
		h.lost = true
		return fmt.Errorf("%w: %s half %d (a save was written over the step being sent)", ErrSuperseded, h.seg.path, h.i)
	}
	return nil
}

// release stops looking and unpins. It returns check's error: called
// after the last byte was read, it says whether every byte read was the
// step's. Later calls return the first one's result.
func (h *halfHold) release() error {
	h.once.Do(func() {
		close(h.stop)
		<-h.done
		h.released = h.check()
		h.mu.Lock()
		h.unpin()
		h.mu.Unlock()
	})
	return h.released
}

// sendStep writes the sealed step in half i of seg, which must be step
// want (-1: any), to w as a step frame, and returns its meta and the
// blob bytes written. With yield, the
// half is held so as to give way to the trainer (halfHold). A frame left
// unfinished by an error lacks its last byte, so the receiver discards
// it: the caller closes the connection.
func sendStep(w io.Writer, seg *segment, i int, want int64, yield bool) (m layout.StepMeta, sent int64, err error) {
	h, err := holdHalf(seg, i, yield)
	if err != nil {
		return m, 0, err
	}
	defer func() {
		// What went wrong with a half that a writer took over is that.
		if rerr := h.release(); rerr != nil {
			err = rerr
		}
	}()
	m, err = seg.parse(i)
	switch {
	case err != nil:
		return m, 0, err
	case want >= 0 && m.Step != want:
		return m, 0, fmt.Errorf("%w: %s half %d holds step %d now, not %d", ErrSuperseded, seg.path, i, m.Step, want)
	case !m.Sealed:
		return m, 0, fmt.Errorf("ckpt: step %d in %s half %d is not sealed", m.Step, seg.path, i)
	}
	mb, err := m.MarshalBinary()
	if err != nil {
		return m, 0, err
	}
	head := binary.LittleEndian.AppendUint32(nil, uint32(len(mb)))
	if _, err := w.Write(append(head, mb...)); err != nil {
		return m, 0, err
	}
	// The receiver checks every CRC as the bytes arrive: a second pass
	// here would only take a core from the trainer.
	half := seg.half(i)
	for _, e := range m.Blobs {
		data := half[e.Offset : e.Offset+e.Size]
		for o := 0; o < len(data); o += persistChunk {
			if err := h.check(); err != nil {
				return m, sent, err
			}
			chunk := data[o:min(o+persistChunk, len(data))]
			if _, err := w.Write(chunk); err != nil {
				return m, sent, err
			}
			sent += int64(len(chunk))
		}
	}
	if err := h.release(); err != nil {
		return m, sent, err
	}
	_, err = w.Write([]byte{stepEnd})
	return m, sent, err
}

// recvStep reads a step frame from r into a new save of the segment open
// returns (given the half size the step needs), checking every CRC before
// the save completes, which it writes sealed once the frame's last byte
// arrived. The step must be want (-1: any). It returns the meta saved
// (its seq the segment's) and the segment and half it went to.
func recvStep(r io.Reader, want int64, open func(need int64) (*segment, error)) (layout.StepMeta, *segment, int, error) {
	var none layout.StepMeta
	lb := make([]byte, 4)
	if _, err := io.ReadFull(r, lb); err != nil {
		return none, nil, 0, fmt.Errorf("read meta length: %w", err)
	}
	metaLen := int(binary.LittleEndian.Uint32(lb))
	if metaLen < layout.StepHeaderSize || metaLen > maxMetaLen {
		return none, nil, 0, formatErr(0, "meta length", "value %d, want %d..%d", metaLen, layout.StepHeaderSize, maxMetaLen)
	}
	mb := make([]byte, metaLen)
	if _, err := io.ReadFull(r, mb); err != nil {
		return none, nil, 0, fmt.Errorf("read meta: %w", err)
	}
	m, err := layout.ParseStepMeta(mb, layout.MaxHalfSize)
	if err != nil {
		return none, nil, 0, err
	}
	switch {
	case int(m.MetaSize()) != metaLen:
		return none, nil, 0, formatErr(44, "table_size", "meta of %d bytes holds a table of %d and %d blobs", metaLen, m.TableSize(), len(m.Blobs))
	case !m.Sealed:
		return none, nil, 0, formatErr(layout.OffSeal, "seal", "the peer sent an unsealed step, whose CRCs are unknown")
	case want >= 0 && m.Step != want:
		return none, nil, 0, fmt.Errorf("the peer sent step %d, %d was asked for", m.Step, want)
	}
	seg, err := open(m.End())
	if err != nil {
		return none, nil, 0, err
	}
	hw, err := seg.begin(m)
	if err != nil {
		return none, nil, 0, err
	}
	crcs, err := readBlobs(hw, func(int) io.Reader { return r })
	if err != nil {
		return none, nil, 0, err
	}
	for k, e := range m.Blobs {
		if crcs[k] != e.CRC32C {
			return none, nil, 0, crcMismatch(k, e, crcs[k])
		}
	}
	end := make([]byte, 1)
	if _, err := io.ReadFull(r, end); err != nil || end[0] != stepEnd {
		return none, nil, 0, fmt.Errorf("step %d: the sender did not end its frame (%v, byte %v): it gave the step up, a trainer having saved over it, or it was cut off; the previous copy stays", m.Step, err, end)
	}
	if err := hw.commit(crcs); err != nil {
		return none, nil, 0, err
	}
	return hw.meta, seg, hw.idx, nil
}
