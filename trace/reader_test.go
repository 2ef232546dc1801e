package trace

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"
)

func appendFile(t testing.TB, path string, data string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o640)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString(data); err != nil {
		t.Fatal(err)
	}
	f.Close()
}

func line(i int) string {
	r := testRecord(i)
	return string(r.AppendJSON(nil)) + "\n"
}

func readIDs(t *testing.T, rr *RankReader) []uint64 {
	t.Helper()
	var ids []uint64
	if err := rr.Read(func(r *Record) error { ids = append(ids, r.ID); return nil }); err != nil {
		t.Fatal(err)
	}
	return ids
}

func openReader(t *testing.T, dir string, cfg ReaderConfig) *RankReader {
	t.Helper()
	rr, err := OpenRankReader(dir, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rr.Close() })
	return rr
}

func TestRankReaderTailsAcrossRotation(t *testing.T) {
	root := t.TempDir()
	w, err := newFileWriter(fileWriterConfig{Root: root, Job: "j", MaxFileBytes: 2000, Now: fixedNow(1731000000)})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	dir := filepath.Join(root, "j", "0")
	os.MkdirAll(dir, 0o750)
	rr := openReader(t, dir, ReaderConfig{BufferBytes: 512})
	if ids := readIDs(t, rr); len(ids) != 0 {
		t.Fatalf("read %v from an empty folder", ids)
	}
	next := 0
	for round := range 5 {
		for range 7 + round*5 {
			r := testRecord(next)
			w.Write(&r)
			next++
		}
		w.Flush()
		ids := readIDs(t, rr)
		want := uint64(next - len(ids) + 1)
		for _, id := range ids {
			if id != want {
				t.Fatalf("round %d: ids %v, want consecutive up to %d", round, ids, next)
			}
			want++
		}
		if want != uint64(next+1) {
			t.Fatalf("round %d: read up to %d, want %d", round, want-1, next)
		}
	}
	if s := rr.Stats(); s.Files < 3 || s.Records != uint64(next) || s.GarbageLines != 0 {
		t.Fatalf("stats %+v", s)
	}
}

func TestRankReaderPartialLine(t *testing.T) {
	dir := t.TempDir()
	f := filepath.Join(dir, "1731000000")
	l1 := line(1)
	appendFile(t, f, line(0)+l1[:50])
	rr := openReader(t, dir, ReaderConfig{})
	if ids := readIDs(t, rr); !cmp.Equal(ids, []uint64{1}) {
		t.Fatalf("ids %v", ids)
	}
	if ids := readIDs(t, rr); len(ids) != 0 {
		t.Fatalf("ids %v from a partial line", ids)
	}
	appendFile(t, f, l1[50:]+line(2)[:10])
	if ids := readIDs(t, rr); !cmp.Equal(ids, []uint64{2}) {
		t.Fatalf("ids %v", ids)
	}
	// The writer died mid-line and its successor started a new file: the
	// stub is damage, counted once.
	appendFile(t, filepath.Join(dir, "1731000009"), line(3))
	if ids := readIDs(t, rr); !cmp.Equal(ids, []uint64{4}) {
		t.Fatalf("ids %v", ids)
	}
	s := rr.Stats()
	var le *ParseError
	if s.GarbageLines != 1 || !errors.As(s.LastGarbage, &le) || le.Line != 3 || !errors.Is(le, ErrTruncatedLine) ||
		le.File != f {
		t.Fatalf("stats %+v", s)
	}
}

func TestRankReaderSkipsGarbage(t *testing.T) {
	dir := t.TempDir()
	f := filepath.Join(dir, "1731000000")
	long := `{"Kind":1,"Name":"` + strings.Repeat("x", MaxLineBytes) + `"}`
	appendFile(t, f, line(0)+
		"not json at all\n"+
		"\x00\x01\x02\xff\xfe binary\n"+
		line(1)+
		long+"\n"+
		"\r\n"+ // blank: not counted
		line(2)+
		`{"Kind":1,"Flag":2}`+"\n"+ // no Timestamp, no Id
		strings.Repeat("\x00", 3*MaxLineBytes)+"\n"+ // a crash's zero-filled tail
		line(3))
	rr := openReader(t, dir, ReaderConfig{BufferBytes: 4096})
	if ids := readIDs(t, rr); !cmp.Equal(ids, []uint64{1, 2, 3, 4}) {
		t.Fatalf("ids %v", ids)
	}
	s := rr.Stats()
	if s.GarbageLines != 5 {
		t.Fatalf("garbage lines %d, want 5 (%v)", s.GarbageLines, s.LastGarbage)
	}
	var le *ParseError
	if !errors.As(s.LastGarbage, &le) || le.Line != 9 || !errors.Is(le, ErrLineTooLong) ||
		!strings.Contains(le.Error(), f+":9:") {
		t.Fatalf("last garbage %v", s.LastGarbage)
	}
	if st, _ := os.Stat(f); s.Bytes != uint64(st.Size()) {
		t.Errorf("bytes %d, file has %d", s.Bytes, st.Size())
	}
}

