package ckpt

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// InspectSegment maps the segment at path read-only and checks both
// halves, every CRC of a sealed step included. It does not disturb a
// writer or an owner, and seals nothing.
func InspectSegment(path string) (rep layout.SegmentReport, err error) {
	seg, err := openSegment(path, true)
	if err != nil {
		return layout.SegmentReport{}, err
	}
	defer seg.close()
	defer recoverFault(&err, debug.SetPanicOnFault(true))
	r := layout.SegmentReport{Path: path, Header: seg.hdr, NewestHalf: -1}
	r.Header.Active, r.Header.PersistSeq = seg.active(), seg.persistSeq()
	for i := range 2 {
		h := &r.Halves[i]
		h.State = seg.state(i)
		h.Err = seg.read(i, false, func(m layout.StepMeta, half []byte, _ func() error) error {
			h.Meta = m
			return checkBlobs(m, half)
		})
		h.Corrupt = h.State != layout.StateEmpty && h.State != layout.StateWriting && errors.Is(h.Err, layout.ErrCorrupt)
	}
	for _, i := range seg.newest() {
		if r.Halves[i].Err == nil {
			r.NewestHalf = i
			break
		}
	}
	return r, nil
}

// InspectDir checks every step directory of the disk tier at dir, every
// CRC included, and the trackers. A dir that does not exist is reported
// Absent, with nothing on disk.
func InspectDir(dir string) (layout.DirReport, error) {
	r := layout.DirReport{Dir: dir}
	steps, committed, err := stepDirs(dir)
	if errors.Is(err, fs.ErrNotExist) {
		r.Absent = true
		return r, nil
	}
	if err != nil {
		return r, err
	}
	for _, s := range steps {
		sr := layout.StepReport{Step: s, Committed: committed[s]}
		n := shardsIn(layout.StepDir(dir, s))
		if sr.Committed {
			b, err := os.ReadFile(filepath.Join(layout.StepDir(dir, s), layout.CommitFile))
			if err == nil {
				var sm layout.StepManifest
				if sm, err = layout.ParseStepManifest(b); err == nil {
					n = max(n, len(sm.Shards))
				}
			}
			if err != nil {
				sr.Err = withFile(err, filepath.Join(layout.StepDir(dir, s), layout.CommitFile))
				r.Problems = append(r.Problems, corrupt(fmt.Errorf("step %d: %w", s, sr.Err)))
			}
		}
		for sh := range n {
			rep := inspectShard(dir, s, sh, sr.Committed)
			if rep.Err != nil && sr.Committed && !rep.Absent {
				r.Problems = append(r.Problems, corrupt(fmt.Errorf("step %d shard %d: %w", s, sh, rep.Err)))
			}
			sr.Shards = append(sr.Shards, rep)
		}
		r.Steps = append(r.Steps, sr)
	}
	for _, name := range []string{layout.TrackerFile, layout.DLRoverTrackerFile, layout.MegatronTrackerFile} {
		t := layout.TrackerReport{File: name, Step: -1}
		b, err := os.ReadFile(filepath.Join(dir, name))
		switch {
		case errors.Is(err, fs.ErrNotExist):
			r.Trackers = append(r.Trackers, t)
			continue
		case err != nil:
		case name == layout.TrackerFile:
			var m layout.StepManifest
			m, err = layout.ParseStepManifest(b)
			t.Step = m.Step
		default:
			t.Step, err = layout.ParseStepText(b)
		}
		if err == nil && !committed[t.Step] {
			err = fmt.Errorf("names step %d, which is not committed", t.Step)
		}
		if err != nil {
			t.Err = withFile(err, filepath.Join(dir, name))
			r.Problems = append(r.Problems, corrupt(fmt.Errorf("tracker %s: %w", name, t.Err)))
		}
		r.Trackers = append(r.Trackers, t)
	}
	return r, nil
}

// corruptError marks an error found where intact data was due, such as a
// committed step's manifest that is gone, as corruption, keeping its
// message.
type corruptError struct{ err error }

func (e corruptError) Error() string   { return e.err.Error() }
func (e corruptError) Unwrap() []error { return []error{e.err, layout.ErrCorrupt} }

