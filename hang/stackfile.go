package hang

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/faultline-ml/faultline/internal/atomicfile"
	"github.com/faultline-ml/faultline/internal/parseerr"
)

// Kind says which runtime a thread's frames come from. Stacks of different
// kinds are merged into different trees.
type Kind string

// Kinds of stacks.
const (
	KindPython Kind = "python" // Python frames (py-spy)
	KindNative Kind = "native" // OS threads (gdb, eu-stack)
	KindGo     Kind = "go"     // goroutines (runtime stacks)
)

// Frame is one call in a stack.
type Frame struct {
	Func string // function name; "??" when the tool could not tell
	File string // source file, else the shared object; may be empty
	Line int    // 0 when unknown
}

// Thread is the stack of one thread or goroutine.
type Thread struct {
	Kind   Kind
	ID     uint64  // OS thread id, Python thread id or goroutine id
	Name   string  // thread name; may be empty
	State  string  // "active+gil", "chan receive", ...; may be empty
	Frames []Frame // innermost (the running function) first
}

// Dump is the content of one rank's stack file: the state of one process
// and the stacks of its threads at one moment.
type Dump struct {
	Rank    int
	World   int
	Pid     int       // 0 when unknown
	Host    string    // node name; may be empty
	Time    time.Time // when the stacks were taken; zero when unknown
	State   string    // process state as /proc/<pid>/status says it, e.g. "S (sleeping)"
	Reason  string    // why the stacks were taken, e.g. the hang that triggered it
	Notes   []string  // what the capture used or could not do
	Threads []Thread
}

// FileSuffix ends the name of every stack file.
const FileSuffix = ".stacktrace"

// FileName returns the name of rank's stack file in a job of world ranks:
// "<rank:05d>-<world:05d>.stacktrace", as xpu_timer names them.
func FileName(rank, world int) string {
	return fmt.Sprintf("%05d-%05d%s", rank, world, FileSuffix)
}

// ParseFileName returns the rank and world that a stack file's base name
// encodes, and false when the name is not of FileName's form.
func ParseFileName(name string) (rank, world int, ok bool) {
	base, found := strings.CutSuffix(filepath.Base(name), FileSuffix)
	if !found {
		return 0, 0, false
	}
	return parseRankWorld(base)
}

func parseRankWorld(s string) (rank, world int, ok bool) {
	a, b, found := strings.Cut(s, "-")
	if !found {
		return 0, 0, false
	}
	rank, err1 := parseRank(a)
	world, err2 := parseRank(b)
	if err1 != nil || err2 != nil || world < 1 || rank >= world {
		return 0, 0, false
	}
	return rank, world, true
}

// FileVersion is the version of the stack-file format that Marshal writes
// and the newest that ParseDump reads.
const FileVersion = 1

const fileMagic = "faultline-stacktrace"

// MaxFileBytes bounds the size of a stack file that ReadStackFile reads.
const MaxFileBytes = 256 << 20

// ErrFormat is wrapped by every error ParseDump returns.
var ErrFormat = errors.New("hang: malformed stack file")

// ErrTruncated is wrapped by the error for a stack file that lacks its
// closing "end" line, or whose counts disagree with it: a dump cut short.
var ErrTruncated = errors.New("hang: stack file truncated")

// ParseError says where a stack file is malformed. It has the shape of
// every parse error of this module: what was parsed, where, the field and
// value at fault, and what is wrong.
type ParseError struct {
	Format string // what was parsed; "" for a stack file, which its name says
	File   string // path, when known
	Line   int    // 1-based; 0 when the error is about the whole file
	Field  string // the offending field, if any
	Value  string // the offending value, if any
	Msg    string // what is wrong
	Err    error  // ErrTruncated or ErrFormat; nil means ErrFormat
}

// Error returns "hang: <file>:<line>: <msg>", leaving out what is unknown.
func (e *ParseError) Error() string {
	return parseerr.Text{Pkg: "hang", Format: e.Format, File: e.File, Line: e.Line,
		Field: e.Field, Value: e.Value, Msg: e.Msg}.String()
}

