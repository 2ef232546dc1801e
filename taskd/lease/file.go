package lease

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/fsnotify/fsnotify"
	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/internal/atomicfile"
)

// DefaultRetryPeriod is a File lease's default FileConfig.RetryPeriod.
const DefaultRetryPeriod = 100 * time.Millisecond

// FileConfig configures a File lease.
type FileConfig struct {
	// Path is the lease file, which holds the Record of the lease's newest
	// term; the lock is the file Path+".lock" beside it. Required. The
	// directory must exist, on a filesystem that every candidate shares
	// and whose locks work between them: one machine's, or a shared
	// filesystem whose flock reaches every client (NFSv4, CephFS, Lustre
	// mounted with flock).
	Path string
	// Candidate is who campaigns; Job and Config are required.
	Candidate Candidate
	// RetryPeriod is how often a waiting candidate tries the lock, and how
	// often a holder reads the lease file besides each time inotify tells
	// of a change (it cannot tell of other machines' changes on a shared
	// filesystem); default DefaultRetryPeriod.
	RetryPeriod time.Duration
	// Logger receives a record per term taken and lost; nil: discard.
	Logger *slog.Logger
}

// Validate reports the first field of c that is missing or out of range.
func (c FileConfig) Validate() error {
	switch {
	case c.Path == "":
		return errors.New("lease: FileConfig.Path is empty")
	case c.RetryPeriod < 0:
		return fmt.Errorf("lease: FileConfig.RetryPeriod is %v, want >= 0", c.RetryPeriod)
	}
	return c.Candidate.Validate()
}

// File is a lease kept in files, for managers on one machine or on a
// shared filesystem: whoever holds an exclusive flock on the lock file
// holds the lease, and the lease file beside it records the newest term
// and its fencing token.
//
// A candidate that takes the lock reads the lease file, refuses it if it
// is another job's (ErrForeign) or unreadable (ErrInvalid), and writes it
// again, atomically, with the token increased by one and itself as the
// holder. The kernel drops the lock of a holder that dies, however it
// dies, and a waiting candidate takes it within RetryPeriod.
//
// A holder reads the lease file again whenever inotify tells of a change
// to it or to the lock file, and every RetryPeriod: if the file names a
// newer term, is gone or invalid, or the lock file was removed or
// replaced (so that another candidate may lock a new one), the term ends
// at once. That happens only when something defeats the lock: an
// operator, or a shared filesystem whose locks do not reach every
// machine. A file that cannot be read just now (EIO, ESTALE, EMFILE)
// ends nothing. Term.Check reads them on demand.
//
// A term that ends keeps the lock until Term.Resign, so that no standby
// takes over while the holder still stops the work it did under the term.
//
// Deleting the lease file restarts its tokens from 1, below the tokens
// that fences have seen: keep it while the job runs.
type File struct {
	cfg      FileConfig
	lockPath string
	log      *slog.Logger
	// flock is unix.Flock; tests stand in a filesystem without working
	// locks.
	flock func(fd int, how int) error
}

// NewFile returns the lease that cfg describes, once it has checked that
// the filesystem's locks work (ErrNoLocks), and that a lease file already
// there can be read (ErrInvalid) and is cfg's job's (ErrForeign).
func NewFile(cfg FileConfig) (*File, error) {
	return newFile(cfg, unix.Flock)
}

func newFile(cfg FileConfig, flock func(int, int) error) (*File, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Path = filepath.Clean(cfg.Path)
	cfg.Candidate = cfg.Candidate.withDefaults()
	if cfg.RetryPeriod == 0 {
		cfg.RetryPeriod = DefaultRetryPeriod
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	l := &File{cfg: cfg, lockPath: cfg.Path + ".lock", flock: flock,
		log: cfg.Logger.With("lease", cfg.Path, "candidate", cfg.Candidate.Name)}
	if err := l.probe(); err != nil {
		return nil, err
	}
	rec, err := l.read()
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return nil, err
	case rec.Job != cfg.Candidate.Job:
		return nil, l.foreign(rec)
	}
	return l, nil
}

// errHeld is tryLock's answer when another open file description holds
// the lock.
var errHeld = errors.New("lease: lock held")

