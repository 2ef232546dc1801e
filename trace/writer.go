package trace

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cenkalti/backoff/v4"
	"golang.org/x/sys/unix"
)

// fileWriter defaults.
const (
	defaultMaxFileBytes  = 10 << 20
	defaultFlushInterval = 5 * time.Second
	defaultBufferBytes   = 256 << 10
)

// fileWriterConfig configures a fileWriter. The zero value writes rank 0 of
// the job ResolveJob names under DefaultRoot.
type fileWriterConfig struct {
	Root         string           // default DefaultRoot
	Job          string           // default ResolveJob(Root), resolved when the first file is opened
	Rank         int              // global rank; must not be negative
	MaxFileBytes int64            // a new file starts when the current one reaches this size; default 10 MiB
	BufferBytes  int              // bytes buffered before a write to the file; default 256 KiB
	Now          func() time.Time // names new files; default time.Now
	Logger       *slog.Logger     // nil: discard
}

// Validate reports the first field that cannot be used.
func (c fileWriterConfig) Validate() error {
	if c.Job != "" {
		if err := ValidateJob(c.Job); err != nil {
			return fmt.Errorf("trace: fileWriterConfig.Job: %w", err)
		}
	}
	switch {
	case c.Rank < 0:
		return fmt.Errorf("trace: fileWriterConfig.Rank: %d is negative", c.Rank)
	case c.MaxFileBytes < 0:
		return fmt.Errorf("trace: fileWriterConfig.MaxFileBytes: %d is negative", c.MaxFileBytes)
	case c.BufferBytes < 0:
		return fmt.Errorf("trace: fileWriterConfig.BufferBytes: %d is negative", c.BufferBytes)
	}
	return nil
}

func (c *fileWriterConfig) setDefaults() {
	c.Root = cmp.Or(c.Root, DefaultRoot)
	c.MaxFileBytes = cmp.Or(c.MaxFileBytes, defaultMaxFileBytes)
	c.BufferBytes = cmp.Or(c.BufferBytes, defaultBufferBytes)
	if c.BufferBytes < 4<<10 {
		c.BufferBytes = 4 << 10
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	c.Logger = cmp.Or(c.Logger, slog.New(slog.DiscardHandler))
}

// DomainCounts counts records per marker domain. Records of a domain other
// than the two known ones count as default.
type DomainCounts struct {
	Default       uint64
	Communication uint64
}

// Stats reports what a Recorder has done.
type Stats struct {
	Written     DomainCounts // records that reached a file
	Dropped     DomainCounts // records lost: recorder buffer full, or the file could not be opened or written
	Bytes       uint64       // bytes written to files
	Files       uint64       // files created
	WriteErrors uint64       // failed opens, writes and syncs
	LastError   error        // the most recent of those, nil if none
	File        string       // the file being written, "" if none
}

const (
	domDefault = iota
	domComm
	numDomains
)

var domainNames = [numDomains]string{DomainDefault, DomainCommunication}

func domainIndex(d string) int {
	if d == DomainCommunication {
		return domComm
	}
	return domDefault
}

// counters are the statistics shared between the goroutine that writes
// and those that read Stats.
type counters struct {
	written, dropped [numDomains]atomic.Uint64
	bytes, files     atomic.Uint64
	errors           atomic.Uint64

	mu      sync.Mutex
	lastErr error
	file    string
	dir     string
}

func (c *counters) snapshot() Stats {
	s := Stats{
		Written:     DomainCounts{c.written[domDefault].Load(), c.written[domComm].Load()},
		Dropped:     DomainCounts{c.dropped[domDefault].Load(), c.dropped[domComm].Load()},
		Bytes:       c.bytes.Load(),
		Files:       c.files.Load(),
		WriteErrors: c.errors.Load(),
	}
	c.mu.Lock()
	s.LastError, s.File = c.lastErr, c.file
	c.mu.Unlock()
	return s
}

// fileWriter appends records to the rotating files of one rank:
// <Root>/<Job>/<Rank>/<10-digit unix seconds>, as JSON Lines in the form
// Record.AppendJSON writes. It creates folders with mode 0750 and files
// with mode 0640, follows no symlink beneath Root and never appends to a
// file it did not create. A fileWriter is not safe for concurrent use; the
// Recorder gives it a goroutine of its own.
//
// Errors (an unwritable root, a full disk) are returned, counted in Stats
// and drop the records they concern; the fileWriter keeps going and reopens
// with backoff, so a caller that ignores them is never blocked.
type fileWriter struct {
	cfg  fileWriterConfig
	job  string
	dir  string // rank folder, once resolved
	dirf int    // rank folder fd, -1 until opened
	f    *os.File
	name string
	sec  int64 // seconds in the current file's name
	size int64 // bytes in the file that end with a complete line

	buf     []byte
	pending []uint8 // domain of each record not yet wholly in the file, in order
	partial int64   // bytes of the first pending record already in the file
	enc     encoder

	retryAt time.Time
	backoff *backoff.ExponentialBackOff
	openErr error

	lastLog    time.Time
	lastLogMsg string

	c      *counters
	closed bool
}

// newFileWriter returns a fileWriter; it touches no file until the first record.
func newFileWriter(cfg fileWriterConfig) (*fileWriter, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	w := &fileWriter{cfg: cfg, job: cfg.Job, dirf: -1, c: &counters{}}
	w.buf = make([]byte, 0, cfg.BufferBytes+MaxLineBytes)
	w.backoff = backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(time.Second),
		backoff.WithMaxInterval(30*time.Second),
		backoff.WithMaxElapsedTime(0))
	return w, nil
}

