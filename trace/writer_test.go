package trace

import (
	"bufio"
	"errors"
	"fmt"
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

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/internal/testkit"
)

func fixedNow(sec int64) func() time.Time {
	return func() time.Time { return time.Unix(sec, 0) }
}

func testRecord(i int) Record {
	return Record{Kind: ActivityKindMarker, Flag: FlagDeviceStart, SourceKind: SourceKindHost,
		Timestamp: uint64(1731000000000000000 + i), ID: uint64(i + 1), ProcessID: 10, ThreadID: 10,
		DeviceID: 1, StreamID: 2, Name: "step " + strconv.Itoa(i), Domain: DomainDefault}
}

func TestWriterFormatLayoutAndModes(t *testing.T) {
	old := unix.Umask(0o077) // modes must not depend on the umask
	defer unix.Umask(old)
	root := filepath.Join(t.TempDir(), "profiling")
	w, err := newFileWriter(fileWriterConfig{Root: root, Job: "job-1", Rank: 7, Now: fixedNow(1731000000)})
	if err != nil {
		t.Fatal(err)
	}
	var want []byte
	for i := range 3 {
		r := testRecord(i)
		if err := w.Write(&r); err != nil {
			t.Fatal(err)
		}
		want = append(r.AppendJSON(want), '\n')
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	file := filepath.Join(root, "job-1", "7", "1731000000")
	got, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != string(want) {
		t.Fatalf("file content:\n%s\nwant:\n%s", got, want)
	}
	for path, mode := range map[string]os.FileMode{
		file:                              0o640,
		filepath.Join(root, "job-1"):      0o750 | os.ModeDir,
		filepath.Join(root, "job-1", "7"): 0o750 | os.ModeDir,
	} {
		fi, err := os.Lstat(path)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode() != mode {
			t.Errorf("%s: mode %v, want %v", path, fi.Mode(), mode)
		}
	}
	if s := w.Stats(); s.Written.Default != 3 || s.Files != 1 || s.Bytes != uint64(len(want)) || s.LastError != nil {
		t.Errorf("stats %+v", s)
	}
}

func TestWriterRotatesAndNeverAppends(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, "j", "0")
	os.MkdirAll(dir, 0o750)
	// A file from an earlier process in the same second: left alone.
	os.WriteFile(filepath.Join(dir, "1731000000"), []byte("earlier\n"), 0o640)
	w, err := newFileWriter(fileWriterConfig{Root: root, Job: "j", MaxFileBytes: 1000, Now: fixedNow(1731000000)})
	if err != nil {
		t.Fatal(err)
	}
	const n = 40
	for i := range n {
		r := testRecord(i)
		if err := w.Write(&r); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	// A later process of the rank, its clock behind the names of the first:
	// its file still sorts last, so a reader tailing the folder sees it.
	w2, _ := newFileWriter(fileWriterConfig{Root: root, Job: "j", Now: fixedNow(1731000002)})
	r := testRecord(n)
	w2.Write(&r)
	w2.Close()
	if b, _ := os.ReadFile(filepath.Join(dir, "1731000000")); string(b) != "earlier\n" {
		t.Fatalf("an existing file was changed: %q", b)
	}
	ents, _ := os.ReadDir(dir)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
		fi, _ := e.Info()
		if e.Name() != "1731000000" && fi.Size() > 1000+300 {
			t.Errorf("%s has %d bytes, want about 1000 at most", e.Name(), fi.Size())
		}
	}
	if len(names) < 8 || names[1] != "1731000001" {
		t.Fatalf("files %v: want rotation into consecutive names after 1731000000", names)
	}
	recs, st := readAll(t, dir)
	if st.GarbageLines != 1 { // "earlier"
		t.Errorf("garbage %d (%v), want 1", st.GarbageLines, st.LastGarbage)
	}
	if len(recs) != n+1 {
		t.Fatalf("read %d records, want %d", len(recs), n+1)
	}
	for i, r := range recs {
		if r.ID != uint64(i+1) {
			t.Fatalf("record %d has id %d: out of order", i, r.ID)
		}
	}
}

// TestWriterIgnoresFarFutureNames plants a record file named at the top
// of the int64 range: the writer's next name must not overflow into one
// that readers and the ager do not see as a record file.
func TestWriterIgnoresFarFutureNames(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, "j", "0")
	os.MkdirAll(dir, 0o750)
	os.WriteFile(filepath.Join(dir, "9223372036854775807"), nil, 0o640)
	w, err := newFileWriter(fileWriterConfig{Root: root, Job: "j", Now: fixedNow(1731000000)})
	if err != nil {
		t.Fatal(err)
	}
	r := testRecord(0)
	if err := w.Write(&r); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if !IsRecordFileName(e.Name()) {
			t.Fatalf("the writer created %q, which is no record file name", e.Name())
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "1731000000")); err != nil {
		t.Fatalf("the writer did not name its file by the clock: %v", err)
	}
}

