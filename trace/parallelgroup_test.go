package trace

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// A parallel_group.json as MindCluster's tests write it.
const mindClusterGroups = `{
  "group_name_1": {
    "group_name": "cp",
    "group_rank": 2,
    "global_ranks": [1, 3, 9]
  },
  "group_name_136": {
    "group_name": "pp",
    "group_rank": 0,
    "global_ranks": [1, 2]
  },
  "group_name_137": {
    "group_name": "tp",
    "group_rank": 1,
    "global_ranks": [5, 6, 7]
  }
}`

func TestParallelGroupsRoundTrip(t *testing.T) {
	g, err := ParseParallelGroups([]byte(mindClusterGroups))
	if err != nil {
		t.Fatal(err)
	}
	want := ParallelGroups{
		"group_name_1":   {GroupName: "cp", GroupRank: 2, GlobalRanks: []int{1, 3, 9}},
		"group_name_136": {GroupName: "pp", GroupRank: 0, GlobalRanks: []int{1, 2}},
		"group_name_137": {GroupName: "tp", GroupRank: 1, GlobalRanks: []int{5, 6, 7}},
	}
	if diff := cmp.Diff(want, g); diff != "" {
		t.Fatalf("parse (-want +got):\n%s", diff)
	}
	b, err := g.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	again, err := ParseParallelGroups(b)
	if err != nil || !cmp.Equal(g, again) {
		t.Fatalf("round trip: %v, %v", again, err)
	}

	dir := t.TempDir()
	if err := WriteParallelGroups(dir, g); err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Stat(filepath.Join(dir, ParallelGroupFile))
	if fi.Mode().Perm() != 0o640 {
		t.Errorf("mode %v", fi.Mode())
	}
	read, err := ReadParallelGroups(dir)
	if err != nil || !cmp.Equal(g, read) {
		t.Fatalf("ReadParallelGroups = %v, %v", read, err)
	}
}

func TestParallelGroupsErrors(t *testing.T) {
	for in, field := range map[string]string{
		`{"g":{"group_name":"tp","group_rank":3,"global_ranks":[0,1]}}`:  "group_rank",
		`{"g":{"group_name":"tp","group_rank":-1,"global_ranks":[0,1]}}`: "group_rank",
		`{"g":{"group_name":"tp","group_rank":0,"global_ranks":[0,-4]}}`: "global_ranks",
		`{"g":{"group_name":"tp","group_rank":0,"global_ranks":[2,2]}}`:  "global_ranks",
		`{"":{"group_name":"tp","group_rank":0,"global_ranks":[2]}}`:     "",
		`{"g":{"group_name":"tp","group_rank":"0","global_ranks":[2]}}`:  "",
		`[]`:   "",
		`null`: "",
		`{} x`: "",
		``:     "",
	} {
		_, err := ParseParallelGroups([]byte(in))
		if !errors.Is(err, ErrParallelGroups) {
			t.Errorf("ParseParallelGroups(%s) = %v", in, err)
			continue
		}
		if field != "" && !strings.Contains(err.Error(), `field "`+field+`"`) {
			t.Errorf("ParseParallelGroups(%s): %v does not name %s", in, err, field)
		}
	}
}

func TestParallelGroupsRefuseSymlinks(t *testing.T) {
	root, outside := t.TempDir(), t.TempDir()
	os.Symlink(outside, filepath.Join(root, "0"))
	g := ParallelGroups{"x": {GroupName: "dp", GlobalRanks: []int{0}}}
	if err := WriteParallelGroups(filepath.Join(root, "0"), g); !errors.Is(err, ErrPath) {
		t.Fatalf("write through a symlinked folder: %v", err)
	}
	if ents, _ := os.ReadDir(outside); len(ents) != 0 {
		t.Fatalf("wrote outside: %v", ents)
	}
	dir := t.TempDir()
	os.WriteFile(filepath.Join(outside, "g.json"), []byte(mindClusterGroups), 0o640)
	os.Symlink(filepath.Join(outside, "g.json"), filepath.Join(dir, ParallelGroupFile))
	if _, err := ReadParallelGroups(dir); !errors.Is(err, ErrPath) {
		t.Fatalf("read through a symlinked file: %v", err)
	}
}

