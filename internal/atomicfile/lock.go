//go:build unix

package atomicfile

import (
	"errors"
	"fmt"
	"io/fs"
	"os"

	"golang.org/x/sys/unix"
)

// Lock takes an exclusive flock on the file name (created with mode perm
// if missing; a symlink is refused), waiting for the holder, and returns
// what releases it. The lock belongs to the open file: two callers in one
// process exclude each other too, and a process that dies releases its
// locks at once.
func Lock(name string, perm fs.FileMode) (unlock func(), err error) {
	f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE|unix.O_NOFOLLOW, perm)
	if err != nil {
		return nil, err
	}
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX)
		if !errors.Is(err, unix.EINTR) {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("flock %s: %w", name, err)
	}
	return func() { f.Close() }, nil // closing it releases the lock
}
