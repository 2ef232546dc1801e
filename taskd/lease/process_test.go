package lease

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/internal/testkit"
	"golang.org/x/sys/unix"
)

// A child candidate: this test binary run again in the role of its mode
// (testkit.Role: "hold" or "cycle"). It
// campaigns for the lease at childPath as childName, prints "held TOKEN"
// on each term it takes and, with a journal, writes "NAME TOKEN start",
// "alive" (after each Check that passed) and "end" lines there, each with
// CLOCK_MONOTONIC, which all processes of the machine share. In "hold"
// mode it keeps its first term; in "cycle" mode it checks its term a few
// times, resigns and campaigns again.
const (
	childPath    = "FAULTLINE_LEASE_PATH"
	childName    = "FAULTLINE_LEASE_NAME"
	childJournal = "FAULTLINE_LEASE_JOURNAL"
	childRetry   = "FAULTLINE_LEASE_RETRY"
)

func runChild() int {
	if err := child(); err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 2
	}
	return 0
}

func child() error {
	retry, _ := time.ParseDuration(os.Getenv(childRetry))
	l, err := NewFile(FileConfig{Path: os.Getenv(childPath), RetryPeriod: retry,
		Candidate: Candidate{Job: "llm", Config: testConfig, Name: os.Getenv(childName)}})
	if err != nil {
		return err
	}
	var journal *os.File
	if p := os.Getenv(childJournal); p != "" {
		if journal, err = os.OpenFile(p, os.O_WRONLY|os.O_APPEND, 0); err != nil {
			return err
		}
	}
	note := func(token uint64, what string) {
		if journal != nil {
			fmt.Fprintf(journal, "%s %d %s %d\n", os.Getenv(childName), token, what, monotonic())
		}
	}
	ctx := context.Background()
	for {
		term, err := l.Campaign(ctx)
		if err != nil {
			return err
		}
		note(term.Token(), "start")
		fmt.Printf("held %d\n", term.Token())
		if testkit.Role() == "hold" {
			<-term.Context().Done()
			return context.Cause(term.Context())
		}
		for range 10 {
			if err := term.Check(ctx); err != nil {
				return err
			}
			note(term.Token(), "alive")
			time.Sleep(time.Duration(rand.IntN(500)) * time.Microsecond)
		}
		note(term.Token(), "end")
		term.Resign()
		time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond)
	}
}

