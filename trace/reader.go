package trace

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"
)

// Errors a skipped line's *ParseError may wrap besides ErrRecord.
var (
	ErrLineTooLong   = errors.New("trace: line longer than MaxLineBytes")
	ErrTruncatedLine = errors.New("trace: incomplete last line of a finished file")
)

// ReaderConfig configures a RankReader. The zero value is ready to use.
type ReaderConfig struct {
	BufferBytes int // bytes read per system call; default 256 KiB

	// Buffers, when set, lends the reader a buffer for each Read (and
	// BufferBytes is the pool's): readers that tail many ranks then hold
	// as many buffers as read at a time, not one each. A Read that its
	// callback stopped reads the rest of that buffer again next time.
	Buffers *BufferPool
}

// BufferPool lends read buffers to the RankReaders that share it. It is
// safe for concurrent use.
type BufferPool struct {
	size int
	pool sync.Pool
}

// NewBufferPool returns a pool of buffers of size bytes (256 KiB if size
// is not positive).
func NewBufferPool(size int) *BufferPool {
	if size <= 0 {
		size = 256 << 10
	}
	p := &BufferPool{size: size}
	p.pool.New = func() any { b := make([]byte, size); return &b }
	return p
}

// ReaderStats reports what a RankReader has read and skipped.
type ReaderStats struct {
	Records      uint64 // records passed to the callback
	GarbageLines uint64 // lines skipped: not a record, binary, over-long, or cut short
	LastGarbage  error  // the latest skipped line, a *ParseError naming file and line
	Bytes        uint64 // bytes consumed
	Files        int    // record files opened
	SkippedFiles int    // record files that vanished (aged away) or could not be opened
	LastSkip     error  // why the latest file was skipped
}

// RankReader tails the record files of one rank folder: the digit-named
// files in numeric name order, each by offset, moving to the next file once
// a newer one exists. It follows no symlink and opens only regular files.
// A RankReader is not safe for concurrent use.
type RankReader struct {
	dir   string
	dirfd int
	cfg   ReaderConfig

	cur      string // current file's name, "" before the first
	fd       int    // current file, -1 between files
	off      int64  // bytes of cur read so far, carry and pending included
	line     int    // complete lines of cur seen
	buf      []byte
	pending  []byte // what a Read stopped by its callback left of buf, for the next
	carry    []byte // the start of an unfinished line
	skipping bool   // inside an over-long line, until its newline
	budget   int    // reads ReadSome may still make, -1 for Read

	later  []string // record files after cur that the last listing found, in name order
	listed bool     // the folder was listed: its offset must be rewound

	rec   Record
	names interner
	stats ReaderStats
}

// OpenRankReader opens the rank folder dir (not a symlink) for tailing.
func OpenRankReader(dir string, cfg ReaderConfig) (*RankReader, error) {
	if cfg.Buffers != nil {
		cfg.BufferBytes = cfg.Buffers.size
	}
	if cfg.BufferBytes <= 0 {
		cfg.BufferBytes = 256 << 10
	}
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, dirError(dir, err)
	}
	r := &RankReader{dir: dir, dirfd: fd, fd: -1, cfg: cfg}
	if cfg.Buffers == nil {
		r.buf = make([]byte, cfg.BufferBytes)
	}
	return r, nil
}

// dirError is the error of opening the rank folder dir with O_NOFOLLOW.
func dirError(dir string, err error) error {
	if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
		return fmt.Errorf("%w: %s is not a folder (a symlink or a file)", ErrPath, dir)
	}
	return fmt.Errorf("trace: open rank folder: %w", &os.PathError{Op: "open", Path: dir, Err: err})
}

// ParallelGroups reads the rank folder's parallel_group.json, as
// ReadParallelGroups does, through the folder the reader holds open.
func (r *RankReader) ParallelGroups() (ParallelGroups, error) {
	if r.dirfd < 0 {
		return nil, fmt.Errorf("trace: read %s: %w", r.dir, os.ErrClosed)
	}
	return readParallelGroupsAt(r.dirfd, r.dir)
}

// Read calls fn for each complete record written since the last call, in
// file order, and returns nil once it has caught up. The *Record is valid
// only during the call. A partial last line is kept for the next Read.
// Lines that are not records are skipped and counted in Stats. If fn
// returns an error, Read returns it at once; the next Read continues with
// the following record.
func (r *RankReader) Read(fn func(*Record) error) error {
	r.budget = -1
	return r.read(fn)
}

// ReadSome is Read that reads at most n buffers of the files: it stops at
// the end of one, so that nothing it read is read again, and reports
// whether it stopped before catching up. A reader that takes turns among
// many ranks reads a buffer or so at each.
func (r *RankReader) ReadSome(n int, fn func(*Record) error) (more bool, err error) {
	r.budget = max(n, 0)
	err = r.read(fn)
	if err == errBudget {
		return true, nil
	}
	return false, err
}