// Dir returns the rank folder, or "" before the job is resolved.
func (w *fileWriter) Dir() string { return w.dir }

// Stats returns the writer's counters. It is safe to call concurrently
// with the writer's use.
func (w *fileWriter) Stats() Stats { return w.c.snapshot() }

// Write buffers one record. It returns an error, and counts the record
// as dropped, when no file can be opened or a buffer flush fails.
func (w *fileWriter) Write(r *Record) error {
	return w.put(domainIndex(r.Domain), r, nameLiteral, 0, nil)
}

// put buffers one record; see encoder.appendRecord for the name forms.
func (w *fileWriter) put(dom int, r *Record, form uint8, step uint64, op *CommOp) error {
	if w.closed {
		w.c.dropped[dom].Add(1)
		return fmt.Errorf("trace: write: %w", os.ErrClosed)
	}
	if w.f == nil || w.size+w.partial+int64(len(w.buf)) >= w.cfg.MaxFileBytes {
		if err := w.rotate(); err != nil {
			w.c.dropped[dom].Add(1)
			return err
		}
	}
	n := len(w.buf)
	w.buf = w.enc.appendRecord(w.buf, r, form, step, op)
	if size := len(w.buf) - n; size > MaxLineBytes {
		// Readers would skip it anyway; keep the file clean.
		w.buf = w.buf[:n]
		w.c.dropped[dom].Add(1)
		return w.fail("encode", fmt.Errorf("record of %d bytes exceeds MaxLineBytes", size))
	}
	w.buf = append(w.buf, '\n')
	w.pending = append(w.pending, uint8(dom))
	if len(w.buf) >= w.cfg.BufferBytes {
		return w.flush(false)
	}
	return nil
}

// maxNameAhead bounds how far ahead of the clock the name of an earlier
// writer's file may be for this one to follow it.
const maxNameAhead = 24 * time.Hour

// pageSize aligns the writes of a full buffer: the kernel copies whole
// pages into its cache markedly faster than writes that end mid-page.
const pageSize = 4096

// Flush writes the buffered records to the file, which then ends with a
// complete line. On a failed write the file is cut back to its last
// complete line and the buffered records are dropped.
func (w *fileWriter) Flush() error { return w.flush(true) }

