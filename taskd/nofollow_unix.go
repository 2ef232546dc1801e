//go:build unix

package taskd

import "syscall"

// syscallNoFollow makes opening a symlink fail.
const syscallNoFollow = syscall.O_NOFOLLOW