// errBudget stops read once ReadSome's reads are made.
var errBudget = errors.New("trace: read budget spent")

func (r *RankReader) read(fn func(*Record) error) error {
	if r.dirfd < 0 {
		return fmt.Errorf("trace: read %s: %w", r.dir, os.ErrClosed)
	}
	if p := r.cfg.Buffers; p != nil {
		b := p.pool.Get().(*[]byte)
		r.buf = *b
		defer func() {
			// What a callback's error left of the buffer is read again
			// from the file next time.
			r.off -= int64(len(r.pending))
			r.pending, r.buf = nil, nil
			p.pool.Put(b)
		}()
	}
	next := "" // the file after cur, when the last listing found one
	for {
		if r.fd < 0 {
			if next == "" {
				var err error
				if next, err = r.nextFile(); err != nil || next == "" {
					return err
				}
			}
			r.cur, r.off, r.line, r.carry, r.skipping = next, 0, 0, r.carry[:0], false
			next = ""
			fd, _, err := openFileAt(r.dirfd, r.dir, r.cur)
			if err != nil {
				r.stats.SkippedFiles++
				r.stats.LastSkip = err
				continue
			}
			r.fd = fd
			r.stats.Files++
		}
		if err := r.readToEOF(fn); err != nil {
			return err
		}
		r.checkShrunk()
		var err error
		if next, err = r.nextFile(); err != nil || next == "" {
			return err // caught up; the current file may still grow
		}
		// A newer file exists, so the writer has finished this one; what it
		// wrote between our EOF and its switch is read now.
		if err := r.readToEOF(fn); err != nil {
			return err
		}
		if len(r.carry) > 0 || r.skipping {
			if !r.skipping {
				r.garbage(r.line+1, ErrTruncatedLine)
			}
			r.carry, r.skipping = r.carry[:0], false
		}
		unix.Close(r.fd)
		r.fd = -1
	}
}

// nextFile returns the first record file after r.cur in name order, or "".
// The folder is listed only once the files found by the last listing are
// used up: a file that was there then still says the one before it is
// finished. The listing reads the folder's entries through the reader's
// own descriptor, rewound: a reader that tails a thousand ranks lists
// each at every poll.
func (r *RankReader) nextFile() (string, error) {
	if len(r.later) == 0 {
		if err := r.list(); err != nil {
			return "", err
		}
		if len(r.later) == 0 {
			return "", nil
		}
	}
	next := r.later[0]
	r.later = r.later[1:]
	return next, nil
}

// list sets r.later to the record files after r.cur, in name order.
func (r *RankReader) list() error {
	fail := func(err error) error {
		return fmt.Errorf("trace: list %s: %w", r.dir, &os.PathError{Op: "getdents", Path: r.dir, Err: err})
	}
	if r.listed { // a folder just opened reads from its start
		if _, err := unix.Seek(r.dirfd, 0, io.SeekStart); err != nil {
			return fail(err)
		}
	}
	r.listed = true
	dents := direntBufs.Get().(*[]byte)
	defer direntBufs.Put(dents)
	r.later = r.later[:0]
	for {
		n, err := unix.Getdents(r.dirfd, *dents)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			r.later = r.later[:0]
			return fail(err)
		}
		if n <= 0 {
			slices.SortFunc(r.later, recordNameCmp)
			return nil
		}
		// Each entry is a linux_dirent64: inode (8 bytes), offset (8),
		// length (2), type (1), and the name ending in a NUL.
		for b := (*dents)[:n]; len(b) >= direntName; {
			size := int(binary.NativeEndian.Uint16(b[direntSize:]))
			if size < direntName || size > len(b) {
				return fail(unix.EINVAL)
			}
			name, typ := b[direntName:size], b[direntType]
			b = b[size:]
			if i := bytes.IndexByte(name, 0); i >= 0 {
				name = name[:i]
			}
			if !IsRecordFileName(string(name)) {
				continue
			}
			if typ == unix.DT_UNKNOWN { // file systems that do not say
				var st unix.Stat_t
				if err := unix.Fstatat(r.dirfd, string(name), &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
					continue // gone since
				}
				typ = unix.DT_REG
				switch st.Mode & unix.S_IFMT {
				case unix.S_IFLNK:
					typ = unix.DT_LNK
				case unix.S_IFDIR:
					typ = unix.DT_DIR
				}
			}
			if typ == unix.DT_LNK || typ == unix.DT_DIR {
				continue
			}
			if r.cur == "" || recordNameCmp(string(name), r.cur) > 0 {
				r.later = append(r.later, string(name))
			}
		}
	}
}

// direntBufs lends list its buffer: readers that tail a thousand ranks
// each list at every poll, one at a time per goroutine.
var direntBufs = sync.Pool{New: func() any { b := make([]byte, 8192); return &b }}

