package ckpt

import (
	"net"

	"golang.org/x/sys/unix"
)

// Marks of a replica's traffic in the background: DSCP CS1, the class
// that switches with QoS classes queue behind the rest (in the TOS byte,
// 0x20), and the socket priority TC_PRIO_BULK, the band that Linux's
// default queueing (pfifo_fast, prio) sends last.
const (
	bulkTOS      = 0x20
	bulkPriority = 2
)

// markBulk marks c's traffic, both ways (a receiver's acknowledgements
// too), as background, so that a replica yields the link to the job's
// collectives wherever the queues honor it. Failing to is harmless.
func markBulk(c net.Conn) {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return
	}
	raw, err := tc.SyscallConn()
	if err != nil {
		return
	}
	raw.Control(func(fd uintptr) {
		_ = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_TOS, bulkTOS)
		_ = unix.SetsockoptInt(int(fd), unix.IPPROTO_IPV6, unix.IPV6_TCLASS, bulkTOS)
		// After the TOS, which sets the priority from its own bits.
		_ = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PRIORITY, bulkPriority)
	})
}
