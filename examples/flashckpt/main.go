// Command flashckpt saves, loads, inspects and verifies flash checkpoints:
// the shared-memory segments and the disk tier of package ckpt.
//
//	flashckpt save    --dir D [--shard S] [--num-shards N] --step K [--capacity SIZE] [--memory-only] FILE...
//	flashckpt load    --dir D [--shard S | --all-shards] [--num-shards N] [--step K] [--out DIR]
//	flashckpt inspect --dir D
//	flashckpt verify  --dir D
//
// Every command also takes --shm (default /dev/shm) and --name (default
// faultline-ckpt), which locate the segments: <shm>/<name>-<shard>, and
// <shm>/<name>-replica-<shard> for peers' copies.
//
// save copies the files, as blobs named by their base names, into shard
// S's segment, seals the step (computes the CRC of each blob, as a node
// agent does after a trainer's save), then persists it to D and commits it
// once all N shards of it are there. It creates a missing segment with
// halves of --capacity bytes, or as many as the step needs if that is
// more, and grows a smaller one to that size, keeping its steps. Saving a
// step that is committed already reads its disk copy back: an intact one
// is kept, a damaged one written again, and other content under the step
// number refused.
//
// load writes the blobs of a step to files in --out, one per blob named
// after it ('%' and '/' escaped as in URLs): the newest step that shard
// S's segment or the disk tier holds intact (either half of the segment,
// memory before disk at one step, and never an older step while a newer
// committed one is intact on disk), or step K. It says which tier served
// and why each newer step, and each tier preferred to the one that
// served, was passed over. The shards of a job restore one step: the job
// is the shards that have a segment here or are in the newest committed
// step (or --num-shards N), and without --step, load refuses a shard
// whose newest step the others do not all hold intact, naming the step
// they agree on; --all-shards loads that step of every shard, each into
// --out/shard-NNNNN.
//
// inspect lists steps, tiers, sizes and CRC status (a memory step is
// sealed, with its CRCs, or not yet sealed); verify checks every CRC.
// A disk tier that does not exist yet holds nothing: no corruption.
//
// Results go to standard output; reasons (what a load passed over, what
// is corrupt) and the final error go to standard error.
//
// Exit codes:
//
//	0  success
//	1  corruption found: verify or inspect met data that fails a check
//	2  usage: a bad command, flag or argument
//	3  no intact step: load found none (or none every shard of the job holds)
//	4  any other failure, such as a file that cannot be read or written
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/ckpt/layout"
	"github.com/faultline-ml/faultline/internal/atomicfile"
)

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

// Exit codes, as the package doc lists them.
const (
	exitOK      = 0
	exitCorrupt = 1
	exitUsage   = 2
	exitNoStep  = 3
	exitFailure = 4
)

// errCorruptFound ends a verify or an inspect that met corruption.
var errCorruptFound = errors.New("corruption found")

type options struct {
	dir, shm, name, out string
	shard, numShards    int
	step                int64
	capacity            int64
	memoryOnly          bool
	allShards           bool
	set                 map[string]bool // the flags given
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprintln(stderr, "usage: flashckpt save|load|inspect|verify --dir D [flags] [FILE...]")
		return exitUsage
	}
	cmd := args[0]
	fs := flag.NewFlagSet("flashckpt "+cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	var o options
	fs.StringVar(&o.dir, "dir", "", "disk tier directory (required)")
	fs.StringVar(&o.shm, "shm", "/dev/shm", "directory of the shared-memory segments")
	fs.StringVar(&o.name, "name", "faultline-ckpt", "segment name prefix")
	fs.IntVar(&o.shard, "shard", 0, "shard (rank)")
	fs.IntVar(&o.numShards, "num-shards", 1, "shards in the job (save; load: default the shards found)")
	fs.Int64Var(&o.step, "step", -1, "step (save: required; load: default the newest)")
	fs.StringVar(&o.out, "out", ".", "directory for the loaded blobs (load)")
	fs.BoolVar(&o.memoryOnly, "memory-only", false, "save to shared memory only, do not persist")
	fs.Func("capacity", "bytes per half of the segment, such as 512MiB (save; default what the step needs: a larger save grows the segment)", func(v string) (err error) {
		o.capacity, err = parseSize(v)
		return err
	})
	fs.BoolVar(&o.allShards, "all-shards", false, "load every shard of the job at the step they all hold (load)")
	if err := fs.Parse(args[1:]); err != nil {
		return exitUsage
	}
	o.set = map[string]bool{}
	fs.Visit(func(f *flag.Flag) { o.set[f.Name] = true })
	if o.dir == "" {
		fmt.Fprintln(stderr, "flashckpt: --dir is required")
		return exitUsage
	}
	ctx := context.Background()
	var err error
	switch cmd {
	case "save":
		err = save(ctx, o, fs.Args(), stdout, stderr)
	case "load":
		err = load(o, stdout, stderr)
	case "inspect":
		err = inspect(o, stdout)
	case "verify":
		err = verify(o, stdout, stderr)
	default:
		fmt.Fprintf(stderr, "flashckpt: unknown command %q\n", cmd)
		return exitUsage
	}
	if err == nil {
		return exitOK
	}
	fmt.Fprintln(stderr, "flashckpt:", err)
	var ue usageError
	switch {
	case errors.As(err, &ue):
		return exitUsage
	case errors.Is(err, errCorruptFound):
		return exitCorrupt
	case errors.Is(err, ckpt.ErrNoStep):
		return exitNoStep
	case errors.Is(err, layout.ErrCorrupt):
		return exitCorrupt
	}
	return exitFailure
}