// Unwrap returns Err, or ErrFormat.
func (e *ParseError) Unwrap() error { return cmp.Or(e.Err, ErrFormat) }

// Validate reports what would make d unfit for a stack file.
func (d *Dump) Validate() error {
	if why := d.invalid(); why != "" {
		return errors.New("hang: dump: " + why)
	}
	return nil
}

// invalid says what Validate finds wrong, "" for nothing.
func (d *Dump) invalid() string {
	switch {
	case d.World < 1 || d.World > maxRank:
		// Above maxRank, FileName would write a name ParseFileName rejects.
		return fmt.Sprintf("World %d: must be in [1, %d]", d.World, maxRank)
	case d.Rank < 0 || d.Rank >= d.World:
		return fmt.Sprintf("Rank %d: must be in [0, %d)", d.Rank, d.World)
	case d.Pid < 0:
		return fmt.Sprintf("Pid %d: must not be negative", d.Pid)
	}
	for i, t := range d.Threads {
		if !isToken(string(t.Kind)) {
			return fmt.Sprintf("Threads[%d].Kind %q: must be lower-case letters, digits or _", i, t.Kind)
		}
		for j, f := range t.Frames {
			if f.Line < 0 {
				return fmt.Sprintf("Threads[%d].Frames[%d].Line %d: must not be negative", i, j, f.Line)
			}
		}
	}
	return ""
}

// Marshal returns d in the stack-file format (see the package
// documentation). ParseDump(d.Marshal()) returns d again.
func (d *Dump) Marshal() ([]byte, error) {
	if err := d.Validate(); err != nil {
		return nil, err
	}
	frames := 0
	for _, t := range d.Threads {
		frames += len(t.Frames)
	}
	b := make([]byte, 0, 256+64*len(d.Threads)+80*frames)
	b = fmt.Appendf(b, "%s %d\n", fileMagic, FileVersion)
	b = fmt.Appendf(b, "rank %d\nworld %d\n", d.Rank, d.World)
	if d.Pid != 0 {
		b = fmt.Appendf(b, "pid %d\n", d.Pid)
	}
	if d.Host != "" {
		b = strconv.AppendQuote(append(b, "host "...), d.Host)
		b = append(b, '\n')
	}
	if !d.Time.IsZero() {
		b = d.Time.UTC().AppendFormat(append(b, "time "...), time.RFC3339Nano)
		b = append(b, '\n')
	}
	if d.State != "" {
		b = strconv.AppendQuote(append(b, "state "...), d.State)
		b = append(b, '\n')
	}
	if d.Reason != "" {
		b = strconv.AppendQuote(append(b, "reason "...), d.Reason)
		b = append(b, '\n')
	}
	for _, n := range d.Notes {
		b = strconv.AppendQuote(append(b, "note "...), n)
		b = append(b, '\n')
	}
	for _, t := range d.Threads {
		b = append(b, "thread "...)
		b = append(b, t.Kind...)
		b = append(b, ' ')
		b = strconv.AppendUint(b, t.ID, 10)
		b = strconv.AppendQuote(append(b, ' '), t.Name)
		b = strconv.AppendQuote(append(b, ' '), t.State)
		b = append(b, '\n')
		for _, f := range t.Frames {
			b = strconv.AppendQuote(append(b, "frame "...), f.Func)
			b = strconv.AppendQuote(append(b, ' '), f.File)
			b = strconv.AppendInt(append(b, ' '), int64(f.Line), 10)
			b = append(b, '\n')
		}
	}
	b = fmt.Appendf(b, "end %d %d\n", len(d.Threads), frames)
	return b, nil
}

// ParseDump parses a stack file. Errors are *ParseError naming the line;
// they wrap ErrTruncated when the file was cut short and ErrFormat
// otherwise. Lines with a keyword this version does not know are skipped,
// so that later minor additions stay readable.
func ParseDump(data []byte) (*Dump, error) {
	p := dumpParser{data: data}
	d, err := p.parse()
	if err != nil {
		return nil, err
	}
	return d, nil
}

type dumpParser struct {
	data []byte
	line int
}

