package ckpt

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
)

// HalfReport is what InspectSegment found in one half.
type HalfReport struct {
	State uint32
	Meta  StepMeta // when the table is valid; Meta.Sealed says whether the CRCs are known
	// Err says why the half holds no intact step; nil when it does: a
	// sealed step whose every CRC holds, or a complete step not sealed yet,
	// which has nothing to check.
	Err error
	// Corrupt is set when the half claims a complete step that fails a
	// check: a flipped bit, not an interrupted save.
	Corrupt bool
}

// SegmentReport is what InspectSegment found in a segment.
type SegmentReport struct {
	Path       string
	Header     SegmentHeader // with the live words as read
	Halves     [2]HalfReport
	NewestHalf int // the half Load would serve, -1 if none
}

// InspectSegment maps the segment at path read-only and checks both
// halves, every CRC of a sealed step included. It does not disturb a
// writer or an owner, and seals nothing.
func InspectSegment(path string) (_ SegmentReport, err error) {
	seg, err := openSegment(path, true)
	if err != nil {
		return SegmentReport{}, err
	}
	defer seg.close()
	defer recoverFault(&err, debug.SetPanicOnFault(true))
	r := SegmentReport{Path: path, Header: seg.hdr, NewestHalf: -1}
	r.Header.Active, r.Header.PersistSeq = seg.active(), seg.persistSeq()
	for i := range 2 {
		h := &r.Halves[i]
		h.State = seg.state(i)
		h.Err = seg.read(i, false, func(m StepMeta, half []byte, _ func() error) error {
			h.Meta = m
			return checkBlobs(m, half)
		})
		h.Corrupt = h.State != StateEmpty && h.State != StateWriting && errors.Is(h.Err, ErrCorrupt)
	}
	for _, i := range seg.newest() {
		if r.Halves[i].Err == nil {
			r.NewestHalf = i
			break
		}
	}
	return r, nil
}

// ShardReport is the state of one shard file of a step on disk.
type ShardReport struct {
	Shard  int
	Size   int64
	Blobs  int
	Absent bool  // neither data nor manifest here (another node's shard)
	Err    error // nil when every check holds
}

// StepReport is the state of one step directory.
type StepReport struct {
	Step      int64
	Committed bool
	Shards    []ShardReport
}

// TrackerReport is the state of one tracker file.
type TrackerReport struct {
	File string
	Step int64 // -1 when absent or unreadable
	Err  error
}

// DirReport is what InspectDir found in a disk tier.
type DirReport struct {
	Dir      string
	Trackers []TrackerReport
	Steps    []StepReport // newest first
	// Problems are the corruptions found: trackers naming a step that is
	// not committed, committed shards that fail a check. Uncommitted step
	// directories (persists in progress or cut short) are none.
	Problems []error
}

// InspectDir checks every step directory of the disk tier at dir, every
// CRC included, and the trackers.
func InspectDir(dir string) (DirReport, error) {
	r := DirReport{Dir: dir}
	steps, committed, err := stepDirs(dir)
	if err != nil {
		return r, err
	}
	for _, s := range steps {
		sr := StepReport{Step: s, Committed: committed[s]}
		n := shardsIn(StepDir(dir, s))
		if sr.Committed {
			b, err := os.ReadFile(filepath.Join(StepDir(dir, s), CommitFile))
			if err == nil {
				var sm StepManifest
				if sm, err = ParseStepManifest(b); err == nil {
					n = max(n, len(sm.Shards))
				}
			}
			if err != nil {
				r.Problems = append(r.Problems, fmt.Errorf("step %d: %w", s, withFile(err, filepath.Join(StepDir(dir, s), CommitFile))))
			}
		}
		for sh := range n {
			rep := inspectShard(dir, s, sh, sr.Committed)
			if rep.Err != nil && sr.Committed && !rep.Absent {
				r.Problems = append(r.Problems, fmt.Errorf("step %d shard %d: %w", s, sh, rep.Err))
			}
			sr.Shards = append(sr.Shards, rep)
		}
		r.Steps = append(r.Steps, sr)
	}
	for _, name := range []string{TrackerFile, DLRoverTrackerFile, MegatronTrackerFile} {
		t := TrackerReport{File: name, Step: -1}
		b, err := os.ReadFile(filepath.Join(dir, name))
		switch {
		case errors.Is(err, fs.ErrNotExist):
			r.Trackers = append(r.Trackers, t)
			continue
		case err != nil:
		case name == TrackerFile:
			var m StepManifest
			m, err = ParseStepManifest(b)
			t.Step = m.Step
		default:
			t.Step, err = ParseStepText(b)
		}
		if err == nil && !committed[t.Step] {
			err = fmt.Errorf("names step %d, which is not committed", t.Step)
		}
		if err != nil {
			t.Err = withFile(err, filepath.Join(dir, name))
			r.Problems = append(r.Problems, fmt.Errorf("tracker %s: %w", name, t.Err))
		}
		r.Trackers = append(r.Trackers, t)
	}
	return r, nil
}