// parseSize reads a byte count with an optional binary unit: 4096, 64KiB,
// 512MiB, 2GiB (K, M and G alone mean the same).
func parseSize(v string) (int64, error) {
	num := strings.TrimRight(v, "KMGTiB")
	shift := map[string]uint{"": 0, "B": 0, "K": 10, "KiB": 10, "M": 20, "MiB": 20, "G": 30, "GiB": 30, "T": 40, "TiB": 40}
	unit, ok := shift[v[len(num):]]
	n, err := strconv.ParseInt(num, 10, 64)
	if !ok || err != nil || n < 0 || n > math.MaxInt64>>unit {
		return 0, fmt.Errorf("size %q is not a byte count such as 4096, 64KiB, 512MiB or 2GiB", v)
	}
	return n << unit, nil
}

type usageError string

func (e usageError) Error() string { return string(e) }

func save(ctx context.Context, o options, files []string, stdout, stderr io.Writer) error {
	if o.step < 0 || len(files) == 0 {
		return usageError("save needs --step and at least one file")
	}
	var names []string
	var sizes []int64
	var srcs []ckpt.Source
	for _, f := range files {
		fh, err := os.Open(f)
		if err != nil {
			return err
		}
		defer fh.Close()
		fi, err := fh.Stat()
		if err != nil {
			return err
		}
		names, sizes = append(names, filepath.Base(f)), append(sizes, fi.Size())
		srcs = append(srcs, ckpt.Source{Name: filepath.Base(f), Size: fi.Size(), R: fh})
	}
	path := ckpt.SegmentPath(o.shm, o.name, o.shard)
	was := int64(-1)
	if r, err := ckpt.InspectSegment(path); err == nil {
		was = r.Header.HalfSize
	}
	// A segment smaller than this grows, keeping its steps; a larger one is
	// kept as it is.
	capacity := max(layout.StepSize(names, sizes), o.capacity)
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelWarn,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Key == slog.TimeKey {
				return slog.Attr{}
			}
			return a
		}}))
	cfg := ckpt.OwnerConfig{ShmDir: o.shm, Name: o.name, Shards: []int{o.shard}, NumShards: o.numShards, Capacity: capacity, Logger: log}
	if !o.memoryOnly {
		cfg.Dir = o.dir
	}
	owner, err := ckpt.NewOwner(cfg)
	if err != nil {
		return err
	}
	defer owner.Close()
	w, err := ckpt.NewWriter(ckpt.WriterConfig{Path: path, Logger: log})
	if err != nil {
		return err
	}
	defer w.Close()
	if was >= 0 && w.Capacity() > was {
		fmt.Fprintf(stdout, "grew segment %s from halves of %d bytes to %d, keeping its steps\n", path, was, w.Capacity())
	}
	start := time.Now()
	if err := w.SaveFrom(ctx, o.step, srcs...); err != nil {
		return err
	}
	var total int64
	for _, s := range sizes {
		total += s
	}
	fmt.Fprintf(stdout, "saved step %d shard %d: %d blobs, %d bytes to %s in %v\n", o.step, o.shard, len(files), total, path, time.Since(start).Round(time.Microsecond))
	start = time.Now()
	if err := owner.Seal(ctx, o.shard); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "sealed step %d shard %d: CRC32C of %d blobs in %v\n", o.step, o.shard, len(files), time.Since(start).Round(time.Microsecond))
	if o.memoryOnly {
		return nil
	}
	start = time.Now()
	_, err = os.Stat(filepath.Join(layout.StepDir(o.dir, o.step), layout.CommitFile))
	committed := err == nil
	man, err := owner.Persist(ctx, o.shard)
	if err != nil {
		return err
	}
	if committed {
		// The owner's log has said if it wrote a damaged copy again.
		fmt.Fprintf(stdout, "step %d was committed already: its disk copy of shard %d was read back, and kept if intact or written again from memory if damaged\n", man.Step, man.Shard)
	}
	fmt.Fprintf(stdout, "persisted step %d shard %d to %s in %v\n", man.Step, man.Shard, layout.StepDir(o.dir, man.Step), time.Since(start).Round(time.Microsecond))
	if _, err := os.Stat(filepath.Join(layout.StepDir(o.dir, man.Step), layout.CommitFile)); err == nil {
		fmt.Fprintf(stdout, "committed step %d\n", man.Step)
	} else {
		fmt.Fprintf(stdout, "step %d waits for the other shards of %d before it commits\n", man.Step, o.numShards)
	}
	return nil
}

