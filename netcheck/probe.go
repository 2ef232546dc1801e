package netcheck

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
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
//
// A probe connects, times Pings small round trips, then makes Repeats
// transfers on the same connection, each moving Bytes up and then Bytes
// down, so that a probe moves up to Repeats × Bytes each way. The
// measurement keeps the fastest transfer: a link that is slow is slow every
// time, while a busy host's scheduling stalls hit one transfer and not the
// next. (A link that is slow only now and then therefore needs Repeats = 1
// to be seen.) A transfer that would not finish by the probe's deadline,
// at the pace of the one before, is not started; one that the deadline
// cuts short still tells the rate of what it moved (Measurement.Partial).
type TCPProber struct {
	// Bytes is how much one transfer sends each way. Default 8 MiB.
	Bytes int64
	// Repeats is how many transfers a probe makes at most. Default 3.
	Repeats int
	// Pings is how many small round trips measure latency. Default 5.
	Pings int
	// Dialer dials agents; nil means a net.Dialer with defaults.
	Dialer *net.Dialer
}

// load is what one probe moves.
type load struct {
	bytes          int64
	pings, repeats int
}

const (
	maxPings   = 1000
	maxRepeats = 100
)

func (p *TCPProber) load() load {
	l := load{bytes: p.Bytes, pings: p.Pings, repeats: p.Repeats}
	if l.bytes <= 0 {
		l.bytes = 8 << 20
	}
	if l.pings <= 0 {
		l.pings = 5
	}
	if l.repeats <= 0 {
		l.repeats = 3
	}
	l.pings, l.repeats = min(l.pings, maxPings), min(l.repeats, maxRepeats)
	return l
}

func (p *TCPProber) dialer() *net.Dialer {
	if p.Dialer == nil {
		return &net.Dialer{}
	}
	return p.Dialer
}

// Probe implements Prober.
func (p *TCPProber) Probe(ctx context.Context, from, to Node) (Measurement, error) {
	if to.Addr == "" {
		return Measurement{}, fmt.Errorf("netcheck: node %q has no agent address", to.Name)
	}
	if from.Addr == "" {
		return measure(ctx, p.dialer(), to.Addr, p.load())
	}
	return p.remote(ctx, from.Addr, to.Addr)
}

// remote asks the agent at agent to probe peer.
func (p *TCPProber) remote(ctx context.Context, agent, peer string) (Measurement, error) {
	l := p.load()
	req := probeRequest{Peer: peer, Bytes: l.bytes, Pings: l.pings, Repeats: l.repeats, Timeout: 30 * time.Second}
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

// measure runs one probe against the agent at addr. Elapsed is the
// fastest transfer's time to move the bytes up and down; Bandwidth is the
// slower direction's best rate. When the deadline cuts the first transfer
// short, the measurement is partial: the rate of the bytes that arrived.
func measure(ctx context.Context, d *net.Dialer, addr string, l load) (Measurement, error) {
	m := Measurement{Bytes: l.bytes}
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
	hdr := transferHeader{pings: uint16(l.pings), repeats: uint16(l.repeats), up: uint64(l.bytes), down: uint64(l.bytes)}
	if _, err := conn.Write(hdr.append(appendHeader(nil, opTransfer))); err != nil {
		return fail("send to", err)
	}
	if err := readStatus(conn); err != nil {
		return fail("transfer with", err)
	}

	rtts := make([]time.Duration, l.pings)
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
	var bestUp, bestDown, last time.Duration
	for r := range l.repeats {
		if dl, ok := ctx.Deadline(); r > 0 && ok && time.Until(dl) < last {
			break // it would be cut short: the ones done tell enough
		}
		t := time.Now()
		sent, err := send(conn, buf, l.bytes)
		if err == nil {
			_, err = io.ReadFull(conn, ping[:1]) // all arrived
		}
		if err != nil {
			if deadlineHit(ctx, err) && r > 0 {
				break
			}
			if moved := sent - unacked(conn); deadlineHit(ctx, err) && moved > 0 {
				return partial(m, moved, time.Since(t), float64(moved)/time.Since(t).Seconds()), nil
			}
			return fail("send to", err)
		}
		up := time.Since(t)
		t = time.Now()
		got, err := receive(conn, buf, l.bytes)
		if err != nil {
			if deadlineHit(ctx, err) && r > 0 {
				break
			}
			if down := time.Since(t); deadlineHit(ctx, err) && got > 0 {
				bw := min(float64(l.bytes)/up.Seconds(), float64(got)/down.Seconds())
				return partial(m, l.bytes+got, up+down, bw), nil
			}
			return fail("receive from", err)
		}
		down := time.Since(t)
		last = up + down
		if r == 0 || up+down < m.Elapsed {
			m.Elapsed = up + down
		}
		if r == 0 || up < bestUp {
			bestUp = up
		}
		if r == 0 || down < bestDown {
			bestDown = down
		}
	}
	m.Bandwidth = float64(l.bytes) / max(bestUp, bestDown, time.Nanosecond).Seconds()
	return m, nil
}

// deadlineHit reports whether err is the probe's deadline, not a cancellation or
// a broken link.
func deadlineHit(ctx context.Context, err error) bool {
	return errors.Is(err, os.ErrDeadlineExceeded) && !errors.Is(ctx.Err(), context.Canceled)
}

// partial returns m as cut short after moving moved bytes in elapsed at
// rate bw.
func partial(m Measurement, moved int64, elapsed time.Duration, bw float64) Measurement {
	m.Partial, m.Moved, m.Elapsed, m.Bandwidth = true, moved, elapsed, bw
	return m
}

// send writes n bytes from buf, whose content does not matter, and
// returns how many it wrote.
func send(w io.Writer, buf []byte, n int64) (int64, error) {
	var sent int64
	for sent < n {
		k, err := w.Write(buf[:min(n-sent, int64(len(buf)))])
		sent += int64(k)
		if err != nil {
			return sent, err
		}
	}
	return sent, nil
}

// receive reads and drops n bytes, and returns how many it read.
func receive(r io.Reader, buf []byte, n int64) (int64, error) {
	var got int64
	for got < n {
		k, err := r.Read(buf[:min(n-got, int64(len(buf)))])
		got += int64(k)
		if err != nil && got < n {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return got, err
		}
	}
	return got, nil
}
