package atomicfile

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// File is a file being written under a temporary name. Its content becomes
// visible under the final name only when Commit returns nil.
type File struct {
	*os.File
	name string // final path
	done bool
}

// Create opens a temporary file beside name, with mode perm, for the caller
// to write. The caller must call Commit or Abort.
func Create(name string, perm fs.FileMode) (*File, error) {
	dir, base := filepath.Split(name)
	if dir == "" {
		dir = "."
	}
	f, err := os.CreateTemp(dir, "."+base+".tmp-*")
	if err != nil {
		return nil, fmt.Errorf("atomicfile: create temporary for %s: %w", name, err)
	}
	if err := f.Chmod(perm); err != nil {
		f.Close()
		os.Remove(f.Name())
		return nil, fmt.Errorf("atomicfile: chmod %s: %w", f.Name(), err)
	}
	return &File{File: f, name: name}, nil
}

// Commit syncs the written data, renames the temporary file to the final
// name and syncs the directory. After an error in the sync or the rename
// the temporary file is removed and the final name keeps its previous
// content; an error in syncing the directory comes after the rename, when
// the new content is in place but may not survive a power loss. A final
// name that is a symlink is replaced, not followed.
func (f *File) Commit() error {
	if f.done {
		return fmt.Errorf("atomicfile: %s: %w", f.name, os.ErrClosed)
	}
	f.done = true
	tmp := f.File.Name()
	err := f.File.Sync()
	if cerr := f.File.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, f.name)
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("atomicfile: commit %s: %w", f.name, err)
	}
	return SyncDir(filepath.Dir(f.name))
}

// Abort closes and removes the temporary file. It is a no-op after Commit,
// so `defer f.Abort()` is safe.
func (f *File) Abort() error {
	if f.done {
		return nil
	}
	f.done = true
	tmp := f.File.Name()
	err := f.File.Close()
	if rerr := os.Remove(tmp); rerr != nil && !errors.Is(rerr, fs.ErrNotExist) {
		err = errors.Join(err, rerr)
	}
	return err
}

// WriteFile atomically replaces name with data, with mode perm.
func WriteFile(name string, data []byte, perm fs.FileMode) error {
	f, err := Create(name, perm)
	if err != nil {
		return err
	}
	defer f.Abort()
	if _, err := f.Write(data); err != nil {
		return fmt.Errorf("atomicfile: write %s: %w", name, err)
	}
	return f.Commit()
}

// SyncDir fsyncs a directory so that a rename or a new entry in it survives
// a power loss.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("atomicfile: open dir %s: %w", dir, err)
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("atomicfile: sync dir %s: %w", dir, err)
	}
	return nil
}