func monotonic() int64 {
	var ts unix.Timespec
	unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

// candidate is a child candidate process.
type candidate struct {
	name string
	cmd  *exec.Cmd
	done chan struct{} // closed once its output has ended
}

// held is a child's report of a term.
type held struct {
	c     *candidate
	token uint64
}

// startCandidate starts a child candidate that sends each term it takes to
// terms. The test's cleanup kills it.
func startCandidate(t testing.TB, path, name, mode, journal string, retry time.Duration, terms chan<- held) *candidate {
	t.Helper()
	cmd := testkit.Command(t, mode, childPath+"="+path, childName+"="+name, childJournal+"="+journal, childRetry+"="+retry.String())
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &candidate{name: name, cmd: cmd, done: make(chan struct{})}
	go func() {
		defer close(c.done)
		for line := range testkit.Lines(out) {
			if tok, ok := strings.CutPrefix(line, "held "); ok {
				n, _ := strconv.ParseUint(tok, 10, 64)
				terms <- held{c, n}
			}
		}
	}()
	t.Cleanup(c.kill)
	return c
}

// kill SIGKILLs the candidate and waits for it.
func (c *candidate) kill() {
	c.cmd.Process.Signal(syscall.SIGKILL)
	<-c.done
	c.cmd.Wait()
}

// TestFileTakeoverAfterSIGKILL: the holder, a process, is SIGKILLed; the
// standby takes the lease as soon as it next tries (RetryPeriod), with the
// next token, and a fence that has seen the new token refuses the old.
func TestFileTakeoverAfterSIGKILL(t *testing.T) {
	dir := t.TempDir()
	cfg := fileConfig(dir, "standby", testConfig)
	terms := make(chan held, 1)
	a := startCandidate(t, cfg.Path, "leader", "hold", "", 0, terms)
	h := <-terms
	if h.token != 1 {
		t.Fatalf("leader's token = %d, want 1", h.token)
	}
	var fence Fence // what the leader commands
	if err := fence.Admit(h.token); err != nil {
		t.Fatal(err)
	}
	b := newTestFile(t, cfg)
	waiting := campaignAsync(t, t.Context(), b)
	select {
	case <-waiting:
		t.Fatal("the standby took a lease that a live process holds")
	default:
	}
	killed := time.Now()
	a.kill()
	tb := <-waiting
	defer tb.Resign()
	t.Logf("standby took the lease %v after the SIGKILL (RetryPeriod %v)", time.Since(killed), DefaultRetryPeriod)
	if tb.Token() != 2 {
		t.Errorf("standby's token = %d, want 2", tb.Token())
	}
	if err := fence.Admit(tb.Token()); err != nil {
		t.Errorf("the new term's act: %v", err)
	}
	if err := fence.Admit(h.token); !errors.Is(err, ErrStale) {
		t.Errorf("an act of the killed leader's term after the takeover: %v, want ErrStale", err)
	}
	if err := tb.Check(t.Context()); err != nil {
		t.Errorf("Check: %v", err)
	}
}

// TestFileNeverTwoHolders: three candidate processes take, check and
// resign the lease over and over while the test SIGKILLs a holder now and
// then and starts another candidate in its place. Every line a holder
// writes for a term, each after a Check that passed, must come before the
// start of every later term: no two processes ever believed they held
// the lease at once.
func TestFileNeverTwoHolders(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "manager.lease")
	journal := filepath.Join(dir, "journal")
	if err := os.WriteFile(journal, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	terms := make(chan held, 16)
	start := func(i int) *candidate {
		return startCandidate(t, path, fmt.Sprintf("c%d", i), "cycle", journal, time.Millisecond, terms)
	}
	next := 0
	for range 3 {
		start(next)
		next++
	}
	const wantTerms, killEvery = 24, 4
	kills := 0
	for n := 1; n <= wantTerms; n++ {
		h := <-terms
		if n%killEvery == 0 {
			h.c.kill()
			kills++
			start(next)
			next++
		}
	}

	data, err := os.ReadFile(journal)
	if err != nil {
		t.Fatal(err)
	}
	type span struct {
		holder   string
		starts   int
		min, max int64
	}
	spans := map[uint64]*span{}
	for line := range strings.Lines(string(data)) {
		f := strings.Fields(line)
		if len(f) != 4 {
			continue // a line cut short by a SIGKILL
		}
		tok, _ := strconv.ParseUint(f[1], 10, 64)
		ts, _ := strconv.ParseInt(f[3], 10, 64)
		s := spans[tok]
		if s == nil {
			s = &span{holder: f[0], min: ts, max: ts}
			spans[tok] = s
		}
		if s.holder != f[0] {
			t.Errorf("token %d was held by %s and %s", tok, s.holder, f[0])
		}
		if f[2] == "start" {
			s.starts++
		}
		s.min, s.max = min(s.min, ts), max(s.max, ts)
	}
	tokens := slices.Sorted(func(yield func(uint64) bool) {
		for tok := range spans {
			if !yield(tok) {
				return
			}
		}
	})
	if len(tokens) < wantTerms {
		t.Errorf("%d terms in the journal, want at least %d", len(tokens), wantTerms)
	}
	for i, tok := range tokens {
		s := spans[tok]
		if s.starts != 1 {
			t.Errorf("token %d started %d times", tok, s.starts)
		}
		if i+1 < len(tokens) {
			if later := spans[tokens[i+1]]; s.max >= later.min {
				t.Errorf("%s still held token %d %v after %s took token %d", s.holder, tok,
					time.Duration(s.max-later.min), later.holder, tokens[i+1])
			}
		}
	}
	t.Logf("%d terms, %d holders SIGKILLed, %d candidate processes", len(tokens), kills, next)
}

// BenchmarkFileTakeover measures how long a standby takes to hold the
// lease after its holder, a process, is SIGKILLed; its baseline,
// BenchmarkFileCampaignFree, a campaign for a free lease.
func BenchmarkFileTakeover(b *testing.B) {
	dir := b.TempDir()
	cfg := fileConfig(dir, "standby", testConfig)
	l, err := NewFile(cfg)
	if err != nil {
		b.Fatal(err)
	}
	terms := make(chan held, 1)
	for i := 0; b.Loop(); i++ {
		b.StopTimer()
		holder := startCandidate(b, cfg.Path, fmt.Sprintf("leader-%d", i), "hold", "", 0, terms)
		<-terms
		var wg sync.WaitGroup
		got := make(chan Term, 1)
		wg.Go(func() {
			term, err := l.Campaign(context.Background())
			if err != nil {
				b.Error(err)
			}
			got <- term
		})
		b.StartTimer()
		holder.kill()
		term := <-got
		b.StopTimer()
		wg.Wait()
		if term != nil {
			term.Resign()
		}
		b.StartTimer()
	}
}

func BenchmarkFileCampaignFree(b *testing.B) {
	l, err := NewFile(fileConfig(b.TempDir(), "a", testConfig))
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		term, err := l.Campaign(context.Background())
		if err != nil {
			b.Fatal(err)
		}
		term.Resign()
	}
}
