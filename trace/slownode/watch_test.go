package slownode

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/faultline-ml/faultline/trace"
	"github.com/faultline-ml/faultline/trace/slownode/internal/gen"
)

// copyJob copies the rank folders of src into dst. Each rank's record
// bytes (its files in order) are split at frac: part 0 copies what comes
// before, cutting a line in two, and part 1 the rest.
func copyJob(t *testing.T, src, dst string, frac float64, part int) {
	t.Helper()
	ranks, err := trace.ListRanks(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range ranks {
		sdir := filepath.Join(src, strconv.Itoa(r))
		ddir := filepath.Join(dst, strconv.Itoa(r))
		if err := os.MkdirAll(ddir, 0o750); err != nil {
			t.Fatal(err)
		}
		ents, _ := os.ReadDir(sdir)
		var names []string
		total := 0
		for _, e := range ents {
			if trace.IsRecordFileName(e.Name()) {
				names = append(names, e.Name())
				fi, _ := e.Info()
				total += int(fi.Size())
			} else if part == 0 {
				b, _ := os.ReadFile(filepath.Join(sdir, e.Name()))
				os.WriteFile(filepath.Join(ddir, e.Name()), b, 0o640)
			}
		}
		slices.Sort(names)
		cut := int(float64(total) * frac)
		off := 0
		for _, n := range names {
			b, err := os.ReadFile(filepath.Join(sdir, n))
			if err != nil {
				t.Fatal(err)
			}
			lo, hi := off, off+len(b)
			off = hi
			a, z := max(lo, 0), min(hi, cut) // part 0
			if part == 1 {
				a, z = max(lo, cut), hi
			}
			if a >= z {
				continue
			}
			f, err := os.OpenFile(filepath.Join(ddir, n), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o640)
			if err != nil {
				t.Fatal(err)
			}
			f.Write(b[a-lo : z-lo])
			f.Close()
		}
	}
}

func TestWatchFollowsAGrowingJob(t *testing.T) {
	src, live := t.TempDir(), t.TempDir()
	if _, err := gen.Generate(gen.Config{Root: src, Job: "job", TP: 4, DP: 4, PP: 1, Steps: 70, Seed: 11,
		Inject: []gen.Injection{{Kind: gen.SlowRank, Rank: 6, From: 45, Factor: 1.5}}}); err != nil {
		t.Fatal(err)
	}
	src = filepath.Join(src, "job")
	live = filepath.Join(live, "job")
	copyJob(t, src, live, 0.5, 0)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	verdicts := make(chan *Result, 100)
	done := make(chan error, 1)
	go func() {
		done <- Watch(ctx, live, Config{PollInterval: 5 * time.Millisecond}, func(r *Result) { verdicts <- r })
	}()
	wait := func(what string, ok func(*Result) bool) *Result {
		t.Helper()
		timeout := time.After(60 * time.Second)
		for {
			select {
			case r := <-verdicts:
				if ok(r) {
					return r
				}
			case err := <-done:
				t.Fatalf("Watch returned %v while waiting for %s", err, what)
			case <-timeout:
				t.Fatalf("no verdict with %s", what)
			}
		}
	}
	first := wait("a first verdict", func(*Result) bool { return true })
	if first.IsSlow != 0 {
		t.Fatalf("first verdict slow: %+v", first.Findings)
	}
	copyJob(t, src, live, 0.5, 1)
	r := wait("rank 6 slow", func(r *Result) bool { return slices.Equal(r.SlowCalculateRanks, []int{6}) })
	if r.OnsetStep < 45 || r.OnsetStep > 46 {
		t.Errorf("onset %d, want 45", r.OnsetStep)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Watch: %v", err)
	}
}

func TestAnalyzeBadInput(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	if _, err := Analyze(ctx, filepath.Join(root, "nope"), Config{}); err == nil {
		t.Error("a missing folder analysed")
	}
	file := filepath.Join(root, "file")
	os.WriteFile(file, []byte("x"), 0o640)
	if _, err := Analyze(ctx, file, Config{}); err == nil {
		t.Error("a file analysed as a job folder")
	}
	empty := filepath.Join(root, "empty")
	os.Mkdir(empty, 0o750)
	if _, err := Analyze(ctx, empty, Config{}); !errors.Is(err, ErrNoRanks) {
		t.Errorf("empty job: %v, want ErrNoRanks", err)
	}
	if _, err := Analyze(ctx, root, Config{Window: -1}); err == nil {
		t.Error("a bad Config accepted")
	}

	// Empty rank folders, a garbage file, a bad parallel_group.json and a
	// symlinked rank: a verdict with no step, and no panic.
	job := filepath.Join(root, "job")
	for _, r := range []string{"0", "1", "2"} {
		os.MkdirAll(filepath.Join(job, r), 0o750)
	}
	os.WriteFile(filepath.Join(job, "1", "1700000000"), []byte("\x00\x01garbage\n{\"Kind\":\n"+strings.Repeat("z", 100)), 0o640)
	os.WriteFile(filepath.Join(job, "2", trace.ParallelGroupFile), []byte(`{"tp":{"group_rank":7,"global_ranks":[0]}}`), 0o640)
	os.Symlink(filepath.Join(job, "0"), filepath.Join(job, "3"))
	var logs bytes.Buffer
	r, err := Analyze(ctx, job, Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if r.IsSlow != 0 || r.LastStep != -1 || len(r.Ranks) != 3 || r.Input.GarbageLines != 2 {
		t.Errorf("isSlow %d lastStep %d ranks %d garbage %d", r.IsSlow, r.LastStep, len(r.Ranks), r.Input.GarbageLines)
	}
	for _, rk := range r.Ranks {
		if rk.Status != "waiting" {
			t.Errorf("rank %d: status %q, want waiting", rk.Rank, rk.Status)
		}
	}
	for _, want := range []string{"ignoring parallel groups", "skipped lines that are not records"} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("log lacks %q:\n%s", want, logs.String())
		}
	}
	var text bytes.Buffer
	if err := WriteText(&text, r); err != nil || !strings.Contains(text.String(), "no step evaluated yet") {
		t.Errorf("text: %v\n%s", err, text.String())
	}
}