func TestJobValidation(t *testing.T) {
	for _, job := range []string{"", ".", "..", "../../etc", "a/b", ".hidden", "x\x00y", "tab\there", strings.Repeat("x", 256)} {
		if err := ValidateJob(job); !errors.Is(err, ErrPath) {
			t.Errorf("ValidateJob(%q) = %v, want ErrPath", job, err)
		}
		if _, err := newFileWriter(fileWriterConfig{Job: job}); job != "" && err == nil {
			t.Errorf("newFileWriter accepted job %q", job)
		}
	}
	for _, job := range []string{"default_task_id_1731000000", "3f1e2d4c-aaaa-bbbb-cccc-0123456789ab", "job.v2"} {
		if err := ValidateJob(job); err != nil {
			t.Errorf("ValidateJob(%q) = %v", job, err)
		}
	}
}

func TestWriterRefusesTaskIDTraversal(t *testing.T) {
	base := t.TempDir()
	root := filepath.Join(base, "root")
	t.Setenv(EnvTaskID, "../../etc")
	w, err := newFileWriter(fileWriterConfig{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	r := testRecord(0)
	err = w.Write(&r)
	if !errors.Is(err, ErrPath) || !strings.Contains(err.Error(), "../../etc") {
		t.Fatalf("Write with MINDX_TASK_ID=../../etc: %v", err)
	}
	w.Close()
	ents, _ := os.ReadDir(base)
	if len(ents) != 0 {
		t.Fatalf("created %v", ents)
	}
	if s := w.Stats(); s.Dropped.Default != 1 || s.WriteErrors != 1 {
		t.Fatalf("stats %+v", s)
	}
}

func TestWriterRefusesPlantedSymlinks(t *testing.T) {
	for _, planted := range []string{"job", "rank"} {
		t.Run(planted, func(t *testing.T) {
			root, outside := t.TempDir(), t.TempDir()
			switch planted {
			case "job":
				os.Symlink(outside, filepath.Join(root, "j"))
			case "rank":
				os.Mkdir(filepath.Join(root, "j"), 0o750)
				os.Symlink(outside, filepath.Join(root, "j", "0"))
			}
			w, _ := newFileWriter(fileWriterConfig{Root: root, Job: "j"})
			r := testRecord(0)
			if err := w.Write(&r); !errors.Is(err, ErrPath) {
				t.Fatalf("Write through a planted symlink: %v", err)
			}
			w.Close()
			if ents, _ := os.ReadDir(outside); len(ents) != 0 {
				t.Fatalf("wrote outside the root: %v", ents)
			}
		})
	}
}

// mountTmpfs mounts a tmpfs of size bytes at a new folder for the test.
func mountTmpfs(t *testing.T, size int, flags uintptr) string {
	t.Helper()
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", flags, fmt.Sprintf("size=%d,mode=0755", size)); err != nil {
		t.Skipf("cannot mount a tmpfs (needs CAP_SYS_ADMIN): %v", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
	})
	return dir
}

func TestWriterDiskFull(t *testing.T) {
	root := mountTmpfs(t, 64<<10, 0)
	w, err := newFileWriter(fileWriterConfig{Root: root, Job: "j", BufferBytes: 4 << 10})
	if err != nil {
		t.Fatal(err)
	}
	var werr error
	for i := 0; i < 5000 && werr == nil; i++ {
		r := testRecord(i)
		werr = w.Write(&r)
	}
	if !errors.Is(werr, syscall.ENOSPC) {
		t.Fatalf("writing 1 MB into 64 KiB: %v, want ENOSPC", werr)
	}
	// Training goes on: further writes fail fast and are counted.
	start := time.Now()
	for i := range 2000 {
		r := testRecord(i)
		w.Write(&r)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("writes on a full disk took %v", d)
	}
	w.Close()
	s := w.Stats()
	if s.WriteErrors == 0 || s.Dropped.Default == 0 || !errors.Is(s.LastError, syscall.ENOSPC) {
		t.Fatalf("stats %+v", s)
	}
	// What reached the disk is whole lines only.
	recs, st := readAll(t, filepath.Join(root, "j", "0"))
	if st.GarbageLines != 0 || len(recs) == 0 {
		t.Fatalf("%d records, %d garbage lines (%v)", len(recs), st.GarbageLines, st.LastGarbage)
	}
	if uint64(len(recs)) != s.Written.Default {
		t.Errorf("read %d records, the writer counted %d written", len(recs), s.Written.Default)
	}
}

func TestWriterUnwritableRoot(t *testing.T) {
	t.Run("read-only", func(t *testing.T) {
		root := mountTmpfs(t, 64<<10, unix.MS_RDONLY)
		w, _ := newFileWriter(fileWriterConfig{Root: root, Job: "j"})
		r := testRecord(0)
		err := w.Write(&r)
		if !errors.Is(err, syscall.EROFS) || !strings.Contains(err.Error(), root) {
			t.Fatalf("Write on a read-only root: %v", err)
		}
		for range 100 { // within the backoff: no new attempt, just drops
			w.Write(&r)
		}
		w.Close()
		if s := w.Stats(); s.WriteErrors != 1 || s.Dropped.Default != 101 {
			t.Fatalf("stats %+v, want 1 error and 101 drops", s)
		}
	})
	t.Run("root is a file", func(t *testing.T) {
		root := filepath.Join(t.TempDir(), "file")
		os.WriteFile(root, nil, 0o640)
		w, _ := newFileWriter(fileWriterConfig{Root: root, Job: "j"})
		r := testRecord(0)
		if err := w.Write(&r); err == nil || !strings.Contains(err.Error(), root) {
			t.Fatalf("Write with a file as root: %v", err)
		}
		w.Close()
	})
}

// TestKilledWriterKeepsFlushedRecords SIGKILLs a process that writes
// records: every record it reported flushed is readable, and no line is
// damaged.
func TestKilledWriterKeepsFlushedRecords(t *testing.T) {
	root := t.TempDir()
	cmd := testkit.Command(t, "write-forever", "TRACE_ROOT="+root, "TRACE_RANK=5")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(out)
	flushed := 0
	for flushed < 3000 && sc.Scan() {
		flushed, _ = strconv.Atoi(sc.Text())
	}
	cmd.Process.Kill()
	cmd.Wait()
	if flushed < 3000 {
		t.Fatalf("child reported %d flushed records before dying", flushed)
	}
	recs, st := readAll(t, filepath.Join(root, "killed", "5"))
	if len(recs) < flushed {
		t.Fatalf("read %d records, the child had flushed %d", len(recs), flushed)
	}
	if st.GarbageLines != 0 {
		t.Fatalf("%d damaged lines: %v", st.GarbageLines, st.LastGarbage)
	}
	if st.Files < 2 {
		t.Errorf("read %d files, want rotation at 64 KiB", st.Files)
	}
}

// TestResolveJobOncePerLauncher starts several processes from this one
// (their launcher) at once: they agree on one job folder. A process with
// another parent gets its own; MINDX_TASK_ID wins over both.
func TestResolveJobOncePerLauncher(t *testing.T) {
	root := t.TempDir()
	t.Setenv(EnvTaskID, "")
	// output runs cmd; it may run on any goroutine, so it reports with
	// t.Errorf and leaves stopping to the caller.
	output := func(cmd *exec.Cmd) string {
		out, err := cmd.Output()
		if err != nil {
			t.Errorf("%v: %v", cmd, err)
		}
		return strings.TrimSpace(string(out))
	}
	run := func(cmd *exec.Cmd) string {
		t.Helper()
		out := output(cmd)
		if t.Failed() {
			t.FailNow()
		}
		return out
	}
	const n = 6
	jobs := make([]string, n)
	cmds := make([]*exec.Cmd, n)
	for i := range cmds {
		cmds[i] = testkit.Command(t, "resolve-job", "TRACE_ROOT="+root)
	}
	var wg sync.WaitGroup
	for i, cmd := range cmds {
		wg.Go(func() { jobs[i] = output(cmd) })
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	for _, j := range jobs {
		if j != jobs[0] || !strings.HasPrefix(j, DefaultJobPrefix) {
			t.Fatalf("jobs %v: want one default_task_id_ job", jobs)
		}
	}
	if again := run(testkit.Command(t, "resolve-job", "TRACE_ROOT="+root)); again != jobs[0] {
		t.Fatalf("a later process of the same launcher got %q, want %q", again, jobs[0])
	}
	// A process whose parent is a shell has another launcher.
	sh := testkit.Command(t, "resolve-job", "TRACE_ROOT="+root)
	sh.Args = []string{"sh", "-c", `"$0" -test.run='^$'; true`, sh.Path}
	sh.Path, _ = exec.LookPath("sh")
	if other := run(sh); other == jobs[0] || !strings.HasPrefix(other, DefaultJobPrefix) {
		t.Fatalf("another launcher got %q, want a job of its own (not %q)", other, jobs[0])
	}
	ents, _ := os.ReadDir(root)
	var dirs []string
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), ".") {
			dirs = append(dirs, e.Name())
			if fi, _ := e.Info(); fi.Mode().Perm() != 0o750 {
				t.Errorf("%s: mode %v", e.Name(), fi.Mode())
			}
		}
	}
	if len(dirs) != 2 {
		t.Fatalf("job folders %v, want 2", dirs)
	}
	if got := run(testkit.Command(t, "resolve-job", "TRACE_ROOT="+root, EnvTaskID+"=task-42")); got != "task-42" {
		t.Fatalf("with %s set: %q", EnvTaskID, got)
	}
}

