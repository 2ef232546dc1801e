package netcheck

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"time"
)

// Prober measures the link between two nodes. The default, TCPProber, asks
// From's agent to measure TCP bandwidth and round trips to To's agent; a
// vendor adds a device probe (a matrix multiply and an all-gather on real
// accelerators, say) by implementing this interface.
type Prober interface {
	// Probe measures the link from one node to another and returns by
	// ctx's deadline. from.Addr is empty when from is the checker itself,
	// as the reference; a prober that cannot probe from there returns an
	// error. An error is recorded as a failed probe.
	Probe(ctx context.Context, from, to Node) (Measurement, error)
}

// TCPProber is the default Prober: real TCP between node agents. When From
// is the checker itself it probes To's agent directly; otherwise it asks
// From's agent to probe To's, so that the link measured is the one between
// the two nodes. The zero value is ready to use.
type TCPProber struct {
	// Bytes is how much each probe sends each way. Default 16 MiB.
	Bytes int64
	// Pings is how many small round trips measure latency. Default 5.
	Pings int
	// Dialer dials agents; nil means a net.Dialer with defaults.
	Dialer *net.Dialer
}

func (p *TCPProber) bytes() int64 {
	if p.Bytes <= 0 {
		return 16 << 20
	}
	return p.Bytes
}

func (p *TCPProber) pings() int {
	if p.Pings <= 0 {
		return 5
	}
	return min(p.Pings, maxPings)
}

func (p *TCPProber) dialer() *net.Dialer {
	if p.Dialer == nil {
		return &net.Dialer{}
	}
	return p.Dialer
}

const maxPings = 1000

// Probe implements Prober.
func (p *TCPProber) Probe(ctx context.Context, from, to Node) (Measurement, error) {
	if to.Addr == "" {
		return Measurement{}, fmt.Errorf("netcheck: node %q has no agent address", to.Name)
	}
	if from.Addr == "" {
		return measure(ctx, p.dialer(), to.Addr, p.bytes(), p.pings())
	}
	return p.remote(ctx, from.Addr, to.Addr)
}

// remote asks the agent at agent to probe peer.
func (p *TCPProber) remote(ctx context.Context, agent, peer string) (Measurement, error) {
	req := probeRequest{Peer: peer, Bytes: p.bytes(), Pings: p.pings(), Timeout: 30 * time.Second}
	if d, ok := ctx.Deadline(); ok {
		// Leave the agent time to report its own timeout, which says more
		// than ours would.
		left := time.Until(d)
		req.Timeout = left - min(left/10, 500*time.Millisecond)
	}
	if req.Timeout <= 0 {
		return Measurement{}, context.DeadlineExceeded
	}
	conn, err := dial(ctx, p.dialer(), agent)
	if err != nil {
		return Measurement{}, fmt.Errorf("reach agent %s: %w", agent, err)
	}
	defer conn.Close()
	if _, err := conn.Write(appendHeader(nil, opProbe)); err != nil {
		return Measurement{}, fmt.Errorf("agent %s: %w", agent, err)
	}
	if err := writeJSON(conn, req); err != nil {
		return Measurement{}, fmt.Errorf("agent %s: %w", agent, err)
	}
	var m Measurement
	if err := readJSON(conn, &m); err != nil {
		return Measurement{}, fmt.Errorf("agent %s: %w", agent, ctxErr(ctx, err))
	}
	if m.Error != "" {
		return m, errors.New(m.Error)
	}
	return m, nil
}

// dial connects to addr and makes every read and write of the connection
// honour ctx: its deadline, and its cancellation.
func dial(ctx context.Context, d *net.Dialer, addr string) (net.Conn, error) {
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	if dl, ok := ctx.Deadline(); ok {
		conn.SetDeadline(dl)
	}
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	return &ctxConn{Conn: conn, stop: stop}, nil
}

type ctxConn struct {
	net.Conn
	stop func() bool
}

func (c *ctxConn) Close() error {
	c.stop()
	return c.Conn.Close()
}

// ctxErr prefers the context's error to the I/O error it caused.
func ctxErr(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		return fmt.Errorf("%w (%v)", cerr, err)
	}
	return err
}

// measure runs one probe against the agent at addr: pings round trips,
// then bytes up and bytes down.
func measure(ctx context.Context, d *net.Dialer, addr string, bytes int64, pings int) (Measurement, error) {
	m := Measurement{Bytes: bytes}
	start := time.Now()
	fail := func(what string, err error) (Measurement, error) {
		m.Elapsed = time.Since(start)
		return m, fmt.Errorf("%s %s: %w", what, addr, ctxErr(ctx, err))
	}
	conn, err := dial(ctx, d, addr)
	if err != nil {
		return fail("connect to", err)
	}
	defer conn.Close()
	hdr := transferHeader{pings: uint16(pings), up: uint64(bytes), down: uint64(bytes)}
	if _, err := conn.Write(hdr.append(appendHeader(nil, opTransfer))); err != nil {
		return fail("send to", err)
	}
	if err := readStatus(conn); err != nil {
		return fail("transfer with", err)
	}

	rtts := make([]time.Duration, pings)
	var ping [8]byte
	for i := range rtts {
		t := time.Now()
		if _, err := conn.Write(ping[:]); err != nil {
			return fail("ping", err)
		}
		if _, err := io.ReadFull(conn, ping[:]); err != nil {
			return fail("ping", err)
		}
		rtts[i] = time.Since(t)
	}
	if len(rtts) > 0 {
		slices.Sort(rtts)
		m.RTT = rtts[len(rtts)/2]
	}

	buf := make([]byte, chunk)
	t := time.Now()
	if err := send(conn, buf, bytes); err != nil {
		return fail("send to", err)
	}
	if _, err := io.ReadFull(conn, ping[:1]); err != nil { // all arrived
		return fail("send to", err)
	}
	up := time.Since(t)
	t = time.Now()
	if err := receive(conn, buf, bytes); err != nil {
		return fail("receive from", err)
	}
	down := time.Since(t)
	m.Elapsed = time.Since(start)
	m.Bandwidth = float64(bytes) / max(up, down).Seconds()
	return m, nil
}

// send writes n bytes from buf, whose content does not matter.
func send(w io.Writer, buf []byte, n int64) error {
	for n > 0 {
		k := int(min(n, int64(len(buf))))
		if _, err := w.Write(buf[:k]); err != nil {
			return err
		}
		n -= int64(k)
	}
	return nil
}

// receive reads and drops n bytes.
func receive(r io.Reader, buf []byte, n int64) error {
	for n > 0 {
		k, err := r.Read(buf[:min(n, int64(len(buf)))])
		n -= int64(k)
		if err != nil {
			if n > 0 && err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			if n > 0 {
				return err
			}
		}
	}
	return nil
}