// flush writes the buffer, or with all unset only as much of it as ends
// the file on a page boundary, the rest waiting for more records; the file
// may then end inside a line until the next flush. Readers wait for the
// rest of a line.
func (w *fileWriter) flush(all bool) error {
	if len(w.buf) == 0 || w.f == nil {
		return nil
	}
	n := len(w.buf)
	if !all {
		end := w.size + w.partial + int64(n)
		n -= int(end % pageSize)
		if n <= 0 {
			return nil
		}
	}
	k, err := w.f.Write(w.buf[:n])
	if err != nil {
		if k > 0 || w.partial > 0 {
			// Never leave a partial line: readers would join it to the next one.
			if terr := w.f.Truncate(w.size); terr != nil {
				err = errors.Join(err, terr)
			}
		}
		if _, serr := w.f.Seek(w.size, 0); serr != nil {
			err = errors.Join(err, serr)
		}
		for _, d := range w.pending {
			w.c.dropped[d].Add(1)
		}
		w.pending, w.partial, w.buf = w.pending[:0], 0, w.buf[:0]
		return w.fail("write "+w.path(), err)
	}
	written := w.buf[:n]
	w.c.bytes.Add(uint64(n))
	// Every pending record's newline is in the buffer: those left in the
	// unwritten tail, shorter than a page, tell how many are now written.
	lines := len(w.pending) - bytes.Count(w.buf[n:], []byte{'\n'})
	var count [numDomains]uint64
	for _, d := range w.pending[:lines] {
		count[d]++
	}
	for d, c := range count {
		if c > 0 {
			w.c.written[d].Add(c)
		}
	}
	w.pending = w.pending[:copy(w.pending, w.pending[lines:])]
	if last := bytes.LastIndexByte(written, '\n'); last >= 0 {
		w.size += w.partial + int64(last+1)
		w.partial = int64(n - last - 1)
	} else {
		w.partial += int64(n)
	}
	w.buf = w.buf[:copy(w.buf, w.buf[n:])]
	return nil
}

// Sync flushes and fsyncs the current file and the rank folder.
func (w *fileWriter) Sync() error {
	if err := w.Flush(); err != nil {
		return err
	}
	if w.f == nil {
		return nil
	}
	if err := w.f.Sync(); err != nil {
		return w.fail("sync "+w.path(), err)
	}
	if err := unix.Fsync(w.dirf); err != nil {
		return w.fail("sync "+w.dir, err)
	}
	return nil
}

// Close flushes, fsyncs and closes the file. It is idempotent.
func (w *fileWriter) Close() error {
	if w.closed {
		return nil
	}
	err := w.Sync()
	if cerr := w.closeFile(); err == nil {
		err = cerr
	}
	w.closed = true
	if w.dirf >= 0 {
		unix.Close(w.dirf)
		w.dirf = -1
	}
	return err
}

// closeFile flushes and closes the current file. It does not fsync:
// rotated files are left to the kernel's writeback, which keeps rotation
// from stalling the writer on the disk; Close fsyncs.
func (w *fileWriter) closeFile() error {
	if w.f == nil {
		return nil
	}
	err := w.Flush()
	if cerr := w.f.Close(); err == nil && cerr != nil {
		err = w.fail("close "+w.path(), cerr)
	}
	w.f = nil
	w.c.mu.Lock()
	w.c.file = ""
	w.c.mu.Unlock()
	return err
}

func (w *fileWriter) path() string { return filepath.Join(w.dir, w.name) }

// rotate closes the current file, if any, and creates the next one.
// After a failure it waits (exponential backoff up to 30 s) before trying
// again and returns the last error meanwhile.
func (w *fileWriter) rotate() error {
	now := w.cfg.Now()
	if w.openErr != nil && now.Before(w.retryAt) {
		return w.openErr
	}
	if w.f != nil {
		w.closeFile() // errors are counted; the next file may do better
	}
	err := w.open(now)
	if err != nil {
		w.openErr = err
		w.retryAt = now.Add(w.backoff.NextBackOff())
		return w.fail("open", err)
	}
	w.openErr = nil
	w.backoff.Reset()
	return nil
}