func (p *dumpParser) fail(msg string, args ...any) error {
	return &ParseError{Line: p.line, Msg: fmt.Sprintf(msg, args...), Err: ErrFormat}
}

// next returns the next line without its newline, and false at the end.
// complete is false for a last line that has no newline.
func (p *dumpParser) next() (line []byte, complete, ok bool) {
	if len(p.data) == 0 {
		return nil, false, false
	}
	p.line++
	i := bytes.IndexByte(p.data, '\n')
	if i < 0 {
		line, p.data = p.data, nil
		return line, false, true
	}
	line, p.data = p.data[:i], p.data[i+1:]
	return line, true, true
}

func (p *dumpParser) parse() (*Dump, error) {
	line, _, ok := p.next()
	if !ok {
		return nil, &ParseError{Msg: "empty file", Err: ErrTruncated}
	}
	magic, ver, _ := strings.Cut(string(bytes.TrimRight(line, "\r")), " ")
	if magic != fileMagic {
		return nil, p.fail("not a stack file: first line must be %q", fmt.Sprintf("%s %d", fileMagic, FileVersion))
	}
	v, err := strconv.Atoi(ver)
	if err != nil || v < 1 {
		return nil, p.fail("version %q: not a positive number", ver)
	}
	if v > FileVersion {
		return nil, p.fail("version %d: this reader knows versions up to %d", v, FileVersion)
	}

	d := &Dump{Rank: -1, World: -1}
	var cur *Thread
	frames := 0
	for {
		line, complete, ok := p.next()
		if !ok {
			return nil, &ParseError{Line: p.line, Msg: fmt.Sprintf("no end line after %d threads and %d frames", len(d.Threads), frames), Err: ErrTruncated}
		}
		if !complete {
			// Every line of a complete file ends with a newline.
			return nil, &ParseError{Line: p.line, Msg: fmt.Sprintf("last line cut short after %d threads and %d frames", len(d.Threads), frames), Err: ErrTruncated}
		}
		s := string(bytes.TrimRight(line, "\r"))
		if s == "" {
			continue
		}
		key, rest, _ := strings.Cut(s, " ")
		switch key {
		case "rank", "world", "pid":
			n, err := strconv.Atoi(rest)
			if err != nil || n < 0 {
				return nil, p.fail("%s %q: not a non-negative number", key, rest)
			}
			switch key {
			case "rank":
				d.Rank = n
			case "world":
				d.World = n
			case "pid":
				d.Pid = n
			}
		case "host", "state", "reason", "note":
			v, err := p.quotedOnly(key, rest)
			if err != nil {
				return nil, err
			}
			switch key {
			case "host":
				d.Host = v
			case "state":
				d.State = v
			case "reason":
				d.Reason = v
			case "note":
				d.Notes = append(d.Notes, v)
			}
		case "time":
			t, err := time.Parse(time.RFC3339Nano, rest)
			if err != nil {
				return nil, p.fail("time %q: not RFC 3339", rest)
			}
			d.Time = t.UTC()
		case "thread":
			t, err := p.thread(rest)
			if err != nil {
				return nil, err
			}
			d.Threads = append(d.Threads, t)
			cur = &d.Threads[len(d.Threads)-1]
		case "frame":
			if cur == nil {
				return nil, p.fail("frame before any thread")
			}
			f, err := p.frame(rest)
			if err != nil {
				return nil, err
			}
			cur.Frames = append(cur.Frames, f)
			frames++
		case "end":
			var nt, nf int
			if _, err := fmt.Sscanf(rest, "%d %d", &nt, &nf); err != nil {
				return nil, p.fail("end %q: want two counts", rest)
			}
			if nt != len(d.Threads) || nf != frames {
				return nil, &ParseError{Line: p.line, Msg: fmt.Sprintf("end says %d threads and %d frames, file has %d and %d", nt, nf, len(d.Threads), frames), Err: ErrTruncated}
			}
			if d.Rank < 0 || d.World < 0 {
				return nil, p.fail("rank and world lines are required")
			}
			if why := d.invalid(); why != "" {
				return nil, p.fail("%s", why)
			}
			if rest := bytes.TrimSpace(p.data); len(rest) > 0 {
				p.line++
				return nil, p.fail("data after the end line")
			}
			return d, nil
		default:
			if !isToken(key) {
				return nil, p.fail("line does not start with a keyword")
			}
			// A keyword from a later minor revision: skip it.
		}
	}
}

