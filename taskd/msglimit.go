package taskd

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync"

	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc/credentials"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
)

// methodLimits bound the messages of the calls that carry a few hundred
// bytes, far below a server's MaxMessageBytes: gRPC checks a message's
// size against one bound for every method, and reads and holds what
// arrives up to it before a handler sees the call, so that a stalled
// Register of 4 MiB held 4 MiB, taken in before the member was checked.
// Send keeps MaxMessageBytes, since a node's stack dumps in a hang travel
// in one message, and Upload, a file's chunks; what their stalled
// messages hold is bounded per member and per address instead (guard.hold).
var methodLimits = map[string]int{
	pb.Control_Register_FullMethodName:      16 << 10,
	pb.Control_Stream_FullMethodName:        16 << 10,
	pb.Control_Leave_FullMethodName:         16 << 10,
	pb.Control_UploadOffsets_FullMethodName: 64 << 10,
	// A proxy's heartbeat carries a beat of each of its node's workers.
	pb.Control_Heartbeat_FullMethodName: 256 << 10,
	// A batch of acknowledgements, each error cut (ackBatchBytes).
	pb.Control_Acknowledge_FullMethodName: 1 << 20,
	// A proxy's collection result, its errors cut (maxCollectErrors).
	pb.Control_CollectDone_FullMethodName: 256 << 10,
}

// errMessageLimit is what a connection whose peer declared a message
// beyond its method's bound is closed with.
var errMessageLimit = errors.New("taskd: a message beyond its method's bound")

// errUnfinished is what a connection is closed with whose call would hold
// more bytes of messages not yet whole than its member or address may.
var errUnfinished = errors.New("taskd: messages not yet whole beyond their bound")

// limitCreds wraps a server's transport credentials so that each
// connection, once its handshake is done, reads through a msgLimiter.
type limitCreds struct {
	credentials.TransportCredentials
	g *guard
}

func (c limitCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.TransportCredentials.ServerHandshake(raw)
	if err != nil {
		return conn, info, err
	}
	return newMsgLimiter(conn, guardBudget{g: c.g, ip: peerHost(raw.RemoteAddr().String())}), info, nil
}

func (c limitCreds) Clone() credentials.TransportCredentials {
	return limitCreds{TransportCredentials: c.TransportCredentials.Clone(), g: c.g}
}

// msgBudget is what a msgLimiter answers to: who a call's secret names,
// whether its bytes not yet whole may grow, and where to count a
// connection it closes.
type msgBudget interface {
	member(secret string) *identity
	hold(who *identity, n int) bool
	exceeded(method, reason string)
}

// guardBudget is a connection's budget: its guard's, for its peer address.
type guardBudget struct {
	g  *guard
	ip string
}

func (b guardBudget) member(secret string) *identity { return b.g.member(secret) }
func (b guardBudget) hold(who *identity, n int) bool { return b.g.hold(b.ip, who, n) }
func (b guardBudget) exceeded(method, reason string) { b.g.messageLimit(b.ip, method, reason) }

// HTTP/2 as a client writes it (RFC 9113): what msgLimiter reads.
const (
	h2Preface     = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
	h2FrameHeader = 9
	h2Data        = 0x0
	h2Headers     = 0x1
	h2RSTStream   = 0x3
	h2Continue    = 0x9
	h2EndStream   = 0x1
	h2EndHeaders  = 0x4
	h2Padded      = 0x8
	h2Priority    = 0x20
	// maxTracked bounds the streams a connection's limiter follows; a
	// client holds at most maxStreamsPerConn open.
	maxTracked = 4 * maxStreamsPerConn
)

// msgLimiter reads a server connection's HTTP/2 frames as they pass, and
// closes the connection when a call declares a gRPC message longer than
// its method's bound (methodLimits), from the message's 5-byte prefix,
// before its body arrives, or when the bytes of the messages begun and
// not yet whole, which gRPC holds until they are, would pass what the
// call's member or the connection's address may hold (its budget). It
// decodes the header blocks (HPACK is stateful) for each call's method
// and member; it changes no byte.
type msgLimiter struct {
	net.Conn
	budget msgBudget

	mu     sync.Mutex // Read and Close may run at once
	closed bool

	preface int // bytes of the client preface still to pass
	hdr     [h2FrameHeader]byte
	hn      int              // bytes of hdr read
	left    int              // bytes of the current frame's payload to come
	typ     byte             // the current frame's type and flags
	flags   byte             //
	stream  uint32           // the current frame's stream
	pad     int              // DATA: padding at the frame's end; -1 until its length is read
	block   []byte           // a HEADERS frame's payload and CONTINUATIONs, until END_HEADERS
	ends    bool             // that HEADERS frame ended its stream
	dec     *hpack.Decoder   // the client's header blocks, in order
	path    string           // :path of the block being decoded
	secret  string           // the member secret of the block being decoded
	calls   map[uint32]*call // by stream, until the client or the server ends it
	out     frameHeads       // what the server sends
	err     error
}

