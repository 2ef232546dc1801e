package python

import (
	"bytes"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
)

// Package holds the source of the faultline Python package, the files
// faultline/*.py. (A pattern naming the folder would leave out
// __init__.py and the _*.py modules; "all:" would take a __pycache__.)
//
//go:embed faultline/*.py
var Package embed.FS

// Extract writes Package into a folder under dir named by the hash of its
// content, unless it is there already, and returns that folder: the one to
// put on PYTHONPATH. Launchers extracting at once are safe: each writes a
// folder of its own and renames it into place, and the first rename wins.
// A folder already there whose files differ from Package is an error
// naming the file (ranks may be importing from it; it is left alone).
func Extract(dir string) (string, error) {
	files, sum, err := contents()
	if err != nil {
		return "", err
	}
	final := filepath.Join(dir, "faultline-python-"+sum)
	if _, err := os.Stat(final); err == nil {
		return check(final, files)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("python: extract: %w", err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("python: extract: %w", err)
	}
	tmp, err := os.MkdirTemp(dir, ".faultline-python-*")
	if err != nil {
		return "", fmt.Errorf("python: extract: %w", err)
	}
	defer os.RemoveAll(tmp) // a no-op once renamed
	if err := write(tmp, files); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, final); err != nil {
		if _, serr := os.Stat(final); serr == nil {
			return check(final, files) // another launcher got there first
		}
		return "", fmt.Errorf("python: extract: %w", err)
	}
	if err := syncDir(dir); err != nil {
		return "", err
	}
	return final, nil
}

// contents returns the embedded files by path and the hex digest (16
// bytes) of their names and contents.
func contents() (map[string][]byte, string, error) {
	files := map[string][]byte{}
	h := sha256.New()
	err := fs.WalkDir(Package, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := Package.ReadFile(p)
		if err != nil {
			return err
		}
		files[p] = b
		fmt.Fprintf(h, "%s\x00%d\x00", p, len(b))
		h.Write(b)
		return nil
	})
	if err != nil {
		return nil, "", fmt.Errorf("python: embedded package: %w", err)
	}
	return files, hex.EncodeToString(h.Sum(nil)[:16]), nil
}

// check returns dir if it holds files, else an error naming the first
// file that differs.
func check(dir string, files map[string][]byte) (string, error) {
	for p, want := range files {
		got, err := os.ReadFile(filepath.Join(dir, filepath.FromSlash(p)))
		if err == nil && !bytes.Equal(got, want) {
			err = errors.New("differs from the embedded package")
		}
		if err != nil {
			return "", fmt.Errorf("python: extracted package %s: %s: %w (remove the folder to extract it again)", dir, p, err)
		}
	}
	return dir, nil
}

// write writes files under dir and syncs them.
func write(dir string, files map[string][]byte) error {
	if err := os.Chmod(dir, 0o755); err != nil {
		return fmt.Errorf("python: extract: %w", err)
	}
	for p, b := range files {
		name := filepath.Join(dir, filepath.FromSlash(p))
		if err := os.MkdirAll(filepath.Join(dir, filepath.FromSlash(path.Dir(p))), 0o755); err != nil {
			return fmt.Errorf("python: extract: %w", err)
		}
		f, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
		if err != nil {
			return fmt.Errorf("python: extract: %w", err)
		}
		_, err = f.Write(b)
		if err == nil {
			err = f.Sync()
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("python: extract %s: %w", name, err)
		}
	}
	return errors.Join(syncDir(filepath.Join(dir, "faultline")), syncDir(dir))
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("python: extract: %w", err)
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("python: extract: sync %s: %w", dir, err)
	}
	return nil
}
