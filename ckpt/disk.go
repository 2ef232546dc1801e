package ckpt

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/ckpt/layout"
	"github.com/faultline-ml/faultline/internal/atomicfile"
)

// parseStepName returns the step a directory name denotes: a canonical
// non-negative decimal.
func parseStepName(name string) (int64, bool) {
	n, err := strconv.ParseInt(name, 10, 64)
	if err != nil || n < 0 || strconv.FormatInt(n, 10) != name {
		return 0, false
	}
	return n, true
}

// persistChunk is the unit of a write to disk.
const persistChunk = 1 << 20

// writebackWindow is how much a persist writes before it asks the kernel
// to start writing those pages back. Without it a persist leaves up to a
// gigabyte of dirty pages for the final fsync, and the kernel's dirty
// limits throttle every writer on the node while they drain: on a virtual
// disk a 1 GiB persist took 0.7 to 3 s that way, and a steady 0.5 s with
// writeback started window by window.
const writebackWindow = 8 << 20

// writeback streams a file to disk while it is written: each full window
// is handed to writeback at once, the window before it is waited for and
// dropped from the page cache (a persisted step is read back only when
// memory and replicas are gone). The final fsync stays the durability
// point; this only spreads its work over the write.
type writeback struct {
	fd              int
	waited, started int64 // [waited, started) is in writeback, [started, written) is not yet
	written         int64
	unsupported     bool
}

func newWriteback(f *os.File) *writeback {
	return &writeback{fd: int(f.Fd())}
}

// wrote records n more bytes written and starts writeback of a full window.
func (w *writeback) wrote(n int) error {
	w.written += int64(n)
	if w.unsupported || w.written-w.started < writebackWindow {
		return nil
	}
	if err := w.syncRange(w.started, w.written-w.started, unix.SYNC_FILE_RANGE_WRITE); err != nil {
		return err
	}
	if w.started > w.waited {
		// The error of a failed writeback must reach the caller here:
		// waiting consumes it, so the final fsync would not see it.
		if err := w.syncRange(w.waited, w.started-w.waited,
			unix.SYNC_FILE_RANGE_WAIT_BEFORE|unix.SYNC_FILE_RANGE_WRITE|unix.SYNC_FILE_RANGE_WAIT_AFTER); err != nil {
			return err
		}
		// Advice only: a page kept in the cache costs memory, not data.
		_ = unix.Fadvise(w.fd, w.waited, w.started-w.waited, unix.FADV_DONTNEED)
	}
	w.waited, w.started = w.started, w.written
	return nil
}

func (w *writeback) syncRange(off, n int64, flags int) error {
	err := unix.SyncFileRange(w.fd, off, n, flags)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, unix.ENOSYS), errors.Is(err, unix.EINVAL), errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.ESPIPE):
		// A filesystem without it is written the plain way.
		w.unsupported = true
		return nil
	}
	return fmt.Errorf("sync_file_range [%d, %d): %w", off, off+n, err)
}

func wrapNoSpace(err error) error {
	if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) {
		return fmt.Errorf("%w: %w", ErrNoSpace, err)
	}
	return err
}

// mkdirSynced creates dir (whose parent must exist) and makes its entry
// durable. An existing dir must be a directory, not a symlink: a persist
// writes nothing outside the disk tier.
func mkdirSynced(dir string) error {
	err := os.Mkdir(dir, 0o750)
	if errors.Is(err, fs.ErrExist) {
		if fi, err := os.Lstat(dir); err != nil || !fi.IsDir() {
			return fmt.Errorf("ckpt: step directory %s exists and is not a directory (a symlink?)", dir)
		}
		return nil
	}
	if err != nil {
		return wrapNoSpace(fmt.Errorf("ckpt: create step directory: %w", err))
	}
	return atomicfile.SyncDir(filepath.Dir(dir))
}

// persisted says what a persist did with a shard's files.
type persisted int

const (
	wrote     persisted = iota // the step was not committed: written
	kept                       // committed, and its disk copy intact: kept
	rewritten                  // committed, its disk copy damaged: written again
)