// openDir resolves the job and opens (creating) the rank folder.
func (w *fileWriter) openDir() error {
	if w.dirf >= 0 {
		return nil
	}
	if w.job == "" {
		job, err := ResolveJob(w.cfg.Root)
		if err != nil {
			return err
		}
		w.job = job
	}
	fd, err := openRankDir(w.cfg.Root, w.job, w.cfg.Rank, true)
	if err != nil {
		return err
	}
	w.dirf = fd
	w.dir = filepath.Join(w.cfg.Root, w.job, strconv.Itoa(w.cfg.Rank))
	w.c.mu.Lock()
	w.c.dir = w.dir
	w.c.mu.Unlock()
	return nil
}

func (w *fileWriter) open(now time.Time) error {
	if err := w.openDir(); err != nil {
		return err
	}
	if w.sec == 0 {
		// Readers tail files in name order, so the first file of this
		// process must sort after what an earlier one left, even one that
		// rotated faster than once a second into names ahead of the clock.
		// Names further ahead than maxNameAhead did not come from a writer
		// (one would need to rotate a day's worth of seconds ahead) and are
		// ignored: following one to the top of the int64 range would
		// overflow into names that are no record file names.
		ents, err := listDir(w.dirf, w.dir)
		if err != nil {
			return err
		}
		limit := now.Unix() + int64(maxNameAhead/time.Second)
		for _, e := range ents {
			if IsRecordFileName(e.Name()) {
				if n, err := strconv.ParseInt(e.Name(), 10, 64); err == nil && n > w.sec && n <= limit {
					w.sec = n
				}
			}
		}
	}
	sec := now.Unix()
	if sec <= w.sec {
		sec = w.sec + 1 // rotating faster than once a second, or behind an earlier process
	}
	for tries := 0; ; tries++ {
		name := fmt.Sprintf("%010d", sec)
		fd, err := unix.Openat(w.dirf, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, fileMode)
		if errors.Is(err, unix.EEXIST) && tries < 1000 {
			sec++ // a previous process of this rank, in the same second
			continue
		}
		if err != nil {
			if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ESTALE) {
				// The rank folder went away under us: find it again next time.
				unix.Close(w.dirf)
				w.dirf = -1
			}
			return &os.PathError{Op: "create", Path: filepath.Join(w.dir, name), Err: err}
		}
		unix.Fchmod(fd, fileMode) // exact mode regardless of the umask
		w.f = os.NewFile(uintptr(fd), filepath.Join(w.dir, name))
		w.name, w.sec, w.size, w.partial = name, sec, 0, 0
		w.c.files.Add(1)
		w.c.mu.Lock()
		w.c.file = w.path()
		w.c.mu.Unlock()
		return nil
	}
}

// fail counts err, remembers it and logs it, at most once a minute for
// the same message, and returns it wrapped with what was being done.
func (w *fileWriter) fail(op string, err error) error {
	err = fmt.Errorf("trace: %s: %w", op, err)
	w.c.errors.Add(1)
	w.c.mu.Lock()
	w.c.lastErr = err
	w.c.mu.Unlock()
	msg := err.Error()
	if now := time.Now(); msg != w.lastLogMsg || now.Sub(w.lastLog) > time.Minute {
		w.cfg.Logger.Warn("trace: records dropped", "err", err, "rank", w.cfg.Rank)
		w.lastLog, w.lastLogMsg = now, msg
	}
	return err
}

// WriteParallelGroups writes g as parallel_group.json into the writer's
// rank folder, creating the folder if needed.
func (w *fileWriter) WriteParallelGroups(g ParallelGroups) error {
	if w.closed {
		return fmt.Errorf("trace: write %s: %w", ParallelGroupFile, os.ErrClosed)
	}
	if err := w.openDir(); err != nil {
		return fmt.Errorf("trace: write %s: %w", ParallelGroupFile, err)
	}
	return WriteParallelGroups(w.dir, g)
}
