package ckpt

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// RenameShard makes the segment of shard from in dir (see SegmentPath)
// the segment of shard to, with the steps it holds: a job that goes on
// with fewer ranks renumbers them, and each keeps its state in memory
// under its new number. No owner or writer may have either segment open;
// a segment already at to's path is replaced. It fails, touching nothing,
// when from's segment is missing, is a replica, or holds another shard.
func RenameShard(dir, name string, from, to int) error {
	src, dst := SegmentPath(dir, name, from), SegmentPath(dir, name, to)
	if from == to {
		_, err := os.Stat(src)
		return err
	}
	if to < 0 || to >= layout.MaxShards {
		return fmt.Errorf("ckpt: rename %s: shard %d, want 0..%d", src, to, layout.MaxShards-1)
	}
	f, err := os.OpenFile(src, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("ckpt: rename segment: %w", err)
	}
	defer f.Close()
	// The flock that growing takes: no owner grows it meanwhile.
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		return fmt.Errorf("ckpt: rename %s: lock: %w", src, err)
	}
	b := make([]byte, 64)
	if _, err := f.ReadAt(b, 0); err != nil {
		return fmt.Errorf("ckpt: rename %s: %w", src, err)
	}
	h, err := layout.ParseSegmentHeader(b)
	if err != nil {
		return fmt.Errorf("ckpt: rename: %w", withFile(err, src))
	}
	switch {
	case h.Flags&layout.FlagReplica != 0:
		return fmt.Errorf("ckpt: rename %s: it is a replica of shard %d, not a shard's own segment", src, h.Shard)
	case h.Shard != from:
		return fmt.Errorf("ckpt: rename %s: it holds shard %d, not %d", src, h.Shard, from)
	}
	h.Shard = to
	nb, err := h.MarshalBinary()
	if err != nil {
		return fmt.Errorf("ckpt: rename %s: %w", src, err)
	}
	// The immutable fields and their CRC only: the live words stay.
	if _, err := f.WriteAt(nb[:layout.OffActive], 0); err != nil {
		return fmt.Errorf("ckpt: rename %s: %w", src, err)
	}
	if err := os.Rename(src, dst); err != nil {
		// Put the header back: the segment stays from's.
		f.WriteAt(b[:layout.OffActive], 0)
		return fmt.Errorf("ckpt: rename segment: %w", err)
	}
	return nil
}
