package ckpt

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// Errors callers branch on.
var (
	// ErrBusy is returned by a save whose target half is pinned by the
	// owner (a persist or a replica copy is reading it) while the other
	// is too, or holds a step whose persist was asked for and is not done.
	// The save is skipped; the previous step stays in memory.
	ErrBusy = errors.New("ckpt: both halves are being read by the owner or wait for a persist; save skipped")
	// ErrTooLarge is returned by a save that does not fit in a half and
	// cannot grow the segment, and by a replica too large for the local
	// segment.
	ErrTooLarge = errors.New("ckpt: step does not fit in the segment")
	// ErrNoSpace is returned when shared memory or disk lacks the room.
	ErrNoSpace = errors.New("ckpt: not enough space")
	// ErrNoStep is returned when no tier holds an intact step.
	ErrNoStep = errors.New("ckpt: no intact step")
	// ErrSuperseded is returned by a reader whose half was overwritten by
	// newer saves while it read; what it read is discarded.
	ErrSuperseded = errors.New("ckpt: step overwritten while being read")
)

// SegmentPath is where an owner keeps shard's segment: dir/name-shard.
func SegmentPath(dir, name string, shard int) string {
	return filepath.Join(dir, fmt.Sprintf("%s-%d", name, shard))
}

// ReplicaPath is where an owner keeps the copy of a peer's shard.
func ReplicaPath(dir, name string, shard int) string {
	return filepath.Join(dir, fmt.Sprintf("%s-replica-%d", name, shard))
}

// segment is a mapped shared-memory file in the documented layout.
type segment struct {
	path string
	f    *os.File // kept open for the flock of growing (FORMAT)
	dev  uint64   // with ino, the file mapped, which path may no longer name
	ino  uint64
	mem  []byte
	hdr  layout.SegmentHeader // the immutable fields
	ro   bool
}

// freeBytes returns the bytes available to an unprivileged writer in dir's
// filesystem.
func freeBytes(dir string) (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, fmt.Errorf("ckpt: statfs %s: %w", dir, err)
	}
	return int64(st.Bavail) * int64(st.Bsize), nil
}

// createSegment creates the segment at path with halves of at least
// halfSize bytes, or opens it if it exists, keeping the steps it holds: a
// segment with smaller halves is grown (growing, in the FORMAT section),
// and its steps go with it. It checks the free space first and reserves
// every page with fallocate, so that a full /dev/shm is an error here
// rather than a SIGBUS on a later write.
func createSegment(path string, shard int, flags uint32, halfSize int64) (*segment, error) {
	h := layout.SegmentHeader{Version: layout.Version, HalfSize: alignUp(max(halfSize, layout.PageSize), layout.PageSize), Shard: shard, Flags: flags}
	for {
		s, err := openSegment(path, false)
		if errors.Is(err, fs.ErrNotExist) {
			s, err = newSegment(path, h)
			if errors.Is(err, fs.ErrExist) { // another owner won the race
				continue
			}
			return s, err
		}
		if err != nil {
			return nil, err
		}
		if err := s.writable(); err != nil {
			s.close()
			return nil, err
		}
		if s.hdr.Shard != shard || s.hdr.Flags != flags {
			s.close()
			return nil, fmt.Errorf("ckpt: segment %s holds shard %d with flags %d, not shard %d with flags %d: it belongs to another shard or job; give each job on a node its own OwnerConfig.Name (flashckpt --name), or load its step (flashckpt load), then remove it",
				path, s.hdr.Shard, s.hdr.Flags, shard, flags)
		}
		if s.hdr.HalfSize < h.HalfSize {
			g, err := s.grow(h.HalfSize, 2)
			s.close()
			if errors.Is(err, errReplaced) {
				continue
			}
			if err != nil {
				return nil, err
			}
			s = g
		}
		// Pins belong to the owner process; a new owner starts with none.
		for i := range 2 {
			atomic.StoreUint32(s.u32(s.halfBase(i)+layout.OffPin), 0)
		}
		return s, nil
	}
}

// newSegment creates the segment at path, failing with fs.ErrExist if
// there is one: only a complete segment appears under its name.
func newSegment(path string, h layout.SegmentHeader) (*segment, error) {
	tmp, err := newSegmentFile(path, h)
	if err != nil {
		return nil, err
	}
	defer os.Remove(tmp)
	if err := os.Link(tmp, path); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return nil, err
		}
		return nil, fmt.Errorf("ckpt: create segment %s: %w", path, err)
	}
	return openSegment(path, false)
}

