package trace

import (
	"context"
	"fmt"
	"io/fs"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// snapshot lists every path under dir with its size, or its link target.
func snapshot(t *testing.T, dir string) map[string]string {
	t.Helper()
	m := map[string]string{}
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			t.Fatal(err)
		}
		rel, _ := filepath.Rel(dir, p)
		switch {
		case d.Type()&fs.ModeSymlink != 0:
			target, _ := os.Readlink(p)
			m[rel] = "-> " + target
		case d.IsDir():
			m[rel] = "dir"
		default:
			fi, _ := d.Info()
			m[rel] = fmt.Sprint(fi.Size())
		}
		return nil
	})
	return m
}

var past = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// makeRecordFile writes a record file of size bytes with mtime past+age.
func makeRecordFile(t *testing.T, dir, name string, size int, age time.Duration) {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, make([]byte, size), 0o640); err != nil {
		t.Fatal(err)
	}
	os.Chtimes(p, past.Add(age), past.Add(age))
}

func TestAgerDeletesOnlyOldRecordFiles(t *testing.T) {
	base := t.TempDir()
	root, outside := filepath.Join(base, "root"), filepath.Join(base, "outside")
	r0 := filepath.Join(root, "jobA", "0")
	r1 := filepath.Join(root, "jobA", "1")
	for _, d := range []string{r0, r1, filepath.Join(root, "jobA", "x"), filepath.Join(root, ".faultline-jobs"), outside, filepath.Join(outside, "rank")} {
		os.MkdirAll(d, 0o750)
	}
	// Rank 0: ten files, names in the opposite order of their age.
	for i := range 10 {
		makeRecordFile(t, r0, fmt.Sprint(1731000000+i), 1000, time.Duration(10-i)*time.Minute)
	}
	makeRecordFile(t, r1, "1731000000", 1000, 0)
	makeRecordFile(t, r1, "1731000001", 1000, time.Minute)
	makeRecordFile(t, r1, "1731000002", 1000, 2*time.Minute)
	// Foreign things that must survive, however old.
	makeRecordFile(t, r0, ParallelGroupFile, 5000, -time.Hour)
	makeRecordFile(t, r0, "notes.txt", 5000, -time.Hour)
	os.Mkdir(filepath.Join(r0, "1700000000"), 0o750)
	makeRecordFile(t, filepath.Join(root, "jobA", "x"), "1700000000", 5000, -time.Hour)
	makeRecordFile(t, root, "foreign", 5000, -time.Hour)
	makeRecordFile(t, filepath.Join(root, ".faultline-jobs"), "claim", 10, -time.Hour)
	// Planted symlinks: a digit-named file link, a rank folder and a job
	// folder pointing outside the root, all at old files.
	makeRecordFile(t, outside, "1600000000", 7000, -time.Hour)
	for i := range 6 {
		makeRecordFile(t, filepath.Join(outside, "rank"), fmt.Sprint(1600000000+i), 7000, -time.Hour)
	}
	os.Symlink(filepath.Join(outside, "1600000000"), filepath.Join(r0, "1600000000"))
	os.Symlink(filepath.Join(outside, "rank"), filepath.Join(root, "jobA", "2"))
	os.Symlink(outside, filepath.Join(root, "jobB"))
	outsideBefore := snapshot(t, outside)

	reg := prometheus.NewPedanticRegistry()
	a, err := NewAger(AgerConfig{Root: root, BudgetBytes: 12000, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	rep, err := a.Check()
	if err != nil {
		t.Fatal(err)
	}
	// 13000 bytes of record files: rank 0 loses its 2 oldest, rank 1 keeps 3.
	if rep.DeletedFiles != 2 || rep.DeletedBytes != 2000 || rep.Bytes != 11000 || rep.Files != 11 || !rep.Full {
		t.Fatalf("report %+v", rep)
	}
	for _, gone := range []string{"1731000009", "1731000008"} { // the oldest by mtime
		if _, err := os.Lstat(filepath.Join(r0, gone)); !os.IsNotExist(err) {
			t.Errorf("%s survived: %v", gone, err)
		}
	}

	// Down to the minimum.
	a2, _ := NewAger(AgerConfig{Root: root, BudgetBytes: 1})
	rep, err = a2.Check()
	if err != nil {
		t.Fatal(err)
	}
	if rep.Files != 6 || rep.Bytes != 6000 {
		t.Fatalf("report %+v, want 3 files kept per rank", rep)
	}
	ents, _ := os.ReadDir(r0)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	want := []string{"1600000000", "1700000000", "1731000000", "1731000001", "1731000002", "notes.txt", ParallelGroupFile}
	if diff := cmp.Diff(want, names); diff != "" {
		t.Errorf("rank 0 left (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(outsideBefore, snapshot(t, outside)); diff != "" {
		t.Fatalf("outside the root changed (-before +after):\n%s", diff)
	}
	for _, p := range []string{"foreign", ".faultline-jobs/claim", "jobA/x/1700000000", "jobA/1/1731000000"} {
		if _, err := os.Lstat(filepath.Join(root, p)); err != nil {
			t.Errorf("%s: %v", p, err)
		}
	}
	got := gatherLines(t, reg, "faultline_trace_aged_files_total", "faultline_trace_aged_bytes_total", "faultline_trace_root_bytes")
	wantMetrics := []string{
		"faultline_trace_aged_bytes_total 2000",
		"faultline_trace_aged_files_total 2",
		"faultline_trace_root_bytes 11000",
	}
	if diff := cmp.Diff(wantMetrics, got); diff != "" {
		t.Errorf("metrics (-want +got):\n%s", diff)
	}
}

// TestAgerLightCheck shows the accounting between full scans: only
// folders whose mtime moved are listed, and only each rank's newest file
// is stat'ed; growth and new files are still seen.
func TestAgerLightCheck(t *testing.T) {
	root := t.TempDir()
	var rankDirs []string
	for j := range 2 {
		for r := range 4 {
			d := filepath.Join(root, fmt.Sprintf("job%d", j), fmt.Sprint(r))
			os.MkdirAll(d, 0o750)
			for i := range 5 {
				makeRecordFile(t, d, fmt.Sprint(1731000000+i), 100, time.Duration(i)*time.Minute)
			}
			rankDirs = append(rankDirs, d)
		}
	}
	agePast := func(paths ...string) {
		for _, p := range paths {
			os.Chtimes(p, past, past)
		}
	}
	agePast(root, filepath.Join(root, "job0"), filepath.Join(root, "job1"))
	agePast(rankDirs...)

	a, err := NewAger(AgerConfig{Root: root, BudgetBytes: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	rep, _ := a.Check()
	full := a.Stats()
	if !rep.Full || rep.Files != 40 || rep.Bytes != 4000 || full.DirListings != 11 {
		t.Fatalf("first check %+v, stats %+v", rep, full)
	}

	// Nothing changed: no folder listed, one stat per rank.
	rep, _ = a.Check()
	s := a.Stats()
	if rep.Full || s.DirListings != full.DirListings || s.FileStats-full.FileStats != 8 || rep.Bytes != 4000 {
		t.Fatalf("idle check %+v: %d listings, %d stats", rep, s.DirListings-full.DirListings, s.FileStats-full.FileStats)
	}

	// The writer of rank 3 appends to its newest file and starts another;
	// the writer of rank 0 only appends.
	f, _ := os.OpenFile(filepath.Join(rankDirs[0], "1731000004"), os.O_APPEND|os.O_WRONLY, 0)
	f.Write(make([]byte, 50))
	f.Close()
	makeRecordFile(t, rankDirs[3], "1731000005", 70, time.Hour)
	agePast(rankDirs[3])
	os.Chtimes(rankDirs[3], past.Add(time.Second), past.Add(time.Second))
	before := a.Stats()
	rep, _ = a.Check()
	s = a.Stats()
	if rep.Files != 41 || rep.Bytes != 4120 {
		t.Fatalf("after growth: %+v", rep)
	}
	if n := s.DirListings - before.DirListings; n != 1 {
		t.Fatalf("listed %d folders, want only rank 3's", n)
	}
	if n := s.FileStats - before.FileStats; n != 7+6 {
		t.Fatalf("stat'ed %d files, want 7 newest + 6 in the relisted folder", n)
	}

	// A full scan after FullScanInterval.
	a.lastFull = time.Now().Add(-2 * DefaultFullScanInterval)
	if rep, _ := a.Check(); !rep.Full || rep.Bytes != 4120 {
		t.Fatalf("full rescan %+v", rep)
	}
}

func TestAgerMissingRootAndRun(t *testing.T) {
	root := filepath.Join(t.TempDir(), "not-yet")
	a, err := NewAger(AgerConfig{Root: root, Interval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if rep, err := a.Check(); err != nil || rep.Files != 0 {
		t.Fatalf("Check of a missing root: %+v, %v", rep, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error)
	go func() { done <- a.Run(ctx) }()
	os.MkdirAll(filepath.Join(root, "j", "0"), 0o750)
	os.WriteFile(filepath.Join(root, "j", "0", "1731000000"), make([]byte, 123), 0o640)
	testkit.WaitFor(t, "the ager to see the new file", func() bool { return a.Stats().Bytes == 123 })
	a.Close()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	a.Close()
}

func TestAgerConfigValidate(t *testing.T) {
	for _, c := range []AgerConfig{
		{BudgetBytes: -1}, {Interval: -1}, {FullScanInterval: -1},
		{DeleteFraction: 1.5}, {DeleteFraction: -0.1}, {DeleteFraction: math.NaN()}, {KeepPerRank: -1},
	} {
		if _, err := NewAger(c); err == nil || !strings.Contains(err.Error(), "AgerConfig.") {
			t.Errorf("NewAger(%+v) = %v", c, err)
		}
	}
}

// TestPlanAgingProperty checks the deletion plan on random folders: per
// rank, exactly min(ceil(frac*n), n-keep) files go, never below keep, and
// every file that goes is no newer than every file that stays.
func TestPlanAgingProperty(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for trial := range 500 {
		var ranks []openRank
		for range 1 + rng.IntN(5) {
			idx := &rankIndex{}
			for i := range rng.IntN(30) {
				idx.files = append(idx.files, fileEntry{name: fmt.Sprint(1731000000 + i), mtime: rng.Int64N(20)})
			}
			ranks = append(ranks, openRank{idx: idx})
		}
		frac, keep := rng.Float64(), rng.IntN(5)
		plan := planAging(ranks, frac, keep)
		del := map[[2]int]bool{}
		for _, d := range plan {
			if del[[2]int{d.rank, d.file}] {
				t.Fatalf("trial %d: %v planned twice", trial, d)
			}
			del[[2]int{d.rank, d.file}] = true
		}
		for ri, r := range ranks {
			n := len(r.idx.files)
			want := max(0, min(int(math.Ceil(frac*float64(n))), n-keep))
			var gone, kept []int64
			for fi, f := range r.idx.files {
				if del[[2]int{ri, fi}] {
					gone = append(gone, f.mtime)
				} else {
					kept = append(kept, f.mtime)
				}
			}
			if len(gone) != want {
				t.Fatalf("trial %d rank %d: %d of %d planned, want %d (frac %.2f keep %d)", trial, ri, len(gone), n, want, frac, keep)
			}
			if len(gone) > 0 && len(kept) > 0 && slices.Max(gone) > slices.Min(kept) {
				t.Fatalf("trial %d rank %d: deletes mtime %d but keeps %d", trial, ri, slices.Max(gone), slices.Min(kept))
			}
		}
	}
}
