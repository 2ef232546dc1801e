package ckpt

import (
	"errors"
	"fmt"
	"os"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// errReplaced says that a segment's path names another file than the one
// mapped: another process grew the segment, and the path is to be mapped
// anew.
var errReplaced = errors.New("segment replaced")

// flock takes (unix.LOCK_SH, unix.LOCK_EX) or releases (unix.LOCK_UN) the
// lock on the segment file that saves share and a grow holds alone
// (growing, in the FORMAT section).
func (s *segment) flock(how int) error {
	for {
		err := unix.Flock(int(s.f.Fd()), how)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return fmt.Errorf("ckpt: flock segment %s: %w", s.path, err)
		}
		return nil
	}
}

// replaced says whether s's path names another file than the one s maps:
// the segment was grown. A path that names no file (the owner removed
// it) is not replaced.
func (s *segment) replaced() bool {
	var st unix.Stat_t
	if err := unix.Stat(s.path, &st); err != nil {
		return false
	}
	return uint64(st.Dev) != s.dev || st.Ino != s.ino
}

// grow replaces s by a segment with halves of halfSize bytes that holds
// the newest of s's complete steps (keep 1) or both (keep 2), as they
// are, sealed or not, and the persist request: growing, in the FORMAT
// section. It returns the new segment, mapped read-write, or errReplaced
// if another process replaced s first. s stays mapped; the caller closes
// it.
func (s *segment) grow(halfSize int64, keep int) (*segment, error) {
	if err := s.flock(unix.LOCK_EX); err != nil {
		return nil, err
	}
	defer s.flock(unix.LOCK_UN)
	if s.replaced() {
		return nil, errReplaced
	}
	h := s.hdr
	h.HalfSize = alignUp(halfSize, layout.PageSize)
	tmp, err := newSegmentFile(s.path, h)
	if err != nil {
		return nil, fmt.Errorf("ckpt: grow segment %s from halves of %d bytes to %d: %w", s.path, s.hdr.HalfSize, h.HalfSize, err)
	}
	defer os.Remove(tmp) // if the rename did not happen
	g, err := openSegment(tmp, false)
	if err != nil {
		return nil, err
	}
	halves := s.newest()
	halves = halves[:min(len(halves), keep)]
	// The newest step goes to half 0, the active one. A half a writer
	// took over meanwhile (one that does not lock) is left behind.
	for j, i := range halves {
		if err := g.copyHalf(j, s, i); err != nil && !errors.Is(err, ErrSuperseded) && !errors.Is(err, errNotComplete) {
			g.close()
			return nil, fmt.Errorf("ckpt: grow segment %s: copy half %d: %w", s.path, i, err)
		}
	}
	atomic.StoreUint64(g.u64(layout.OffPersistSeq), s.persistSeq())
	if err := os.Rename(tmp, s.path); err != nil {
		g.close()
		return nil, fmt.Errorf("ckpt: grow segment %s: %w", s.path, err)
	}
	g.path = s.path
	return g, nil
}

// copyHalf copies the complete step in half i of src into half j of g,
// which no other process maps yet: its meta as src's reader saw it
// (sealed, with its CRC array, or not) and its blobs, unchecked. A half
// that a writer took over meanwhile gives ErrSuperseded.
func (g *segment) copyHalf(j int, src *segment, i int) error {
	return src.read(i, false, func(m layout.StepMeta, half []byte, valid func() error) error {
		b, err := m.MarshalBinary()
		if err != nil {
			return err
		}
		dst := g.half(j)
		copy(dst[16:len(b)], b[16:])
		to := make([][]byte, len(m.Blobs))
		for k, e := range m.Blobs {
			to[k] = dst[e.Offset : e.Offset+e.Size]
		}
		if _, err := copyBlobs(to, blobData(m, half), 0, false); err != nil {
			return err
		}
		if err := valid(); err != nil {
			return err
		}
		atomic.StoreUint32(g.u32(g.halfBase(j)+layout.OffState), layout.StateComplete)
		return nil
	})
}

func alignUp(n, a int64) int64 { return (n + a - 1) / a * a }
