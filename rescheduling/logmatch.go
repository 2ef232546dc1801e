package rescheduling

import (
	"bytes"
	"cmp"
	"fmt"
	"io"
	"os"
	"regexp"
	"strconv"
	"strings"
)

// LogRule maps a pattern in a training log to a class of fault.
type LogRule struct {
	// Name is reported as the fault's Reason.
	Name string
	// Pattern is an RE2 regular expression (package regexp) matched
	// against each line, without its line ending.
	Pattern string
	// Class is the fault's class when the pattern matches.
	Class Class
}

// DefaultLogRules returns the rules a zero LogConfig uses, in priority
// order: device failures, then out-of-memory errors, then collective
// timeouts. They are a start; add the patterns of your own stack.
func DefaultLogRules() []LogRule {
	return []LogRule{
		{
			Name:    "device-failure",
			Pattern: `(?i)uncorrectable ECC error|multi-bit ECC|GPU has fallen off the bus|\bXid[: ]+\d+|device lost`,
			Class:   ClassHardware,
		},
		{
			Name:    "out-of-memory",
			Pattern: `(?i)\b(CUDA|NPU|HIP|XPU) out of memory|OutOfMemoryError`,
			Class:   ClassOOM,
		},
		{
			Name:    "collective-timeout",
			Pattern: `(?i)\b(NCCL|HCCL|RCCL|gloo)\b.*\b(timeout|timed out)\b|Watchdog caught collective operation timeout`,
			Class:   ClassHang,
		},
	}
}

// LogConfig configures a LogMatcher. The zero value holds the documented
// defaults.
type LogConfig struct {
	// Rules are tried in order; the first that matches a line wins. Nil
	// means DefaultLogRules; an empty, non-nil slice matches nothing.
	Rules []LogRule
	// Lines is how many lines from the end of a log Scan reads; default
	// 200.
	Lines int
	// MaxBytes bounds what Scan reads from the end of a log, whatever
	// the line lengths; default 1 MiB. A line cut by the bound is
	// dropped unless it is the only one.
	MaxBytes int64
}

// Validate reports the first field that is out of range or a pattern that
// does not compile, naming its index.
func (c LogConfig) Validate() error {
	switch {
	case c.Lines < 0:
		return fmt.Errorf("rescheduling: LogConfig.Lines is %d, want >= 0", c.Lines)
	case c.MaxBytes < 0:
		return fmt.Errorf("rescheduling: LogConfig.MaxBytes is %d, want >= 0", c.MaxBytes)
	}
	for i, r := range c.Rules {
		if r.Class == Unclassified || r.Class >= ClassNone {
			return fmt.Errorf("rescheduling: LogConfig.Rules[%d] (%q): Class is %s, want killed..membership", i, r.Name, r.Class)
		}
		if r.Pattern == "" {
			return fmt.Errorf("rescheduling: LogConfig.Rules[%d] (%q): Pattern is empty", i, r.Name)
		}
		if _, err := regexp.Compile(r.Pattern); err != nil {
			return fmt.Errorf("rescheduling: LogConfig.Rules[%d] (%q): Pattern %q: %w", i, r.Name, r.Pattern, err)
		}
	}
	return nil
}

// LogMatcher classifies training logs by patterns over their last lines,
// as DLRover's failure-node diagnostician does. It is safe for
// concurrent use.
type LogMatcher struct {
	rules    []LogRule
	res      []*regexp.Regexp
	lines    int
	maxBytes int64
}

// NewLogMatcher returns a matcher built from cfg.
func NewLogMatcher(cfg LogConfig) (*LogMatcher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Rules == nil {
		cfg.Rules = DefaultLogRules()
	}
	cfg.Lines = cmp.Or(cfg.Lines, 200)
	cfg.MaxBytes = cmp.Or(cfg.MaxBytes, 1<<20)
	m := &LogMatcher{rules: cfg.Rules, lines: cfg.Lines, maxBytes: cfg.MaxBytes}
	for _, r := range cfg.Rules {
		m.res = append(m.res, regexp.MustCompile(r.Pattern)) // compiled by Validate
	}
	return m, nil
}

// LogMatch is a rule that matched a log line.
type LogMatch struct {
	Rule  string // the rule's Name
	Class Class
	// File is the log's path ("" for Match).
	File string
	// Line is the most recent matching line.
	Line string
	// Offset is the line's byte offset in File; for Match, its index in
	// the lines given.
	Offset int64
}

