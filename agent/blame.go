package agent

import (
	"bytes"
	"fmt"
	"math/bits"
	"net/netip"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/faultline-ml/faultline/taskd"
)

// Kinds of IncidentFault beyond taskd's fault kinds.
const (
	kindRemote = "remote" // the manager paused this node's ranks for a fault elsewhere
	kindPeer   = "peer"   // a rank that a peer's collective error names, with no fault of its own
)

// blame picks an incident's root cause among its faults, in the order
// this node saw them: the rank the others' errors follow from. It returns
// the fault that stands for it and the evidence that chose it:
//
//  1. a collective error naming a peer's address points at the local
//     rank at the far end of the erring rank's connection to it (see
//     rankOfPeer), or, where none is, at the one local rank whose
//     end of a connection with the erring rank had closed (and one that
//     names a third rank's points on):
//     the rank pointed at last is the cause, through its own exit when it
//     had one, else its own first fault, else itself (kind peer);
//  2. else a rank that exited (with a code, or killed by a signal)
//     without a failed collective of its own beats the collective errors,
//     which follow from its death: the first such exit;
//  3. else the first fault.
//
// A hang seen first is left to its merged stacks. Faults must not be
// empty.
func blame(faults []IncidentFault) (IncidentFault, string) {
	first := faults[0]
	if first.Kind == string(taskd.FaultHang) {
		return first, "a collective ran past its timeout: the merged stacks name the rank (see verdict)"
	}
	own := func(rank int) (IncidentFault, bool) {
		i := slices.IndexFunc(faults, func(f IncidentFault) bool { return f.Rank == rank && f.Kind == string(taskd.FaultProcessExit) })
		if i < 0 {
			i = slices.IndexFunc(faults, func(f IncidentFault) bool { return f.Rank == rank })
		}
		if i < 0 {
			return IncidentFault{}, false
		}
		return faults[i], true
	}
	pointing := func(rank int) (IncidentFault, bool) {
		i := slices.IndexFunc(faults, func(f IncidentFault) bool {
			return f.Rank == rank && f.PeerRank != nil && *f.PeerRank != rank
		})
		if i < 0 {
			return IncidentFault{}, false
		}
		return faults[i], true
	}

	// 1. Errors that name a peer: follow them to the rank they end at.
	var remote string
	for _, f := range faults {
		if f.PeerRank == nil {
			if f.Peer != "" && remote == "" {
				remote = fmt.Sprintf("rank %d's error names %s, which no rank of this node held: the cause may be on another node", f.Rank, f.Peer)
			}
			continue
		}
		if *f.PeerRank == f.Rank {
			continue
		}
		chain := []string{fmt.Sprintf("rank %d's collective error names %s, %s", f.Rank, f.Peer, heldBy(f))}
		seen := map[int]bool{f.Rank: true}
		at, by := *f.PeerRank, f.Rank
		for !seen[at] {
			seen[at] = true
			g, ok := pointing(at)
			if !ok {
				break
			}
			chain = append(chain, fmt.Sprintf("whose own names %s, %s", g.Peer, heldBy(g)))
			at, by = *g.PeerRank, g.Rank
		}
		why := strings.Join(chain, ", ")
		if g, ok := own(at); ok {
			return g, why
		}
		return IncidentFault{Kind: kindPeer, Rank: at, Time: f.Time,
			Message: fmt.Sprintf("rank %d: rank %d's collective failed on its connection to it", at, by)}, why
	}

	// 2. An exit beats the collective errors of its peers.
	failed := map[int]bool{}
	for _, f := range faults {
		if f.Kind == string(taskd.FaultOpError) {
			failed[f.Rank] = true
		}
	}
	if len(failed) > 0 {
		for _, f := range faults {
			if f.Kind == string(taskd.FaultProcessExit) && !failed[f.Rank] {
				var ranks []int
				for r := range failed {
					ranks = append(ranks, r)
				}
				slices.Sort(ranks)
				return f, fmt.Sprintf("rank %d ended without a failed collective of its own; the collective errors of ranks %v follow from its end", f.Rank, ranks)
			}
		}
	}

	// 3. The first fault.
	why := "the first fault seen"
	if len(faults) > 1 {
		why = fmt.Sprintf("the first of %d faults seen; none names another rank", len(faults))
	}
	if remote != "" {
		why += "; " + remote
	}
	return first, why
}

// heldBy says how f's peer rank was found from the address its error
// names.
func heldBy(f IncidentFault) string {
	if f.PeerClosedPort != 0 {
		return fmt.Sprintf("which no rank of this node held; of rank %d's connections with this node's ranks, only rank %d's end (port %d) was closed when the error came", f.Rank, *f.PeerRank, f.PeerClosedPort)
	}
	return fmt.Sprintf("a socket of rank %d", *f.PeerRank)
}

// peerPattern finds an address in brackets with a port, as gloo's errors
// name a peer ("Connection closed by peer [127.0.0.1]:14772").
var peerPattern = regexp.MustCompile(`\[([0-9A-Fa-f.:]+)\]:(\d{1,5})`)

// peerAddr returns the peer address an error message names, if any.
func peerAddr(msg string) (netip.AddrPort, bool) {
	for _, m := range peerPattern.FindAllStringSubmatch(msg, -1) {
		ip, err := netip.ParseAddr(m[1])
		if err != nil {
			continue
		}
		port, err := strconv.ParseUint(m[2], 10, 16)
		if err != nil {
			continue
		}
		return netip.AddrPortFrom(ip.Unmap(), uint16(port)), true
	}
	return netip.AddrPort{}, false
}

// peerPorts returns the ports that may stand for port in an error: port
// itself, and port with its bytes swapped (gloo 2022 prints sin_port in
// network byte order, unconverted).
func peerPorts(port uint16) []uint16 {
	if sw := bits.ReverseBytes16(port); sw != port {
		return []uint16{port, sw}
	}
	return []uint16{port}
}

// tcpSocket is a TCP socket of a rank's process, as notePorts saw it.
type tcpSocket struct {
	inode         string
	local, remote uint16 // ports
	// first is the number of the slot's note that first saw it, gone
	// that of the first that did not (0 while held): see slot.note.
	first, gone int
}

// tcpSockets returns the sockets in table (the text of
// /proc/<pid>/net/tcp or tcp6) whose inodes are in inodes. A line it
// cannot read is skipped.
func tcpSockets(table []byte, inodes map[string]bool) []tcpSocket {
	port := func(addr string) (uint16, bool) {
		_, hex, ok := strings.Cut(addr, ":")
		p, err := strconv.ParseUint(hex, 16, 16)
		return uint16(p), ok && err == nil
	}
	var socks []tcpSocket
	for i, line := range bytes.Split(table, []byte("\n")) {
		fields := strings.Fields(string(line))
		if i == 0 || len(fields) < 10 || !inodes[fields[9]] {
			continue
		}
		local, ok1 := port(fields[1])
		remote, ok2 := port(fields[2])
		if ok1 && ok2 {
			socks = append(socks, tcpSocket{inode: fields[9], local: local, remote: remote})
		}
	}
	return socks
}
