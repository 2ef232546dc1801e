package ckpt

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/faultline-ml/faultline/internal/testkit"
)

func TestMain(m *testing.M) {
	// The crash tests re-execute this binary as the trainer or the owner
	// that they SIGKILL.
	if role := testkit.Role(); role != "" {
		os.Exit(runChild(role))
	}
	goleak.VerifyTestMain(m)
}

// shmDir returns a fresh directory in /dev/shm (a real tmpfs), removed
// after the test.
func shmDir(t testing.TB) string {
	t.Helper()
	base := "/dev/shm"
	if fi, err := os.Stat(base); err != nil || !fi.IsDir() {
		return t.TempDir()
	}
	d, err := os.MkdirTemp(base, "ckpt-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}
