//go:build unix

package atomicfile

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestLockExcludes: a second Lock of the same file waits until the first
// is released.
func TestLockExcludes(t *testing.T) {
	name := filepath.Join(t.TempDir(), "dir.lock")
	unlock, err := Lock(name, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan func(), 1)
	go func() {
		u, err := Lock(name, 0o644)
		if err != nil {
			t.Error(err)
			u = func() {}
		}
		got <- u
	}()
	select {
	case <-got:
		t.Fatal("the second Lock did not wait for the first")
	case <-time.After(50 * time.Millisecond):
	}
	unlock()
	(<-got)()
}

func TestLockRefusesSymlink(t *testing.T) {
	dir := t.TempDir()
	name := filepath.Join(dir, "dir.lock")
	if err := os.Symlink(filepath.Join(dir, "elsewhere"), name); err != nil {
		t.Fatal(err)
	}
	if _, err := Lock(name, 0o644); err == nil {
		t.Fatal("a symlink was locked")
	}
}