func load(o options, stdout, stderr io.Writer) error {
	if o.allShards && o.set["shard"] {
		return usageError("load takes --shard or --all-shards, not both")
	}
	shards, err := jobShards(o)
	if err != nil {
		return err
	}
	segs := map[int]string{}
	for _, s := range shards {
		segs[s] = ckpt.SegmentPath(o.shm, o.name, s)
	}
	agree := func() (int64, error) {
		step, why, err := ckpt.CommonStep(o.dir, segs)
		for _, w := range why {
			say(stderr, "passed over", w)
		}
		return step, err
	}
	if o.allShards {
		step := o.step
		if step < 0 {
			if step, err = agree(); err != nil {
				return err
			}
		}
		for _, s := range shards {
			if err := loadShard(o, s, step, filepath.Join(o.out, fmt.Sprintf("shard-%05d", s)), stdout, stderr, nil); err != nil {
				return err
			}
		}
		return nil
	}
	return loadShard(o, o.shard, o.step, o.out, stdout, stderr, func(ck *ckpt.Checkpoint) error {
		// Without --step, the newest step of this shard must be one every
		// shard of the job holds intact.
		if o.step >= 0 || len(shards) < 2 {
			return nil
		}
		step, err := agree()
		if err != nil {
			return fmt.Errorf("shard %d holds step %d, and the shards %v of the job agree on none: %w", o.shard, ck.Step, shards, err)
		}
		if step != ck.Step {
			return fmt.Errorf("%w: shard %d's newest intact step is %d, which the shards %v of the job do not all hold; they agree on step %d: load it with --step %d, or every shard with --all-shards",
				ckpt.ErrNoStep, o.shard, ck.Step, shards, step, step)
		}
		return nil
	})
}

// loadShard loads step (-1: the newest) of shard into out, once check,
// if given, accepts the step.
func loadShard(o options, shard int, step int64, out string, stdout, stderr io.Writer, check func(*ckpt.Checkpoint) error) error {
	ck, rep, err := ckpt.LoadShard(ckpt.SegmentPath(o.shm, o.name, shard), o.dir, shard, step)
	for _, e := range rep.Refused {
		say(stderr, fmt.Sprintf("shard %d: %s refused", shard, e.Tier), e.Err)
	}
	for _, n := range rep.Notes {
		say(stderr, fmt.Sprintf("shard %d: passed over", shard), n)
	}
	if err != nil {
		what := "an intact step"
		if step >= 0 {
			what = fmt.Sprintf("step %d intact", step)
		}
		return fmt.Errorf("%w: no tier holds %s of shard %d", ckpt.ErrNoStep, what, shard)
	}
	if check != nil {
		if err := check(ck); err != nil {
			return err
		}
	}
	if ck.Unverified {
		fmt.Fprintf(stderr, "   shard %d: memory: step %d is not sealed yet (its owner has not computed the CRCs): loaded as saved, unchecked\n", shard, ck.Step)
	}
	if err := os.MkdirAll(out, 0o750); err != nil {
		return err
	}
	for _, b := range ck.Blobs {
		if err := atomicfile.WriteFile(filepath.Join(out, blobFile(b.Name)), b.Data, 0o640); err != nil {
			return err
		}
	}
	fmt.Fprintf(stdout, "loaded step %d shard %d from %s: %d blobs, %d bytes to %s\n", ck.Step, shard, rep.Tier, len(ck.Blobs), ck.Size(), out)
	return nil
}

