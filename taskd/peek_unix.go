//go:build unix

package taskd

import (
	"net"
	"syscall"
)

// hasBytes reports whether c has bytes waiting to be read, without
// reading them: a peer that speaks, which the server has not read yet.
func hasBytes(c net.Conn) bool {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return false
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	var waiting bool
	var b [1]byte
	rc.Control(func(fd uintptr) {
		n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		waiting = err == nil && n > 0
	})
	return waiting
}