// probe checks that the filesystem's locks work: an exclusive flock taken
// through one open file description of the lock file must refuse a second
// one opened by this same process (flock locks belong to open file
// descriptions, not to processes as fcntl's do). A lock that another
// candidate holds refuses the first attempt already, which shows as much.
// A filesystem that refuses flock fails the first attempt; one that grants
// every flock (some FUSE and network filesystems mounted without lock
// support) fails the second. What no probe on one machine can tell is a
// shared filesystem whose locks are only local to each client: the tokens
// in the lease file catch a second holder there.
func (l *File) probe() error {
	a, err := l.openLock()
	if err != nil {
		return err
	}
	defer a.Close()
	switch err := l.tryLock(a); {
	case errors.Is(err, errHeld):
		return nil
	case err != nil:
		return err
	}
	defer l.flock(int(a.Fd()), unix.LOCK_UN)
	b, err := l.openLock()
	if err != nil {
		return err
	}
	defer b.Close()
	switch err := l.tryLock(b); {
	case errors.Is(err, errHeld):
		return nil
	case err != nil:
		return err
	}
	return fmt.Errorf("%w: lock file %s: two open files of it both took an exclusive flock, so the filesystem grants locks without enforcing them; put the lease file on a filesystem with working locks",
		ErrNoLocks, l.lockPath)
}

// openLock opens the lock file, creating it if need be.
func (l *File) openLock() (*os.File, error) {
	f, err := os.OpenFile(l.lockPath, os.O_RDONLY|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("lease: open lock file: %w", err)
	}
	return f, nil
}

// tryLock takes an exclusive flock on f without waiting: errHeld if
// another holds it, an error wrapping ErrNoLocks if the filesystem
// refuses locks.
func (l *File) tryLock(f *os.File) error {
	for {
		err := l.flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		switch {
		case err == nil:
			return nil
		case errors.Is(err, unix.EINTR):
			continue
		case errors.Is(err, unix.EWOULDBLOCK):
			return errHeld
		}
		return fmt.Errorf("%w: lock file %s: flock: %w; put the lease file on a filesystem with working locks", ErrNoLocks, l.lockPath, err)
	}
}