// newSegmentFile writes a segment of header h, with every page reserved,
// to a temporary file beside path, and returns its name.
func newSegmentFile(path string, h layout.SegmentHeader) (string, error) {
	hb, err := h.MarshalBinary()
	if err != nil {
		return "", err
	}
	dir := filepath.Dir(path)
	free, err := freeBytes(dir)
	if err != nil {
		return "", err
	}
	size := h.Size()
	if size > free {
		return "", fmt.Errorf("%w: segment %s needs %d bytes (2 halves of %d), %s has %d free; enlarge it (mount -o remount,size=...) or lower the capacity",
			ErrNoSpace, path, size, h.HalfSize, dir, free)
	}
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return "", fmt.Errorf("ckpt: create segment %s: %w (the segment directory, OwnerConfig.ShmDir, must exist and be writable)", path, err)
	}
	tmp := f.Name()
	fail := func(err error) (string, error) {
		f.Close()
		os.Remove(tmp)
		return "", err
	}
	if err := f.Chmod(0o600); err != nil {
		return fail(fmt.Errorf("ckpt: chmod %s: %w", tmp, err))
	}
	if err := unix.Fallocate(int(f.Fd()), 0, 0, size); err != nil {
		if errors.Is(err, unix.ENOSPC) {
			err = fmt.Errorf("%w: enlarge %s (mount -o remount,size=...) or lower the capacity", ErrNoSpace, dir)
		}
		return fail(fmt.Errorf("ckpt: reserve %d bytes for segment %s in %s: %w", size, path, dir, err))
	}
	if _, err := f.WriteAt(hb, 0); err != nil {
		return fail(fmt.Errorf("ckpt: write header of %s: %w", tmp, err))
	}
	if err := f.Close(); err != nil {
		return fail(fmt.Errorf("ckpt: close %s: %w", tmp, err))
	}
	return tmp, nil
}

// notSegment says how to recover from a file that is no readable
// segment.
const notSegment = "it is no segment this package can read: load what the other tiers hold (flashckpt load), then remove it, and the owner creates a new one"

// openSegment maps an existing segment, read-write (with every page
// faulted in, so that saves run at memory speed) or read-only.
func openSegment(path string, readOnly bool) (*segment, error) {
	flag, prot := os.O_RDWR, unix.PROT_READ|unix.PROT_WRITE
	mflags := unix.MAP_SHARED | unix.MAP_POPULATE
	if readOnly {
		flag, prot, mflags = os.O_RDONLY, unix.PROT_READ, unix.MAP_SHARED
	}
	f, err := os.OpenFile(path, flag, 0)
	if errors.Is(err, fs.ErrPermission) {
		return nil, fmt.Errorf("ckpt: open segment: %w (an owner creates segments with mode 0600: run the trainer and the tools as the owner's user)", err)
	}
	if err != nil {
		return nil, fmt.Errorf("ckpt: open segment: %w", err)
	}
	s, err := mapSegment(f, path, prot, mflags)
	if err != nil {
		f.Close()
		return nil, err
	}
	s.ro = readOnly
	return s, nil
}

func mapSegment(f *os.File, path string, prot, mflags int) (*segment, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return nil, fmt.Errorf("ckpt: stat segment %s: %w", path, err)
	}
	b := make([]byte, 64)
	if _, err := f.ReadAt(b, 0); err != nil {
		return nil, &layout.ParseError{File: path, Offset: 0, Msg: fmt.Sprintf("file of %d bytes has no header; %s", st.Size, notSegment)}
	}
	h, err := layout.ParseSegmentHeader(b)
	if err != nil {
		return nil, fmt.Errorf("%w; %s", withFile(err, path), notSegment)
	}
	// A short file would fault on access: refuse it before mapping.
	if st.Size != h.Size() {
		return nil, &layout.ParseError{File: path, Offset: -1, Field: "size",
			Msg: fmt.Sprintf("file is %d bytes, header says %d (truncated?); %s", st.Size, h.Size(), notSegment)}
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, int(h.Size()), prot, mflags)
	if err != nil {
		return nil, fmt.Errorf("ckpt: map segment %s of %d bytes: %w", path, h.Size(), err)
	}
	h.Active, h.PersistSeq = 0, 0 // live; read with atomics
	return &segment{path: path, f: f, dev: uint64(st.Dev), ino: st.Ino, mem: mem, hdr: h}, nil
}