// say writes a reason to w, one line per line of err.
func say(w io.Writer, what string, err error) {
	lines := strings.Split(err.Error(), "\n")
	fmt.Fprintf(w, "   %s: %s\n", what, lines[0])
	for _, l := range lines[1:] {
		fmt.Fprintf(w, "      %s\n", l)
	}
}

// jobShards are the shards of the job: 0..--num-shards-1 if it is given,
// else those with a segment here and those of the newest committed step,
// and the --shard asked for.
func jobShards(o options) ([]int, error) {
	if o.set["num-shards"] {
		if o.numShards < 1 || o.numShards > layout.MaxShards {
			return nil, usageError(fmt.Sprintf("--num-shards %d is out of range [1,%d]", o.numShards, layout.MaxShards))
		}
		if o.shard < 0 || o.shard >= o.numShards {
			return nil, usageError(fmt.Sprintf("--shard %d is not one of the %d shards of --num-shards", o.shard, o.numShards))
		}
		var all []int
		for s := range o.numShards {
			all = append(all, s)
		}
		return all, nil
	}
	if o.shard < 0 {
		return nil, usageError(fmt.Sprintf("--shard %d is negative", o.shard))
	}
	found := map[int]bool{}
	if !o.allShards {
		found[o.shard] = true
	}
	for _, p := range segments(o) {
		rest := strings.TrimPrefix(filepath.Base(p), o.name+"-")
		if s, err := strconv.Atoi(rest); err == nil && strconv.Itoa(s) == rest && s >= 0 {
			found[s] = true
		}
	}
	if b, err := os.ReadFile(filepath.Join(o.dir, layout.TrackerFile)); err == nil {
		if m, err := layout.ParseStepManifest(b); err == nil {
			for s := range m.Shards {
				found[s] = true
			}
		}
	}
	if len(found) == 0 {
		return nil, fmt.Errorf("%w: no segment in %s and no committed step in %s", ckpt.ErrNoStep, o.shm, o.dir)
	}
	return slices.Sorted(maps.Keys(found)), nil
}

// blobFile is the file name a loaded blob is written to: its name with
// '%' and '/' escaped as in URLs, and "." and ".." escaped whole, so that
// "model/layer.0" and "optim/layer.0" land in two files inside --out and
// no name reaches outside it.
func blobFile(name string) string {
	switch name {
	case ".":
		return "%2E"
	case "..":
		return "%2E%2E"
	}
	return strings.NewReplacer("%", "%25", "/", "%2F").Replace(name)
}

func segments(o options) []string {
	paths, _ := filepath.Glob(filepath.Join(o.shm, o.name+"-*"))
	return slices.DeleteFunc(paths, func(p string) bool {
		return strings.Contains(filepath.Base(p), ".tmp-") || strings.HasSuffix(p, ".next")
	})
}

