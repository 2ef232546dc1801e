package netcheck

import (
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// unacked returns how many bytes written to c its peer has not
// acknowledged yet, so that a transfer cut short counts only what arrived.
func unacked(c net.Conn) int64 {
	if cc, ok := c.(*ctxConn); ok {
		c = cc.Conn
	}
	sc, ok := c.(syscall.Conn)
	if !ok {
		return 0
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return 0
	}
	var n int
	raw.Control(func(fd uintptr) { n, _ = unix.IoctlGetInt(int(fd), unix.SIOCOUTQ) })
	return int64(n)
}