func TestProcStartTime(t *testing.T) {
	got, err := procStartTime([]byte("123 (a (weird) name) S 1 123 123 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 100 10"))
	if err != nil || got != 98765 {
		t.Fatalf("procStartTime = %d, %v", got, err)
	}
	for _, bad := range []string{"", "1 (x) S 1", "no paren"} {
		if _, err := procStartTime([]byte(bad)); err == nil {
			t.Errorf("procStartTime(%q) succeeded", bad)
		}
	}
}

func TestRecordFileNames(t *testing.T) {
	if got := RecordFileName(time.Unix(5, 0)); got != "0000000005" {
		t.Fatalf("RecordFileName = %q", got)
	}
	names := []string{"1731000010", "999", "1731000002", "0000000005"}
	slices.SortFunc(names, recordNameCmp)
	if diff := cmp.Diff([]string{"0000000005", "999", "1731000002", "1731000010"}, names); diff != "" {
		t.Fatal(diff)
	}
	for name, ok := range map[string]bool{"1731000000": true, "0": true, "": false, "12a": false,
		"parallel_group.json": false, strings.Repeat("1", 21): false} {
		if IsRecordFileName(name) != ok {
			t.Errorf("IsRecordFileName(%q) = %v", name, !ok)
		}
	}
}

func TestListRanksAndJobs(t *testing.T) {
	root := t.TempDir()
	job := filepath.Join(root, "job")
	for _, d := range []string{"0", "2", "10", "007", "x"} {
		os.MkdirAll(filepath.Join(job, d), 0o750)
	}
	os.WriteFile(filepath.Join(job, "3"), nil, 0o640)
	os.Symlink(t.TempDir(), filepath.Join(job, "4"))
	os.MkdirAll(filepath.Join(root, ".faultline-jobs"), 0o750)
	ranks, err := ListRanks(job)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]int{0, 2, 10}, ranks); diff != "" {
		t.Errorf("ListRanks (-want +got):\n%s", diff)
	}
	jobs, err := ListJobs(root)
	if err != nil || !slices.Equal(jobs, []string{"job"}) {
		t.Errorf("ListJobs = %v, %v", jobs, err)
	}
}