// writable says why a writer may not write the segment: it is of an
// earlier layout version, which this package reads but does not write.
func (s *segment) writable() error {
	if s.hdr.Version != layout.Version {
		return fmt.Errorf("ckpt: segment %s has layout version %d, of an earlier release, and this one writes version %d: read its step with LoadSegment (flashckpt load), then remove the file",
			s.path, s.hdr.Version, layout.Version)
	}
	return nil
}

func (s *segment) close() error {
	if s.mem == nil {
		return nil
	}
	err := unix.Munmap(s.mem)
	s.mem = nil
	s.f.Close()
	if err != nil {
		return fmt.Errorf("ckpt: unmap %s: %w", s.path, err)
	}
	return nil
}

func (s *segment) u32(off int64) *uint32 { return (*uint32)(unsafe.Pointer(&s.mem[off])) }
func (s *segment) u64(off int64) *uint64 { return (*uint64)(unsafe.Pointer(&s.mem[off])) }

func (s *segment) halfBase(i int) int64 { return layout.HeaderSize + int64(i)*s.hdr.HalfSize }

func (s *segment) half(i int) []byte {
	b := s.halfBase(i)
	return s.mem[b : b+s.hdr.HalfSize : b+s.hdr.HalfSize]
}

func (s *segment) state(i int) uint32 {
	return atomic.LoadUint32(s.u32(s.halfBase(i) + layout.OffState))
}
func (s *segment) gen(i int) uint64 { return atomic.LoadUint64(s.u64(s.halfBase(i) + layout.OffGen)) }
func (s *segment) seq(i int) uint64 {
	return atomic.LoadUint64(s.u64(s.halfBase(i) + 16))
}

func (s *segment) sealWord(i int) uint32 {
	return atomic.LoadUint32(s.u32(s.halfBase(i) + layout.OffSeal))
}

func (s *segment) active() uint32     { return atomic.LoadUint32(s.u32(layout.OffActive)) }
func (s *segment) persistSeq() uint64 { return atomic.LoadUint64(s.u64(layout.OffPersistSeq)) }

// setPersistSeq asks the owner to persist the save with this seq.
func (s *segment) setPersistSeq(seq uint64) { atomic.StoreUint64(s.u64(layout.OffPersistSeq), seq) }

// held says whether a writer must leave half i alone: the owner reads it
// (its pin), or it holds the save whose persist was asked for and is not
// done yet (persist_seq names its seq; the owner clears it when done).
func (s *segment) held(i int) bool {
	if atomic.LoadUint32(s.u32(s.halfBase(i)+layout.OffPin)) != 0 {
		return true
	}
	req := s.persistSeq()
	return req != 0 && s.state(i) == layout.StateComplete && s.seq(i) == req
}

// donePersist clears the persist request req once the owner is done with
// it (persisted, or its step gone), unless a writer asked for another
// meanwhile.
func (s *segment) donePersist(req uint64) {
	atomic.CompareAndSwapUint64(s.u64(layout.OffPersistSeq), req, 0)
}

// parse decodes the meta of half i. It loads the seal word (atomically)
// before it reads the CRC array, which the sealer writes before the seal.
func (s *segment) parse(i int) (layout.StepMeta, error) {
	seal := s.sealWord(i)
	return layout.ParseHalfMeta(s.half(i), s.hdr.HalfSize, s.hdr.Version, seal)
}

// metaOK says whether half i is complete with a valid meta checksum: cheap,
// it does not read the data.
func (s *segment) metaOK(i int) (layout.StepMeta, bool) {
	if s.state(i) != layout.StateComplete {
		return layout.StepMeta{}, false
	}
	m, err := s.parse(i)
	return m, err == nil
}

// unsealed says whether a half looks complete but unsealed, from its live
// words alone: cheap enough to poll.
func (s *segment) unsealed() bool {
	for i := range 2 {
		if s.hdr.Version >= 2 && s.state(i) == layout.StateComplete && s.sealWord(i) == layout.Unsealed {
			return true
		}
	}
	return false
}

// badSave is the error of a save whose blobs are bad input from the
// caller, not corrupt data: it does not wrap layout.ErrCorrupt.
func badSave(meta layout.StepMeta, err error) error {
	return fmt.Errorf("ckpt: save step %d: %v", meta.Step, err)
}

// halfWriter is a save in progress into one half.
type halfWriter struct {
	s    *segment
	idx  int
	meta layout.StepMeta
}