func TestRankReaderFollowsNoSymlink(t *testing.T) {
	root, outside := t.TempDir(), t.TempDir()
	dir := filepath.Join(root, "0")
	os.Mkdir(dir, 0o750)
	appendFile(t, filepath.Join(outside, "secret"), line(99))
	os.Symlink(filepath.Join(outside, "secret"), filepath.Join(dir, "1731000001"))
	os.Mkdir(filepath.Join(dir, "1731000002"), 0o750)
	unix.Mkfifo(filepath.Join(dir, "1731000003"), 0o640) // opening it must not block
	appendFile(t, filepath.Join(dir, "1731000004"), line(0))
	appendFile(t, filepath.Join(dir, ParallelGroupFile), line(98))
	appendFile(t, filepath.Join(dir, "notes.txt"), line(97))
	rr := openReader(t, dir, ReaderConfig{})
	if ids := readIDs(t, rr); !cmp.Equal(ids, []uint64{1}) {
		t.Fatalf("ids %v", ids)
	}
	if s := rr.Stats(); s.SkippedFiles != 1 || !errors.Is(s.LastSkip, ErrPath) {
		t.Fatalf("stats %+v: want the FIFO skipped", s)
	}
	// The rank folder itself as a symlink is refused.
	os.Symlink(dir, filepath.Join(root, "1"))
	if _, err := OpenRankReader(filepath.Join(root, "1"), ReaderConfig{}); !errors.Is(err, ErrPath) {
		t.Fatalf("OpenRankReader on a symlink: %v", err)
	}
}

func TestRankReaderFileAgedAway(t *testing.T) {
	dir := t.TempDir()
	first := filepath.Join(dir, "1731000000")
	appendFile(t, first, line(0))
	rr := openReader(t, dir, ReaderConfig{})
	readIDs(t, rr)
	// The ager deletes the file being read; the writer has moved on.
	os.Remove(first)
	appendFile(t, filepath.Join(dir, "1731000005"), line(1))
	if ids := readIDs(t, rr); !cmp.Equal(ids, []uint64{2}) {
		t.Fatalf("ids %v", ids)
	}
	if s := rr.Stats(); s.GarbageLines != 0 {
		t.Fatalf("stats %+v", s)
	}
}

func TestRankReaderFileCutShort(t *testing.T) {
	dir := t.TempDir()
	f := filepath.Join(dir, "1731000000")
	appendFile(t, f, line(0)+line(1)[:40])
	rr := openReader(t, dir, ReaderConfig{})
	readIDs(t, rr)
	// A writer that failed mid-line cuts the file back to its last line.
	os.Truncate(f, int64(len(line(0))))
	appendFile(t, f, line(2))
	if ids := readIDs(t, rr); !cmp.Equal(ids, []uint64{3}) {
		t.Fatalf("ids %v", ids)
	}
	if s := rr.Stats(); s.GarbageLines != 0 {
		t.Fatalf("stats %+v", s)
	}
}

func TestRankReaderCallbackError(t *testing.T) {
	for name, cfg := range map[string]ReaderConfig{"own buffer": {}, "borrowed buffer": {Buffers: NewBufferPool(64)}} {
		t.Run(name, func(t *testing.T) { testCallbackError(t, cfg) })
	}
}

func testCallbackError(t *testing.T, cfg ReaderConfig) {
	dir := t.TempDir()
	appendFile(t, filepath.Join(dir, "1731000000"), line(0)+line(1)+line(2))
	rr := openReader(t, dir, cfg)
	stop := errors.New("stop")
	var ids []uint64
	err := rr.Read(func(r *Record) error {
		ids = append(ids, r.ID)
		if r.ID == 2 {
			return stop
		}
		return nil
	})
	if !errors.Is(err, stop) || !cmp.Equal(ids, []uint64{1, 2}) {
		t.Fatalf("Read = %v, ids %v", err, ids)
	}
	if ids := readIDs(t, rr); !cmp.Equal(ids, []uint64{3}) {
		t.Fatalf("after the error: ids %v", ids)
	}
	rr.Close()
	if err := rr.Read(func(*Record) error { return nil }); err == nil {
		t.Fatal("Read after Close succeeded")
	}
}