// TestWriterAlignedFlush fills the buffer: the file grows by whole pages,
// which may end inside a line; readers wait for its rest, the counts
// follow whole lines, and Flush ends the file on a line.
func TestWriterAlignedFlush(t *testing.T) {
	root := t.TempDir()
	w, err := newFileWriter(fileWriterConfig{Root: root, Job: "j", BufferBytes: 4 << 10, Now: fixedNow(1731000000)})
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(root, "j", "0")
	file := filepath.Join(dir, "1731000000")
	rr := openReader(t, func() string { os.MkdirAll(dir, 0o750); return dir }(), ReaderConfig{})
	read := 0
	for i := range 200 {
		r := testRecord(i)
		if err := w.Write(&r); err != nil {
			t.Fatal(err)
		}
		read += len(readIDs(t, rr))
		fi, err := os.Stat(file)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Size()%pageSize != 0 {
			t.Fatalf("after record %d the file has %d bytes, not whole pages", i, fi.Size())
		}
		if s := w.Stats(); s.Written.Default != uint64(read) || s.Bytes != uint64(fi.Size()) {
			t.Fatalf("after record %d: stats %+v, reader saw %d records, file %d bytes", i, s, read, fi.Size())
		}
	}
	if read == 0 {
		t.Fatal("no page-aligned flush happened")
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	read += len(readIDs(t, rr))
	if read != 200 || rr.Stats().GarbageLines != 0 {
		t.Fatalf("read %d records after Flush (%+v)", read, rr.Stats())
	}
	if b, _ := os.ReadFile(file); b[len(b)-1] != '\n' {
		t.Fatal("file does not end with a line after Flush")
	}
	w.Close()
}