// begin claims the half a save of meta goes to: the one that does not
// hold the newest step. It never waits: a half pinned by the owner gives
// ErrBusy. See the FORMAT section for the protocol.
func (s *segment) begin(meta layout.StepMeta) (*halfWriter, error) {
	if s.ro {
		return nil, fmt.Errorf("ckpt: segment %s is open read-only", s.path)
	}
	if err := s.writable(); err != nil {
		return nil, err
	}
	if err := meta.Check(s.hdr.HalfSize); err != nil {
		if end := meta.End(); end > s.hdr.HalfSize {
			return nil, fmt.Errorf("%w: step %d needs %d bytes per half (%d of data in %d blobs), segment %s has %d",
				ErrTooLarge, meta.Step, end, meta.DataSize(), len(meta.Blobs), s.path, s.hdr.HalfSize)
		}
		return nil, badSave(meta, err)
	}
	// Write over the half that does not hold the newest intact step, so
	// that a crash mid-save leaves that step as it was. While the owner
	// reads that half (a persist), or owes it a persist asked for, write
	// over the newest step instead: the older step kept is the one a
	// crash leaves.
	idx := 1 - int(s.active()&1)
	c := s.newest()
	if len(c) > 0 {
		idx = 1 - c[0]
	}
	if s.held(idx) && len(c) > 0 && atomic.LoadUint32(s.u32(s.halfBase(idx)+layout.OffState)) == layout.StateComplete {
		idx = c[0]
	}
	base := s.halfBase(idx)
	pin, state := s.u32(base+layout.OffPin), s.u32(base+layout.OffState)
	if s.held(idx) {
		return nil, ErrBusy
	}
	prev := atomic.LoadUint32(state)
	atomic.StoreUint32(state, layout.StateWriting)
	// A reader that pinned between the two loads has either seen the
	// writing state or is seen here (both sides store, then load).
	if atomic.LoadUint32(pin) != 0 {
		atomic.StoreUint32(state, prev)
		return nil, ErrBusy
	}
	atomic.AddUint64(s.u64(base+layout.OffGen), 1)
	meta.Seq = max(s.seq(0), s.seq(1)) + 1
	if meta.Time.IsZero() {
		meta.Time = time.Now()
	}
	return &halfWriter{s: s, idx: idx, meta: meta}, nil
}

// blob returns the bytes of blob i in the half being written.
func (w *halfWriter) blob(i int) []byte {
	e := w.meta.Blobs[i]
	return w.s.half(w.idx)[e.Offset : e.Offset+e.Size : e.Offset+e.Size]
}

// commit writes the table, marks the half complete and makes it the
// active one. With crcs, the CRCs of the blobs that the caller computed
// anyway (a replica it received), it writes the step sealed; without, it
// leaves the CRCs to the owner.
func (w *halfWriter) commit(crcs []uint32) error {
	if crcs != nil {
		for i := range w.meta.Blobs {
			w.meta.Blobs[i].CRC32C = crcs[i]
		}
		w.meta.Sealed = true
	}
	b, err := w.meta.MarshalBinary()
	if err != nil {
		return err
	}
	h := w.s.half(w.idx)
	copy(h[16:len(b)], b[16:])
	atomic.StoreUint32(w.s.u32(w.s.halfBase(w.idx)+layout.OffState), layout.StateComplete)
	atomic.StoreUint32(w.s.u32(layout.OffActive), uint32(w.idx))
	return nil
}

// halfError says why one half of a segment did not yield a step.
type halfError struct {
	path string
	half int
	err  error
}

func (e *halfError) Error() string {
	return fmt.Sprintf("ckpt: %s half %d: %v", e.path, e.half, e.err)
}

func (e *halfError) Unwrap() error { return e.err }

var errNotComplete = errors.New("holds no complete step")

// read runs fn on half i if it holds a complete step, and checks
// afterwards that no writer touched the half meanwhile (a sequence lock
// on the gen word); fn may call valid to check it earlier, before it makes
// what it read visible (or seals the half). With pin, it also pins the
// half so that a conforming writer leaves it alone. fn must verify the
// CRCs of what it reads, if m is sealed.
func (s *segment) read(i int, pin bool, fn func(m layout.StepMeta, half []byte, valid func() error) error) error {
	base := s.halfBase(i)
	if pin {
		p := s.u32(base + layout.OffPin)
		atomic.AddUint32(p, 1)
		defer atomic.AddUint32(p, ^uint32(0))
	}
	// gen before state: a writer sets the state to writing before it
	// increments gen, so a save that began before this load of gen shows
	// in the state, and one that begins after it changes gen.
	g := s.gen(i)
	if st := s.state(i); st != layout.StateComplete {
		return s.notComplete(i, st)
	}
	valid := func() error {
		if s.state(i) != layout.StateComplete || s.gen(i) != g {
			return fmt.Errorf("%w: %s half %d", ErrSuperseded, s.path, i)
		}
		return nil
	}
	half := s.half(i)
	m, err := s.parse(i)
	if err == nil {
		err = fn(m, half, valid)
	}
	if verr := valid(); verr != nil {
		return verr
	}
	var he *halfError
	if err != nil && !errors.As(err, &he) && errors.Is(err, layout.ErrCorrupt) {
		// Name the half and the file of what failed a check.
		return &halfError{s.path, i, err}
	}
	return err
}