// persistHalf writes the sealed step in half i of seg to dir as shard
// numShards: the data file (CRC-checked while written, fsynced, renamed)
// and then its manifest. A step already committed there is checked
// against memory: the same step with its disk copy intact is kept, the
// same step with its copy damaged is written again (to the files the
// commit names, byte for byte), and another step under the same number
// is an error that keeps the committed one.
func persistHalf(ctx context.Context, seg *segment, i int, dir string, numShards int) (layout.ShardManifest, persisted, error) {
	shard := seg.hdr.Shard
	var man layout.ShardManifest
	did := wrote
	err := seg.read(i, true, func(m layout.StepMeta, half []byte, valid func() error) error {
		if !m.Sealed {
			return fmt.Errorf("ckpt: step %d in %s half %d is not sealed", m.Step, seg.path, i)
		}
		stepDir := layout.StepDir(dir, m.Step)
		if committed, err := checkCommitted(stepDir, m, shard, numShards); err != nil || committed {
			if err != nil {
				return err
			}
			if prev, ok := committedShard(stepDir, shard); ok {
				if _, err := scanShardFile(filepath.Join(stepDir, layout.ShardFile(shard)), prev, true); err == nil {
					man, did = prev, kept
					return nil
				}
			}
			did = rewritten
		}
		if err := mkdirSynced(stepDir); err != nil {
			return err
		}
		name := filepath.Join(stepDir, layout.ShardFile(shard))
		f, err := atomicfile.Create(name, 0o640)
		if err != nil {
			return wrapNoSpace(err)
		}
		defer f.Abort()
		wb := newWriteback(f.File)
		man = layout.ShardManifest{Step: m.Step, Shard: shard, NumShards: numShards, Blobs: make([]layout.BlobEntry, 0, len(m.Blobs))}
		for k, e := range m.Blobs {
			data := half[e.Offset : e.Offset+e.Size]
			var c uint32
			for o := 0; o < len(data); o += persistChunk {
				if err := ctx.Err(); err != nil {
					return err
				}
				chunk := data[o:min(o+persistChunk, len(data))]
				c = crc32.Update(c, castagnoli, chunk)
				if _, err := f.Write(chunk); err != nil {
					return wrapNoSpace(fmt.Errorf("ckpt: write %s: %w", name, err))
				}
				if err := wb.wrote(len(chunk)); err != nil {
					return wrapNoSpace(fmt.Errorf("ckpt: write back %s: %w", name, err))
				}
			}
			if c != e.CRC32C {
				return crcMismatch(k, e, c)
			}
			man.Blobs = append(man.Blobs, layout.BlobEntry{Name: e.Name, Offset: man.Size, Size: e.Size, CRC32C: c})
			man.Size += e.Size
		}
		// What was written must be what the step held all along.
		if err := valid(); err != nil {
			return err
		}
		if err := f.Commit(); err != nil {
			return wrapNoSpace(err)
		}
		b, err := man.Marshal()
		if err != nil {
			return err
		}
		return wrapNoSpace(atomicfile.WriteFile(filepath.Join(stepDir, layout.ShardManifestFile(shard)), b, 0o640))
	})
	if err != nil {
		return layout.ShardManifest{}, did, err
	}
	return man, did, nil
}

// checkCommitted says whether m's step is committed in stepDir, and
// returns an error when it is committed with other content for shard
// than m's: the commit is kept, and memory's step is not written over it.
func checkCommitted(stepDir string, m layout.StepMeta, shard, numShards int) (bool, error) {
	name := filepath.Join(stepDir, layout.CommitFile)
	b, err := os.ReadFile(name)
	if err != nil {
		return false, nil
	}
	sm, err := layout.ParseStepManifest(b)
	if err != nil {
		return false, fmt.Errorf("ckpt: step %d: %w (remove %s to persist the step anew)", m.Step, withFile(err, name), stepDir)
	}
	want := layout.ShardManifest{Step: m.Step, Shard: shard, NumShards: numShards}
	for _, e := range m.Blobs {
		want.Blobs = append(want.Blobs, layout.BlobEntry{Name: e.Name, Offset: want.Size, Size: e.Size, CRC32C: e.CRC32C})
		want.Size += e.Size
	}
	ref, err := want.Ref()
	if err == nil && (shard >= len(sm.Shards) || sm.Shards[shard] != ref) {
		err = errOtherContent
	}
	if err != nil {
		return true, fmt.Errorf("ckpt: step %d shard %d is committed in %s, and %w: kept the committed step; save memory's state as another step, or remove %s to persist it anew",
			m.Step, shard, stepDir, err, stepDir)
	}
	return true, nil
}

// errOtherContent is a persist of a step committed with other content:
// an older half holding the committed content does not make up for it.
var errOtherContent = errors.New("memory holds other content under that step")

