package main

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"
)

// The fabric stands in for the accelerators' interconnect. A collective
// completes when every member of its group has arrived, so a slow rank
// makes its peers wait, and a rank that never arrives (dead, or stuck on
// its link) holds them forever: the behaviour that slow-node and hang
// detection have to see through. It lives in the launcher and speaks a
// line protocol over one TCP connection per rank:
//
//	rank -> fabric: hello <rank> | arrive <key> <size> | leave <key>
//	fabric -> rank: done <key>   | left <key>
//
// A key names one run of one collective ("dp-1/HcclAllReduce/42"). A rank
// that aborts a collective (a pause, a recovery's stop-and-clean) leaves
// it; the fabric answers "left" after any "done" it sent first, so the
// rank knows whether the collective completed before it left.
type fabric struct {
	ln net.Listener
	wg sync.WaitGroup

	mu       sync.Mutex
	barriers map[string]*barrier
	conns    map[*fabricConn]bool
}

type barrier struct {
	size    int
	members map[int]*fabricConn // arrived ranks
}

type fabricConn struct {
	c    net.Conn
	rank int
	wmu  sync.Mutex
}

func (fc *fabricConn) send(line string) {
	fc.wmu.Lock()
	defer fc.wmu.Unlock()
	fc.c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	fc.c.Write([]byte(line + "\n")) // a rank that stopped reading is gone
}

// newFabric serves on a loopback port until Close.
func newFabric() (*fabric, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("fabric: %w", err)
	}
	f := &fabric{ln: ln, barriers: map[string]*barrier{}, conns: map[*fabricConn]bool{}}
	f.wg.Go(f.accept)
	return f, nil
}

func (f *fabric) Addr() string { return f.ln.Addr().String() }

func (f *fabric) accept() {
	for {
		c, err := f.ln.Accept()
		if err != nil {
			return
		}
		fc := &fabricConn{c: c, rank: -1}
		f.mu.Lock()
		f.conns[fc] = true
		f.mu.Unlock()
		f.wg.Go(func() { f.serve(fc) })
	}
}

func (f *fabric) serve(fc *fabricConn) {
	defer func() {
		fc.c.Close()
		f.mu.Lock()
		defer f.mu.Unlock()
		delete(f.conns, fc)
		for key, b := range f.barriers { // a dead rank's arrivals are withdrawn
			if b.members[fc.rank] == fc {
				delete(b.members, fc.rank)
			}
			if len(b.members) == 0 {
				delete(f.barriers, key)
			}
		}
	}()
	sc := bufio.NewScanner(fc.c)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		switch {
		case len(fields) == 2 && fields[0] == "hello":
			fc.rank, _ = strconv.Atoi(fields[1])
		case len(fields) == 3 && fields[0] == "arrive" && fc.rank >= 0:
			size, err := strconv.Atoi(fields[2])
			if err != nil || size < 1 {
				return
			}
			f.arrive(fc, fields[1], size)
		case len(fields) == 2 && fields[0] == "leave":
			f.leave(fc, fields[1])
		default:
			return
		}
	}
}

func (f *fabric) arrive(fc *fabricConn, key string, size int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	b := f.barriers[key]
	if b == nil {
		b = &barrier{size: size, members: map[int]*fabricConn{}}
		f.barriers[key] = b
	}
	b.members[fc.rank] = fc
	if len(b.members) < b.size {
		return
	}
	delete(f.barriers, key)
	for _, m := range b.members {
		m.send("done " + key)
	}
}

func (f *fabric) leave(fc *fabricConn, key string) {
	f.mu.Lock()
	if b := f.barriers[key]; b != nil && b.members[fc.rank] == fc {
		delete(b.members, fc.rank)
		if len(b.members) == 0 {
			delete(f.barriers, key)
		}
	}
	f.mu.Unlock()
	fc.send("left " + key)
}

// Close stops serving and drops every rank's connection.
func (f *fabric) Close() error {
	err := f.ln.Close()
	f.mu.Lock()
	for fc := range f.conns {
		fc.c.Close()
	}
	f.mu.Unlock()
	f.wg.Wait()
	return err
}

// errAborted is a collective left before it completed.
var errAborted = errors.New("collective aborted")

// errFabricGone is a collective whose fabric connection broke.
var errFabricGone = errors.New("fabric connection lost")

// fabricClient is a rank's end of the fabric. One collective runs at a
// time.
type fabricClient struct {
	conn   net.Conn
	wmu    sync.Mutex
	in     chan string
	closed chan struct{} // closed by stop
	once   sync.Once
	done   chan struct{} // closed when the reader returns
}

func (c *fabricClient) stop() { c.once.Do(func() { close(c.closed) }) }

func dialFabric(addr string, rank int) (*fabricClient, error) {
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return nil, fmt.Errorf("fabric: %w", err)
	}
	c := &fabricClient{conn: conn, in: make(chan string, 16), closed: make(chan struct{}), done: make(chan struct{})}
	go c.read()
	if err := c.send("hello " + strconv.Itoa(rank)); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func (c *fabricClient) read() {
	defer close(c.done)
	sc := bufio.NewScanner(c.conn)
	for sc.Scan() {
		select {
		case c.in <- sc.Text():
		case <-c.closed:
			return
		}
	}
	c.stop()
}

func (c *fabricClient) send(line string) error {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if _, err := c.conn.Write([]byte(line + "\n")); err != nil {
		return fmt.Errorf("%w: %v", errFabricGone, err)
	}
	return nil
}

// collective arrives at key, a collective of size ranks, and waits for its
// peers. It returns nil when every member arrived, errAborted when abort
// was closed first.
func (c *fabricClient) collective(key string, size int, abort <-chan struct{}) error {
	if err := c.send(fmt.Sprintf("arrive %s %d", key, size)); err != nil {
		return err
	}
	return c.waitPeers(key, abort)
}

func (c *fabricClient) waitPeers(key string, abort <-chan struct{}) error {
	for {
		select {
		case line := <-c.in:
			if line == "done "+key {
				return nil
			}
		case <-abort:
			return c.leave(key)
		case <-c.closed:
			return errFabricGone
		}
	}
}

// leave withdraws from key; the collective still counts as done when the
// fabric completed it before it saw the leave.
func (c *fabricClient) leave(key string) error {
	if err := c.send("leave " + key); err != nil {
		return err
	}
	completed := false
	for {
		select {
		case line := <-c.in:
			switch line {
			case "done " + key:
				completed = true
			case "left " + key:
				if completed {
					return nil
				}
				return errAborted
			}
		case <-c.closed:
			return errFabricGone
		}
	}
}

// Close drops the connection and waits for the reader.
func (c *fabricClient) Close() error {
	c.stop()
	err := c.conn.Close()
	<-c.done
	return err
}
