package atomicfile

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestWriteFileReplaces(t *testing.T) {
	dir := t.TempDir()
	name := filepath.Join(dir, "latest.txt")
	if err := os.WriteFile(name, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(name, []byte("new"), 0o640); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != "new" {
		t.Fatalf("content = %q, want %q", got, "new")
	}
	fi, err := os.Stat(name)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o640 {
		t.Fatalf("mode = %v, want 0640", fi.Mode().Perm())
	}
	assertOnly(t, dir, "latest.txt")
}

func TestAbortKeepsOld(t *testing.T) {
	dir := t.TempDir()
	name := filepath.Join(dir, "m.json")
	if err := WriteFile(name, []byte("v1"), 0o640); err != nil {
		t.Fatal(err)
	}
	f, err := Create(name, 0o640)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write([]byte("half-written")); err != nil {
		t.Fatal(err)
	}
	if err := f.Abort(); err != nil {
		t.Fatal(err)
	}
	if err := f.Commit(); err == nil {
		t.Fatal("Commit after Abort succeeded")
	}
	got, _ := os.ReadFile(name)
	if string(got) != "v1" {
		t.Fatalf("content = %q, want v1", got)
	}
	assertOnly(t, dir, "m.json")
}

func TestCreateInMissingDir(t *testing.T) {
	if _, err := Create(filepath.Join(t.TempDir(), "no", "such", "f"), 0o640); err == nil {
		t.Fatal("Create in a missing directory succeeded")
	}
}

func TestCommitFailureKeepsOld(t *testing.T) {
	dir := t.TempDir()
	name := filepath.Join(dir, "busy")
	// A non-empty folder cannot be renamed over.
	if err := os.MkdirAll(filepath.Join(name, "inside"), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(name, []byte("new"), 0o640); err == nil {
		t.Fatal("WriteFile over a non-empty folder succeeded")
	}
	if fi, err := os.Stat(name); err != nil || !fi.IsDir() {
		t.Fatalf("the folder is gone: %v", err)
	}
	assertOnly(t, dir, "busy")
}

func TestWriteFileReplacesSymlink(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(t.TempDir(), "target")
	if err := os.WriteFile(target, []byte("target"), 0o640); err != nil {
		t.Fatal(err)
	}
	name := filepath.Join(dir, "link")
	if err := os.Symlink(target, name); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(name, []byte("new"), 0o640); err != nil {
		t.Fatal(err)
	}
	if got, _ := os.ReadFile(target); string(got) != "target" {
		t.Fatalf("the symlink's target was written: %q", got)
	}
	if fi, err := os.Lstat(name); err != nil || !fi.Mode().IsRegular() {
		t.Fatalf("%s is not a regular file: %v", name, err)
	}
}

func TestCommitTwice(t *testing.T) {
	f, err := Create(filepath.Join(t.TempDir(), "f"), 0o640)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := f.Commit(); !errors.Is(err, os.ErrClosed) {
		t.Fatalf("second Commit = %v, want os.ErrClosed", err)
	}
	if err := f.Abort(); err != nil {
		t.Fatalf("Abort after Commit = %v, want nil", err)
	}
}

func assertOnly(t *testing.T, dir, want string) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 1 || ents[0].Name() != want {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Fatalf("dir holds %v, want only %s", names, want)
	}
}
