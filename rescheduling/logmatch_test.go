package rescheduling

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func writeLog(t testing.TB, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "train.log")
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestLogMatcherScan(t *testing.T) {
	m, err := NewLogMatcher(LogConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for i := range 5000 {
		fmt.Fprintf(&b, "step %d loss 0.%d\n", i, i)
	}
	prefix := b.String()
	tests := []struct {
		name    string
		content string
		want    LogMatch
		ok      bool
	}{
		{"clean log", prefix, LogMatch{}, false},
		{"oom at the end", prefix + "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB\nexiting\n",
			LogMatch{Rule: "out-of-memory", Class: ClassOOM, Line: "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", Offset: int64(len(prefix))}, true},
		{"device failure outranks a later timeout", prefix + "NVRM: Xid 79, GPU has fallen off the bus\n[E] NCCL watchdog: collective timed out after 600000 ms\n",
			LogMatch{Rule: "device-failure", Class: ClassHardware, Line: "NVRM: Xid 79, GPU has fallen off the bus", Offset: int64(len(prefix))}, true},
		{"collective timeout, CRLF, no final newline", prefix + "HCCL error: timeout waiting for peers\r\nbye",
			LogMatch{Rule: "collective-timeout", Class: ClassHang, Line: "HCCL error: timeout waiting for peers", Offset: int64(len(prefix))}, true},
		{"too far back is not seen", "CUDA out of memory\n" + prefix, LogMatch{}, false},
	}
	for _, tt := range tests {
		path := writeLog(t, tt.content)
		got, ok, err := m.Scan(path)
		if err != nil {
			t.Fatalf("%s: %v", tt.name, err)
		}
		if tt.ok {
			tt.want.File = path
		}
		if ok != tt.ok || !cmp.Equal(got, tt.want) {
			t.Errorf("%s: Scan = %+v %v, want %+v %v", tt.name, got, ok, tt.want, tt.ok)
		}
	}
	if _, _, err := m.Scan(filepath.Join(t.TempDir(), "missing.log")); err == nil || !strings.Contains(err.Error(), "missing.log") {
		t.Errorf("missing file: %v", err)
	}
}

func TestLogMatchFault(t *testing.T) {
	m, err := NewLogMatcher(LogConfig{Rules: []LogRule{{Name: "ecc", Pattern: `ECC`, Class: ClassHardware}}})
	if err != nil {
		t.Fatal(err)
	}
	lm, ok := m.Match([]string{"ok", "ECC error on HBM", "ok"})
	if !ok {
		t.Fatal("no match")
	}
	f := lm.Fault()
	f.Node = "n1"
	want := Fault{Kind: KindLog, Class: ClassHardware, Node: "n1", Reason: "ecc", Evidence: []string{"line 1: ECC error on HBM"}}
	if diff := cmp.Diff(want, f); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	if Classify(f) != ClassHardware {
		t.Errorf("class %s", Classify(f))
	}
	none, err := NewLogMatcher(LogConfig{Rules: []LogRule{}})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := none.Match([]string{"CUDA out of memory"}); ok {
		t.Error("an empty rule list matched")
	}
}

func TestLogConfigValidate(t *testing.T) {
	tests := []struct {
		cfg   LogConfig
		field string
	}{
		{LogConfig{Lines: -1}, "Lines"},
		{LogConfig{MaxBytes: -1}, "MaxBytes"},
		{LogConfig{Rules: []LogRule{{Name: "a", Pattern: "x", Class: ClassOOM}, {Name: "b", Pattern: "(", Class: ClassOOM}}}, `Rules[1] ("b"): Pattern "("`},
		{LogConfig{Rules: []LogRule{{Name: "a", Pattern: "", Class: ClassOOM}}}, `Rules[0] ("a"): Pattern is empty`},
		{LogConfig{Rules: []LogRule{{Name: "a", Pattern: "x"}}}, `Rules[0] ("a"): Class`},
		{LogConfig{Rules: []LogRule{{Name: "a", Pattern: "x", Class: ClassNone}}}, `Rules[0] ("a"): Class`},
	}
	for _, tt := range tests {
		err := tt.cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("Validate(%+v) = %v, want an error naming %s", tt.cfg, err, tt.field)
		}
		if _, err := NewLogMatcher(tt.cfg); err == nil {
			t.Errorf("NewLogMatcher(%+v) succeeded", tt.cfg)
		}
	}
}