// read reads and parses the lease file; an error wrapping fs.ErrNotExist
// if there is none.
func (l *File) read() (Record, error) {
	f, err := os.Open(l.cfg.Path)
	if err != nil {
		return Record{}, fmt.Errorf("lease: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxRecordBytes+1))
	if err != nil {
		return Record{}, fmt.Errorf("lease: read %s: %w", l.cfg.Path, err)
	}
	rec, err := ParseRecord(data)
	var pe *ParseError
	if errors.As(err, &pe) {
		pe.File = l.cfg.Path
	}
	return rec, err
}

// foreign is the error for a lease file of another job.
func (l *File) foreign(rec Record) error {
	return fmt.Errorf("%w: lease file %s belongs to job %q (last held by %s), not %q: refused, nothing changed; give each job its own lease file",
		ErrForeign, l.cfg.Path, rec.Job, rec.Holder, l.cfg.Candidate.Job)
}

// Campaign blocks until the lease is this candidate's, and returns its
// term. While another holds it, Campaign refuses a lease file of another
// job (ErrForeign) or an unreadable one (ErrInvalid), and a holder of
// another configuration (*ConfigError) once it has seen the same term
// twice: a holder writes the lease file just after it takes the lock, so a
// first sight may be of the term before. Any other error (the lock or
// lease file cannot be opened, read or written just now: EMFILE, EIO, a
// shared filesystem's server away) is logged and tried again, with
// backoff, until ctx ends.
func (l *File) Campaign(ctx context.Context) (Term, error) {
	wake, stop := l.watch()
	defer stop()
	retry := time.NewTimer(l.cfg.RetryPeriod)
	defer retry.Stop()
	bo := backoff.NewExponentialBackOff(backoff.WithInitialInterval(l.cfg.RetryPeriod),
		backoff.WithMaxInterval(max(l.cfg.RetryPeriod, maxRetryBackoff)), backoff.WithMaxElapsedTime(0))
	var other *Record // a holder of another configuration, seen once
	for {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("lease %s: campaign: %w", l.cfg.Path, context.Cause(ctx))
		}
		wait := l.cfg.RetryPeriod
		t, holder, err := l.try(ctx)
		switch {
		case err != nil && final(err):
			return nil, err
		case err != nil && ctx.Err() != nil:
			continue
		case err != nil:
			wait = bo.NextBackOff()
			l.log.Warn("lease: cannot campaign just now; trying again", "err", err, "retry_in", wait)
		case t != nil:
			return t, nil
		case holder == nil:
			other = nil
		case holder.Job != l.cfg.Candidate.Job:
			return nil, l.foreign(*holder)
		case holder.Config == l.cfg.Candidate.Config:
			other = nil
		case other != nil && other.Term == holder.Term:
			return nil, &ConfigError{Lease: l.cfg.Path, Job: holder.Job, Holder: holder.Holder,
				HolderConfig: holder.Config, Config: l.cfg.Candidate.Config}
		default:
			other = holder
		}
		if err == nil {
			bo.Reset()
		}
		retry.Reset(wait)
		select {
		case <-ctx.Done():
		case <-wake:
		case <-retry.C:
		}
	}
}

// maxRetryBackoff caps the wait between a File's tries after errors.
const maxRetryBackoff = 5 * time.Second

// final reports whether err, from a try for the lease, refuses the
// candidate for good rather than for now.
func final(err error) bool {
	return errors.Is(err, ErrInvalid) || errors.Is(err, ErrForeign) || errors.Is(err, ErrConfig) || errors.Is(err, ErrNoLocks)
}

// try takes the lease if its lock is free and returns the new term. If
// another holds the lock, it returns the lease file's record (nil while
// there is none).
func (l *File) try(ctx context.Context) (*fileTerm, *Record, error) {
	f, err := l.openLock()
	if err != nil {
		return nil, nil, err
	}
	err = l.tryLock(f)
	if errors.Is(err, errHeld) {
		f.Close()
		rec, err := l.read()
		switch {
		case errors.Is(err, fs.ErrNotExist):
			return nil, nil, nil
		case err != nil:
			return nil, nil, err
		}
		return nil, &rec, nil
	}
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	t, err := l.take(ctx, f)
	if t == nil {
		l.flock(int(f.Fd()), unix.LOCK_UN)
		f.Close()
	}
	return t, nil, err
}

// take writes the lease file of a new term for the holder of the lock on
// f. It returns nil and no error if f is no longer the lock file.
func (l *File) take(ctx context.Context, f *os.File) (*fileTerm, error) {
	// The lock file may have been replaced between the open and the lock:
	// a lock on a file without a name excludes no one.
	info, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("lease: stat lock file %s: %w", l.lockPath, err)
	}
	if now, err := os.Stat(l.lockPath); err != nil || !os.SameFile(info, now) {
		return nil, nil
	}
	token := uint64(1)
	prev, err := l.read()
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return nil, err
	case prev.Job != l.cfg.Candidate.Job:
		return nil, l.foreign(prev)
	case prev.Token == math.MaxUint64:
		return nil, &ParseError{File: l.cfg.Path, Field: "token", Msg: "has no successor"}
	default:
		token = prev.Token + 1
		if prev.Config != l.cfg.Candidate.Config {
			l.log.Info("lease: taking over from a holder of another configuration, who is gone",
				"holder", prev.Holder, "holder_config", prev.Config, "config", l.cfg.Candidate.Config)
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("lease %s: campaign: %w", l.cfg.Path, context.Cause(ctx))
	}
	rec := Record{Job: l.cfg.Candidate.Job, Config: l.cfg.Candidate.Config, Token: token,
		Holder: l.cfg.Candidate.Name, Term: randomHex(8), Acquired: time.Now().UTC()}
	data, err := rec.Marshal()
	if err != nil {
		return nil, err
	}
	if err := atomicfile.WriteFile(l.cfg.Path, data, 0o644); err != nil {
		return nil, fmt.Errorf("lease: %w", err)
	}
	l.log.Info("lease: term taken", "token", token, "term", rec.Term)
	return l.start(ctx, f, info, rec), nil
}