// committedShard returns the manifest of shard in stepDir if the step is
// committed and the manifest is the committed one.
func committedShard(stepDir string, shard int) (layout.ShardManifest, bool) {
	b, err := os.ReadFile(filepath.Join(stepDir, layout.CommitFile))
	if err != nil {
		return layout.ShardManifest{}, false
	}
	sm, err := layout.ParseStepManifest(b)
	if err != nil || shard < 0 || shard >= len(sm.Shards) {
		return layout.ShardManifest{}, false
	}
	mb, err := os.ReadFile(filepath.Join(stepDir, layout.ShardManifestFile(shard)))
	if err != nil || layout.CRC32C(mb) != sm.Shards[shard].ManifestCRC32C {
		return layout.ShardManifest{}, false
	}
	m, err := layout.ParseShardManifest(mb)
	return m, err == nil
}

// ErrStale is returned by CommitStep for a step older than the one the
// tracker names: trackers never move back.
var ErrStale = errors.New("ckpt: step is older than the committed one")

// lockDir takes the disk tier's layout.LockFile, waiting for the process or
// goroutine that holds it; unlock releases it. A lock belongs to the open
// file, so two callers in one process exclude each other too, and a
// process that dies releases its lock.
func lockDir(dir string) (unlock func(), err error) {
	unlock, err = atomicfile.Lock(filepath.Join(dir, layout.LockFile), 0o640)
	if err != nil {
		return nil, wrapNoSpace(fmt.Errorf("ckpt: lock the disk tier: %w", err))
	}
	return unlock, nil
}

// CommitStep commits a step in dir once every shard of it is durable: it
// writes the step's layout.CommitFile, then the trackers (layout.TrackerFile,
// DLRoverTrackerFile, MegatronTrackerFile), each atomically, holding the
// layout.LockFile of dir. The step directory must exist in dir; on a node that
// holds only some shards it holds only theirs. A control plane that
// learns shard completion from every node calls CommitStep on each;
// LocalCommitter calls it for one.
func CommitStep(dir string, m layout.StepManifest) error {
	unlock, err := lockDir(dir)
	if err != nil {
		return err
	}
	defer unlock()
	return commitStep(dir, m)
}

// commitStep is CommitStep for a caller that holds the lock.
func commitStep(dir string, m layout.StepManifest) error {
	b, err := m.Marshal()
	if err != nil {
		return err
	}
	stepDir := layout.StepDir(dir, m.Step)
	if fi, err := os.Stat(stepDir); err != nil || !fi.IsDir() {
		return fmt.Errorf("ckpt: commit step %d: step directory %s is missing", m.Step, stepDir)
	}
	if cur, err := readTracker(dir); err == nil && cur.Step > m.Step {
		return fmt.Errorf("%w: commit step %d: %s names step %d", ErrStale, m.Step, filepath.Join(dir, layout.TrackerFile), cur.Step)
	}
	if err := atomicfile.WriteFile(filepath.Join(stepDir, layout.CommitFile), b, 0o640); err != nil {
		return wrapNoSpace(err)
	}
	for _, t := range []struct {
		name string
		data []byte
	}{
		{layout.TrackerFile, b},
		{layout.DLRoverTrackerFile, layout.MarshalStepText(m.Step)},
		{layout.MegatronTrackerFile, layout.MarshalStepText(m.Step)},
	} {
		if err := atomicfile.WriteFile(filepath.Join(dir, t.name), t.data, 0o640); err != nil {
			return wrapNoSpace(err)
		}
	}
	return nil
}

func readTracker(dir string) (layout.StepManifest, error) {
	name := filepath.Join(dir, layout.TrackerFile)
	b, err := os.ReadFile(name)
	if err != nil {
		return layout.StepManifest{}, err
	}
	m, err := layout.ParseStepManifest(b)
	return m, withFile(err, name)
}

// Retention says which committed steps the disk tier keeps.
type Retention struct {
	// KeepLatest is how many of the newest committed steps are kept:
	// 0 means 3, a negative value keeps every step.
	KeepLatest int
	// KeepEvery also keeps every step that is a multiple of it (say 1000
	// for a long-lived history); 0 keeps none beyond KeepLatest.
	KeepEvery int64
}