// notComplete says why a half in state st holds no step.
func (s *segment) notComplete(i int, st uint32) error {
	switch st {
	case layout.StateWriting:
		return &halfError{s.path, i, fmt.Errorf("%w (a save was in progress or died)", errNotComplete)}
	case layout.StateEmpty:
		return &halfError{s.path, i, fmt.Errorf("%w (empty)", errNotComplete)}
	}
	return &halfError{s.path, i, formatErr(s.halfBase(i)+layout.OffState, "state", "value %d is no known state", st)}
}

// whyNot says why half i is no candidate for loading, cheaply: it checks
// the state and the table, not the data. It returns nil for a half that
// holds a complete step with a valid table.
func (s *segment) whyNot(i int) error {
	return s.read(i, false, func(layout.StepMeta, []byte, func() error) error { return nil })
}

// load returns the newest step of the segment whose every CRC holds (or,
// unsealed, that is complete), and why each half that did not serve was
// refused.
func (s *segment) load(workers int, reuse *Checkpoint) (*Checkpoint, []error) {
	var why []error
	cands := s.newest()
	for i := range 2 {
		if len(cands) == 2 || (len(cands) == 1 && cands[0] == i) {
			continue
		}
		if err := s.whyNot(i); err != nil {
			why = append(why, err)
		}
	}
	for _, i := range cands {
		ck, _, err := s.loadHalf(i, workers, reuse, false)
		if err == nil {
			return ck, why
		}
		why = append(why, err)
	}
	return nil, why
}

// newest returns the halves holding a complete step with a valid meta, the
// newest save first.
func (s *segment) newest() []int {
	m0, ok0 := s.metaOK(0)
	m1, ok1 := s.metaOK(1)
	switch {
	case ok0 && ok1 && m1.Seq > m0.Seq:
		return []int{1, 0}
	case ok0 && ok1:
		return []int{0, 1}
	case ok0:
		return []int{0}
	case ok1:
		return []int{1}
	}
	return nil
}

// newestSeq returns the seq of the newest step the segment holds, 0 for
// none.
func (s *segment) newestSeq() uint64 {
	if c := s.newest(); len(c) > 0 {
		return s.seq(c[0]) // its meta checked by newest
	}
	return 0
}

// holds says whether a half holds the save seq, complete.
func (s *segment) holds(seq uint64) bool {
	for i := range 2 {
		if m, ok := s.metaOK(i); ok && m.Seq == seq {
			return true
		}
	}
	return false
}

// loadHalf copies the step of half i out. It checks every CRC of a sealed
// step; an unsealed one it takes as the save left it (Unverified), its
// CRCs computed on the way, and with seal (the owner, holding the shard's
// seal lock) it pins the half meanwhile and seals it with them.
func (s *segment) loadHalf(i int, workers int, reuse *Checkpoint, seal bool) (ck *Checkpoint, sealed bool, err error) {
	pin := seal && s.hdr.Version >= 2 && s.sealWord(i) == layout.Unsealed
	err = s.read(i, pin, func(m layout.StepMeta, half []byte, valid func() error) error {
		c, crcs, err := copyOut(m, half, workers, reuse)
		if err != nil {
			return err
		}
		ck = c
		if pin && !m.Sealed {
			if err := valid(); err != nil {
				return err
			}
			s.writeSeal(i, m, crcs, nil)
			sealed = true
		}
		return nil
	})
	if err != nil {
		return nil, false, err
	}
	return ck, sealed, nil
}