// TestReadParallelGroupsRefuses checks what the file readers refuse, the
// reader's own and ReadParallelGroups alike: a symlinked folder, a FIFO
// in the file's place (without blocking on it), a file over the bound; a
// missing file is os.ErrNotExist, which callers take as "not written yet".
func TestReadParallelGroupsRefuses(t *testing.T) {
	root, outside := t.TempDir(), t.TempDir()
	os.Symlink(outside, filepath.Join(root, "0"))
	if _, err := ReadParallelGroups(filepath.Join(root, "0")); !errors.Is(err, ErrPath) {
		t.Errorf("read through a symlinked folder: %v", err)
	}
	dir := filepath.Join(root, "1")
	os.Mkdir(dir, 0o750)
	rd, err := OpenRankReader(dir, ReaderConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Close()
	if _, err := rd.ParallelGroups(); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
	if _, err := ReadParallelGroups(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file: %v", err)
	}
	name := filepath.Join(dir, ParallelGroupFile)
	if err := syscall.Mkfifo(name, 0o640); err != nil {
		t.Fatal(err)
	}
	if _, err := rd.ParallelGroups(); !errors.Is(err, ErrPath) {
		t.Errorf("FIFO: %v", err)
	}
	os.Remove(name)
	big := append([]byte(mindClusterGroups), bytes.Repeat([]byte(" "), maxParallelGroupsBytes)...)
	os.WriteFile(name, big, 0o640)
	if _, err := rd.ParallelGroups(); !errors.Is(err, ErrParallelGroups) || !strings.Contains(err.Error(), name) {
		t.Errorf("file over the bound: %v", err)
	}
	os.WriteFile(name, []byte(mindClusterGroups), 0o640)
	want, err := ReadParallelGroups(dir)
	if err != nil {
		t.Fatal(err)
	}
	got, err := rd.ParallelGroups()
	if err != nil || !cmp.Equal(got, want) {
		t.Errorf("RankReader.ParallelGroups = %v, %v; ReadParallelGroups %v", got, err, want)
	}
	rd.Close()
	if _, err := rd.ParallelGroups(); !errors.Is(err, os.ErrClosed) {
		t.Errorf("closed reader: %v", err)
	}
}

func TestRecorderWritesParallelGroups(t *testing.T) {
	root := t.TempDir()
	rec := newTestRecorder(t, RecorderConfig{Root: root, Rank: 2})
	g := ParallelGroups{"tp-0": {GroupName: "tp", GroupRank: 1, GlobalRanks: []int{1, 2}}}
	if err := rec.WriteParallelGroups(g); err != nil {
		t.Fatal(err)
	}
	got, err := ReadParallelGroups(filepath.Join(root, "job", "2"))
	if err != nil || !cmp.Equal(g, got) {
		t.Fatalf("read back %v, %v", got, err)
	}
	if rec.Dir() != filepath.Join(root, "job", "2") {
		t.Fatalf("Dir() = %q", rec.Dir())
	}
}

func FuzzParseParallelGroups(f *testing.F) {
	f.Add([]byte(mindClusterGroups))
	f.Add([]byte(`{"g":{"group_name":"tp","group_rank":0,"global_ranks":[0]}}`))
	f.Add([]byte(`{"g":{"global_ranks":[1,1]}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		// The plain path must decode as encoding/json does wherever it answers.
		if plain, ok := parseGroupsPlain(data); ok {
			generic, err := parseGroupsJSON(data)
			if err != nil {
				t.Fatalf("plain path accepts what encoding/json rejects (%v): %q", err, data)
			}
			if !cmp.Equal(plain, generic) {
				t.Fatalf("paths disagree on %q:\nplain   %v\ngeneric %v", data, plain, generic)
			}
		}
		g, err := ParseParallelGroups(data)
		if err != nil {
			if !errors.Is(err, ErrParallelGroups) {
				t.Fatalf("error %v does not wrap ErrParallelGroups", err)
			}
			return
		}
		b, err := g.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		again, err := ParseParallelGroups(b)
		if err != nil || !cmp.Equal(g, again) {
			t.Fatalf("round trip of %s: %v, %v", b, again, err)
		}
	})
}

// TestParallelGroupsPlainPath checks that what Marshal and MindCluster
// write takes the fast path, and decodes as encoding/json decodes it.
func TestParallelGroupsPlainPath(t *testing.T) {
	g := ParallelGroups{
		"group_tp-0": {GroupName: "tp", GroupRank: 1, GlobalRanks: []int{0, 1, 2, 3}},
		"group_dp-1": {GroupName: "dp", GroupRank: 0, GlobalRanks: []int{1, 9}},
	}
	b, err := g.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range [][]byte{b, []byte(mindClusterGroups)} {
		plain, ok := parseGroupsPlain(in)
		if !ok {
			t.Fatalf("not on the plain path: %s", in)
		}
		generic, err := parseGroupsJSON(in)
		if err != nil || !cmp.Equal(plain, generic) {
			t.Fatalf("%s:\nplain   %v\ngeneric %v, %v", in, plain, generic, err)
		}
	}
}