// Offsets in a linux_dirent64.
const (
	direntSize = 16
	direntType = 18
	direntName = 19
)

func (r *RankReader) readToEOF(fn func(*Record) error) error {
	for {
		if len(r.pending) > 0 {
			// What a callback's error left, in place: not read again.
			data := r.pending
			r.pending = nil
			unread, err := r.lines(data, fn)
			r.stats.Bytes += uint64(len(data) - unread)
			if err != nil {
				r.pending = data[len(data)-unread:]
				return err
			}
		}
		if r.budget == 0 {
			return errBudget
		}
		n, err := unix.Pread(r.fd, r.buf, r.off)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		// The end for now. The descriptor was opened non-blocking, which
		// regular files ignore; a file system that does not may say so.
		if err == nil && n == 0 || errors.Is(err, unix.EAGAIN) {
			return nil
		}
		if err != nil {
			// The data is gone; a vanished file reads to EOF, so this is rarer
			// (EIO): move on as if the file had ended.
			r.stats.SkippedFiles++
			r.stats.LastSkip = fmt.Errorf("trace: read %s: %w", filepath.Join(r.dir, r.cur), err)
			return nil
		}
		r.off += int64(n)
		r.pending = r.buf[:n]
		if r.budget > 0 {
			r.budget-- // only reads that found something count
		}
	}
}

// checkShrunk handles a file cut below what was read (a writer drops a
// partial line after a failed write): the unfinished line shrinks with it.
func (r *RankReader) checkShrunk() {
	var st unix.Stat_t
	if err := unix.Fstat(r.fd, &st); err != nil || st.Size >= r.off {
		return
	}
	lost := r.off - st.Size
	if int64(len(r.carry)) >= lost && !r.skipping {
		r.carry = r.carry[:int64(len(r.carry))-lost]
	} else {
		r.carry, r.skipping = r.carry[:0], false
	}
	r.off = st.Size
}

// lines splits data into lines, joining the carry from the previous chunk.
// When fn fails it returns how many bytes of data are left unread.
func (r *RankReader) lines(data []byte, fn func(*Record) error) (int, error) {
	for len(data) > 0 {
		i := bytes.IndexByte(data, '\n')
		if i < 0 {
			if r.skipping {
				return 0, nil
			}
			if len(r.carry)+len(data) > MaxLineBytes {
				r.garbage(r.line+1, ErrLineTooLong)
				r.carry, r.skipping = r.carry[:0], true
				return 0, nil
			}
			r.carry = append(r.carry, data...)
			return 0, nil
		}
		line := data[:i]
		data = data[i+1:]
		r.line++
		if r.skipping {
			r.skipping = false
			continue
		}
		if len(r.carry) > 0 {
			if len(r.carry)+len(line) > MaxLineBytes {
				r.garbage(r.line, ErrLineTooLong)
				r.carry = r.carry[:0]
				continue
			}
			r.carry = append(r.carry, line...)
			line = r.carry
		}
		err := r.record(line, fn)
		r.carry = r.carry[:0]
		if err != nil {
			return len(data), err
		}
	}
	return 0, nil
}

func (r *RankReader) record(line []byte, fn func(*Record) error) error {
	if len(line) > MaxLineBytes {
		r.garbage(r.line, ErrLineTooLong)
		return nil
	}
	if (len(line) == 0 || line[0] != '{') && len(bytes.TrimSpace(line)) == 0 {
		return nil // blank lines are not records, nor damage
	}
	if err := parseRecordInto(line, &r.rec, &r.names); err != nil {
		r.garbage(r.line, err)
		return nil
	}
	r.stats.Records++
	return fn(&r.rec)
}

// garbage counts a skipped line: one that is no record (a *ParseError),
// too long (ErrLineTooLong) or the cut last line of a finished file
// (ErrTruncatedLine).
func (r *RankReader) garbage(line int, err error) {
	r.stats.GarbageLines++
	var pe *ParseError
	if errors.As(err, &pe) {
		c := *pe // the record's, named here
		pe = &c
	} else {
		msg := "the last line of a finished file is incomplete"
		if err == ErrLineTooLong {
			msg = "longer than " + strconv.Itoa(MaxLineBytes) + " bytes"
		}
		pe = &ParseError{Format: "record", Msg: msg, Err: err}
	}
	pe.File, pe.Line = filepath.Join(r.dir, r.cur), line
	r.stats.LastGarbage = pe
}

// Stats returns the reader's counters.
func (r *RankReader) Stats() ReaderStats { return r.stats }

// Close releases the reader's files. It is idempotent.
func (r *RankReader) Close() error {
	if r.fd >= 0 {
		unix.Close(r.fd)
		r.fd = -1
	}
	if r.dirfd >= 0 {
		unix.Close(r.dirfd)
		r.dirfd = -1
	}
	return nil
}