// call is what a msgLimiter follows of one stream.
type call struct {
	method string
	limit  int       // 0: the server's
	who    *identity // the member its secret names; nil for none
	prefix [5]byte   // the gRPC message prefix being read
	pn     int
	body   uint32 // bytes of the current message's body to come
	held   int    // bytes of the current message's body come
}

func newMsgLimiter(c net.Conn, budget msgBudget) *msgLimiter {
	l := &msgLimiter{Conn: c, budget: budget, preface: len(h2Preface), calls: make(map[uint32]*call)}
	l.dec = hpack.NewDecoder(4096, func(f hpack.HeaderField) {
		switch f.Name {
		case ":path":
			l.path = f.Value
		case memberHeader:
			l.secret = f.Value
		}
	})
	l.dec.SetMaxStringLength(maxHeaderBytes)
	return l
}

func (l *msgLimiter) Read(p []byte) (int, error) {
	n, err := l.Conn.Read(p)
	l.mu.Lock()
	if l.err == nil && l.closed {
		l.err = net.ErrClosed
	}
	if l.err == nil {
		l.err = l.feed(p[:n])
	}
	ferr := l.err
	l.mu.Unlock()
	if ferr != nil {
		l.Close()
		return 0, ferr
	}
	return n, err
}

// Write follows the frames the server sends, for the calls it ends.
func (l *msgLimiter) Write(p []byte) (int, error) {
	l.mu.Lock()
	l.out.feed(p, l.forget)
	l.mu.Unlock()
	return l.Conn.Write(p)
}

// frameHeads follows the frame headers of one direction of HTTP/2, and
// tells of each stream one of its frames ends: a call that the server
// ended (refused from its headers, say) is no longer followed, whether
// or not its client ever ends it too.
type frameHeads struct {
	hdr  [h2FrameHeader]byte
	hn   int
	left int // bytes of the current frame's payload to come
}

func (f *frameHeads) feed(b []byte, ended func(stream uint32)) {
	for len(b) > 0 {
		if f.left > 0 {
			k := min(f.left, len(b))
			f.left -= k
			b = b[k:]
			continue
		}
		k := copy(f.hdr[f.hn:], b)
		f.hn += k
		b = b[k:]
		if f.hn < h2FrameHeader {
			return
		}
		f.hn = 0
		f.left = int(f.hdr[0])<<16 | int(f.hdr[1])<<8 | int(f.hdr[2])
		typ, flags := f.hdr[3], f.hdr[4]
		if typ == h2RSTStream || (flags&h2EndStream != 0 && (typ == h2Headers || typ == h2Data)) {
			ended(binary.BigEndian.Uint32(f.hdr[5:]) & (1<<31 - 1))
		}
	}
}

// Close gives back what the connection's calls hold, and closes it.
func (l *msgLimiter) Close() error {
	l.mu.Lock()
	if !l.closed {
		l.closed = true
		for id := range l.calls {
			l.forget(id)
		}
	}
	l.mu.Unlock()
	return l.Conn.Close()
}

// forget stops following stream id, and gives back what its call holds.
func (l *msgLimiter) forget(id uint32) {
	if c := l.calls[id]; c != nil {
		if c.held > 0 {
			l.budget.hold(c.who, -c.held)
		}
		delete(l.calls, id)
	}
}