// TestRankReaderReadSome reads three files, one of them still growing,
// a buffer at a time: every record comes once, in order, across the
// files' ends, with no byte read twice; a call with nothing left to read
// reports that it caught up.
func TestRankReaderReadSome(t *testing.T) {
	for name, cfg := range map[string]ReaderConfig{"own buffer": {BufferBytes: 300}, "borrowed buffer": {Buffers: NewBufferPool(300)}} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			var size int
			next := 0
			write := func(file string, lines int) {
				var b strings.Builder
				for range lines {
					b.WriteString(line(next))
					next++
				}
				size += b.Len()
				appendFile(t, filepath.Join(dir, file), b.String())
			}
			write("1731000000", 7)
			write("1731000100", 1)
			write("1731000200", 9)
			rr := openReader(t, dir, cfg)
			var ids []uint64
			take := func(r *Record) error { ids = append(ids, r.ID); return nil }
			calls := 0
			for more := true; more; calls++ {
				var err error
				if more, err = rr.ReadSome(1, take); err != nil {
					t.Fatal(err)
				}
				if calls > 1000 {
					t.Fatal("ReadSome does not catch up")
				}
			}
			write("1731000200", 2) // the newest file grows
			if more, err := rr.ReadSome(100, take); more || err != nil {
				t.Fatalf("ReadSome after the files grew = %v, %v", more, err)
			}
			want := make([]uint64, next)
			for i := range want {
				want[i] = testRecord(i).ID
			}
			if !cmp.Equal(ids, want) {
				t.Fatalf("ids %v, want %v", ids, want)
			}
			if st := rr.Stats(); st.Bytes != uint64(size) || st.GarbageLines != 0 {
				t.Fatalf("stats %+v, want %d bytes and no garbage", st, size)
			}
			// A buffer of 300 bytes holds a line and a bit: one read a
			// call, a few calls a file.
			if lines := next - 2; calls < lines/2 {
				t.Fatalf("%d calls for %d lines: more than a buffer a call", calls, lines)
			}
		})
	}
}

// mindClusterRecord is the shape MindCluster's writer and tests use: Go
// structs through encoding/json, -1 in the union half that does not apply,
// and no name or domain on end and device records.
type mindClusterRecord struct {
	Kind          int
	Flag          int
	SourceKind    int
	Timestamp     int64
	Id            int64
	MsptiObjectId struct {
		Pt struct{ ProcessId, ThreadId int64 }
		Ds struct{ DeviceId, StreamId int64 }
	}
	Name   string
	Domain string
}

