package freeport

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
)

// lowest is the first port Find considers: below it lie the ports that
// services are given by number.
const lowest = 10000

// Find returns a port p such that p to p+n-1 were free on every address
// when it looked: from outside the kernel's ephemeral range where there is
// room, from the kernel's choice where there is none.
func Find(n int) (int, error) {
	if n < 1 || n > 1000 {
		return 0, fmt.Errorf("freeport: %d ports in a row: give 1 to 1000", n)
	}
	lo, hi := 32768, 60999 // Linux's default
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if l, h, ok := parseRange(string(b)); ok {
			lo, hi = l, h
		}
	}
	var spans [][2]int // the first and last port of room outside it
	for _, s := range [][2]int{{lowest, lo - 1}, {hi + 1, 65535}} {
		if s[1]-s[0]+1 >= 10*n {
			spans = append(spans, s)
		}
	}
	for range 200 {
		var p int
		if len(spans) == 0 {
			l, err := net.Listen("tcp", ":0")
			if err != nil {
				return 0, fmt.Errorf("freeport: %w", err)
			}
			p = l.Addr().(*net.TCPAddr).Port
			l.Close()
		} else {
			s := spans[rand.IntN(len(spans))]
			p = s[0] + rand.IntN(s[1]-s[0]+2-n)
		}
		if p+n-1 <= 65535 && free(p, n) {
			return p, nil
		}
	}
	return 0, fmt.Errorf("freeport: no %d free ports in a row in 200 tries", n)
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