// naiveTail is tail's specification: the last n lines of the last
// maxBytes bytes, a cut first line dropped unless no other line follows.
func naiveTail(content []byte, n int, maxBytes int64) ([]string, []int64) {
	if n <= 0 || maxBytes <= 0 || len(content) == 0 {
		return nil, nil
	}
	start := max(0, int64(len(content))-maxBytes)
	region := content[start:]
	if start > 0 && content[start-1] != '\n' {
		if i := bytes.IndexByte(region, '\n'); i >= 0 && i < len(region)-1 {
			region, start = region[i+1:], start+int64(i)+1
		}
	}
	lines, offs, _ := splitLines(region, start)
	if len(lines) > n {
		lines, offs = lines[len(lines)-n:], offs[len(offs)-n:]
	}
	return lines, offs
}

func TestTail(t *testing.T) {
	long := strings.Repeat("x", 3*tailChunk+17)
	tests := []struct {
		content string
		n       int
		max     int64
	}{
		{"", 3, 100},
		{"\n", 3, 100},
		{"a", 3, 100},
		{"a\nb\nc\n", 2, 100},
		{"a\nb\nc", 2, 100},
		{"a\nb\nc\n", 5, 100},
		{"a\n\n\nb\n", 2, 100},
		{"abc\ndef\n", 5, 5}, // cut "abc": dropped
		{"abcdefgh\n", 5, 4}, // the only line, cut
		{"ab\ncd\n", 5, 3},   // cut exactly at a line start
		{long + "\nend\n", 2, 1 << 20},
		{long + "\n" + long + "\nend", 2, int64(len(long)) + 10},
		{strings.Repeat("line\n", 100000), 200, 1 << 20},
	}
	for _, tt := range tests {
		lines, offs, err := tail(strings.NewReader(tt.content), int64(len(tt.content)), tt.n, tt.max)
		if err != nil {
			t.Fatal(err)
		}
		wl, wo := naiveTail([]byte(tt.content), tt.n, tt.max)
		if !cmp.Equal(lines, wl) || !cmp.Equal(offs, wo) {
			t.Errorf("tail(%.40q, %d, %d) = %.80q %v, want %.80q %v", tt.content, tt.n, tt.max, lines, offs, wl, wo)
		}
	}
}

func FuzzTail(f *testing.F) {
	f.Add([]byte("a\nb\nc\n"), 2, int64(100))
	f.Add([]byte("abc\ndef\n"), 5, int64(5))
	f.Add([]byte("\r\n\n\r"), 1, int64(2))
	f.Fuzz(func(t *testing.T, content []byte, n int, maxBytes int64) {
		n %= 1000
		lines, offs, err := tail(bytes.NewReader(content), int64(len(content)), n, maxBytes)
		if err != nil {
			t.Fatal(err)
		}
		wl, wo := naiveTail(content, n, maxBytes)
		if !cmp.Equal(lines, wl) || !cmp.Equal(offs, wo) {
			t.Fatalf("tail(%q, %d, %d) = %q %v, want %q %v", content, n, maxBytes, lines, offs, wl, wo)
		}
		for i, off := range offs {
			if off < 0 || off > int64(len(content)) || !bytes.HasPrefix(content[off:], []byte(strings.TrimSuffix(lines[i], "\r"))) {
				t.Fatalf("line %d %q not at offset %d", i, lines[i], off)
			}
		}
	})
}

// BenchmarkScan reads the last 200 lines of a 64 MiB log; the baseline
// reads the whole file, as a naive scanner would.
func BenchmarkScan(b *testing.B) {
	var buf bytes.Buffer
	for i := 0; buf.Len() < 64<<20; i++ {
		fmt.Fprintf(&buf, "2026-01-01T00:00:00Z step %d loss 0.123456 lr 3e-4 tokens/s 123456\n", i)
	}
	buf.WriteString("RuntimeError: CUDA out of memory\n")
	path := writeLog(b, buf.String())
	m, err := NewLogMatcher(LogConfig{})
	if err != nil {
		b.Fatal(err)
	}
	b.Run("tail", func(b *testing.B) {
		for b.Loop() {
			if _, ok, err := m.Scan(path); err != nil || !ok {
				b.Fatal(ok, err)
			}
		}
	})
	b.Run("baseline-readfile", func(b *testing.B) {
		for b.Loop() {
			if _, err := os.ReadFile(path); err != nil {
				b.Fatal(err)
			}
		}
	})
}
