package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// outMarker marks a folder the demo made, which the next run may replace.
const outMarker = ".faultline-demo"

// prepareOut returns the absolute path of a fresh, empty output folder at
// dir: it creates dir, or empties one that the demo made (it holds
// outMarker), and refuses any other non-empty folder, so that a mistyped
// --out never deletes someone's files.
func prepareOut(dir string) (string, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	ents, err := os.ReadDir(abs)
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		return "", fmt.Errorf("output folder: %w", err)
	case len(ents) == 0:
	default:
		if _, err := os.Lstat(filepath.Join(abs, outMarker)); err != nil {
			return "", fmt.Errorf("output folder %s is not empty and was not made by the demo (no %s in it): give --out a new or empty folder", abs, outMarker)
		}
		// Only what the demo wrote: the folder's entries, not the folder,
		// so that a symlinked --out stays a symlink.
		for _, e := range ents {
			if err := os.RemoveAll(filepath.Join(abs, e.Name())); err != nil {
				return "", fmt.Errorf("output folder: %w", err)
			}
		}
	}
	if err := os.MkdirAll(abs, 0o755); err != nil {
		return "", fmt.Errorf("output folder: %w", err)
	}
	note := "Written by faultline's examples/demo; the next run of the demo replaces this folder.\n"
	if err := os.WriteFile(filepath.Join(abs, outMarker), []byte(note), 0o644); err != nil {
		return "", fmt.Errorf("output folder: %w", err)
	}
	return abs, nil
}

// shmPrefix names the demo's shared-memory folders:
// /dev/shm/faultline-demo-<pid>.
const shmPrefix = "faultline-demo-"

// sweepShm removes the shared-memory folders of demos whose process is
// gone (killed before they could clean up) and returns the paths removed.
func sweepShm(shm string) []string {
	paths, _ := filepath.Glob(filepath.Join(shm, shmPrefix+"*"))
	var removed []string
	for _, p := range paths {
		pid, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(p), shmPrefix))
		if err != nil || pid <= 0 || pid == os.Getpid() {
			continue
		}
		if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
			continue // alive, or not ours to judge
		}
		if os.RemoveAll(p) == nil {
			removed = append(removed, p)
		}
	}
	return removed
}