func inspect(o options, stdout io.Writer) error {
	bad := 0
	var failed []error
	for _, p := range segments(o) {
		r, err := ckpt.InspectSegment(p)
		if err != nil {
			if errors.Is(err, layout.ErrCorrupt) {
				bad++
				fmt.Fprintf(stdout, "memory %s: BAD: %v\n", p, err)
			} else {
				failed = append(failed, err)
				fmt.Fprintf(stdout, "memory %s: cannot inspect: %v\n", p, err)
			}
			continue
		}
		kind := "shard"
		if r.Header.Flags&layout.FlagReplica != 0 {
			kind = "replica of shard"
		}
		fmt.Fprintf(stdout, "memory %s: %s %d, layout version %d, halves of %d bytes, active %d, persist seq %d\n",
			p, kind, r.Header.Shard, r.Header.Version, r.Header.HalfSize, r.Header.Active, r.Header.PersistSeq)
		for i, h := range r.Halves {
			mark := " "
			if i == r.NewestHalf {
				mark = "*"
			}
			switch {
			case h.Err == nil:
				status := "sealed, CRC ok"
				if !h.Meta.Sealed {
					status = "unsealed (CRCs not computed yet)"
				}
				fmt.Fprintf(stdout, "  %s half %d: step %d seq %d saved %s, %d blobs, %d bytes, %s\n",
					mark, i, h.Meta.Step, h.Meta.Seq, h.Meta.Time.UTC().Format(time.RFC3339), len(h.Meta.Blobs), h.Meta.DataSize(), status)
				for _, b := range h.Meta.Blobs {
					crc := fmt.Sprintf("%08x", b.CRC32C)
					if !h.Meta.Sealed {
						crc = "-"
					}
					fmt.Fprintf(stdout, "      %-24s %12d bytes  crc32c %s\n", b.Name, b.Size, crc)
				}
			case h.Corrupt:
				bad++
				fmt.Fprintf(stdout, "  %s half %d: BAD: %v\n", mark, i, h.Err)
			default:
				fmt.Fprintf(stdout, "  %s half %d: %v\n", mark, i, h.Err)
			}
		}
	}
	r, err := ckpt.InspectDir(o.dir)
	if err != nil {
		return errors.Join(append(failed, err)...)
	}
	if r.Absent {
		fmt.Fprintf(stdout, "disk %s: nothing on disk yet (the directory does not exist)\n", o.dir)
	}
	for _, t := range r.Trackers {
		switch {
		case t.Err != nil:
			fmt.Fprintf(stdout, "tracker %s: BAD: %v\n", t.File, t.Err)
		case t.Step < 0:
			fmt.Fprintf(stdout, "tracker %s: absent\n", t.File)
		default:
			fmt.Fprintf(stdout, "tracker %s: step %d\n", t.File, t.Step)
		}
	}
	for _, s := range r.Steps {
		state := "committed"
		if !s.Committed {
			state = "not committed (persist in progress or cut short)"
		}
		if s.Err != nil {
			state = fmt.Sprintf("committed, BAD: %v", s.Err)
		}
		fmt.Fprintf(stdout, "disk step %d: %s\n", s.Step, state)
		for _, sh := range s.Shards {
			switch {
			case sh.Absent:
				fmt.Fprintf(stdout, "  shard %d: not on this node\n", sh.Shard)
			case sh.Err != nil && s.Committed:
				fmt.Fprintf(stdout, "  shard %d: BAD: %v\n", sh.Shard, sh.Err)
			case sh.Err != nil:
				fmt.Fprintf(stdout, "  shard %d: incomplete: %v\n", sh.Shard, sh.Err)
			default:
				fmt.Fprintf(stdout, "  shard %d: %d blobs, %d bytes, CRC ok\n", sh.Shard, sh.Blobs, sh.Size)
			}
		}
	}
	// Each problem of the disk tier is a BAD line above.
	if bad += len(r.Problems); bad > 0 {
		return fmt.Errorf("%w: BAD entries: %d", errCorruptFound, bad)
	}
	return errors.Join(failed...)
}

func verify(o options, stdout, stderr io.Writer) error {
	paths := segments(o)
	err := ckpt.Verify(o.dir, paths...)
	if err == nil {
		disk := o.dir
		if _, err := os.Stat(o.dir); errors.Is(err, fs.ErrNotExist) {
			disk = "nothing on disk yet in " + o.dir
		}
		fmt.Fprintf(stdout, "ok: %s and %d segments verified\n", disk, len(paths))
		return nil
	}
	var errs []error
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		errs = j.Unwrap()
	} else {
		errs = []error{err}
	}
	corrupt := false
	for _, e := range errs {
		if errors.Is(e, layout.ErrCorrupt) {
			corrupt = true
			say(stderr, "CORRUPT", e)
		} else {
			say(stderr, "cannot verify", e)
		}
	}
	if corrupt {
		return errCorruptFound
	}
	return errors.New("verify could not check everything")
}