// CommittedSteps lists the steps committed in the disk tier at dir, newest
// first, from the directory alone (nothing is read but each step's
// commit file's presence); a dir that does not exist holds none.
func CommittedSteps(dir string) ([]int64, error) {
	steps, committed, err := stepDirs(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return slices.DeleteFunc(steps, func(s int64) bool { return !committed[s] }), nil
}

// stepDirs lists the step directories of dir (no symlinks), newest first,
// with whether each is committed.
func stepDirs(dir string) (steps []int64, committed map[int64]bool, err error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, nil, fmt.Errorf("ckpt: list %s: %w", dir, err)
	}
	committed = map[int64]bool{}
	for _, e := range ents {
		n, ok := parseStepName(e.Name())
		if !ok || !e.IsDir() {
			continue
		}
		steps = append(steps, n)
		if _, err := os.Stat(filepath.Join(dir, e.Name(), layout.CommitFile)); err == nil {
			committed[n] = true
		}
	}
	slices.Sort(steps)
	slices.Reverse(steps)
	return steps, committed, nil
}

// ApplyRetention removes from dir the committed steps r does not keep and
// the uncommitted step directories older than the newest committed step
// (persists that never completed), holding the layout.LockFile of dir. It never
// removes the step the tracker names, nor anything that is not a step
// directory; a step another process removed meanwhile is no error. It
// returns the steps removed.
func ApplyRetention(dir string, r Retention) ([]int64, error) {
	unlock, err := lockDir(dir)
	if err != nil {
		return nil, err
	}
	defer unlock()
	return applyRetention(dir, r)
}

// applyRetention is ApplyRetention for a caller that holds the lock.
func applyRetention(dir string, r Retention) ([]int64, error) {
	keepLatest := r.KeepLatest
	if keepLatest == 0 {
		keepLatest = 3
	}
	steps, committed, err := stepDirs(dir)
	if err != nil {
		return nil, err
	}
	tracked := int64(-1)
	if m, err := readTracker(dir); err == nil {
		tracked = m.Step
	}
	var newest int64 = -1
	for _, s := range steps {
		if committed[s] {
			newest = s
			break
		}
	}
	var removed []int64
	var errs []error
	kept := 0
	for _, s := range steps {
		keep := s == tracked || s >= newest
		if committed[s] {
			if keepLatest < 0 || kept < keepLatest {
				keep = true
			}
			kept++
			if r.KeepEvery > 0 && s%r.KeepEvery == 0 {
				keep = true
			}
		}
		if keep {
			continue
		}
		// A step vanishes at once, by a rename, so that a crash in the
		// middle of removing its files cannot leave a committed step with
		// some of them gone.
		err := os.Rename(layout.StepDir(dir, s), filepath.Join(dir, fmt.Sprintf("%s%d", removingPrefix, s)))
		if errors.Is(err, fs.ErrNotExist) {
			continue // removed by a process that does not take the lock
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("ckpt: retention: %w", err))
			continue
		}
		removed = append(removed, s)
	}
	if len(removed) > 0 {
		if err := atomicfile.SyncDir(dir); err != nil {
			errs = append(errs, err)
		}
	}
	// Remove what this and any earlier, interrupted, pass set aside.
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if _, ok := parseStepName(strings.TrimPrefix(e.Name(), removingPrefix)); ok && strings.HasPrefix(e.Name(), removingPrefix) && e.IsDir() {
			if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
				errs = append(errs, fmt.Errorf("ckpt: retention: %w", err))
			}
		}
	}
	return removed, errors.Join(errs...)
}

// removingPrefix names a step directory that retention set aside.
const removingPrefix = ".removing-"

// LoadDiskStep reads shard of a given committed step from dir and verifies
// the step manifest, the shard manifest's CRC against it, the data file's
// size and every blob's CRC.
func LoadDiskStep(dir string, step int64, shard int) (*Checkpoint, error) {
	man, err := checkDiskShard(dir, step, shard)
	if err != nil {
		return nil, err
	}
	return readShardFile(filepath.Join(layout.StepDir(dir, step), layout.ShardFile(shard)), man)
}

// VerifyDiskStep checks shard of a committed step in dir as LoadDiskStep
// does, every CRC included, without keeping what it reads: whether the
// shard can be loaded. An error that wraps layout.ErrCorrupt is damage.
func VerifyDiskStep(dir string, step int64, shard int) error {
	man, err := checkDiskShard(dir, step, shard)
	if err != nil {
		return err
	}
	_, err = scanShardFile(filepath.Join(layout.StepDir(dir, step), layout.ShardFile(shard)), man, true)
	return err
}