// shardsIn counts the shards a step directory names in its file names.
func shardsIn(stepDir string) int {
	ents, _ := os.ReadDir(stepDir)
	n := 0
	for _, e := range ents {
		var s int
		var ext string
		if c, _ := fmt.Sscanf(e.Name(), "shard-%05d.%s", &s, &ext); c == 2 {
			n = max(n, s+1)
		}
	}
	return n
}

func inspectShard(dir string, step int64, shard int, committed bool) ShardReport {
	rep := ShardReport{Shard: shard}
	stepDir := StepDir(dir, step)
	_, derr := os.Stat(filepath.Join(stepDir, ShardFile(shard)))
	_, merr := os.Stat(filepath.Join(stepDir, ShardManifestFile(shard)))
	if errors.Is(derr, fs.ErrNotExist) && errors.Is(merr, fs.ErrNotExist) {
		rep.Absent, rep.Err = true, errors.New("absent here")
		return rep
	}
	var man ShardManifest
	var err error
	if committed {
		man, err = checkDiskShard(dir, step, shard)
	} else {
		name := filepath.Join(stepDir, ShardManifestFile(shard))
		var b []byte
		if b, err = os.ReadFile(name); err == nil {
			man, err = ParseShardManifest(b)
			err = withFile(err, name)
		}
	}
	if err == nil {
		rep.Size, rep.Blobs = man.Size, len(man.Blobs)
		_, err = scanShardFile(filepath.Join(stepDir, ShardFile(shard)), man, true)
	}
	rep.Err = err
	return rep
}

// Verify checks the disk tier at dir and the segments at paths and
// returns every corruption found, joined, or nil. Interrupted saves and
// persists are not corruption: the design leaves them behind and never
// loads them; nor are steps not sealed yet, or seals cut short, which
// only leave a step unsealed.
func Verify(dir string, paths ...string) error {
	var errs []error
	if dir != "" {
		r, err := InspectDir(dir)
		if err != nil {
			return err
		}
		errs = append(errs, r.Problems...)
	}
	for _, p := range slices.Sorted(slices.Values(paths)) {
		r, err := InspectSegment(p)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, h := range r.Halves {
			if h.Corrupt {
				errs = append(errs, h.Err)
			}
		}
	}
	return errors.Join(errs...)
}

// LoadSegment reads the newest intact step of the segment at path through
// a read-only mapping, verifying every CRC of a sealed step, without
// disturbing a writer or an owner: what a tool or a trainer without an
// owner at hand uses. A step not sealed yet is loaded Unverified. It reads
// segments of layout version 1 too. The error wraps ErrNoStep and says why
// each half was refused.
func LoadSegment(path string) (_ *Checkpoint, err error) {
	seg, err := openSegment(path, true)
	if err != nil {
		return nil, err
	}
	defer seg.close()
	defer recoverFault(&err, debug.SetPanicOnFault(true))
	ck, why := seg.load(0, nil)
	if ck == nil {
		return nil, fmt.Errorf("%w in %s: %w", ErrNoStep, path, errors.Join(why...))
	}
	return ck, nil
}

// StepSize is the half size (OwnerConfig.Capacity) that holds a step of
// blobs with these names and sizes, rounded up to whole pages.
func StepSize(names []string, sizes []int64) int64 {
	return alignUp(layoutStep(0, names, sizes).End(), PageSize)
}
