//go:build unix

package taskd

import "syscall"

// defaultMaxConnections is half the process's open-file limit, between 64
// and 16384, so that connections never take the descriptors the server
// needs for its files.
func defaultMaxConnections() int {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil || rl.Cur == 0 {
		return 4096
	}
	return int(min(max(uint64(rl.Cur)/2, 64), 16384))
}
