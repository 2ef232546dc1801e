// Command flashckpt saves, loads, inspects and verifies flash checkpoints:
// the shared-memory segments and the disk tier of package ckpt.
//
//	flashckpt save    --dir D [--shard S] [--num-shards N] --step K [--memory-only] FILE...
//	flashckpt load    --dir D [--shard S] [--step K] [--out DIR]
//	flashckpt inspect --dir D
//	flashckpt verify  --dir D
//
// Every command also takes --shm (default /dev/shm) and --name (default
// faultline-ckpt), which locate the segments: <shm>/<name>-<shard>, and
// <shm>/<name>-replica-<shard> for peers' copies.
//
// save copies the files, as blobs named by their base names, into shard
// S's segment (creating it, sized to fit, if it is missing), seals the
// step (computes the CRC of each blob, as a node agent does after a
// trainer's save), then persists it to D and commits it once all N shards
// of it are there. load writes the blobs of the newest intact step (memory
// first, then disk) to files in --out, one per blob named after it ('%'
// and '/' escaped as in URLs), and says which tier served and why the
// others did not. inspect lists steps, tiers, sizes and CRC status (a
// memory step is sealed, with its CRCs, or not yet sealed); verify checks
// every CRC and exits 1 on any corruption.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/internal/atomicfile"
)

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }

// Exit codes.
const (
	exitOK      = 0
	exitCorrupt = 1 // verify found corruption; load found no intact step
	exitUsage   = 2
)

type options struct {
	dir, shm, name, out string
	shard, numShards    int
	step                int64
	memoryOnly          bool
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
	fs.IntVar(&o.numShards, "num-shards", 1, "shards in the job (save)")
	fs.Int64Var(&o.step, "step", -1, "step (save: required; load: default newest)")
	fs.StringVar(&o.out, "out", ".", "directory for the loaded blobs (load)")
	fs.BoolVar(&o.memoryOnly, "memory-only", false, "save to shared memory only, do not persist")
	if err := fs.Parse(args[1:]); err != nil {
		return exitUsage
	}
	if o.dir == "" {
		fmt.Fprintln(stderr, "flashckpt: --dir is required")
		return exitUsage
	}
	ctx := context.Background()
	var err error
	switch cmd {
	case "save":
		err = save(ctx, o, fs.Args(), stdout)
	case "load":
		err = load(o, stdout)
	case "inspect":
		err = inspect(o, stdout)
	case "verify":
		err = verify(o, stdout)
	default:
		fmt.Fprintf(stderr, "flashckpt: unknown command %q\n", cmd)
		return exitUsage
	}
	var ue usageError
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &ue):
		fmt.Fprintln(stderr, "flashckpt:", err)
		return exitUsage
	default:
		fmt.Fprintln(stderr, "flashckpt:", err)
		return exitCorrupt
	}
}

type usageError string

func (e usageError) Error() string { return string(e) }

func save(ctx context.Context, o options, files []string, stdout io.Writer) error {
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
	capacity := ckpt.StepSize(names, sizes)
	path := ckpt.SegmentPath(o.shm, o.name, o.shard)
	if r, err := ckpt.InspectSegment(path); err == nil {
		// Keep an existing segment that is large enough, and its steps.
		capacity = max(capacity, r.Header.HalfSize)
	}
	cfg := ckpt.OwnerConfig{ShmDir: o.shm, Name: o.name, Shards: []int{o.shard}, NumShards: o.numShards, Capacity: capacity}
	if !o.memoryOnly {
		cfg.Dir = o.dir
	}
	owner, err := ckpt.NewOwner(cfg)
	if err != nil {
		return err
	}
	defer owner.Close()
	w, err := ckpt.NewWriter(ckpt.WriterConfig{Path: path})
	if err != nil {
		return err
	}
	defer w.Close()
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
	man, err := owner.Persist(ctx, o.shard)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "persisted step %d shard %d to %s in %v\n", man.Step, man.Shard, ckpt.StepDir(o.dir, man.Step), time.Since(start).Round(time.Microsecond))
	if _, err := os.Stat(filepath.Join(ckpt.StepDir(o.dir, man.Step), ckpt.CommitFile)); err == nil {
		fmt.Fprintf(stdout, "committed step %d\n", man.Step)
	} else {
		fmt.Fprintf(stdout, "step %d waits for the other shards of %d before it commits\n", man.Step, o.numShards)
	}
	return nil
}

