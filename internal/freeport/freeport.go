package freeport

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
)

// Find looks among [lowest, highest] below the ephemeral range and
// [its end + 1, 65535] above it: below lowest lie the ports services are
// given by number, and from 30000 to 32767 Kubernetes' NodePorts, which
// kube-proxy may answer on a node's loopback.
const (
	lowest  = 10000
	highest = 29999
)

// Find returns a port p such that p to p+n-1 were free for TCP on every
// address when it looked. It holds none of them: a caller that needs
// several ports asks for them in one call. They come from outside the
// kernel's ephemeral range and its reserved ports where there is room,
// from the kernel's choice where there is none.
func Find(n int) (int, error) {
	if n < 1 || n > 1000 {
		return 0, fmt.Errorf("freeport: %d ports in a row: give 1 to 1000", n)
	}
	lo, hi, reserved := kernelRanges()
	// The first ports a run may start at, in spans of room.
	var starts [][2]int
	room := 0
	for _, s := range outside(lo, hi) {
		if s[1]-s[0]+1 >= 10*n {
			starts = append(starts, [2]int{s[0], s[1] - n + 1})
			room += s[1] - n + 1 - s[0] + 1
		}
	}
	for range 200 {
		p := 0
		if room == 0 {
			l, err := net.Listen("tcp", ":0")
			if err != nil {
				return 0, fmt.Errorf("freeport: %w", err)
			}
			p = l.Addr().(*net.TCPAddr).Port
			l.Close()
		} else {
			i := rand.IntN(room)
			for _, s := range starts {
				if i <= s[1]-s[0] {
					p = s[0] + i
					break
				}
				i -= s[1] - s[0] + 1
			}
		}
		if p+n-1 <= 65535 && !overlaps(reserved, p, p+n-1) && free(p, n) {
			return p, nil
		}
	}
	return 0, fmt.Errorf("freeport: no %d free ports in a row in 200 tries", n)
}

// kernelRanges returns the kernel's ephemeral range (Linux's default
// where it cannot be read) and its reserved ports.
func kernelRanges() (lo, hi int, reserved [][2]int) {
	lo, hi = 32768, 60999
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if l, h, ok := parseRange(string(b)); ok {
			lo, hi = l, h
		}
	}
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_reserved_ports"); err == nil {
		reserved, _ = parseReserved(string(b))
	}
	return lo, hi, reserved
}

// outside returns the spans Find looks in, around the ephemeral range
// [lo, hi]; a span may be empty (its end before its start).
func outside(lo, hi int) [][2]int {
	return [][2]int{{lowest, min(highest, lo-1)}, {hi + 1, 65535}}
}

// overlaps says whether [lo, hi] meets one of ranges.
func overlaps(ranges [][2]int, lo, hi int) bool {
	for _, r := range ranges {
		if lo <= r[1] && r[0] <= hi {
			return true
		}
	}
	return false
}

// free says whether p to p+n-1 can each be bound on every address.
func free(p, n int) bool {
	ls := make([]net.Listener, 0, n)
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for i := range n {
		l, err := net.Listen("tcp", ":"+strconv.Itoa(p+i))
		if err != nil {
			return false
		}
		ls = append(ls, l)
	}
	return true
}

// parseRange reads ip_local_port_range: two ports, the first no greater.
func parseRange(s string) (lo, hi int, ok bool) {
	f := strings.Fields(s)
	if len(f) != 2 {
		return 0, 0, false
	}
	lo, err1 := strconv.Atoi(f[0])
	hi, err2 := strconv.Atoi(f[1])
	if err1 != nil || err2 != nil || lo < 1 || lo > hi || hi > 65535 {
		return 0, 0, false
	}
	return lo, hi, true
}

// parseReserved reads ip_local_reserved_ports: ports and ranges of them
// ("8080,20000-29999"), or nothing.
func parseReserved(s string) ([][2]int, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, nil
	}
	var ranges [][2]int
	for _, item := range strings.Split(s, ",") {
		a, b, isRange := strings.Cut(item, "-")
		if !isRange {
			b = a
		}
		lo, err1 := strconv.Atoi(a)
		hi, err2 := strconv.Atoi(b)
		if err1 != nil || err2 != nil || lo < 0 || lo > hi || hi > 65535 {
			return nil, fmt.Errorf("freeport: ip_local_reserved_ports: %q is no port or range of ports", item)
		}
		ranges = append(ranges, [2]int{lo, hi})
	}
	return ranges, nil
}