// Fault returns the KindLog fault the match stands for; the caller fills
// in Node, Pod, Process and Time.
func (m LogMatch) Fault() Fault {
	where := m.File + ":" + strconv.FormatInt(m.Offset, 10)
	if m.File == "" {
		where = "line " + strconv.FormatInt(m.Offset, 10)
	}
	return Fault{
		Kind:     KindLog,
		Class:    m.Class,
		Reason:   m.Rule,
		Evidence: []string{where + ": " + m.Line},
	}
}

// Match returns the first rule, in order, that matches one of lines, with
// the last line it matched.
func (m *LogMatcher) Match(lines []string) (LogMatch, bool) {
	for i, re := range m.res {
		for j := len(lines) - 1; j >= 0; j-- {
			if re.MatchString(lines[j]) {
				r := m.rules[i]
				return LogMatch{Rule: r.Name, Class: r.Class, Line: lines[j], Offset: int64(j)}, true
			}
		}
	}
	return LogMatch{}, false
}

// Scan matches the last lines of the log at path (at most LogConfig.Lines
// lines and LogConfig.MaxBytes bytes, read backwards from the end).
func (m *LogMatcher) Scan(path string) (LogMatch, bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return LogMatch{}, false, fmt.Errorf("rescheduling: scan log: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return LogMatch{}, false, fmt.Errorf("rescheduling: scan log: %w", err)
	}
	lines, offsets, err := tail(f, fi.Size(), m.lines, m.maxBytes)
	if err != nil {
		return LogMatch{}, false, fmt.Errorf("rescheduling: scan log %s: %w", path, err)
	}
	lm, ok := m.Match(lines)
	if ok {
		lm.File, lm.Offset = path, offsets[lm.Offset]
	}
	return lm, ok, nil
}

const tailChunk = 32 << 10

// tail returns the last n lines of the size bytes of r, reading at most
// maxBytes from the end, backwards in chunks, and the byte offset of each
// line. A final line ending does not start an empty line. When the bound
// cuts a line, that line is dropped unless no other line follows.
func tail(r io.ReaderAt, size int64, n int, maxBytes int64) ([]string, []int64, error) {
	if n <= 0 || size <= 0 || maxBytes <= 0 {
		return nil, nil, nil
	}
	start := max(0, size-maxBytes)
	pos := size       // buf holds [pos, size)
	var buf []byte    // grows towards the front
	newlines := 0     // line endings seen, the final one excepted
	from := int64(-1) // where the n-th last line starts, once known
	for pos > start && from < 0 {
		c := min(tailChunk, pos-start)
		b := make([]byte, int(c)+len(buf))
		if _, err := r.ReadAt(b[:c], pos-c); err != nil && err != io.EOF {
			return nil, nil, err
		}
		copy(b[c:], buf)
		buf, pos = b, pos-c
		for i := c - 1; i >= 0; i-- {
			if buf[i] != '\n' || pos+i == size-1 {
				continue
			}
			if newlines++; newlines == n {
				from = pos + i + 1
				break
			}
		}
	}
	if from < 0 {
		from = start
		if start > 0 {
			var prev [1]byte
			if _, err := r.ReadAt(prev[:], start-1); err != nil && err != io.EOF {
				return nil, nil, err
			}
			// A cut line is dropped if another follows it.
			if i := bytes.IndexByte(buf, '\n'); prev[0] != '\n' && i >= 0 && start+int64(i) < size-1 {
				from = start + int64(i) + 1
			}
		}
	}
	return splitLines(buf[from-pos:], from)
}

// splitLines splits b, which starts at offset off, into lines without
// their line endings ("\n" or "\r\n").
func splitLines(b []byte, off int64) ([]string, []int64, error) {
	if len(b) == 0 {
		return nil, nil, nil
	}
	b = bytes.TrimSuffix(b, []byte("\n")) // "\n" alone is one empty line
	s := string(b)
	n := strings.Count(s, "\n") + 1
	lines := make([]string, 0, n)
	offsets := make([]int64, 0, n)
	for {
		i := strings.IndexByte(s, '\n')
		line := s
		if i >= 0 {
			line = s[:i]
		}
		lines = append(lines, strings.TrimSuffix(line, "\r"))
		offsets = append(offsets, off)
		if i < 0 {
			return lines, offsets, nil
		}
		s, off = s[i+1:], off+int64(i)+1
	}
}
