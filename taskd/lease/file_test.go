package lease

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/internal/testkit"
)

const testConfig = "3f2a9c1e0b7d4a65"

// fileConfig is the FileConfig of candidate name of job "llm" with
// config, in dir.
func fileConfig(dir, name, config string) FileConfig {
	return FileConfig{Path: filepath.Join(dir, "manager.lease"),
		Candidate: Candidate{Job: "llm", Config: config, Name: name}}
}

func newTestFile(t *testing.T, cfg FileConfig) *File {
	t.Helper()
	l, err := NewFile(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func campaign(t *testing.T, l Lease) Term {
	t.Helper()
	term, err := l.Campaign(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { term.Resign() })
	return term
}

// campaignAsync campaigns in a goroutine that the test waits for.
func campaignAsync(t *testing.T, ctx context.Context, l Lease) <-chan Term {
	t.Helper()
	ch := make(chan Term, 1)
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	wg.Go(func() {
		term, err := l.Campaign(ctx)
		if err != nil {
			if ctx.Err() == nil {
				t.Errorf("Campaign: %v", err)
			}
			close(ch)
			return
		}
		ch <- term
	})
	return ch
}

func TestFileTermsAndTokens(t *testing.T) {
	dir := t.TempDir()
	a := newTestFile(t, fileConfig(dir, "a", testConfig))
	b := newTestFile(t, fileConfig(dir, "b", testConfig))
	ta := campaign(t, a)
	if ta.Token() != 1 {
		t.Errorf("first token = %d, want 1", ta.Token())
	}
	if err := ta.Check(t.Context()); err != nil {
		t.Fatalf("Check of the holder: %v", err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	waiting := campaignAsync(t, ctx, b)
	// a resigns: b takes the lease without waiting for anything else.
	if err := ta.Resign(); err != nil {
		t.Fatal(err)
	}
	tb := <-waiting
	if tb.Token() != 2 {
		t.Errorf("token after a takeover = %d, want 2", tb.Token())
	}
	if err := ta.Check(t.Context()); !errors.Is(err, ErrLost) {
		t.Errorf("Check of a resigned term = %v, want ErrLost", err)
	}
	if err := context.Cause(ta.Context()); !errors.Is(err, ErrLost) || !strings.Contains(err.Error(), "resigned") {
		t.Errorf("cause of a resigned term = %v", err)
	}
	rec, err := b.read()
	if err != nil || rec.Holder != "b" || rec.Token != 2 {
		t.Errorf("lease file = %+v, %v; want b's term 2", rec, err)
	}
	// a campaigns again: its new term follows b's.
	tb.Resign()
	if ta2 := campaign(t, a); ta2.Token() != 3 {
		t.Errorf("token of a's second term = %d, want 3", ta2.Token())
	}
}

func TestFileCampaignContext(t *testing.T) {
	dir := t.TempDir()
	a := newTestFile(t, fileConfig(dir, "a", testConfig))
	b := newTestFile(t, fileConfig(dir, "b", testConfig))
	campaign(t, a)
	ctx, cancel := context.WithCancelCause(t.Context())
	errc := make(chan error, 1)
	go func() {
		_, err := b.Campaign(ctx)
		errc <- err
	}()
	stop := errors.New("shutting down")
	cancel(stop)
	if err := <-errc; !errors.Is(err, stop) {
		t.Errorf("Campaign after its context ended = %v, want %v", err, stop)
	}

	// A term ends with its campaign's context, with a cause wrapping
	// ErrLost, and lets the lease go once resigned.
	dir = t.TempDir()
	c := newTestFile(t, fileConfig(dir, "c", testConfig))
	ctx, cancel = context.WithCancelCause(t.Context())
	tc, err := c.Campaign(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Resign()
	cancel(stop)
	<-tc.Context().Done()
	if err := context.Cause(tc.Context()); !errors.Is(err, ErrLost) || !errors.Is(err, stop) {
		t.Errorf("cause = %v, want ErrLost and %v", err, stop)
	}
	tc.Resign()
	d := newTestFile(t, fileConfig(dir, "d", testConfig))
	if td := campaign(t, d); td.Token() != 2 {
		t.Errorf("token = %d, want 2", td.Token())
	}
}

// TestFileTermKeepsLockUntilResign: a term that ends, by its campaign's
// context (taskd-manager's SIGTERM) or by a check of the lease file, keeps
// the lock until its holder resigns: the holder may still be stopping the
// work done under the term, which a standby must not start meanwhile.
func TestFileTermKeepsLockUntilResign(t *testing.T) {
	for _, tt := range []struct {
		name string
		end  func(cancel context.CancelFunc, path string) error
	}{
		{"campaign's context ended", func(cancel context.CancelFunc, _ string) error { cancel(); return nil }},
		{"lease file removed", func(_ context.CancelFunc, path string) error { return os.Remove(path) }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			a := newTestFile(t, fileConfig(dir, "a", testConfig))
			b := newTestFile(t, fileConfig(dir, "b", testConfig))
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			ta, err := a.Campaign(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer ta.Resign()
			if err := tt.end(cancel, a.cfg.Path); err != nil {
				t.Fatal(err)
			}
			<-ta.Context().Done()
			<-ta.(*fileTerm).done // nothing of the term is left to run but Resign
			tb, _, err := b.try(t.Context())
			if tb != nil {
				tb.Resign()
				t.Fatalf("b took the lease (token %d) before a resigned term %d", tb.Token(), ta.Token())
			}
			if err != nil {
				t.Fatal(err)
			}
			ta.Resign()
			campaign(t, b)
		})
	}
}

// loopLink puts in place of path, atomically, a symbolic link to itself,
// which any open of path fails with ELOOP: a file that cannot be read
// just now, as on EIO or a shared filesystem's ESTALE. The returned
// function puts back what path held, atomically.
func loopLink(t *testing.T, path string) (restore func()) {
	t.Helper()
	saved, err := os.ReadFile(path)
	existed := err == nil
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	tmp := path + ".loop"
	if err := os.Symlink(filepath.Base(path), tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
	return func() {
		t.Helper()
		if !existed {
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			return
		}
		if err := os.WriteFile(tmp, saved, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
	}
}

// logOutput returns a Logger whose records, without their time, are the
// lines of the returned Output.
func logOutput() (*slog.Logger, *testkit.Output) {
	out := testkit.NewOutput("lease", false)
	noTime := func(_ []string, a slog.Attr) slog.Attr {
		if a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}
	return slog.New(slog.NewTextHandler(out, &slog.HandlerOptions{ReplaceAttr: noTime})), out
}

// TestFileCampaignWaitsOutReadErrors: a lock file or lease file that
// cannot be read just now refuses no candidate: its campaign logs the
// error, tries again, and takes the lease once the file can be read.
func TestFileCampaignWaitsOutReadErrors(t *testing.T) {
	for _, tt := range []struct {
		name   string
		file   string // beside the lease file
		holder bool   // whether a holds the lease meanwhile
	}{
		{"lock file", "manager.lease.lock", false},
		{"lease file", "manager.lease", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			a := newTestFile(t, fileConfig(dir, "a", testConfig))
			var ta Term
			if tt.holder {
				ta = campaign(t, a)
			}
			bcfg := fileConfig(dir, "b", testConfig)
			log, out := logOutput()
			bcfg.Logger = log
			b := newTestFile(t, bcfg)
			restore := loopLink(t, filepath.Join(dir, tt.file))
			type result struct {
				term Term
				err  error
			}
			waiting := make(chan result, 1)
			go func() {
				term, err := b.Campaign(t.Context())
				waiting <- result{term, err}
				fmt.Fprintf(out, "campaign over: %v\n", err)
				out.Close() // a campaign that ends fails the Wait at once
			}()
			out.Wait(t, 0, `level=WARN msg="lease: cannot campaign just now; trying again"`, testkit.Deadline)
			restore()
			if ta != nil {
				ta.Resign()
			}
			r := <-waiting
			if r.err != nil {
				t.Fatalf("Campaign: %v", r.err)
			}
			r.term.Resign()
		})
	}
}

// TestFileTermGoesOnThroughReadErrors: a lease file that cannot be read
// just now ends no term: Check says so with an error that does not wrap
// ErrLost, the background check logs it and lets the term go on, and
// once the file can be read again Check confirms the term.
func TestFileTermGoesOnThroughReadErrors(t *testing.T) {
	cfg := fileConfig(t.TempDir(), "a", testConfig)
	log, out := logOutput()
	cfg.Logger = log
	ta := campaign(t, newTestFile(t, cfg))
	context.AfterFunc(ta.Context(), func() { out.Close() }) // a term that ends fails the Wait at once
	restore := loopLink(t, cfg.Path)
	err := ta.Check(t.Context())
	if err == nil || errors.Is(err, ErrLost) || !strings.Contains(err.Error(), cfg.Path) {
		t.Errorf("Check of an unreadable lease file = %v, want an error naming it that does not wrap ErrLost", err)
	}
	out.Wait(t, 0, `level=WARN msg="lease: cannot read the lease file; the term goes on"`, testkit.Deadline)
	if ta.Context().Err() != nil {
		t.Fatalf("the term ended: %v", context.Cause(ta.Context()))
	}
	restore()
	if err := ta.Check(t.Context()); err != nil {
		t.Errorf("Check once the lease file is back = %v", err)
	}
}

// TestFileDeposedAtOnce: a holder learns at once that another candidate
// took a newer term, here on a filesystem whose locks are local to each
// machine: b's locks are kept apart from a's, as on an NFS mount with
// local locks, and b takes the lease while a holds it. a's term ends
// without waiting for a Check, and Check says so.
func TestFileDeposedAtOnce(t *testing.T) {
	dir := t.TempDir()
	a := newTestFile(t, fileConfig(dir, "a", testConfig))
	ta := campaign(t, a)
	bcfg := fileConfig(dir, "b", testConfig)
	bcfg.RetryPeriod = 1 << 40 // a's term must end on the change's notice, not on its poll
	b, err := newFile(bcfg, newLockTable().flock)
	if err != nil {
		t.Fatal(err)
	}
	tb := campaign(t, b)
	if tb.Token() != 2 {
		t.Fatalf("b's token = %d, want 2", tb.Token())
	}
	<-ta.Context().Done()
	cause := context.Cause(ta.Context())
	if !errors.Is(cause, ErrLost) || !strings.Contains(cause.Error(), "deposed") || !strings.Contains(cause.Error(), "b's term 2") {
		t.Errorf("cause = %v", cause)
	}
	if err := ta.Check(t.Context()); !errors.Is(err, ErrLost) {
		t.Errorf("Check of a deposed term = %v", err)
	}
	if err := tb.Check(t.Context()); err != nil {
		t.Errorf("Check of the newest term = %v", err)
	}
}

// TestFileLockFileRemoved: a holder whose lock file is removed (so that
// another candidate could lock a new one) stops at once.
func TestFileLockFileRemoved(t *testing.T) {
	cfg := fileConfig(t.TempDir(), "a", testConfig)
	cfg.RetryPeriod = 1 << 40
	ta := campaign(t, newTestFile(t, cfg))
	if err := os.Remove(cfg.Path + ".lock"); err != nil {
		t.Fatal(err)
	}
	<-ta.Context().Done()
	if err := context.Cause(ta.Context()); !errors.Is(err, ErrLost) || !strings.Contains(err.Error(), "removed or replaced") {
		t.Errorf("cause = %v", err)
	}
}

// TestFileNoLocks: a filesystem that refuses flock, and one that grants
// every flock without enforcing it, are refused at start, naming the lock
// file. No such filesystem is mounted here: the lease's flock stands in
// for theirs.
func TestFileNoLocks(t *testing.T) {
	cfg := fileConfig(t.TempDir(), "a", testConfig)
	for _, fs := range []struct {
		name  string
		flock func(int, int) error
		msg   string
	}{
		{"refuses", func(int, int) error { return unix.ENOLCK }, "no locks available"},
		{"grants all", func(int, int) error { return nil }, "without enforcing them"},
	} {
		_, err := newFile(cfg, fs.flock)
		if !errors.Is(err, ErrNoLocks) || !strings.Contains(err.Error(), cfg.Path+".lock") || !strings.Contains(err.Error(), fs.msg) {
			t.Errorf("%s: err = %v", fs.name, err)
		}
	}
	// The real filesystem passes, held or not.
	a := newTestFile(t, cfg)
	campaign(t, a)
	newTestFile(t, fileConfig(filepath.Dir(cfg.Path), "b", testConfig))
}

// TestFileRefusesAnotherJobsOrVersion: a lease file of another job, of an
// unknown version or damaged is refused, with the file named, and left as
// it was, at start and when it appears later.
func TestFileRefusesAnotherJobsOrVersion(t *testing.T) {
	other := sampleRecord()
	other.Job = "other-job"
	otherData, _ := other.Marshal()
	mine, _ := sampleRecord().Marshal()
	for _, tt := range []struct {
		name string
		data []byte
		want error
		msg  string
	}{
		{"another job", otherData, ErrForeign, `belongs to job "other-job"`},
		{"unknown version", bytes.Replace(mine, []byte(`"version":1`), []byte(`"version":9`), 1), ErrInvalid, `field version: value "9": is unknown`},
		{"damaged", mine[:len(mine)/2], ErrInvalid, "not a JSON object"},
	} {
		cfg := fileConfig(t.TempDir(), "a", testConfig)
		if err := os.WriteFile(cfg.Path, tt.data, 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := NewFile(cfg)
		if !errors.Is(err, tt.want) || !strings.Contains(err.Error(), cfg.Path) || !strings.Contains(err.Error(), tt.msg) {
			t.Errorf("%s: NewFile: %v", tt.name, err)
		}
		// The same file, arrived after the start.
		if err := os.Remove(cfg.Path); err != nil {
			t.Fatal(err)
		}
		l := newTestFile(t, cfg)
		if err := os.WriteFile(cfg.Path, tt.data, 0o644); err != nil {
			t.Fatal(err)
		}
		if _, err := l.Campaign(t.Context()); !errors.Is(err, tt.want) || !strings.Contains(err.Error(), cfg.Path) {
			t.Errorf("%s: Campaign: %v", tt.name, err)
		}
		if got, _ := os.ReadFile(cfg.Path); !bytes.Equal(got, tt.data) {
			t.Errorf("%s: the lease file was changed:\n%s", tt.name, got)
		}
	}
}

// TestFileRefusesAnotherConfig: while a holder of one configuration lives,
// a candidate of another is refused, naming both; once it is gone, the
// lease is taken whatever configuration it had.
func TestFileRefusesAnotherConfig(t *testing.T) {
	dir := t.TempDir()
	ta := campaign(t, newTestFile(t, fileConfig(dir, "a", testConfig)))
	b := newTestFile(t, fileConfig(dir, "b", "0123456789abcdef"))
	before, _ := os.ReadFile(filepath.Join(dir, "manager.lease"))
	_, err := b.Campaign(t.Context())
	var ce *ConfigError
	if !errors.As(err, &ce) || !errors.Is(err, ErrConfig) {
		t.Fatalf("Campaign = %v, want a *ConfigError", err)
	}
	for _, s := range []string{"manager.lease", "llm", " a ", testConfig, "0123456789abcdef"} {
		if !strings.Contains(err.Error(), s) {
			t.Errorf("error %q does not name %q", err, s)
		}
	}
	if after, _ := os.ReadFile(filepath.Join(dir, "manager.lease")); !bytes.Equal(before, after) {
		t.Errorf("the lease file changed")
	}
	if err := ta.Check(t.Context()); err != nil {
		t.Errorf("the holder lost its term: %v", err)
	}
	ta.Resign()
	if tb := campaign(t, b); tb.Token() != 2 {
		t.Errorf("token = %d, want 2", tb.Token())
	}
}

func TestFileConfigValidate(t *testing.T) {
	good := fileConfig(t.TempDir(), "a", testConfig)
	for _, tt := range []struct {
		edit func(*FileConfig)
		msg  string
	}{
		{func(c *FileConfig) { c.Path = "" }, "Path"},
		{func(c *FileConfig) { c.RetryPeriod = -1 }, "RetryPeriod"},
		{func(c *FileConfig) { c.Candidate.Job = "" }, "Job"},
		{func(c *FileConfig) { c.Candidate.Config = "" }, "Config"},
		{func(c *FileConfig) { c.Candidate.Config = strings.Repeat("a", 65) }, "Config"},
		{func(c *FileConfig) { c.Candidate.Name = "a b" }, "Name"},
		{func(c *FileConfig) { c.Candidate.Name = strings.Repeat("a", 254) }, "Name"},
	} {
		c := good
		tt.edit(&c)
		if _, err := NewFile(c); err == nil || !strings.Contains(err.Error(), tt.msg) {
			t.Errorf("NewFile with a bad %s: %v", tt.msg, err)
		}
	}
	if _, err := NewFile(fileConfig(filepath.Join(t.TempDir(), "missing"), "a", testConfig)); err == nil || !strings.Contains(err.Error(), "missing") {
		t.Errorf("NewFile in a missing directory: %v", err)
	}
	if n := DefaultName(); (Candidate{Job: "j", Config: "c", Name: n}).Validate() != nil {
		t.Errorf("DefaultName %q is not a valid Name", n)
	}
}

// lockTable is flock for one other machine whose locks are kept apart
// from this one's: it excludes the open files of its own users only.
type lockTable struct {
	mu    sync.Mutex
	locks map[[2]uint64]int // (device, inode) -> the descriptor holding it
}

func newLockTable() *lockTable { return &lockTable{locks: map[[2]uint64]int{}} }

func (lt *lockTable) flock(fd, how int) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	key := [2]uint64{st.Dev, st.Ino}
	lt.mu.Lock()
	defer lt.mu.Unlock()
	holder, held := lt.locks[key]
	switch {
	case how&unix.LOCK_UN != 0:
		if held && holder == fd {
			delete(lt.locks, key)
		}
		return nil
	case held && holder != fd:
		return unix.EWOULDBLOCK
	}
	lt.locks[key] = fd
	return nil
}