// feed follows b, the next bytes the client sent.
func (l *msgLimiter) feed(b []byte) error {
	for len(b) > 0 {
		switch {
		case l.preface > 0:
			k := min(l.preface, len(b))
			l.preface -= k
			b = b[k:]
		case l.hn < h2FrameHeader:
			k := copy(l.hdr[l.hn:], b)
			l.hn += k
			b = b[k:]
			if l.hn == h2FrameHeader {
				l.left = int(l.hdr[0])<<16 | int(l.hdr[1])<<8 | int(l.hdr[2])
				l.typ, l.flags = l.hdr[3], l.hdr[4]
				l.stream = binary.BigEndian.Uint32(l.hdr[5:]) & (1<<31 - 1)
				l.pad = -1
				if l.left == 0 {
					if err := l.frameEnd(); err != nil {
						return err
					}
				}
			}
		default:
			k := min(l.left, len(b))
			if err := l.payload(b[:k]); err != nil {
				return err
			}
			l.left -= k
			b = b[k:]
			if l.left == 0 {
				if err := l.frameEnd(); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// payload takes in b, the next bytes of the current frame's payload.
func (l *msgLimiter) payload(b []byte) error {
	switch l.typ {
	case h2Headers, h2Continue:
		if len(l.block)+len(b) > 2*maxHeaderBytes {
			return fmt.Errorf("taskd: a header block over %d bytes", 2*maxHeaderBytes)
		}
		l.block = append(l.block, b...)
	case h2Data:
		rest := l.left // of the payload, b included
		if l.pad < 0 {
			l.pad = 0
			if l.flags&h2Padded != 0 {
				l.pad = int(b[0])
				b, rest = b[1:], rest-1
			}
		}
		// The padding is the payload's last l.pad bytes.
		data := b[:max(0, min(len(b), rest-l.pad))]
		if c := l.calls[l.stream]; c != nil {
			return c.take(data, l.budget)
		}
	}
	return nil
}

// take follows data, the next bytes of a call's messages, drawing the
// bytes of a message not yet whole on budget until it is.
func (c *call) take(data []byte, budget msgBudget) error {
	for len(data) > 0 {
		if c.body > 0 {
			k := min(int(c.body), len(data))
			c.body -= uint32(k)
			data = data[k:]
			if c.body == 0 {
				budget.hold(c.who, -c.held) // whole: the handler has it
				c.held = 0
				continue
			}
			if !budget.hold(c.who, k) {
				budget.exceeded(c.method, "unfinished_bytes")
				return fmt.Errorf("%w: %s, %d bytes of a message of %d", errUnfinished, c.method, c.held+k, uint32(c.held+k)+c.body)
			}
			c.held += k
			continue
		}
		k := copy(c.prefix[c.pn:], data)
		c.pn += k
		data = data[k:]
		if c.pn == len(c.prefix) {
			c.pn = 0
			c.body = binary.BigEndian.Uint32(c.prefix[1:])
			if c.limit > 0 && int64(c.body) > int64(c.limit) {
				budget.exceeded(c.method, "message_limit")
				return fmt.Errorf("%w: %s declared %d bytes, at most %d", errMessageLimit, c.method, c.body, c.limit)
			}
		}
	}
	return nil
}

// frameEnd takes in the end of the current frame.
func (l *msgLimiter) frameEnd() error {
	l.hn = 0
	switch l.typ {
	case h2Headers, h2Continue:
		if l.typ == h2Headers {
			// Its padding and priority are its own, not the block's.
			frag, err := headersFragment(l.block, l.flags)
			if err != nil {
				return err
			}
			l.block = append(l.block[:0], frag...)
			l.ends = l.flags&h2EndStream != 0
		}
		if l.flags&h2EndHeaders == 0 {
			return nil // CONTINUATION frames follow
		}
		if err := l.headers(l.block); err != nil {
			return err
		}
		l.block = l.block[:0]
		if cap(l.block) > 4<<10 {
			l.block = nil
		}
		if l.ends {
			l.forget(l.stream)
		}
	case h2RSTStream:
		l.forget(l.stream)
	case h2Data:
		if l.flags&h2EndStream != 0 {
			l.forget(l.stream)
		}
	}
	return nil
}

// headers decodes a header block, and follows the call it opens.
func (l *msgLimiter) headers(frag []byte) error {
	l.path, l.secret = "", ""
	if _, err := l.dec.Write(frag); err != nil {
		return fmt.Errorf("taskd: header block: %w", err)
	}
	if err := l.dec.Close(); err != nil {
		return fmt.Errorf("taskd: header block: %w", err)
	}
	if l.path == "" || l.calls[l.stream] != nil {
		return nil // trailers, or a block the server refuses
	}
	if len(l.calls) >= maxTracked {
		return fmt.Errorf("taskd: more than %d calls open on one connection", maxTracked)
	}
	l.calls[l.stream] = &call{method: l.path, limit: methodLimits[l.path], who: l.budget.member(l.secret)}
	return nil
}

// headersFragment returns the header block fragment of a HEADERS frame's
// payload.
func headersFragment(p []byte, flags byte) ([]byte, error) {
	pad := 0
	if flags&h2Padded != 0 {
		if len(p) < 1 {
			return nil, errors.New("taskd: HEADERS frame too short for its padding")
		}
		pad, p = int(p[0]), p[1:]
	}
	if flags&h2Priority != 0 {
		if len(p) < 5 {
			return nil, errors.New("taskd: HEADERS frame too short for its priority")
		}
		p = p[5:]
	}
	if pad > len(p) {
		return nil, errors.New("taskd: HEADERS frame's padding longer than the frame")
	}
	return p[:len(p)-pad], nil
}
