package lease

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Lease is held by one candidate at a time: the managers of a job
// campaign for it, one leads, the others wait.
type Lease interface {
	// Campaign blocks until this candidate holds the lease and returns its
	// term. It returns an error when ctx ends (wrapping its cause) or when
	// the lease refuses the candidate: ErrForeign, ErrConfig, ErrNoLocks,
	// ErrInvalid. The term lasts at most as long as ctx.
	Campaign(ctx context.Context) (Term, error)
}

// Term is one holder's hold on a lease, from its acquisition until it is
// lost or resigned. A term that has ended without Resign still keeps the
// lease from the other candidates (a File's lock stays locked; a
// Kubernetes Lease is no longer renewed and runs out), so that none takes
// over while the work done under the term is still stopping.
type Term interface {
	// Token is the term's fencing token: greater than the token of every
	// earlier term of the lease, whoever held it.
	Token() uint64
	// Context is done once the term has ended: lost, resigned, or the
	// campaign's context ended. context.Cause then wraps ErrLost and says
	// why. Work done for the term runs under it.
	Context() context.Context
	// Check confirms with the lease's store that this term is still the
	// newest: its token the lease's, its holder this one. If not, it ends
	// the term and returns why (wrapping ErrLost). Another error means
	// the store could not be asked: the term goes on, and the act waits.
	// Call it before an act that two managers must never both do.
	Check(ctx context.Context) error
	// Resign ends the term, waits for the term's goroutines to stop, and
	// then releases the lease, so that a standby takes it without waiting.
	// Call it once the work done under the term has stopped, lost or not;
	// later calls do nothing.
	Resign() error
}

// Errors that callers branch on.
var (
	// ErrLost is wrapped by the cause of every ended term and by Check's
	// error once a term is over.
	ErrLost = errors.New("lease: term lost")
	// ErrStale is wrapped by Fence.Admit's refusal of an act that carries
	// an older token than the newest seen.
	ErrStale = errors.New("lease: stale fencing token")
	// ErrForeign refuses a candidate whose lease belongs to another job,
	// or to something that is not a manager; nothing of it is changed.
	ErrForeign = errors.New("lease: held for another job")
	// ErrConfig is wrapped by *ConfigError.
	ErrConfig = errors.New("lease: job configurations differ")
	// ErrNoLocks refuses a lease file on a filesystem whose locks do not
	// work.
	ErrNoLocks = errors.New("lease: the filesystem has no working locks")
	// ErrInvalid is wrapped by *ParseError: a lease file that cannot be
	// read, or of an unknown version.
	ErrInvalid = errors.New("lease: invalid lease file")
)

// ConfigError refuses a candidate whose job configuration is not that of
// the lease's live holder: two managers of one job would not run it alike.
type ConfigError struct {
	Lease        string // the lease file, or namespace/name of a Kubernetes Lease
	Job          string
	Holder       string // the live holder's name
	HolderConfig string // its configuration hash
	Config       string // this candidate's
}

func (e *ConfigError) Error() string {
	return fmt.Sprintf("lease %s: job %q is led by %s with configuration %s, and this manager's is %s: the managers of a job must share its configuration",
		e.Lease, e.Job, e.Holder, e.HolderConfig, e.Config)
}

// Unwrap lets errors.Is(err, ErrConfig) hold.
func (e *ConfigError) Unwrap() error { return ErrConfig }

// Candidate says who campaigns for a lease.
type Candidate struct {
	// Job is the job's identifier; required. A lease that another job
	// holds, or held last, refuses the candidate (ErrForeign).
	Job string
	// Config identifies the job's configuration, such as ConfigHash of
	// it; required, 1 to 64 letters, digits, '-', '_' or '.'. While a
	// holder of another Config is alive, the candidate is refused
	// (*ConfigError); a lease whose holder is gone is taken whatever
	// configuration it had.
	Config string
	// Name names this candidate to the others and to operators; default
	// DefaultName(). 1 to 253 letters, digits, '.', '-', '_', ':' or '@'
	// (a pod's name fits).
	Name string
}

// DefaultName is a candidate's default Name: the host's name and the
// process id, as "host-1234", cut to fit 64 bytes.
func DefaultName() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "localhost"
	}
	pid := "-" + strconv.Itoa(os.Getpid())
	host = strings.Map(func(r rune) rune {
		if r < 0x80 && isToken(string(r), nameExtra, 1) {
			return r
		}
		return '_'
	}, host)
	return host[:min(len(host), 64-len(pid))] + pid
}

// Validate reports the first field of c that is wrong. An empty Name is
// allowed (the default).
func (c Candidate) Validate() error {
	if msg := jobProblem(c.Job); msg != "" {
		return fmt.Errorf("lease: Candidate.Job %q %s", c.Job, msg)
	}
	if !isToken(c.Config, configExtra, configMax) {
		return fmt.Errorf("lease: Candidate.Config %q: %s (a hash of the job's configuration)", c.Config, configWant)
	}
	if c.Name != "" && !isToken(c.Name, nameExtra, nameMax) {
		return fmt.Errorf("lease: Candidate.Name %q: %s", c.Name, nameWant)
	}
	return nil
}

// What a Config and a Name may hold: letters, digits and these bytes, up
// to these lengths.
const (
	configExtra = "-_."
	configMax   = 64
	configWant  = "want 1 to 64 letters, digits, '-', '_' or '.'"
	nameExtra   = ".-_:@"
	nameMax     = 253
	nameWant    = "want 1 to 253 letters, digits, '.', '-', '_', ':' or '@'"
)

// jobProblem says what is wrong with a job identifier, "" if nothing.
func jobProblem(job string) string {
	switch {
	case job == "":
		return "is empty"
	case len(job) > 255:
		return "is longer than 255 bytes"
	case !utf8.ValidString(job) || strings.ContainsFunc(job, unicode.IsControl):
		return "is not UTF-8 without control characters"
	}
	return ""
}

// withDefaults returns c with its Name filled.
func (c Candidate) withDefaults() Candidate {
	if c.Name == "" {
		c.Name = DefaultName()
	}
	return c
}

// isToken reports whether s is 1 to maxLen ASCII letters, digits or
// bytes of extra.
func isToken(s, extra string, maxLen int) bool {
	if s == "" || len(s) > maxLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte(extra, c) >= 0) {
			return false
		}
	}
	return true
}

// ConfigHash returns a Candidate.Config for a job's configuration: the
// first 16 hexadecimal digits of its SHA-256.
func ConfigHash(config []byte) string {
	sum := sha256.Sum256(config)
	return hex.EncodeToString(sum[:8])
}