func (p *dumpParser) quotedOnly(key, s string) (string, error) {
	v, rest, err := unquotePrefix(s)
	if err != nil || rest != "" {
		return "", p.fail("%s: want one quoted string", key)
	}
	return v, nil
}

func (p *dumpParser) thread(s string) (Thread, error) {
	kind, s, _ := strings.Cut(s, " ")
	if !isToken(kind) {
		return Thread{}, p.fail("thread kind %q: must be lower-case letters, digits or _", kind)
	}
	idText, s, _ := strings.Cut(s, " ")
	id, err := strconv.ParseUint(idText, 10, 64)
	if err != nil {
		return Thread{}, p.fail("thread id %q: not an unsigned number", idText)
	}
	name, s, err := unquotePrefix(s)
	if err != nil {
		return Thread{}, p.fail("thread name: %v", err)
	}
	s, ok := strings.CutPrefix(s, " ")
	if !ok {
		return Thread{}, p.fail("thread: want kind, id, quoted name and quoted state")
	}
	state, s, err := unquotePrefix(s)
	if err != nil || s != "" {
		return Thread{}, p.fail("thread state: want one quoted string")
	}
	return Thread{Kind: Kind(kind), ID: id, Name: name, State: state}, nil
}

func (p *dumpParser) frame(s string) (Frame, error) {
	fn, s, err := unquotePrefix(s)
	if err != nil {
		return Frame{}, p.fail("frame function: %v", err)
	}
	s, ok := strings.CutPrefix(s, " ")
	if !ok {
		return Frame{}, p.fail("frame: want quoted function, quoted file and line")
	}
	file, s, err := unquotePrefix(s)
	if err != nil {
		return Frame{}, p.fail("frame file: %v", err)
	}
	s, ok = strings.CutPrefix(s, " ")
	line, err := strconv.Atoi(s)
	if !ok || err != nil || line < 0 || strings.HasPrefix(s, "+") {
		return Frame{}, p.fail("frame line %q: not a non-negative number", s)
	}
	return Frame{Func: fn, File: file, Line: line}, nil
}

// unquotePrefix reads one Go-quoted string at the start of s and returns
// its value and what follows it.
func unquotePrefix(s string) (value, rest string, err error) {
	q, err := strconv.QuotedPrefix(s)
	if err != nil || q[0] != '"' {
		return "", "", errors.New("want a double-quoted string")
	}
	v, err := strconv.Unquote(q)
	if err != nil {
		return "", "", errors.New("bad quoted string")
	}
	return v, s[len(q):], nil
}

func isToken(s string) bool {
	if s == "" || len(s) > 32 {
		return false
	}
	for _, c := range []byte(s) {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}

// ReadStackFile reads and parses one stack file. A *ParseError names the
// file and line.
func ReadStackFile(path string) (*Dump, error) {
	data, err := readLimited(path, MaxFileBytes)
	if err != nil {
		return nil, err
	}
	d, err := ParseDump(data)
	if err != nil {
		var pe *ParseError
		if errors.As(err, &pe) {
			pe.File = path
		}
		return nil, err
	}
	return d, nil
}

// WriteStackFile writes d atomically into dir under FileName(d.Rank,
// d.World) and returns the file's path.
func WriteStackFile(dir string, d *Dump) (string, error) {
	data, err := d.Marshal()
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, FileName(d.Rank, d.World))
	if err := atomicfile.WriteFile(path, data, 0o644); err != nil {
		return "", fmt.Errorf("hang: write stack file: %w", err)
	}
	return path, nil
}

// readLimited reads a regular file of at most limit bytes.
func readLimited(path string, limit int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("hang: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("hang: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("hang: %s: not a regular file", path)
	}
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, fmt.Errorf("hang: read %s: %w", path, err)
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("hang: %s: larger than the limit of %d bytes", path, limit)
	}
	return data, nil
}
