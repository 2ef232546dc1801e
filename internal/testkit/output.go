package testkit

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"
)

// Output keeps what processes write, line by line and across their
// restarts, for tests that wait for a line after a point: give it to
// exec.Cmd as Stdout, note Len, act, and Wait from there. Close it at the
// end of the output, so that a Wait for a line that will never come fails
// at once. The zero Output is not ready: use NewOutput.
type Output struct {
	label string
	echo  bool

	mu     sync.Mutex
	cond   *sync.Cond
	all    []string
	part   []byte
	closed bool
}

// NewOutput returns an empty Output; label names it in failures and,
// with echo, prefixes each line it copies to standard error.
func NewOutput(label string, echo bool) *Output {
	o := &Output{label: label, echo: echo}
	o.cond = sync.NewCond(&o.mu)
	return o
}

// Write takes the complete lines of b, keeping a partial last one for the
// next Write.
func (o *Output) Write(b []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.part = append(o.part, b...)
	for {
		i := strings.IndexByte(string(o.part), '\n')
		if i < 0 {
			break
		}
		line := string(o.part[:i])
		o.part = o.part[i+1:]
		o.all = append(o.all, line)
		if o.echo {
			fmt.Fprintf(os.Stderr, "%s: %s\n", o.label, line)
		}
	}
	o.cond.Broadcast()
	return len(b), nil
}

// Close marks the end of the output.
func (o *Output) Close() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.closed = true
	o.cond.Broadcast()
	return nil
}

// Len returns how many lines were written.
func (o *Output) Len() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.all)
}

// String returns everything written so far, the partial last line
// included, for a test that looks for a message anywhere in it.
func (o *Output) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	var b strings.Builder
	for _, l := range o.all {
		b.WriteString(l)
		b.WriteByte('\n')
	}
	b.Write(o.part)
	return b.String()
}

// From returns the lines from index i on.
func (o *Output) From(i int) []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]string(nil), o.all[min(i, len(o.all)):]...)
}

// Wait returns the index of the first line at or after index from that
// starts with prefix, failing the test after d or at the end of the
// output.
func (o *Output) Wait(t testing.TB, from int, prefix string, d time.Duration) int {
	t.Helper()
	timer := time.AfterFunc(d, func() {
		o.mu.Lock()
		o.cond.Broadcast()
		o.mu.Unlock()
	})
	defer timer.Stop()
	end := time.Now().Add(d)
	o.mu.Lock()
	defer o.mu.Unlock()
	for i := from; ; {
		for ; i < len(o.all); i++ {
			if strings.HasPrefix(o.all[i], prefix) {
				return i
			}
		}
		switch {
		case o.closed:
			t.Fatalf("%s: the output ended before a line starting %q; output from %d: %q", o.label, prefix, from, o.all[min(from, len(o.all)):])
		case time.Now().After(end):
			t.Fatalf("%s: no line starting %q within %v; output from %d: %q", o.label, prefix, d, from, o.all[min(from, len(o.all)):])
		}
		o.cond.Wait()
	}
}