func load(o options, stdout io.Writer) error {
	path := ckpt.SegmentPath(o.shm, o.name, o.shard)
	var ck *ckpt.Checkpoint
	var why []string
	tier := ""
	c, err := ckpt.LoadSegment(path)
	switch {
	case err != nil:
		why = append(why, fmt.Sprintf("memory: %v", err))
	case o.step >= 0 && c.Step != o.step:
		why = append(why, fmt.Sprintf("memory: holds step %d, not %d", c.Step, o.step))
	default:
		ck, tier = c, "memory"
	}
	if ck == nil {
		var notes []error
		if o.step >= 0 {
			c, err = ckpt.LoadDiskStep(o.dir, o.step, o.shard)
		} else {
			c, notes, err = ckpt.LoadDisk(o.dir, o.shard)
		}
		for _, n := range notes {
			why = append(why, fmt.Sprintf("disk passed over: %v", n))
		}
		if err != nil {
			why = append(why, fmt.Sprintf("disk: %v", err))
		} else {
			ck, tier = c, "disk"
		}
	}
	for _, w := range why {
		fmt.Fprintln(stdout, "  ", w)
	}
	if ck == nil {
		return fmt.Errorf("no intact step of shard %d", o.shard)
	}
	if ck.Unverified {
		fmt.Fprintf(stdout, "   memory: step %d is not sealed yet (its owner has not computed the CRCs): loaded as saved, unchecked\n", ck.Step)
	}
	if err := os.MkdirAll(o.out, 0o750); err != nil {
		return err
	}
	for _, b := range ck.Blobs {
		if err := atomicfile.WriteFile(filepath.Join(o.out, blobFile(b.Name)), b.Data, 0o640); err != nil {
			return err
		}
	}
	fmt.Fprintf(stdout, "loaded step %d shard %d from %s: %d blobs, %d bytes to %s\n", ck.Step, o.shard, tier, len(ck.Blobs), ck.Size(), o.out)
	return nil
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
	for _, p := range segments(o) {
		r, err := ckpt.InspectSegment(p)
		if err != nil {
			fmt.Fprintf(stdout, "memory %s: %v\n", p, err)
			continue
		}
		kind := "shard"
		if r.Header.Flags&ckpt.FlagReplica != 0 {
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
				fmt.Fprintf(stdout, "  %s half %d: CORRUPT: %v\n", mark, i, h.Err)
			default:
				fmt.Fprintf(stdout, "  %s half %d: %v\n", mark, i, h.Err)
			}
		}
	}
	r, err := ckpt.InspectDir(o.dir)
	if err != nil {
		return err
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
		fmt.Fprintf(stdout, "disk step %d: %s\n", s.Step, state)
		for _, sh := range s.Shards {
			switch {
			case sh.Absent:
				fmt.Fprintf(stdout, "  shard %d: not on this node\n", sh.Shard)
			case sh.Err != nil:
				fmt.Fprintf(stdout, "  shard %d: BAD: %v\n", sh.Shard, sh.Err)
			default:
				fmt.Fprintf(stdout, "  shard %d: %d blobs, %d bytes, CRC ok\n", sh.Shard, sh.Blobs, sh.Size)
			}
		}
	}
	return nil
}

func verify(o options, stdout io.Writer) error {
	paths := segments(o)
	err := ckpt.Verify(o.dir, paths...)
	if err != nil {
		for _, line := range strings.Split(err.Error(), "\n") {
			fmt.Fprintln(stdout, "CORRUPT:", line)
		}
		return errors.New("corruption found")
	}
	fmt.Fprintf(stdout, "ok: %s and %d segments verified\n", o.dir, len(paths))
	return nil
}
