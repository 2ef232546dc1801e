package taskd

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"

	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc/credentials"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
)

// methodLimits bound the messages of the calls that carry a few hundred
// bytes, far below a server's MaxMessageBytes: gRPC checks a message's
// size against one bound for every method, and reads and holds what
// arrives up to it before a handler sees the call, so that a stalled
// Register of 4 MiB held 4 MiB, taken in before the member was checked.
var methodLimits = map[string]int{
	pb.Control_Register_FullMethodName:      16 << 10,
	pb.Control_Stream_FullMethodName:        16 << 10,
	pb.Control_Leave_FullMethodName:         16 << 10,
	pb.Control_UploadOffsets_FullMethodName: 64 << 10,
	// A proxy's heartbeat carries a beat of each of its node's workers.
	pb.Control_Heartbeat_FullMethodName: 256 << 10,
}

// errMessageLimit is what a connection whose peer declared a message
// beyond its method's bound is closed with.
var errMessageLimit = errors.New("taskd: a message beyond its method's bound")

// limitCreds wraps a server's transport credentials so that each
// connection, once its handshake is done, reads through a msgLimiter.
type limitCreds struct {
	credentials.TransportCredentials
	exceeded func(ip, method string) // counts and logs a connection closed
}

func (c limitCreds) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	conn, info, err := c.TransportCredentials.ServerHandshake(raw)
	if err != nil {
		return conn, info, err
	}
	ip := peerHost(raw.RemoteAddr().String())
	return newMsgLimiter(conn, func(method string) { c.exceeded(ip, method) }), info, nil
}

func (c limitCreds) Clone() credentials.TransportCredentials {
	return limitCreds{TransportCredentials: c.TransportCredentials.Clone(), exceeded: c.exceeded}
}

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
// before its body arrives. It decodes the header blocks (HPACK is
// stateful) for each call's method; it changes no byte.
type msgLimiter struct {
	net.Conn
	exceeded func(method string)

	preface int // bytes of the client preface still to pass
	hdr     [h2FrameHeader]byte
	hn      int              // bytes of hdr read
	left    int              // bytes of the current frame's payload to come
	typ     byte             // the current frame's type and flags
	flags   byte             //
	stream  uint32           // the current frame's stream
	pad     int              // DATA: padding at the frame's end; -1 until its length is read
	block   []byte           // a HEADERS frame's payload and CONTINUATIONs, until END_HEADERS
	dec     *hpack.Decoder   // the client's header blocks, in order
	path    string           // :path of the block being decoded
	calls   map[uint32]*call // by stream, until the client ends it
	err     error
}

// call is what a msgLimiter follows of one stream.
type call struct {
	method string
	limit  int
	prefix [5]byte // the gRPC message prefix being read
	pn     int
	body   uint32 // bytes of the current message's body to come
}

func newMsgLimiter(c net.Conn, exceeded func(method string)) *msgLimiter {
	l := &msgLimiter{Conn: c, exceeded: exceeded, preface: len(h2Preface), calls: make(map[uint32]*call)}
	l.dec = hpack.NewDecoder(4096, func(f hpack.HeaderField) {
		if f.Name == ":path" {
			l.path = f.Value
		}
	})
	l.dec.SetMaxStringLength(maxHeaderBytes)
	return l
}

func (l *msgLimiter) Read(p []byte) (int, error) {
	if l.err != nil {
		return 0, l.err
	}
	n, err := l.Conn.Read(p)
	if ferr := l.feed(p[:n]); ferr != nil {
		l.err = ferr
		l.Conn.Close()
		return 0, ferr
	}
	return n, err
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
			return c.take(data, l.exceeded)
		}
	}
	return nil
}

// take follows data, the next bytes of a call's messages.
func (c *call) take(data []byte, exceeded func(method string)) error {
	for len(data) > 0 {
		if c.body > 0 {
			k := min(int(c.body), len(data))
			c.body -= uint32(k)
			data = data[k:]
			continue
		}
		k := copy(c.prefix[c.pn:], data)
		c.pn += k
		data = data[k:]
		if c.pn == len(c.prefix) {
			c.pn = 0
			c.body = binary.BigEndian.Uint32(c.prefix[1:])
			if int64(c.body) > int64(c.limit) {
				exceeded(c.method)
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
	case h2RSTStream:
		delete(l.calls, l.stream)
	}
	if l.flags&h2EndStream != 0 && (l.typ == h2Data || l.typ == h2Headers) {
		delete(l.calls, l.stream)
	}
	return nil
}

// headers decodes a header block, and follows the call it opens.
func (l *msgLimiter) headers(frag []byte) error {
	l.path = ""
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
	if limit, ok := methodLimits[l.path]; ok {
		l.calls[l.stream] = &call{method: l.path, limit: limit}
	}
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
