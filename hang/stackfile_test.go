package hang

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// docDump is the example of the package documentation.
func docDump() *Dump {
	return &Dump{
		Rank: 3, World: 8, Pid: 4242, Host: "node-7",
		Time:   time.Date(2026, 1, 2, 3, 4, 5, 123456789, time.UTC),
		State:  "S (sleeping)",
		Reason: "rank 3: hang: op HcclAllReduce (group dp, stream 0) running 12s, timeout 10s",
		Notes:  []string{"native: eu-stack"},
		Threads: []Thread{
			{Kind: KindPython, ID: 4242, Name: "MainThread", State: "active+gil", Frames: []Frame{
				{Func: "all_reduce", File: "torch/distributed/distributed_c10d.py", Line: 2050},
				{Func: "train_step", File: "train.py", Line: 42},
			}},
			{Kind: KindNative, ID: 4243, Name: "python3", Frames: []Frame{
				{Func: "__futex_abstimed_wait_common", File: "/lib/x86_64-linux-gnu/libc.so.6"},
			}},
		},
	}
}

const docText = `faultline-stacktrace 1
rank 3
world 8
pid 4242
host "node-7"
time 2026-01-02T03:04:05.123456789Z
state "S (sleeping)"
reason "rank 3: hang: op HcclAllReduce (group dp, stream 0) running 12s, timeout 10s"
note "native: eu-stack"
thread python 4242 "MainThread" "active+gil"
frame "all_reduce" "torch/distributed/distributed_c10d.py" 2050
frame "train_step" "train.py" 42
thread native 4243 "python3" ""
frame "__futex_abstimed_wait_common" "/lib/x86_64-linux-gnu/libc.so.6" 0
end 2 3
`

func TestDumpMarshalMatchesDocumentation(t *testing.T) {
	b, err := docDump().Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(docText, string(b)); diff != "" {
		t.Errorf("Marshal (-doc +got):\n%s", diff)
	}
	d, err := ParseDump([]byte(docText))
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(docDump(), d); diff != "" {
		t.Errorf("ParseDump (-want +got):\n%s", diff)
	}
}

func TestDumpRoundTrip(t *testing.T) {
	for _, d := range []*Dump{
		{World: 1},
		{Rank: 9999, World: 10000, Threads: []Thread{{Kind: KindGo, ID: 1 << 63, Frames: []Frame{{}}}}},
		{
			Rank: 1, World: 2, Host: "h\"o\\st\n", State: "D (disk sleep)", Reason: "tab\there",
			Time:  time.Date(2030, 5, 6, 7, 8, 9, 1, time.UTC),
			Notes: []string{"", "é ü 日本", "\x00\xff\xfe not utf-8"},
			Threads: []Thread{
				{Kind: "custom_2", Name: "na\xc3me", State: "s p a c e s", Frames: []Frame{
					{Func: "operator()(int) const", File: "a b.cc", Line: 7},
					{Func: "\xff\xfe", File: "\n", Line: 0},
					{Func: `"quoted"`, File: `C:\path`, Line: 1<<31 - 1},
				}},
				{Kind: KindNative},
			},
		},
	} {
		b, err := d.Marshal()
		if err != nil {
			t.Fatalf("Marshal: %v", err)
		}
		got, err := ParseDump(b)
		if err != nil {
			t.Fatalf("ParseDump of\n%s: %v", b, err)
		}
		if diff := cmp.Diff(d, got); diff != "" {
			t.Errorf("round trip (-want +got):\n%s", diff)
		}
	}
}

func TestDumpMarshalRejectsInvalid(t *testing.T) {
	for _, d := range []*Dump{
		{World: 0},
		{World: maxRank + 1}, // its file name would not parse back
		{Rank: 8, World: 8},
		{Rank: -1, World: 8},
		{World: 1, Pid: -1},
		{World: 1, Threads: []Thread{{Kind: "Python"}}},
		{World: 1, Threads: []Thread{{Kind: "../x"}}},
		{World: 1, Threads: []Thread{{Kind: KindGo, Frames: []Frame{{Line: -1}}}}},
	} {
		if _, err := d.Marshal(); err == nil {
			t.Errorf("Marshal(%+v): no error", d)
		}
	}
}

// TestParseDumpTruncated cuts a valid file at every byte: no prefix
// parses, and each error says the file is truncated or malformed.
func TestParseDumpTruncated(t *testing.T) {
	for n := range len(docText) {
		_, err := ParseDump([]byte(docText[:n]))
		if err == nil {
			t.Fatalf("prefix of %d bytes parsed", n)
		}
		if !errors.Is(err, ErrTruncated) && !errors.Is(err, ErrFormat) {
			t.Fatalf("prefix of %d bytes: %v wraps neither ErrTruncated nor ErrFormat", n, err)
		}
	}
	// Cut at a line boundary, it is truncated, not malformed.
	cut := docText[:strings.Index(docText, "thread native")]
	if _, err := ParseDump([]byte(cut)); !errors.Is(err, ErrTruncated) {
		t.Errorf("cut at a line: %v, want ErrTruncated", err)
	}
}

