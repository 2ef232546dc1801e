package testkit

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// RunNoShmLeftovers runs a package's tests (m.Run) and then fails them,
// returning 1, when /dev/shm holds files whose names start with one of
// prefixes (after an optional dot: temporary files) that were not there
// before: shared memory a test made and did not remove, or a job under
// test did not give back. It removes them, so that one run's leak does
// not fail the next. A package's TestMain calls it:
//
//	func TestMain(m *testing.M) { os.Exit(testkit.RunNoShmLeftovers(m, "faultline-")) }
func RunNoShmLeftovers(m *testing.M, prefixes ...string) int {
	before := shmFiles(prefixes)
	code := m.Run()
	var left []string
	for name := range shmFiles(prefixes) {
		if !before[name] {
			left = append(left, name)
			os.Remove(name)
		}
	}
	if len(left) > 0 {
		fmt.Fprintf(os.Stderr, "FAIL: the tests left %d files in /dev/shm (now removed): %s\n", len(left), strings.Join(left, " "))
		return 1
	}
	return code
}

// shmFiles lists the files of /dev/shm named with one of prefixes.
func shmFiles(prefixes []string) map[string]bool {
	out := map[string]bool{}
	ents, _ := os.ReadDir("/dev/shm")
	for _, e := range ents {
		if e.IsDir() {
			continue
		}
		name := strings.TrimPrefix(e.Name(), ".")
		for _, p := range prefixes {
			if strings.HasPrefix(name, p) {
				out[filepath.Join("/dev/shm", e.Name())] = true
			}
		}
	}
	return out
}