// seal computes the CRCs of the blobs of half i, if it holds a complete,
// unsealed step, and seals it: Sealing in the FORMAT section. It pins the
// half only to write the seal, not while it computes the CRCs, so that a
// writer whose other half is held (a persist asked for, a replica being
// sent) may still take this one rather than skip its save; such a save
// gives ErrSuperseded here, and is the next to seal. It returns whether
// it sealed the half (false: it was sealed already). pause, if not nil,
// runs between the stores of the seal; computed, if not nil, once the
// CRCs are computed, before the pin.
func (s *segment) seal(i int, workers int, pause, computed func()) (sealed bool, err error) {
	err = s.read(i, false, func(m layout.StepMeta, half []byte, valid func() error) error {
		if m.Sealed {
			return nil
		}
		crcs, err := copyBlobs(nil, blobData(m, half), workers, true)
		if err != nil {
			return err
		}
		if computed != nil {
			computed()
		}
		// Pin, then check that no writer took the half: one that claimed
		// it before the pin shows in its state or gen, and one after sees
		// the pin and leaves the half alone.
		p := s.u32(s.halfBase(i) + layout.OffPin)
		atomic.AddUint32(p, 1)
		defer atomic.AddUint32(p, ^uint32(0))
		if err := valid(); err != nil {
			return err
		}
		s.writeSeal(i, m, crcs, pause)
		sealed = true
		return nil
	})
	return sealed, err
}

// writeSeal seals half i, which holds m, with the CRCs of its blobs: the
// CRC array, then seal_crc, then the seal word. The caller pinned the half
// and checked, after computing crcs, that no writer took it over; the
// pin keeps them off until it is done. A reader that loads the seal word
// as Sealed finds every store before it in place.
func (s *segment) writeSeal(i int, m layout.StepMeta, crcs []uint32, pause func()) {
	h := s.half(i)
	end := m.MetaSize()
	arr := h[layout.StepHeaderSize+m.TableSize() : end]
	for k, c := range crcs {
		binary.LittleEndian.PutUint32(arr[4*k:], c)
		if pause != nil {
			pause()
		}
	}
	binary.LittleEndian.PutUint32(h[layout.OffSealCRC:], layout.SealCRC(h[:end]))
	if pause != nil {
		pause()
	}
	atomic.StoreUint32(s.u32(s.halfBase(i)+layout.OffSeal), layout.Sealed)
}

// blobData returns the bytes of each blob of m in half.
func blobData(m layout.StepMeta, half []byte) [][]byte {
	src := make([][]byte, len(m.Blobs))
	for k, e := range m.Blobs {
		src[k] = half[e.Offset : e.Offset+e.Size : e.Offset+e.Size]
	}
	return src
}

// copyOut copies the blobs of m out of half and returns their CRCs,
// which for a sealed m must match the table's. It copies into the buffers
// of reuse's blobs of the same names where they are large enough, and
// returns reuse then.
func copyOut(m layout.StepMeta, half []byte, workers int, reuse *Checkpoint) (*Checkpoint, []uint32, error) {
	src := blobData(m, half)
	dst := make([][]byte, len(m.Blobs))
	ck := &Checkpoint{}
	if reuse != nil {
		ck = reuse
	}
	old := ck.Blobs
	ck.Step, ck.Blobs, ck.Unverified = m.Step, make([]Blob, len(m.Blobs)), !m.Sealed
	for k, e := range m.Blobs {
		for _, b := range old {
			if b.Name == e.Name && int64(cap(b.Data)) >= e.Size {
				dst[k] = b.Data[:e.Size]
				break
			}
		}
		if dst[k] == nil {
			dst[k] = make([]byte, e.Size)
		}
		ck.Blobs[k] = Blob{Name: e.Name, Data: dst[k]}
	}
	crcs, err := copyBlobs(dst, src, workers, true)
	if err != nil {
		return nil, nil, err
	}
	if m.Sealed {
		if err := checkCRCs(m, crcs); err != nil {
			return nil, nil, err
		}
	}
	return ck, crcs, nil
}

// checkCRCs compares the CRCs computed of m's blobs with m's, and returns
// every mismatch, joined.
func checkCRCs(m layout.StepMeta, crcs []uint32) error {
	var errs []error
	for k, e := range m.Blobs {
		if crcs[k] != e.CRC32C {
			errs = append(errs, crcMismatch(k, e, crcs[k]))
		}
	}
	return errors.Join(errs...)
}

func crcMismatch(k int, e layout.BlobEntry, got uint32) error {
	return &layout.ParseError{Offset: -1, Field: fmt.Sprintf("blobs[%d].crc32c", k),
		Msg: fmt.Sprintf("blob %q of %d bytes: table says %#08x, data has %#08x", e.Name, e.Size, e.CRC32C, got)}
}
