package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/faultline-ml/faultline/hang"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/trace"
)

// drain takes in what the ranks wrote to their rings every
// MonitorInterval until ctx ends.
func (a *Agent) drain(ctx context.Context) {
	t := time.NewTicker(a.cfg.MonitorInterval)
	defer t.Stop()
	for {
		for _, s := range a.slots {
			s.drainRing()
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// maxOpen bounds the ranges a slot remembers while they are open.
const maxOpen = 4096

// openRange is a range whose start the ring gave and whose end it has not.
type openRange struct {
	kind  trace.Kind
	step  int64 // for a step range, its number; else -1
	start int64 // unix nanoseconds
}

// drainRing reads the slot's ring. A ring the rank corrupted (it maps it
// read-write) is skipped to its end, and said once.
func (s *slot) drainRing() {
	s.drainMu.Lock()
	defer s.drainMu.Unlock()
	if _, err := s.ring.Drain(s.take); err != nil {
		s.a.log.Warn("agent: rank's dotting ring is corrupt; skipping what it holds", "rank", s.rank, "err", err)
	}
}

// take is one record of the slot's ring.
func (s *slot) take(r *RingRecord) {
	s.mu.Lock()
	pid := 0
	if s.proc != nil {
		pid = s.proc.pid
	}
	s.mu.Unlock()
	domain := trace.DomainDefault
	if r.Domain == RingDomainCommunication {
		domain = trace.DomainCommunication
	}
	rec := trace.Record{Kind: trace.ActivityKindMarker, SourceKind: trace.SourceKindHost, Timestamp: uint64(r.Time), ID: r.ID,
		ProcessID: uint32(pid), ThreadID: r.TID, DeviceID: uint32(s.local), Domain: domain}
	switch r.Type {
	case RingRangeStart, RingMark:
		name := string(r.Name)
		kind, ok := trace.KindOf(name, domain)
		if !ok {
			return
		}
		if r.Type == RingMark {
			_, _, rec.Flag = kind.Flags()
			rec.Name = name
			s.rec.Record(&rec)
			return
		}
		step := int64(-1)
		if kind == trace.Step {
			step, _ = strconv.ParseInt(strings.TrimPrefix(name, "step "), 10, 64)
		}
		s.openRange(r.ID, openRange{kind: kind, step: step, start: r.Time})
		rec.Flag, _, _ = kind.Flags()
		rec.Name = name
		s.rec.Record(&rec)
	case RingRangeEnd:
		o, ok := s.closeRange(r.ID)
		if !ok {
			return
		}
		_, rec.Flag, _ = o.kind.Flags()
		s.rec.Record(&rec)
		if o.step >= 0 {
			s.stepDone(o.step, time.Unix(0, r.Time), time.Duration(r.Time-o.start))
		}
	case RingCollectiveStart:
		op, err := trace.ParseCommOp(string(r.Name))
		if err != nil {
			return
		}
		s.timings[r.ID] = s.op(op.OpName, op.GroupName).Start(int(op.StreamID))
		if !s.noted[op.GroupName] {
			// The communicator's connections are made: note their ports.
			s.noted[op.GroupName] = true
			s.notePorts(pid)
		}
		rec.Flag, _, _ = trace.CommunicationOperator.Flags()
		rec.Name, rec.Domain = string(r.Name), trace.DomainCommunication
		s.rec.Record(&rec) // written only while CommunicationOperator is on
	case RingCollectiveEnd, RingCollectiveError:
		t, ok := s.timings[r.ID]
		if !ok {
			return
		}
		delete(s.timings, r.ID)
		if r.Type == RingCollectiveError {
			t.Fail(errors.New(string(r.Name)))
		} else {
			t.End()
		}
		_, rec.Flag, _ = trace.CommunicationOperator.Flags()
		rec.Domain = trace.DomainCommunication
		s.rec.Record(&rec)
	}
}

func (s *slot) openRange(id uint64, o openRange) {
	if len(s.opens) >= maxOpen {
		clear(s.opens) // a rank that never ends its ranges
	}
	s.opens[id] = o
}

func (s *slot) closeRange(id uint64) (openRange, bool) {
	o, ok := s.opens[id]
	delete(s.opens, id)
	return o, ok
}

// op returns the watchdog's op of a collective.
func (s *slot) op(name, group string) *hang.Op {
	key := name + "\x00" + group
	o := s.ops[key]
	if o == nil {
		o = s.wd.Op(name, group)
		s.ops[key] = o
	}
	return o
}

// stepDone notes that the rank completed step n at t, after d.
func (s *slot) stepDone(n int64, t time.Time, d time.Duration) {
	s.mu.Lock()
	s.lastStep = n
	s.mu.Unlock()
	s.a.incident.step(s.rank, n, t)
	if limit := s.a.cfg.CollectiveTimeout; limit > 0 && d > limit {
		s.a.warnOnce.Do(func() {
			fmt.Fprintf(s.a.cfg.Stderr, "faultline-run: warning: rank %d's step %d took %v, longer than --collective-timeout %v: a collective waiting on a rank still in its step would be called a hang; raise the timeout, or leave it out to learn it from the job\n",
				s.rank, n, d.Round(time.Millisecond), limit)
		})
	}
}

// onHang takes a fault of the slot's watchdog: a collective past its
// timeout or one that failed.
func (s *slot) onHang(f hang.Fault) {
	go s.a.hangFault(s, f)
}

// hangFault handles a collective that hung or failed on slot s: a failed
// one is an op error of the rank; for a hung one the agent takes every
// local rank's stacks before anything moves, merges them, and reports the
// rank they single out as hung (the rank that is not where the others
// are), which starts the recovery.
func (a *Agent) hangFault(s *slot, f hang.Fault) {
	if a.terminating() != 0 || a.growing() {
		return // the ranks are ending: their collectives fail with their peers
	}
	now := time.Now()
	pos := taskd.Position{Node: a.cfg.NodeRank, Rank: s.rank}
	if f.Kind == hang.FaultOpError {
		if errors.Is(f.Err, errStopped) {
			return
		}
		tf := taskd.Fault{Kind: taskd.FaultOpError, Position: pos, Message: f.String(), Time: f.Time,
			Attrs: map[string]string{"op": f.Op, "group": f.Group}}
		if addr, ok := peerAddr(f.String()); ok {
			tf.Attrs[attrPeer] = addr.String()
			if localAddr(addr.Addr()) { // else a rank of another node's
				if r := a.rankOfPeer(addr.Port(), s.rank); r >= 0 {
					tf.Attrs[attrPeerRank] = strconv.Itoa(r)
				} else if r, port := a.closedPeer(s.rank); r >= 0 {
					tf.Attrs[attrPeerRank] = strconv.Itoa(r)
					tf.Attrs[attrPeerClosedPort] = strconv.Itoa(int(port))
				}
			}
		}
		if a.incident.fault(tf, now) {
			s.report(tf)
			a.stopOthers(s, tf.Message)
		}
		return
	}
	if f.Kind != hang.FaultHang {
		return
	}
	in, first := a.incident.hang(f, now)
	if !first {
		return // the agent is already diagnosing this hang
	}
	fmt.Fprintf(a.cfg.Stderr, "faultline-run: rank %d: %s\n", s.rank, f)
	culprits, where := a.diagnoseHang(in)
	if a.cfg.Nodes > 1 {
		go a.sendStacks("", f.String())
	}
	if len(culprits) == 0 {
		culprits = []int{s.rank}
	}
	for _, r := range culprits {
		t := a.slotOf(r)
		if t == nil {
			continue
		}
		msg := f.String()
		if where != "" {
			msg += "; merged stacks: " + where
		}
		t.report(taskd.Fault{Kind: taskd.FaultHang, Position: taskd.Position{Node: a.cfg.NodeRank, Rank: r}, Message: msg, Time: f.Time,
			Attrs: map[string]string{"op": f.Op, "group": f.Group, "stacks": in.Dir}})
	}
}

// notePorts notes the TCP sockets that pid, the slot's process, holds
// now, beside those noted before: once it is gone, or has closed them,
// its ends of its connections still say whom a peer's error names.
func (s *slot) notePorts(pid int) {
	inodes := socketInodes(pid)
	if len(inodes) == 0 {
		return
	}
	var socks []tcpSocket
	for _, table := range []string{"tcp", "tcp6"} {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, table))
		if errors.Is(err, fs.ErrNotExist) && table == "tcp6" {
			continue // no IPv6 on this host
		}
		if err != nil {
			return // a note of part would stamp the rest gone
		}
		socks = append(socks, tcpSockets(b, inodes)...)
	}
	if len(socketInodes(pid)) == 0 {
		return // it ended while noted: its sockets were not closed one by one
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil || s.proc.pid != pid {
		return
	}
	s.note(socks)
}

// maxGone bounds the sockets noted that their process has closed since:
// a job that makes and ends groups as it goes keeps the latest.
const maxGone = 1024

// note adds open, the sockets the slot's process holds now, to those
// noted, stamped with this note's number; a socket noted before and not
// held now is stamped gone at it. s.mu is held.
func (s *slot) note(open []tcpSocket) {
	s.notes++
	held := make(map[string]bool, len(open))
	for _, k := range open {
		held[k.inode] = true
	}
	known := make(map[string]bool, len(s.socks))
	gone := 0
	for i := range s.socks {
		k := &s.socks[i]
		known[k.inode] = true
		if k.gone == 0 && !held[k.inode] {
			k.gone = s.notes
		}
		if k.gone != 0 {
			gone++
		}
	}
	for _, k := range open {
		if !known[k.inode] {
			k.first = s.notes
			s.socks = append(s.socks, k)
		}
	}
	if gone > maxGone {
		slices.SortStableFunc(s.socks, func(a, b tcpSocket) int { return cmp.Compare(goneOrder(a), goneOrder(b)) })
		s.socks = slices.Delete(s.socks, 0, gone-maxGone)
	}
}

// closedBefore reports whether the socket was seen closed at a note of
// its slot's before note n.
func (k tcpSocket) closedBefore(n int) bool { return k.gone != 0 && k.gone < n }

// goneOrder sorts the sockets closed earliest first, those held last.
func goneOrder(k tcpSocket) int {
	if k.gone == 0 {
		return math.MaxInt
	}
	return k.gone
}

// socketInodes returns the inodes of the sockets pid holds open; none
// when it is gone.
func socketInodes(pid int) map[string]bool {
	if pid == 0 {
		return nil
	}
	fds := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(fds)
	if err != nil {
		return nil
	}
	inodes := map[string]bool{}
	for _, e := range ents {
		l, err := os.Readlink(filepath.Join(fds, e.Name()))
		if ino, ok := strings.CutPrefix(l, "socket:["); err == nil && ok {
			inodes[strings.TrimSuffix(ino, "]")] = true
		}
	}
	return inodes
}

// rankOfPeer returns the local rank other than rank at the far end of
// rank's failed connection to port, as an error names it (see
// peerPorts), by the sockets noted: rank's ends whose remote port is a
// reading of port, and the ranks' ends matching them both ways, so that
// a port another rank holds by chance names no one. A connection open at
// both ends did not fail (gloo closes its end on the error), so a match
// counts only where either end is closed now (the far end, once rank's
// process is gone), and of rank's ends to port, an end closed before a
// later one was noted is of an earlier connection. Where rank has no end
// to either reading (the connection failed before the drain saw its
// group start), a rank holding a reading of port on a socket closed now,
// and not closed before its last note, stands for it. -1 when no rank is
// found, or several.
func (a *Agent) rankOfPeer(port uint16, rank int) int {
	own := a.slotOf(rank)
	if own == nil {
		return -1
	}
	ports := peerPorts(port)
	own.mu.Lock()
	mine, notes, ownPid := slices.Clone(own.socks), own.notes, 0
	if own.proc != nil {
		ownPid = own.proc.pid
	}
	own.mu.Unlock()
	mine = slices.DeleteFunc(mine, func(m tcpSocket) bool { return !slices.Contains(ports, m.remote) })
	// An end rank closed before its last note, or before it held a later
	// one to the port, was of an earlier connection: the port went to
	// another's peer since, and its own far end names no one.
	newest := 0
	for _, m := range mine {
		newest = max(newest, m.first)
	}
	var stale []tcpSocket
	mine = slices.DeleteFunc(mine, func(m tcpSocket) bool {
		if m.closedBefore(notes) || m.closedBefore(newest+1) {
			stale = append(stale, m)
			return true
		}
		return false
	})
	// Once rank's process is gone every end of its looks closed: only the
	// far end closed then counts.
	mineOpen := socketInodes(ownPid)
	alive := len(mineOpen) > 0
	// far reports whether k, open by open, is a far end that counts.
	far := func(k tcpSocket, open map[string]bool) bool {
		if len(mine) == 0 {
			// Not an end its rank let go of and went on (see note).
			return slices.Contains(ports, k.local) && !open[k.inode] && k.gone == 0 &&
				!slices.ContainsFunc(stale, func(m tcpSocket) bool { return k.local == m.remote && k.remote == m.local })
		}
		return slices.ContainsFunc(mine, func(m tcpSocket) bool {
			// Not both ends let go of before a note: an ended group's.
			return k.local == m.remote && k.remote == m.local && (!open[k.inode] || alive && !mineOpen[m.inode]) &&
				(m.gone == 0 || k.gone == 0)
		})
	}
	found := -1
	for _, s := range a.slots {
		if s.rank == rank {
			continue
		}
		s.mu.Lock()
		theirs, pid := slices.Clone(s.socks), 0
		if s.proc != nil {
			pid = s.proc.pid
		}
		s.mu.Unlock()
		open := socketInodes(pid)
		if !slices.ContainsFunc(theirs, func(k tcpSocket) bool { return far(k, open) }) {
			continue
		}
		if found >= 0 {
			return -1
		}
		found = s.rank
	}
	return found
}

// closedPeer returns the one local rank whose end of a connection with
// rank's process (both ends as they were noted) is closed now, and the
// port of that end; -1 when no rank's end is, or more than one rank's.
// gloo names at times, for a connection the peer made, the address the
// peer had listened on and closed before it connected, which no table
// holds; the connection's own ends still say which peer let go. While
// rank runs, its own closed ends are the connections that failed (gloo
// closes a pair on its error) and any it closed since its last note:
// each must be one with the rank found, else the failure may be with a
// rank of another agent on this host. An end closed before its rank's
// last note was let go of by a rank that went on: it names no one, and
// is no connection that failed.
func (a *Agent) closedPeer(rank int) (int, uint16) {
	own := a.slotOf(rank)
	if own == nil {
		return -1, 0
	}
	own.mu.Lock()
	mine, notes, ownPid := slices.Clone(own.socks), own.notes, 0
	if own.proc != nil {
		ownPid = own.proc.pid
	}
	own.mu.Unlock()
	found, port := -1, uint16(0)
	var with []tcpSocket // rank's ends of its connections with found
	for _, s := range a.slots {
		if s.rank == rank {
			continue
		}
		s.mu.Lock()
		pid := 0
		if s.proc != nil {
			pid = s.proc.pid
		}
		var ends, theirs []tcpSocket // s's ends of rank's connections, and rank's
		for _, k := range s.socks {
			if i := slices.IndexFunc(mine, func(m tcpSocket) bool {
				return m.local == k.remote && m.remote == k.local && !m.closedBefore(notes)
			}); i >= 0 {
				ends, theirs = append(ends, k), append(theirs, mine[i])
			}
		}
		s.mu.Unlock()
		if len(ends) == 0 {
			continue
		}
		open := socketInodes(pid)
		for _, k := range ends {
			if open[k.inode] || k.gone != 0 {
				continue // open, or let go of by a rank that went on
			}
			if found >= 0 && found != s.rank {
				return -1, 0
			}
			found, port, with = s.rank, k.local, theirs
		}
	}
	if open := socketInodes(ownPid); found >= 0 && len(open) > 0 {
		for _, m := range mine {
			// An end closed before rank's last note is of a group ended
			// before, not of this failure.
			if m.remote != 0 && !open[m.inode] && !m.closedBefore(notes) && !slices.Contains(with, m) {
				return -1, 0
			}
		}
	}
	return found, port
}

// localAddr reports whether ip is this host's.
func localAddr(ip netip.Addr) bool {
	if ip.IsLoopback() {
		return true
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if got, ok := netip.AddrFromSlice(n.IP); ok && got.Unmap() == ip.Unmap() {
				return true
			}
		}
	}
	return false
}

// slotOf returns the local slot of a global rank, nil when it is not on
// this node.
func (a *Agent) slotOf(rank int) *slot {
	l := rank - a.cfg.NodeRank*a.cfg.ProcsPerNode
	if l < 0 || l >= len(a.slots) {
		return nil
	}
	return a.slots[l]
}