// watch returns a channel that receives when inotify tells of a change to
// the lease file or its lock, and the function that stops it. Without
// inotify the channel is nil: the callers poll.
func (l *File) watch() (<-chan struct{}, func()) {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		l.log.Warn("lease: no inotify, polling only", "err", err)
		return nil, func() {}
	}
	if err := w.Add(filepath.Dir(l.cfg.Path)); err != nil {
		w.Close()
		l.log.Warn("lease: no inotify, polling only", "err", err)
		return nil, func() {}
	}
	wake := make(chan struct{}, 1)
	done := make(chan struct{})
	names := map[string]bool{filepath.Base(l.cfg.Path): true, filepath.Base(l.lockPath): true}
	go func() {
		defer close(done)
		for {
			select {
			case ev, ok := <-w.Events:
				if !ok {
					return
				}
				if !names[filepath.Base(ev.Name)] {
					continue
				}
			case _, ok := <-w.Errors: // an overflow may hide a change
				if !ok {
					return
				}
			}
			select {
			case wake <- struct{}{}:
			default:
			}
		}
	}()
	return wake, func() {
		w.Close()
		<-done
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// fileTerm is a term of a File lease. It holds the lock file open and
// locked until Resign, even once the term has ended, so that no standby
// takes over while the work done under it is still stopping; a process
// that dies drops the lock with its open files.
type fileTerm struct {
	l        *File
	rec      Record
	lock     *os.File
	lockInfo os.FileInfo
	ctx      context.Context
	end      context.CancelCauseFunc
	done     chan struct{} // closed once the term's goroutine has returned
	release  sync.Once
}

// start starts the term of rec, whose lock is held on f.
func (l *File) start(parent context.Context, f *os.File, info os.FileInfo, rec Record) *fileTerm {
	// The term's context carries parent's values, but its cause, once
	// parent ends, wraps ErrLost.
	ctx, end := context.WithCancelCause(context.WithoutCancel(parent))
	t := &fileTerm{l: l, rec: rec, lock: f, lockInfo: info, ctx: ctx, end: end, done: make(chan struct{})}
	stopAfter := context.AfterFunc(parent, func() {
		end(fmt.Errorf("%w: lease %s: the campaign's context ended: %w", ErrLost, l.cfg.Path, context.Cause(parent)))
	})
	wake, stopWatch := l.watch()
	go func() {
		defer close(t.done)
		defer stopAfter()
		defer stopWatch()
		tick := time.NewTicker(l.cfg.RetryPeriod)
		defer tick.Stop()
		failing := false // whether the last check could not read the files, logged once
		for {
			select {
			case <-ctx.Done():
				l.log.Info("lease: term over", "token", rec.Token, "cause", context.Cause(ctx))
				return
			case <-wake:
			case <-tick.C:
			}
			switch err := t.verify(); {
			case err == nil && failing:
				l.log.Info("lease: lease file read again; the term goes on", "token", rec.Token)
				failing = false
			case err != nil && !failing && !errors.Is(err, ErrLost):
				l.log.Warn("lease: cannot read the lease file; the term goes on", "token", rec.Token, "err", err)
				failing = true
			}
		}
	}()
	return t
}

func (t *fileTerm) Token() uint64            { return t.rec.Token }
func (t *fileTerm) Context() context.Context { return t.ctx }

// Check reads the lease file and the lock file now.
func (t *fileTerm) Check(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return context.Cause(ctx)
	}
	return t.verify()
}

// verify ends the term, and returns why, unless the lease file still
// names it and the lock file is still the one locked: a lease file gone,
// invalid or naming another term, or a lock file gone or replaced. If
// either cannot be read just now (EMFILE, EIO, ESTALE), the term goes on
// and verify returns an error that does not wrap ErrLost.
func (t *fileTerm) verify() error {
	if t.ctx.Err() != nil {
		return context.Cause(t.ctx)
	}
	path := t.l.cfg.Path
	rec, err := t.l.read()
	switch {
	case errors.Is(err, fs.ErrNotExist) || errors.Is(err, ErrInvalid):
		err = fmt.Errorf("%w: lease file %s cannot confirm term %d: %w", ErrLost, path, t.rec.Token, err)
	case err != nil:
		return fmt.Errorf("lease: lease file %s cannot confirm term %d just now; the term goes on: %w", path, t.rec.Token, err)
	case rec.Token != t.rec.Token || rec.Term != t.rec.Term:
		err = fmt.Errorf("%w: lease file %s names %s's term %d (%s), taken %s; this term was %d: deposed",
			ErrLost, path, rec.Holder, rec.Token, rec.Term, rec.Acquired.Format(time.RFC3339Nano), t.rec.Token)
	default:
		now, serr := os.Stat(t.l.lockPath)
		switch {
		case errors.Is(serr, fs.ErrNotExist) || serr == nil && !os.SameFile(t.lockInfo, now):
			err = fmt.Errorf("%w: lock file %s was removed or replaced during term %d: another candidate may lock it", ErrLost, t.l.lockPath, t.rec.Token)
		case serr != nil:
			return fmt.Errorf("lease: lock file %s cannot confirm term %d just now; the term goes on: %w", t.l.lockPath, t.rec.Token, serr)
		}
	}
	if err != nil {
		t.end(err)
		return context.Cause(t.ctx)
	}
	return nil
}

// Resign ends the term, waits for its goroutine, and only then unlocks
// and closes the lock file.
func (t *fileTerm) Resign() error {
	t.end(fmt.Errorf("%w: lease %s: term %d resigned", ErrLost, t.l.cfg.Path, t.rec.Token))
	<-t.done
	t.release.Do(func() {
		t.l.flock(int(t.lock.Fd()), unix.LOCK_UN)
		t.lock.Close()
	})
	return nil
}