func TestParseDumpErrors(t *testing.T) {
	head := "faultline-stacktrace 1\nrank 0\nworld 2\n"
	for _, tc := range []struct {
		text, want string
		line       int
	}{
		{"", "empty file", 0},
		{"\x89PNG\r\n\x1a\n", "not a stack file", 1},
		{"faultline-stacktrace 2\nend 0 0\n", "version 2", 1},
		{"faultline-stacktrace x\n", "version", 1},
		{"faultline-stacktrace 1\nend 0 0\n", "rank and world lines are required", 2},
		{head + "frame \"f\" \"g\" 1\nend 0 1\n", "frame before any thread", 4},
		{head + "thread go 1 \"\" \"\"\nframe \"f\" \"g\" -1\nend 1 1\n", "frame line", 5},
		{head + "thread go 1 \"\" \"\"\nframe \"f\" \"g\" +1\nend 1 1\n", "frame line", 5},
		{head + "thread go 1 \"\" \"\"\nframe f g 1\nend 1 1\n", "frame function", 5},
		{head + "thread Go 1 \"\" \"\"\nend 1 0\n", "thread kind", 4},
		{head + "thread go x \"\" \"\"\nend 1 0\n", "thread id", 4},
		{head + "thread go 1 \"\"\nend 1 0\n", "thread:", 4},
		{head + "host node\nend 0 0\n", "host", 4},
		{head + "time yesterday\nend 0 0\n", "time", 4},
		{head + "end 0 0\ngarbage\n", "data after the end line", 5},
		{head + "end 1 0\n", "end says 1 threads", 4},
		{head + "\x00\x01\x02\nend 0 0\n", "keyword", 4},
		{"faultline-stacktrace 1\nrank 5\nworld 2\nend 0 0\n", "Rank 5", 4},
		{head + "end 0 0", "last line cut short", 4},
	} {
		_, err := ParseDump([]byte(tc.text))
		var pe *ParseError
		if !errors.As(err, &pe) {
			t.Errorf("%q: error %v is not a *ParseError", tc.text, err)
			continue
		}
		if !strings.Contains(err.Error(), tc.want) || pe.Line != tc.line {
			t.Errorf("%q: error %q at line %d, want %q at line %d", tc.text, err, pe.Line, tc.want, tc.line)
		}
	}
}

func TestParseDumpSkipsUnknownKeywords(t *testing.T) {
	text := "faultline-stacktrace 1\nrank 0\nworld 1\ncgroup \"/kubepods/x\"\nthread go 1 \"\" \"\"\nregisters rip=0x1\nframe \"f\" \"g\" 1\n\nend 1 1\n"
	d, err := ParseDump([]byte(text))
	if err != nil {
		t.Fatal(err)
	}
	if len(d.Threads) != 1 || len(d.Threads[0].Frames) != 1 {
		t.Errorf("got %+v", d)
	}
}

func TestStackFileReadWrite(t *testing.T) {
	dir := t.TempDir()
	path, err := WriteStackFile(dir, docDump())
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Base(path) != "00003-00008.stacktrace" {
		t.Errorf("path %s", path)
	}
	d, err := ReadStackFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(docDump(), d); diff != "" {
		t.Error(diff)
	}
	bad := filepath.Join(dir, FileName(4, 8))
	if err := os.WriteFile(bad, []byte(docText[:200]), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err = ReadStackFile(bad)
	if !errors.Is(err, ErrTruncated) || !strings.Contains(err.Error(), bad) {
		t.Errorf("truncated file: %v, want ErrTruncated naming %s", err, bad)
	}
	if _, err := ReadStackFile(dir); err == nil {
		t.Error("reading a directory: no error")
	}
}

func TestFileNames(t *testing.T) {
	if got := FileName(3, 8); got != "00003-00008.stacktrace" {
		t.Errorf("FileName = %q", got)
	}
	for _, tc := range []struct {
		name        string
		rank, world int
		ok          bool
	}{
		{"00003-00008.stacktrace", 3, 8, true},
		{"/x/y/12345-99999.stacktrace", 12345, 99999, true},
		{"00008-00008.stacktrace", 0, 0, false},
		{"3-8.stacktrace", 3, 8, true},
		{"00003-00008.stack", 0, 0, false},
		{"a-b.stacktrace", 0, 0, false},
		{"00003.stacktrace", 0, 0, false},
	} {
		r, w, ok := ParseFileName(tc.name)
		if r != tc.rank || w != tc.world || ok != tc.ok {
			t.Errorf("ParseFileName(%q) = %d, %d, %v", tc.name, r, w, ok)
		}
	}
}

func FuzzParseDump(f *testing.F) {
	f.Add([]byte(docText))
	f.Add([]byte("faultline-stacktrace 1\nrank 0\nworld 1\nend 0 0\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		d, err := ParseDump(data)
		if err != nil {
			var pe *ParseError
			if !errors.As(err, &pe) || (!errors.Is(err, ErrFormat) && !errors.Is(err, ErrTruncated)) {
				t.Fatalf("error %v is not a *ParseError wrapping ErrFormat or ErrTruncated", err)
			}
			return
		}
		b, err := d.Marshal()
		if err != nil {
			t.Fatalf("parsed dump does not marshal: %v", err)
		}
		again, err := ParseDump(b)
		if err != nil {
			t.Fatalf("marshalled dump does not parse: %v\n%s", err, b)
		}
		if diff := cmp.Diff(d, again); diff != "" {
			t.Fatalf("round trip (-first +second):\n%s", diff)
		}
		b2, _ := again.Marshal()
		if string(b) != string(b2) {
			t.Fatal("Marshal is not stable")
		}
	})
}