// checkDiskShard verifies, for shard of a committed step: the step
// manifest, the shard manifest's CRC against it, and the data file's size.
func checkDiskShard(dir string, step int64, shard int) (layout.ShardManifest, error) {
	stepDir := layout.StepDir(dir, step)
	cname := filepath.Join(stepDir, layout.CommitFile)
	cb, err := os.ReadFile(cname)
	if err != nil {
		return layout.ShardManifest{}, fmt.Errorf("step %d is not committed: %w", step, err)
	}
	sm, err := layout.ParseStepManifest(cb)
	if err != nil {
		return layout.ShardManifest{}, withFile(err, cname)
	}
	if sm.Step != step {
		return layout.ShardManifest{}, &layout.ParseError{File: cname, Offset: -1, Field: "step", Msg: fmt.Sprintf("value %d in the directory of step %d", sm.Step, step)}
	}
	if shard < 0 {
		return layout.ShardManifest{}, fmt.Errorf("ckpt: load step %d from %s: shard %d is negative", step, dir, shard)
	}
	if shard >= len(sm.Shards) {
		return layout.ShardManifest{}, &layout.ParseError{File: cname, Offset: -1, Field: "num_shards", Msg: fmt.Sprintf("value %d has no shard %d", len(sm.Shards), shard)}
	}
	ref := sm.Shards[shard]
	mname := filepath.Join(stepDir, layout.ShardManifestFile(shard))
	mb, err := os.ReadFile(mname)
	if err != nil {
		return layout.ShardManifest{}, err
	}
	if c := layout.CRC32C(mb); c != ref.ManifestCRC32C {
		return layout.ShardManifest{}, &layout.ParseError{File: mname, Offset: -1, Msg: fmt.Sprintf("CRC32C %#08x, %s says %#08x", c, layout.CommitFile, ref.ManifestCRC32C)}
	}
	man, err := layout.ParseShardManifest(mb)
	if err != nil {
		return layout.ShardManifest{}, withFile(err, mname)
	}
	if man.Step != step || man.Shard != shard || man.Size != ref.Size {
		return layout.ShardManifest{}, &layout.ParseError{File: mname, Offset: -1,
			Msg: fmt.Sprintf("step %d shard %d size %d, want %d, %d, %d", man.Step, man.Shard, man.Size, step, shard, ref.Size)}
	}
	return man, nil
}

// readShardFile reads the blobs man describes from name, verifying sizes
// and CRCs.
func readShardFile(name string, man layout.ShardManifest) (*Checkpoint, error) {
	return scanShardFile(name, man, false)
}

// scanShardFile reads or, with verifyOnly, only checks the blobs of name.
func scanShardFile(name string, man layout.ShardManifest, verifyOnly bool) (*Checkpoint, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if fi.Size() != man.Size {
		return nil, &layout.ParseError{File: name, Offset: -1, Field: "size", Msg: fmt.Sprintf("file is %d bytes, manifest says %d (truncated?)", fi.Size(), man.Size)}
	}
	ck := &Checkpoint{Step: man.Step, Blobs: make([]Blob, len(man.Blobs))}
	for k, e := range man.Blobs {
		var data []byte
		if !verifyOnly {
			data = make([]byte, e.Size)
		}
		h := crc32.New(castagnoli)
		var err error
		if verifyOnly {
			_, err = io.Copy(h, io.NewSectionReader(f, e.Offset, e.Size))
		} else if _, err = io.ReadFull(io.NewSectionReader(f, e.Offset, e.Size), data); err == nil {
			h.Write(data)
		}
		if err != nil {
			return nil, fmt.Errorf("ckpt: read %s blob %q: %w", name, e.Name, err)
		}
		if c := h.Sum32(); c != e.CRC32C {
			return nil, withFile(crcMismatch(k, e, c), name)
		}
		ck.Blobs[k] = Blob{Name: e.Name, Data: data}
	}
	return ck, nil
}

// LoadDisk returns shard of the newest committed step in dir whose every
// check holds. The reasons it passed over newer steps (a tracker naming a
// missing step, a flipped bit) come back with it, or in the error, which
// then wraps ErrNoStep. A missing dir holds no step yet.
func LoadDisk(dir string, shard int) (*Checkpoint, []error, error) {
	rep := LoadReport{Shard: shard, Step: -1}
	disk := diskSteps(dir, shard)
	ck, _ := loadNewest(&rep, tierSteps{}, nil, disk)
	if ck == nil {
		why := append(rep.Notes, cmp.Or(disk.none, errors.New("no committed step is intact")))
		return nil, why, fmt.Errorf("%w on disk: %w", ErrNoStep, errors.Join(why...))
	}
	return ck, rep.Notes, nil
}