func TestReadsMindClusterFiles(t *testing.T) {
	dir := t.TempDir()
	f, _ := os.Create(filepath.Join(dir, "1747645582"))
	enc := json.NewEncoder(f)
	comm := `{"streamId": "10","count": "4194304","dataType": "bfp16","opName": "HcclAllReduce","groupName": "group_name_137"}`
	put := func(flag, src int, ts, id int64, name, domain string) {
		var r mindClusterRecord
		r.Kind, r.Flag, r.SourceKind, r.Timestamp, r.Id, r.Name, r.Domain = 1, flag, src, ts, id, name, domain
		if src == SourceKindHost {
			r.MsptiObjectId.Pt.ProcessId, r.MsptiObjectId.Pt.ThreadId = 4242, 4243
			r.MsptiObjectId.Ds.DeviceId, r.MsptiObjectId.Ds.StreamId = -1, -1
		} else {
			r.MsptiObjectId.Pt.ProcessId, r.MsptiObjectId.Pt.ThreadId = -1, -1
			r.MsptiObjectId.Ds.DeviceId, r.MsptiObjectId.Ds.StreamId = 3, 10
		}
		if err := enc.Encode(r); err != nil {
			t.Fatal(err)
		}
	}
	put(16, 0, 1000, 1, "step 1", "default")
	put(32, 0, 9000, 1, "", "")
	put(16, 1, 1500, 1, "", "")
	put(32, 1, 9500, 1, "", "")
	put(16, 0, 2000, 2, comm, "communication")
	put(32, 0, 3000, 2, "", "")
	put(16, 1, 2100, 2, "", "")
	put(32, 1, 3600, 2, "", "")
	put(2, 0, 500, 3, "dataloader", "default")
	put(4, 0, 900, 3, "", "")
	f.Close()

	rr := openReader(t, dir, ReaderConfig{})
	var p Pairer
	var got []Range
	if err := rr.Read(func(r *Record) error {
		if rg, ok := p.Add(r); ok {
			got = append(got, rg)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	const none = 1<<32 - 1
	want := []Range{
		{Name: "step 1", Domain: "default", ID: 1, Start: 1000, End: 9000, ProcessID: 4242, ThreadID: 4243, DeviceID: none, StreamID: none},
		{Name: "step 1", Domain: "default", ID: 1, Start: 1500, End: 9500, ProcessID: none, ThreadID: none, DeviceID: 3, StreamID: 10, SourceKind: 1},
		{Name: comm, Domain: "communication", ID: 2, Start: 2000, End: 3000, ProcessID: 4242, ThreadID: 4243, DeviceID: none, StreamID: none},
		{Name: comm, Domain: "communication", ID: 2, Start: 2100, End: 3600, ProcessID: none, ThreadID: none, DeviceID: 3, StreamID: 10, SourceKind: 1},
		{Name: "dataloader", Domain: "default", ID: 3, Start: 500, End: 900, ProcessID: 4242, ThreadID: 4243, DeviceID: none, StreamID: none},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("ranges (-want +got):\n%s", diff)
	}
	if s := rr.Stats(); s.GarbageLines != 0 || s.Records != 10 {
		t.Fatalf("stats %+v", s)
	}
	op, err := ParseCommOp(got[2].Name)
	if err != nil || op.OpName != "HcclAllReduce" || op.GroupName != "group_name_137" || op.Count != 4194304 {
		t.Fatalf("ParseCommOp = %+v, %v", op, err)
	}
	if k, ok := got[0].Kind(); !ok || k != Step {
		t.Errorf("Kind() = %v, %v", k, ok)
	}
	if n, ok := got[0].Step(); !ok || n != 1 {
		t.Errorf("Step() = %v, %v", n, ok)
	}
}

// FuzzReaderLines writes data into a record file in the chunks cuts says
// and reads after each: the records seen must be those of the complete,
// well-formed lines, whatever the chunking, and nothing may panic.
func FuzzReaderLines(f *testing.F) {
	f.Add([]byte(line(0)+line(1)), []byte{10, 200, 3})
	f.Add([]byte("garbage\n"+line(2)+"\x00\xff\n"+line(3)[:30]), []byte{1, 1, 1, 50})
	f.Add([]byte(line(4)+"\r\n\n"+strings.Repeat("{", 300)+"\n"+line(5)), []byte{255})
	f.Add([]byte(line(6)+line(7)+line(8)+line(9)), []byte{3, 40, 2, 90})
	f.Fuzz(func(t *testing.T, data, cuts []byte) {
		dir := t.TempDir()
		path := filepath.Join(dir, "1731000000")
		os.WriteFile(path, nil, 0o640)
		cfg := ReaderConfig{BufferBytes: 7}
		if len(cuts) > 0 && cuts[0]&2 != 0 {
			// A borrowed buffer: what a pause leaves is read again.
			cfg = ReaderConfig{Buffers: NewBufferPool(7)}
		}
		rr, err := OpenRankReader(dir, cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer rr.Close()
		var got []Record
		// An odd first cut makes the callback stop the reader every few
		// records, as a consumer that reads in turns does: the next Read
		// goes on from the record after.
		pauseEvery := 0
		if len(cuts) > 0 && cuts[0]&1 == 1 {
			pauseEvery = int(cuts[0]>>1)%4 + 1
		}
		errPause := errors.New("pause")
		collect := func(r *Record) error {
			got = append(got, *r)
			if pauseEvery > 0 && len(got)%pauseEvery == 0 {
				return errPause
			}
			return nil
		}
		rest := data
		for i := 0; len(rest) > 0; i++ {
			n := len(rest)
			if i < len(cuts) {
				n = min(int(cuts[i])+1, n)
			}
			appendFile(t, path, string(rest[:n]))
			rest = rest[n:]
			for {
				err := rr.Read(collect)
				if err == nil {
					break
				}
				if !errors.Is(err, errPause) {
					t.Fatal(err)
				}
			}
		}
		var want []Record
		lines := bytes.Split(data, []byte{'\n'})
		for _, l := range lines[:len(lines)-1] { // the last has no newline yet
			if len(l) > MaxLineBytes {
				continue
			}
			if r, err := ParseRecord(l); err == nil {
				want = append(want, r)
			}
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Fatalf("records (-want +got):\n%s", diff)
		}
		s := rr.Stats()
		if s.Records != uint64(len(got)) || s.Bytes != uint64(len(data)) {
			t.Fatalf("stats %+v for %d records, %d bytes", s, len(got), len(data))
		}
	})
}
