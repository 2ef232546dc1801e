//go:build !unix

package taskd

// syscallNoFollow is not available here; the walk skips symlinks instead.
const syscallNoFollow = 0