func TestAnalyzeNodeFolders(t *testing.T) {
	src, root := t.TempDir(), t.TempDir()
	if _, err := gen.Generate(gen.Config{Root: src, Job: "job", TP: 4, DP: 4, PP: 1, Steps: 40, Seed: 12,
		Inject: []gen.Injection{{Kind: gen.SlowNode, Node: 1, From: 20, Factor: 1.5}}}); err != nil {
		t.Fatal(err)
	}
	// Gather the rank folders under one folder per host, as copied from
	// each host's local disk: <job>/<host>/<rank>.
	job := filepath.Join(root, "job")
	for r := range 16 {
		host := []string{"host-a", "host-b"}[r/8]
		os.MkdirAll(filepath.Join(job, host), 0o750)
		if err := os.Rename(filepath.Join(src, "job", strconv.Itoa(r)), filepath.Join(job, host, strconv.Itoa(r))); err != nil {
			t.Fatal(err)
		}
	}
	r, err := Analyze(context.Background(), job, Config{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(r.SlowHostNodes, []string{"host-b"}) {
		t.Errorf("slow hosts %v, want [host-b]", r.SlowHostNodes)
	}
	// A rank table names hosts for the flat layout.
	tbl := RankTable{}
	for rk := range 16 {
		tbl[rk] = []string{"10.0.0.1", "10.0.0.2"}[rk/8]
	}
	src2 := t.TempDir()
	gen.Generate(gen.Config{Root: src2, Job: "job", TP: 4, DP: 4, PP: 1, Steps: 40, Seed: 12,
		Inject: []gen.Injection{{Kind: gen.SlowNode, Node: 1, From: 20, Factor: 1.5}}})
	r, err = Analyze(context.Background(), filepath.Join(src2, "job"), Config{Nodes: tbl})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(r.SlowHostNodes, []string{"10.0.0.2"}) {
		t.Errorf("slow hosts %v, want [10.0.0.2]", r.SlowHostNodes)
	}
}

func TestAnalyzeMetricsAndSpans(t *testing.T) {
	src := t.TempDir()
	if _, err := gen.Generate(gen.Config{Root: src, Job: "job", TP: 4, DP: 2, PP: 1, Steps: 30, Seed: 13, Garbage: true}); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewPedanticRegistry()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())
	for range 2 { // the collectors unregister, so a second run registers again
		var lint []string
		_, err := Analyze(context.Background(), filepath.Join(src, "job"), Config{Registerer: &lintRegisterer{reg, &lint}, TracerProvider: tp})
		if err != nil {
			t.Fatal(err)
		}
		if len(lint) > 0 {
			t.Errorf("metric problems: %v", lint)
		}
	}
	if n := len(rec.Ended()); n != 2 || rec.Ended()[0].Name() != "slownode.Analyze" {
		t.Errorf("%d spans ended, want 2 slownode.Analyze", n)
	}
}

// TestRegistererCollision runs Analyze on the Registerer of a running
// Watch: the collision is Analyze's error, and once Watch has returned its
// metrics are gone and Analyze registers.
func TestRegistererCollision(t *testing.T) {
	src := t.TempDir()
	if _, err := gen.Generate(gen.Config{Root: src, Job: "job", TP: 4, DP: 1, PP: 1, Steps: 20, Seed: 14}); err != nil {
		t.Fatal(err)
	}
	job := filepath.Join(src, "job")
	reg := prometheus.NewPedanticRegistry()
	ctx, cancel := context.WithCancel(context.Background())
	watching := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		var once bool
		done <- Watch(ctx, job, Config{Registerer: reg, PollInterval: time.Hour}, func(*Result) {
			if !once {
				once = true
				close(watching)
			}
		})
	}()
	<-watching
	_, err := Analyze(context.Background(), job, Config{Registerer: reg})
	var are prometheus.AlreadyRegisteredError
	if !errors.As(err, &are) || !strings.HasPrefix(err.Error(), "slownode: Config.Registerer: register faultline_slownode_") {
		t.Errorf("Analyze beside a Watch on one Registerer: %v, want an AlreadyRegisteredError naming the field", err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if mfs, _ := reg.Gather(); len(mfs) != 0 {
		t.Errorf("%d metric families left after Watch returned", len(mfs))
	}
	if _, err := Analyze(context.Background(), job, Config{Registerer: reg}); err != nil {
		t.Errorf("Analyze after Watch returned: %v", err)
	}
}

// lintRegisterer registers on a pedantic registry and gathers from it
// at once, which checks the collector's descriptions against its metrics.
type lintRegisterer struct {
	reg  *prometheus.Registry
	lint *[]string
}

func (l *lintRegisterer) Register(c prometheus.Collector) error {
	if err := l.reg.Register(c); err != nil {
		return err
	}
	mfs, err := l.reg.Gather()
	if err != nil {
		*l.lint = append(*l.lint, err.Error())
	}
	if len(mfs) != 7 {
		*l.lint = append(*l.lint, "gathered "+strconv.Itoa(len(mfs))+" metric families, want 7")
	}
	for _, mf := range mfs {
		name := mf.GetName()
		counter := strings.HasSuffix(name, "_total")
		if !strings.HasPrefix(name, "faultline_slownode_") || counter != (mf.GetType().String() == "COUNTER") {
			*l.lint = append(*l.lint, name+": bad name for a "+mf.GetType().String())
		}
	}
	return nil
}

func (l *lintRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := l.Register(c); err != nil {
			panic(err)
		}
	}
}

func (l *lintRegisterer) Unregister(c prometheus.Collector) bool { return l.reg.Unregister(c) }

// cmpHistory compares Histories by their series.
var cmpHistory = cmp.Comparer(func(a, b *History) bool {
	if (a == nil) != (b == nil) {
		return false
	}
	if a == nil {
		return true
	}
	for s := range Series(numHist) {
		if !slices.Equal(a.Job(s), b.Job(s)) {
			return false
		}
		for rk := range a.ranks {
			if !slices.Equal(a.Rank(rk, s), b.Rank(rk, s)) {
				return false
			}
		}
	}
	return len(a.ranks) == len(b.ranks)
})

// TestAnalyzeReadAhead reads a job whose ranks hold a step of more ranges
// than a worker reads ahead at once, with garbage lines in between: every
// range reaches the detector once, and the verdict does not depend on how
// many workers read.
func TestAnalyzeReadAhead(t *testing.T) {
	job := filepath.Join(t.TempDir(), "job")
	const ranks, steps = 6, 40
	wantRanges := uint64(0)
	for rank := range ranks {
		var b []byte
		id := uint64(0)
		ts := uint64(1_700_000_000_000_000_000)
		rng := func(name, domain string, start, end uint64) {
			id++
			b = append((&trace.Record{Kind: 1, Flag: trace.FlagDeviceStart, SourceKind: 1, Timestamp: start, ID: id, Name: name, Domain: domain}).AppendJSON(b), '\n')
			b = append((&trace.Record{Kind: 1, Flag: trace.FlagDeviceEnd, SourceKind: 1, Timestamp: end, ID: id}).AppendJSON(b), '\n')
			wantRanges++
		}
		for s := range steps {
			fwd := 1
			if rank == 2 && s%10 == 3 {
				fwd = 2*maxQueued + 100 // several read-aheads' worth in one step
			}
			step := uint64(10e6)
			if rank == 4 && s >= steps/2 {
				step = 15e6
			}
			for k := range fwd {
				start := ts + uint64(k)*step/2/uint64(fwd)
				rng(trace.MarkerForward, trace.DomainDefault, start, start+step/2/uint64(fwd))
			}
			rng("step "+strconv.Itoa(s), trace.DomainDefault, ts, ts+step)
			if s%7 == 0 {
				b = append(b, "not a record\n"...)
			}
			ts += step + 1e6
		}
		dir := filepath.Join(job, strconv.Itoa(rank))
		if err := os.MkdirAll(dir, 0o750); err != nil {
			t.Fatal(err)
		}
		// Two files, the second starting mid-job.
		cut := bytes.Index(b[len(b)/2:], []byte{'\n'}) + len(b)/2 + 1
		os.WriteFile(filepath.Join(dir, "1700000000"), b[:cut], 0o640)
		os.WriteFile(filepath.Join(dir, "1700000100"), b[cut:], 0o640)
	}
	var results []*Result
	for _, readers := range []int{1, 2, 5} {
		r, err := Analyze(context.Background(), job, Config{Readers: readers})
		if err != nil {
			t.Fatal(err)
		}
		if got := r.Input.Detector.Ranges; got != wantRanges {
			t.Errorf("readers %d: %d ranges reached the detector, want %d", readers, got, wantRanges)
		}
		if got := r.Input.Detector.Steps; got != ranks*steps {
			t.Errorf("readers %d: %d steps, want %d", readers, got, ranks*steps)
		}
		if r.Input.GarbageLines != ranks*((steps+6)/7) {
			t.Errorf("readers %d: %d garbage lines, want %d", readers, r.Input.GarbageLines, ranks*((steps+6)/7))
		}
		results = append(results, r)
	}
	if !slices.Equal(results[0].SlowCalculateRanks, []int{4}) {
		t.Errorf("slow ranks %v, want [4]", results[0].SlowCalculateRanks)
	}
	for i, r := range results[1:] {
		if diff := cmp.Diff(results[0], r, cmpHistory); diff != "" {
			t.Errorf("result with %d readers differs (-1 reader +more):\n%s", []int{2, 5}[i], diff)
		}
	}
}

// liveRank replays one rank's generated records into a live folder the
// way a trace.Recorder writes them: in bursts, every few steps.
type liveRank struct {
	src, dst string
	starts   []int // offset in src of each step's first record, and len(src) last
	written  int   // bytes of src already in dst
	every    int   // flush every so many steps
	phase    int
}

// newLiveRank reads rank's single record file in src and starts its live
// copy in dst at step first: the steps before it, its dotting was off.
func newLiveRank(t *testing.T, srcDir, dstDir string, first, every, phase int) *liveRank {
	t.Helper()
	ents, err := os.ReadDir(srcDir)
	if err != nil {
		t.Fatal(err)
	}
	lr := &liveRank{every: every, phase: phase}
	if err := os.MkdirAll(dstDir, 0o750); err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(srcDir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if !trace.IsRecordFileName(e.Name()) {
			os.WriteFile(filepath.Join(dstDir, e.Name()), b, 0o640)
			continue
		}
		if lr.src != "" {
			t.Fatalf("%s: more than one record file", srcDir)
		}
		lr.src, lr.dst = string(b), filepath.Join(dstDir, e.Name())
	}
	for off := 0; off < len(lr.src); {
		line, _, _ := strings.Cut(lr.src[off:], "\n")
		if strings.Contains(line, `"Name":"`+trace.StepMarkerPrefix) {
			lr.starts = append(lr.starts, off)
		}
		off += len(line) + 1
	}
	lr.starts = append(lr.starts, len(lr.src))
	lr.written = lr.starts[first]
	return lr
}

// stepDone writes what the rank buffered once step k is done, when its
// flush is due or last is set.
func (lr *liveRank) stepDone(t *testing.T, k int, last bool) {
	if (k+lr.phase)%lr.every != 0 && !last {
		return
	}
	end := lr.starts[min(k+1, len(lr.starts)-1)]
	if end <= lr.written {
		return
	}
	f, err := os.OpenFile(lr.dst, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o640)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString(lr.src[lr.written:end]); err != nil {
		t.Fatal(err)
	}
	lr.written = end
}

// TestWatchDetectsWithinConsecutiveSteps follows generated jobs as they
// train, on synctest's clock: a rank slow to compute or to load data from
// a random step, files that grow in bursts every few steps, ranks whose
// dotting starts a step or two after the others', and polls a few steps
// apart. The first verdict that names the rank is the one of the step
// that convicted it: every one at most Consecutive+3 steps after the
// onset, nine in ten at most Consecutive (Consecutive-1 is the
// earliest); and it reaches the callback no later than the slowest
// rank's flush and the next poll after that step.
func TestWatchDetectsWithinConsecutiveSteps(t *testing.T) {
	const (
		jobs     = 40
		stepTime = 100 * time.Millisecond
	)
	rng := rand.New(rand.NewPCG(18, 3))
	var lats []int
	for i := range jobs {
		layouts := []struct{ tp, dp, pp int }{{2, 2, 1}, {4, 2, 1}, {2, 4, 1}, {2, 2, 2}, {4, 4, 1}}
		l := layouts[rng.IntN(len(layouts))]
		world := l.tp * l.dp * l.pp
		onset := DefaultNormalSteps + 5 + rng.IntN(40)
		in := gen.Injection{Kind: gen.SlowRank, Rank: rng.IntN(world), From: onset, Factor: 1.5 + 1.5*rng.Float64()}
		slow := "computes"
		if rng.IntN(2) == 0 {
			in.Kind, in.Factor, slow = gen.SlowIO, 3+7*rng.Float64(), "loads data"
		}
		steps := onset + 3*DefaultConsecutive + 10
		src, live := t.TempDir(), filepath.Join(t.TempDir(), "job")
		if _, err := gen.Generate(gen.Config{Root: src, Job: "job", TP: l.tp, DP: l.dp, PP: l.pp, Steps: steps,
			Seed: uint64(i), StepsPerFile: steps + 1, Inject: []gen.Injection{in}}); err != nil {
			t.Fatal(err)
		}
		poll := 1 + rng.IntN(5)
		ranks := make([]*liveRank, world)
		slowest := 0
		for r := range ranks {
			first := 0
			if rng.IntN(4) == 0 {
				first = 1 + rng.IntN(2)
			}
			every := 1 + rng.IntN(6)
			slowest = max(slowest, every)
			ranks[r] = newLiveRank(t, filepath.Join(src, "job", strconv.Itoa(r)), filepath.Join(live, strconv.Itoa(r)), first, every, rng.IntN(every))
		}
		names := func(r *Result) bool {
			if in.Kind == gen.SlowIO {
				return slices.Contains(r.SlowIORanks, in.Rank)
			}
			return slices.Contains(r.SlowCalculateRanks, in.Rank)
		}
		var (
			seen    *Result
			seenJob int64 // the step the job had done when seen came
		)
		synctest.Test(t, func(t *testing.T) {
			ctx, cancel := context.WithCancel(t.Context())
			var jobStep atomic.Int64
			jobStep.Store(-1)
			done := make(chan error, 1)
			go func() {
				done <- Watch(ctx, live, Config{PollInterval: time.Duration(poll) * stepTime}, func(r *Result) {
					if seen == nil && names(r) {
						seen, seenJob = r, jobStep.Load()
					}
				})
			}()
			// Polls fall on whole steps, files grow half way between.
			time.Sleep(stepTime / 2)
			for k := range steps {
				for _, lr := range ranks {
					lr.stepDone(t, k, k == steps-1)
				}
				jobStep.Store(int64(k))
				time.Sleep(stepTime)
			}
			time.Sleep(time.Duration(poll) * stepTime)
			cancel()
			if err := <-done; err != nil {
				t.Errorf("Watch: %v", err)
			}
		})
		what := fmt.Sprintf("job %d (tp%d dp%d pp%d, rank %d %s %.1fx slower from step %d, flushes every %d steps at most, polls every %d)",
			i, l.tp, l.dp, l.pp, in.Rank, slow, in.Factor, onset, slowest, poll)
		if seen == nil {
			t.Errorf("%s: never named the rank", what)
			continue
		}
		var detected int64 = -1
		for _, f := range seen.Findings {
			if slices.Contains(f.Ranks, in.Rank) && f.Kind != KindHost {
				detected = f.DetectedStep
			}
		}
		lat := int(seen.LastStep) - onset
		lats = append(lats, lat)
		if lat < 0 || lat > DefaultConsecutive+3 || detected != seen.LastStep {
			t.Errorf("%s: named in the verdict of step %d, %d steps after the onset, convicted at step %d", what, seen.LastStep, lat, detected)
		}
		// The rows wait for the slowest rank's flush; the callback, for the
		// poll after it.
		if lag := seenJob - seen.LastStep; lag > int64(slowest+poll) {
			t.Errorf("%s: the verdict of step %d came when the job had done step %d", what, seen.LastStep, seenJob)
		}
	}
	if len(lats) == 0 {
		return
	}
	slices.Sort(lats)
	hist := map[int]int{}
	for _, l := range lats {
		hist[l]++
	}
	p90 := lats[len(lats)*9/10]
	t.Logf("steps from the onset to the verdict naming the rank, over %d jobs: %v (median %d, 90th percentile %d)", len(lats), hist, lats[len(lats)/2], p90)
	if p90 > DefaultConsecutive {
		t.Errorf("90th percentile %d steps after the onset, want at most Consecutive (%d)", p90, DefaultConsecutive)
	}
}

// TestWatchPassesOnEveryPhaseChange follows a job whose step time moves
// 40 times between two levels, every rank alike: each phase change is a
// verdict of its own, passed on as of the step that recognised it, the
// 33rd and later too, though a Result lists only the latest 32.
func TestWatchPassesOnEveryPhaseChange(t *testing.T) {
	const phases, every = 40, 12
	var in []gen.Injection
	for k := range phases {
		f := 2.0
		if k%2 == 1 {
			f = 0.5 // back to the first level
		}
		in = append(in, gen.Injection{Kind: gen.Phase, From: 2*DefaultNormalSteps + k*every, Factor: f})
	}
	src := t.TempDir()
	steps := 2*DefaultNormalSteps + phases*every + every
	if _, err := gen.Generate(gen.Config{Root: src, Job: "job", TP: 2, DP: 2, PP: 1, Steps: steps, Seed: 5, Inject: in}); err != nil {
		t.Fatal(err)
	}
	var got []PhaseChange // the newest phase change of each verdict that brought one
	last := int64(-1)
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() {
			done <- Watch(ctx, filepath.Join(src, "job"), Config{}, func(r *Result) {
				if n := len(r.PhaseChanges); n > 0 && r.PhaseChanges[n-1].Detected != last {
					p := r.PhaseChanges[n-1]
					last = p.Detected
					got = append(got, p)
					if p.Detected != r.LastStep {
						t.Errorf("phase change of step %d recognised at step %d passed on in the verdict of step %d", p.Step, p.Detected, r.LastStep)
					}
				}
			})
		}()
		time.Sleep(DefaultPollInterval / 2) // the first pass reads the whole job
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Watch: %v", err)
		}
	})
	if len(got) != phases {
		var at []int64
		for _, p := range got {
			at = append(at, p.Detected)
		}
		t.Fatalf("%d phase changes passed on, want %d: those recognised at steps %v", len(got), phases, at)
	}
	for k, p := range got {
		if want := int64(2*DefaultNormalSteps + k*every); p.Step != want {
			t.Errorf("phase change %d from step %d, want %d", k, p.Step, want)
		}
	}
}