func corrupt(err error) error {
	if errors.Is(err, layout.ErrCorrupt) {
		return err
	}
	return corruptError{err}
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

func inspectShard(dir string, step int64, shard int, committed bool) layout.ShardReport {
	rep := layout.ShardReport{Shard: shard}
	stepDir := layout.StepDir(dir, step)
	_, derr := os.Stat(filepath.Join(stepDir, layout.ShardFile(shard)))
	_, merr := os.Stat(filepath.Join(stepDir, layout.ShardManifestFile(shard)))
	if errors.Is(derr, fs.ErrNotExist) && errors.Is(merr, fs.ErrNotExist) {
		rep.Absent, rep.Err = true, errors.New("absent here")
		return rep
	}
	var man layout.ShardManifest
	var err error
	if committed {
		man, err = checkDiskShard(dir, step, shard)
	} else {
		name := filepath.Join(stepDir, layout.ShardManifestFile(shard))
		var b []byte
		if b, err = os.ReadFile(name); err == nil {
			man, err = layout.ParseShardManifest(b)
			err = withFile(err, name)
		}
	}
	if err == nil {
		rep.Size, rep.Blobs = man.Size, len(man.Blobs)
		_, err = scanShardFile(filepath.Join(stepDir, layout.ShardFile(shard)), man, true)
	}
	rep.Err = err
	return rep
}

// Verify checks the disk tier at dir and the segments at paths and
// returns every corruption found, joined, or nil; an error that does not
// wrap layout.ErrCorrupt is one that kept it from checking (a file it cannot
// open). Interrupted saves and persists are not corruption: the design
// leaves them behind and never loads them; nor are steps not sealed yet,
// or seals cut short, which only leave a step unsealed; nor is a dir that
// does not exist yet.
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
// disturbing a writer or an owner. It reads memory alone: LoadShard also
// weighs the disk tier, so that a newer step damaged in memory but intact
// on disk is not passed over for an older one, and says why it passed
// any over. A step not sealed yet is loaded Unverified. It reads segments
// of layout version 1 too. The error wraps ErrNoStep and says why each
// half was refused.
func LoadSegment(path string) (ck *Checkpoint, err error) {
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

// LoadShard loads shard at the newest step that its segment at path
// (mapped read-only, so that no writer or owner is disturbed; "" for none)
// or the disk tier at dir ("" for none) holds intact, or at step when it
// is not negative: what a tool, or a trainer with no owner at hand, uses.
// Either half of the segment serves, and memory serves before disk at one
// step, but no older step is served while a newer committed one is intact
// on disk. A step not sealed yet is loaded Unverified. The report says
// which tier served and why each newer step was passed over; the error
// wraps ErrNoStep when no tier holds an intact step. For several shards
// of a job, load each at CommonStep.
func LoadShard(path, dir string, shard int, step int64) (ck *Checkpoint, rep LoadReport, err error) {
	rep = LoadReport{Shard: shard, Step: -1}
	mem := tierSteps{none: errors.New("no segment given")}
	if path != "" {
		seg, oerr := openShard(path, shard)
		if oerr != nil {
			mem.none = oerr
		} else {
			defer seg.close()
			defer recoverFault(&err, debug.SetPanicOnFault(true))
			mem = segmentSteps(seg)
		}
	}
	disk := tierSteps{none: errors.New("no disk tier given")}
	if dir != "" {
		disk = diskSteps(dir, shard)
	}
	if step >= 0 {
		mem, disk = mem.only(step), disk.only(step)
	}
	ck, t := loadNewest(&rep, mem, nil, disk)
	if ck == nil {
		what := "an intact step"
		if step >= 0 {
			what = fmt.Sprintf("step %d intact", step)
		}
		return nil, rep, fmt.Errorf("%w: no tier holds %s of shard %d: %s", ErrNoStep, what, shard, rep)
	}
	rep.Tier, rep.Step = t, ck.Step
	return ck, rep, nil
}

// openShard maps the segment at path read-only, checking that it holds
// shard (not a peer's replica of it). A missing file is "no segment".
func openShard(path string, shard int) (*segment, error) {
	seg, err := openSegment(path, true)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("no segment %s", path)
	}
	if err != nil {
		return nil, err
	}
	if seg.hdr.Shard != shard || seg.hdr.Flags&layout.FlagReplica != 0 {
		seg.close()
		return nil, fmt.Errorf("segment %s holds shard %d (flags %d), not shard %d", path, seg.hdr.Shard, seg.hdr.Flags, shard)
	}
	return seg, nil
}

// segmentSteps lists the steps of seg's halves with a valid table for a
// load, which takes a step from the newest half that holds it intact; a
// half that holds no step but is not empty is noted with why.
func segmentSteps(seg *segment) tierSteps {
	t := tierSteps{steps: memorySteps(seg)}
	for i := range 2 {
		if _, ok := seg.metaOK(i); !ok && seg.state(i) != layout.StateEmpty {
			t.notes = append(t.notes, fmt.Errorf("memory: %w", seg.whyNot(i)))
		}
	}
	t.steps = slices.Compact(t.steps)
	if len(t.steps) == 0 {
		t.none = fmt.Errorf("%s holds no complete step", seg.path)
	}
	t.load = func(step int64) (*Checkpoint, error) {
		var why []error
		for _, i := range seg.newest() {
			if m, ok := seg.metaOK(i); !ok || m.Step != step {
				continue
			}
			ck, _, err := seg.loadHalf(i, 0, nil, false)
			if err == nil {
				return ck, nil
			}
			why = append(why, err)
		}
		return nil, errors.Join(why...)
	}
	return t
}

// only narrows t to step.
func (t tierSteps) only(step int64) tierSteps {
	if slices.Contains(t.steps, step) {
		t.steps = []int64{step}
		return t
	}
	switch {
	case t.lacks != nil:
		t.none = t.lacks(step)
	case t.none == nil:
		t.none = fmt.Errorf("holds steps %v, not %d", t.steps, step)
	}
	t.steps = nil
	return t
}

// CommonStep returns the newest step that every shard of segments holds
// intact, in its segment (segments[shard], mapped read-only; "" for none)
// or committed in the disk tier at dir ("" for none), checking every CRC
// it reads: the step a job's shards load together, so that none restores
// a step the others cannot match. The reasons each newer step was passed
// over come back with it, or in the error, which then wraps ErrNoStep.
func CommonStep(dir string, segments map[int]string) (common int64, why []error, err error) {
	if len(segments) == 0 {
		return -1, nil, errors.New("ckpt: CommonStep: no shards")
	}
	defer recoverFault(&err, debug.SetPanicOnFault(true))
	shards := slices.Sorted(maps.Keys(segments))
	mem := make(map[int]tierSteps, len(shards))
	disk := tierSteps{none: errors.New("no disk tier given")}
	var cands []int64
	for _, sh := range shards {
		t := tierSteps{none: errors.New("no segment given")}
		if p := segments[sh]; p != "" {
			seg, err := openShard(p, sh)
			if err != nil {
				t.none = err
			} else {
				defer seg.close()
				t = segmentSteps(seg)
				t.load = func(step int64) (*Checkpoint, error) {
					var why []error
					for _, i := range seg.newest() {
						if m, ok := seg.metaOK(i); ok && m.Step == step {
							err := verifyHalf(seg, i)
							if err == nil {
								return nil, nil
							}
							why = append(why, err)
						}
					}
					return nil, errors.Join(why...)
				}
			}
		}
		mem[sh] = t
		why = append(why, t.notes...)
		cands = append(cands, t.steps...)
	}
	if dir != "" {
		disk = diskSteps(dir, shards[0])
		why = append(why, disk.notes...)
		cands = append(cands, disk.steps...)
	}
	slices.Sort(cands)
	slices.Reverse(cands)
	cands = slices.Compact(cands)
	// intact says why shard does not hold step intact in any tier, or nil.
	intact := func(sh int, step int64) error {
		var errs []error
		if m := mem[sh]; slices.Contains(m.steps, step) {
			_, err := m.load(step)
			if err == nil {
				return nil
			}
			errs = append(errs, fmt.Errorf("memory: %w", err))
		}
		if slices.Contains(disk.steps, step) {
			man, err := checkDiskShard(dir, step, sh)
			if err == nil {
				_, err = scanShardFile(filepath.Join(layout.StepDir(dir, step), layout.ShardFile(sh)), man, true)
			}
			if err == nil {
				return nil
			}
			errs = append(errs, fmt.Errorf("disk: %w", err))
		}
		if len(errs) == 0 {
			return errors.New("in no tier")
		}
		return errors.Join(errs...)
	}
	for _, step := range cands {
		// Cheap first: a shard that lacks the step in every tier.
		missing := slices.IndexFunc(shards, func(sh int) bool {
			return !slices.Contains(mem[sh].steps, step) && !slices.Contains(disk.steps, step)
		})
		if missing >= 0 {
			why = append(why, fmt.Errorf("step %d: shard %d holds it in no tier", step, shards[missing]))
			continue
		}
		ok := true
		for _, sh := range shards {
			if err := intact(sh, step); err != nil {
				why = append(why, fmt.Errorf("step %d: shard %d: %w", step, sh, err))
				ok = false
				break
			}
		}
		if ok {
			return step, why, nil
		}
	}
	for _, sh := range shards {
		if m := mem[sh]; len(m.steps) == 0 && m.none != nil {
			why = append(why, fmt.Errorf("shard %d: memory: %w", sh, m.none))
		}
	}
	if disk.none != nil {
		why = append(why, fmt.Errorf("disk: %w", disk.none))
	}
	return -1, why, fmt.Errorf("%w that shards %v all hold: %w", ErrNoStep, shards, errors.Join(why...))
}
