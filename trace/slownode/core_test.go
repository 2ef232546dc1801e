package slownode

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"math"
	"math/rand/v2"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/faultline-ml/faultline/trace"
)

// syncJob models a synchronous job in step figures: every rank computes,
// then waits in its tensor-parallel all-reduce for the slowest member, so
// step time is the same on every rank and the slow rank waits least.
type syncJob struct {
	ranks, tp int
	compute   time.Duration
	noise     float64
	rng       *rand.Rand
	slow      map[int]float64 // rank → compute factor
	io        map[int]float64 // rank → dataloader factor
	all       float64         // job-wide compute factor (a phase)
}

func newSyncJob(ranks, tp int, seed uint64) *syncJob {
	return &syncJob{ranks: ranks, tp: tp, compute: 100 * time.Millisecond, noise: 0.02,
		rng: rand.New(rand.NewPCG(seed, 1)), slow: map[int]float64{}, io: map[int]float64{}, all: 1}
}

func (j *syncJob) groups() trace.ParallelGroups {
	g := trace.ParallelGroups{}
	for k := 0; k < j.ranks/j.tp; k++ {
		var m []int
		for i := range j.tp {
			m = append(m, k*j.tp+i)
		}
		g[fmt.Sprintf("tp-%d", k)] = trace.ParallelGroup{GroupName: "tp", GlobalRanks: m}
	}
	return g
}

// steps returns every rank's Step n.
func (j *syncJob) steps(n int64) []Step {
	out := make([]Step, j.ranks)
	comp := make([]time.Duration, j.ranks)
	dl := make([]time.Duration, j.ranks)
	for r := range j.ranks {
		f := j.all * (1 + j.rng.NormFloat64()*j.noise)
		if s, ok := j.slow[r]; ok {
			f *= s
		}
		comp[r] = time.Duration(float64(j.compute) * f)
		dl[r] = 5 * time.Millisecond
		if s, ok := j.io[r]; ok {
			dl[r] = time.Duration(float64(dl[r]) * s)
		}
	}
	for k := 0; k < j.ranks/j.tp; k++ {
		var arrive time.Duration
		for r := k * j.tp; r < (k+1)*j.tp; r++ {
			arrive = max(arrive, dl[r]+comp[r])
		}
		for r := k * j.tp; r < (k+1)*j.tp; r++ {
			wait := arrive - dl[r] - comp[r] + 10*time.Millisecond
			out[r] = Step{Number: n, Time: arrive + 10*time.Millisecond, Compute: comp[r], DataLoader: dl[r],
				Forward: comp[r] / 3, Comm: []CommTime{{Group: fmt.Sprintf("tp-%d", k), Op: "HcclAllReduce", Time: wait, Count: 1}},
				Have: FigStep | FigForward | FigDataLoader | FigComm}
		}
	}
	return out
}

func newTestDetector(t *testing.T, j *syncJob, cfg Config) *Detector {
	t.Helper()
	d, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	d.AddGroups(j.groups())
	return d
}

func (j *syncJob) run(d *Detector, from, to int64) {
	for n := from; n < to; n++ {
		for r, st := range j.steps(n) {
			d.AddStep(r, st)
		}
	}
}

func TestSlowRankFoundWithinThreeSteps(t *testing.T) {
	for seed := uint64(1); seed <= 20; seed++ {
		j := newSyncJob(16, 4, seed)
		d := newTestDetector(t, j, Config{})
		onset := int64(20 + seed)
		j.run(d, 0, onset)
		if r := d.Result(); r.IsSlow != 0 {
			t.Fatalf("seed %d: slow before the injection: %+v", seed, r.Findings)
		}
		slow := int(seed % 16)
		j.slow[slow] = 1.3
		var found int64 = -1
		for n := onset; n < onset+10 && found < 0; n++ {
			j.run(d, n, n+1)
			if r := d.Result(); slices.Contains(r.SlowCalculateRanks, slow) {
				found = n
				if r.OnsetStep != onset {
					t.Errorf("seed %d: onset %d, want %d", seed, r.OnsetStep, onset)
				}
				if !slices.Equal(r.SlowCalculateRanks, []int{slow}) {
					t.Errorf("seed %d: slow ranks %v, want [%d]", seed, r.SlowCalculateRanks, slow)
				}
			}
		}
		if found < 0 || found-onset > 3 {
			t.Errorf("seed %d: slow rank %d reported at step %d, onset %d", seed, slow, found, onset)
		}
	}
}

func TestOneOutlierStepIsNotASlowNode(t *testing.T) {
	j := newSyncJob(16, 4, 1)
	d := newTestDetector(t, j, Config{})
	j.run(d, 0, 30)
	for _, bad := range []int64{30, 32, 34} { // isolated spikes, never three in a row
		j.slow[3] = 3
		j.run(d, bad, bad+1)
		delete(j.slow, 3)
		j.run(d, bad+1, bad+2)
	}
	j.run(d, 36, 50)
	if r := d.Result(); r.IsSlow != 0 {
		t.Fatalf("isolated spikes made a slow node: %+v", r.Findings)
	}
}

// contendedJob models a 4-rank data-parallel job whose ranks share two
// cores with each other and with whatever else runs, as the PyTorch job of
// TestRealDDPJob does: a rank loses whole 4 ms time slices at random in
// its compute and its data loading, two ranks at times lose them together
// for a few steps, and every rank waits in the gradient all-reduce for the
// last.
type contendedJob struct {
	rng       *rand.Rand
	slow      map[int]float64       // rank → compute factor
	io        map[int]time.Duration // rank → added dataloader time
	pairUntil int64                 // ranks 0 and 1 lose slices together until this step
}

func (j *contendedJob) steps(n int64) []Step {
	const ranks = 4
	slice := 4 * time.Millisecond
	lost := func(p float64) time.Duration {
		k := 0
		for range 3 {
			if j.rng.Float64() < p {
				k++
			}
		}
		return time.Duration(k) * slice
	}
	if n >= j.pairUntil && j.rng.IntN(15) == 0 {
		j.pairUntil = n + 4
	}
	comp := make([]time.Duration, ranks)
	dl := make([]time.Duration, ranks)
	var arrive time.Duration
	for r := range ranks {
		comp[r] = 6*time.Millisecond + lost(0.25)
		if n < j.pairUntil && r < 2 {
			comp[r] += 2 * slice
		}
		if f, ok := j.slow[r]; ok {
			comp[r] = time.Duration(float64(comp[r]) * f)
		}
		dl[r] = 2300*time.Microsecond + lost(0.12) + j.io[r]
		arrive = max(arrive, dl[r]+comp[r])
	}
	out := make([]Step, ranks)
	for r := range ranks {
		wait := arrive - dl[r] - comp[r] + 2*time.Millisecond
		out[r] = Step{Number: n, Time: arrive + 2*time.Millisecond, Compute: comp[r], DataLoader: dl[r], Forward: comp[r] / 3,
			Comm: []CommTime{{Group: "dp", Op: "allreduce", Time: wait, Count: 1}}, Have: FigStep | FigForward | FigDataLoader | FigComm}
	}
	return out
}

// TestContendedRanksAreNotSlow feeds the contended job healthy, and then
// with a rank computing 2.5 times as long and another loading 10 ms more
// from step 100: the healthy noise (a rank two slices behind its peers for
// a step, two ranks behind for four) makes no finding, and the slowdowns
// are named.
func TestContendedRanksAreNotSlow(t *testing.T) {
	groups := trace.ParallelGroups{"dp": {GroupName: "dp", GlobalRanks: []int{0, 1, 2, 3}}}
	for seed := uint64(1); seed <= 10; seed++ {
		for _, slow := range []bool{false, true} {
			j := &contendedJob{rng: rand.New(rand.NewPCG(seed, 3)), slow: map[int]float64{}, io: map[int]time.Duration{}}
			d, err := New(Config{})
			if err != nil {
				t.Fatal(err)
			}
			d.AddGroups(groups)
			for n := int64(0); n < 200; n++ {
				if slow && n == 100 {
					j.slow[2], j.io[3] = 2.5, 10*time.Millisecond
				}
				for r, st := range j.steps(n) {
					d.AddStep(r, st)
				}
			}
			r := d.Result()
			want := [2][]int{{}, {}}
			if slow {
				want = [2][]int{{2}, {3}}
			}
			if !slices.Equal(r.SlowCalculateRanks, want[0]) || !slices.Equal(r.SlowIORanks, want[1]) {
				t.Errorf("seed %d, slow %v: compute %v io %v, want %v %v; findings %+v", seed, slow,
					r.SlowCalculateRanks, r.SlowIORanks, want[0], want[1], r.Findings)
			}
		}
	}
}

func TestRecoveryClearsFinding(t *testing.T) {
	j := newSyncJob(16, 4, 2)
	d := newTestDetector(t, j, Config{})
	j.run(d, 0, 30)
	j.slow[5] = 1.5
	j.run(d, 30, 40)
	if r := d.Result(); !slices.Equal(r.SlowCalculateRanks, []int{5}) {
		t.Fatalf("slow ranks %v, want [5]", r.SlowCalculateRanks)
	}
	delete(j.slow, 5)
	j.run(d, 40, 42)
	if r := d.Result(); r.IsSlow != 1 {
		t.Fatal("cleared after two normal steps; want three")
	}
	j.run(d, 42, 45)
	if r := d.Result(); r.IsSlow != 0 {
		t.Fatalf("still slow after recovery: %+v", r.Findings)
	}
}

// TestFindingClearsOnlyWhenBackWithinHalfTheMargins finds rank 3
// computing 20% more than its 7 peers; then it computes 12% more, under
// RelativeThreshold (15%) but above half of it, three steps in four, as
// a rank 20% slow does on the steps its noise dips: it stays found.
// Recovered partway, 10% above its peers and never flagged, it clears
// within Window steps; and after a relapse, back to its peers' time, it
// clears after Consecutive steps.
func TestFindingClearsOnlyWhenBackWithinHalfTheMargins(t *testing.T) {
	d, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	step := func(n int64, slow float64) {
		for r := range 8 {
			c := 100 * (1 + 0.01*float64(r%3-1))
			if r == 3 {
				c *= slow
			}
			d.AddStep(r, Step{Number: n, Time: 130 * time.Millisecond, Compute: time.Duration(c * float64(time.Millisecond)), Have: FigStep | FigCompute})
		}
	}
	found := func() bool { return slices.Equal(d.Result().SlowCalculateRanks, []int{3}) }
	for n := range int64(30) {
		step(n, 1)
	}
	for n := int64(30); n < 36; n++ {
		step(n, 1.2)
	}
	if !found() {
		t.Fatalf("20%% slower: slow ranks %v, want [3]", d.Result().SlowCalculateRanks)
	}
	for n := int64(36); n < 60; n++ {
		step(n, []float64{1.12, 1.12, 1.12, 1.2}[n%4])
		if !found() {
			t.Fatalf("12%% slower but each fourth step, step %d: slow ranks %v, want [3]", n, d.Result().SlowCalculateRanks)
		}
	}
	n := int64(60)
	for ; found(); n++ {
		if n == 60+DefaultWindow {
			t.Fatalf("10%% slower since step 60: still found at step %d: %+v", n, d.Result().Findings)
		}
		step(n, 1.1)
	}
	for m := n + 6; n < m; n++ {
		step(n, 1.2)
	}
	if !found() {
		t.Fatalf("20%% slower again: slow ranks %v, want [3]", d.Result().SlowCalculateRanks)
	}
	for m := n + 2; n < m; n++ {
		step(n, 1)
	}
	if r := d.Result(); r.IsSlow != 1 {
		t.Fatal("cleared after two normal steps; want three")
	}
	step(n, 1)
	if r := d.Result(); r.IsSlow != 0 {
		t.Fatalf("back to its peers' time: still slow: %+v", r.Findings)
	}
}

// noisyJob is a 4-rank job whose compute jumps from step to step, every
// rank alike, as that of ranks sharing their cores with other work does:
// the job goes round pattern, and its ranks differ by a few percent. It
// records no communication (its switch off), so that the peer test alone
// judges the ranks.
type noisyJob struct {
	d       *Detector
	pattern []float64
}

func newNoisyJob(t *testing.T) *noisyJob {
	d, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	return &noisyJob{d: d, pattern: []float64{1, 1.8}}
}

// step adds step n: rank r computes factor(r) times the pattern's 10 ms.
func (j *noisyJob) step(n int64, factor func(r int) float64) {
	for r := range 4 {
		f := j.pattern[int(n)%len(j.pattern)] * (1 + 0.03*float64(r%3-1)) * factor(r)
		j.d.AddStep(r, Step{Number: n, Time: 60 * time.Millisecond, Compute: time.Duration(f * float64(10*time.Millisecond)),
			DataLoader: 2 * time.Millisecond, Have: FigStep | FigDataLoader})
	}
}

// slowRank returns the factors of a job whose rank is f times slower.
func slowRank(rank int, f float64) func(int) float64 {
	return func(r int) float64 {
		if r == rank {
			return f
		}
		return 1
	}
}

// TestNoiseDoesNotClearASlowRank finds a rank four times as slow as its
// peers, in a job whose compute jumps by most of its median from step to
// step; then the rank stays twice as slow, which no step can tell from
// that noise (less than NSigma of it above its peers) but none shows as
// normal either: it stays found until it computes as its peers do.
func TestNoiseDoesNotClearASlowRank(t *testing.T) {
	j := newNoisyJob(t)
	for n := range int64(30) {
		j.step(n, slowRank(1, 1))
	}
	for n := int64(30); n < 33; n++ {
		j.step(n, slowRank(1, 4))
	}
	if r := j.d.Result(); !slices.Equal(r.SlowCalculateRanks, []int{1}) {
		t.Fatalf("four times as slow: slow ranks %v, want [1]", r.SlowCalculateRanks)
	}
	for n := int64(33); n < 60; n++ {
		j.step(n, slowRank(1, 2))
		if r := j.d.Result(); !slices.Equal(r.SlowCalculateRanks, []int{1}) {
			t.Fatalf("twice as slow, step %d: slow ranks %v, want [1]", n, r.SlowCalculateRanks)
		}
	}
	for n := int64(60); n < 72; n++ {
		j.step(n, slowRank(1, 1))
	}
	if r := j.d.Result(); r.IsSlow != 0 {
		t.Fatalf("recovered: still slow: %+v", r.Findings)
	}
}

// TestFindingClearsWithoutHealthyPeers finds a rank six times as slow for
// three steps (a rank its machine starved); then the job's ranks split in
// two pairs, one twice the other, every step: with no three alike there
// are no healthy peers to compare with, but the rank, in the faster pair
// every other step, is no slower than most, and its finding clears.
func TestFindingClearsWithoutHealthyPeers(t *testing.T) {
	j := newNoisyJob(t)
	for n := range int64(30) {
		j.step(n, slowRank(2, 1))
	}
	for n := int64(30); n < 33; n++ {
		j.step(n, slowRank(2, 6))
	}
	if r := j.d.Result(); !slices.Equal(r.SlowCalculateRanks, []int{2}) {
		t.Fatalf("six times as slow: slow ranks %v, want [2]", r.SlowCalculateRanks)
	}
	j.pattern = []float64{1}
	for n := int64(33); n < 45; n++ {
		j.step(n, func(r int) float64 {
			if (r < 2) == (n%2 == 0) {
				return 2
			}
			return 1
		})
	}
	if r := j.d.Result(); r.IsSlow != 0 {
		t.Fatalf("no slower than most for six steps: still slow: %+v", r.Findings)
	}
}

func TestSlowIOIsNotSlowCompute(t *testing.T) {
	j := newSyncJob(16, 4, 3)
	d := newTestDetector(t, j, Config{})
	j.run(d, 0, 30)
	j.io[9] = 8
	j.run(d, 30, 40)
	r := d.Result()
	if !slices.Equal(r.SlowIORanks, []int{9}) || len(r.SlowCalculateRanks) != 0 {
		t.Fatalf("io %v compute %v, want io [9] only", r.SlowIORanks, r.SlowCalculateRanks)
	}
}

func TestPhaseChangeIsNotASlowNode(t *testing.T) {
	for _, factor := range []float64{2, 0.5} {
		j := newSyncJob(16, 4, 4)
		d := newTestDetector(t, j, Config{})
		j.run(d, 0, 30)
		j.all = factor
		j.run(d, 30, 60)
		r := d.Result()
		if r.IsSlow != 0 {
			t.Errorf("×%v: phase change made it slow: %+v", factor, r.Findings)
		}
		if len(r.PhaseChanges) != 1 || r.PhaseChanges[0].Step != 30 {
			t.Fatalf("×%v: phase changes %+v, want one at step 30", factor, r.PhaseChanges)
		}
		// The new baseline catches a slow rank in the new phase.
		j.slow[2] = 1.5
		j.run(d, 60, 66)
		if r := d.Result(); !slices.Equal(r.SlowCalculateRanks, []int{2}) {
			t.Errorf("×%v: after the phase, slow ranks %v, want [2]", factor, r.SlowCalculateRanks)
		}
	}
}

func TestSilentRankIsReportedNotFast(t *testing.T) {
	j := newSyncJob(16, 4, 5)
	d := newTestDetector(t, j, Config{SilentSteps: 10})
	j.run(d, 0, 20)
	for n := int64(20); n < 40; n++ {
		for r, st := range j.steps(n) {
			if r != 7 {
				d.AddStep(r, st)
			}
		}
	}
	r := d.Result()
	if !slices.Equal(r.SilentRanks, []int{7}) {
		t.Fatalf("silent ranks %v, want [7]", r.SilentRanks)
	}
	if r.IsSlow != 0 || r.LastStep < 30 {
		t.Fatalf("isSlow %d lastStep %d: a silent rank must not stop evaluation nor look slow", r.IsSlow, r.LastStep)
	}
	for _, rk := range r.Ranks {
		if rk.Rank == 7 && (rk.Status != "silent" || rk.LastStep != 19) {
			t.Errorf("rank 7: %+v", rk)
		}
	}
}

func TestStepsWaitForTheSlowestRank(t *testing.T) {
	j := newSyncJob(8, 4, 6)
	d := newTestDetector(t, j, Config{})
	// Rank 0 runs 5 steps ahead of the others: nothing is evaluated until
	// they catch up, since every live rank must report a step first.
	for n := int64(0); n < 5; n++ {
		d.AddStep(0, j.steps(n)[0])
	}
	if d.evaluated >= 0 {
		t.Fatalf("evaluated step %d before the others reported it", d.evaluated)
	}
	for n := int64(0); n < 5; n++ {
		for r, st := range j.steps(n) {
			if r != 0 {
				d.AddStep(r, st)
			}
		}
	}
	if d.evaluated != 4 || d.Stats().IncompleteRows != 0 {
		t.Fatalf("evaluated %d incomplete %d, want 4 and 0", d.evaluated, d.Stats().IncompleteRows)
	}
}

// TestSkippedStepsHoldNothingUp gives ranks that never report some steps:
// rank 3's dotting starts a step after the others' (switched on mid-step),
// and rank 5's is off for steps 10 to 12. A rank that reported a later
// step is done with the earlier ones, so every step is evaluated as soon
// as each rank has reported it or a later one, whichever rank comes first.
func TestSkippedStepsHoldNothingUp(t *testing.T) {
	j := newSyncJob(8, 4, 6)
	var steps [][]Step
	for n := int64(0); n < 20; n++ {
		steps = append(steps, j.steps(n))
	}
	skipped := func(r int, n int64) bool { return r == 3 && n == 0 || r == 5 && n >= 10 && n <= 12 }
	for _, order := range [][]int{{0, 1, 2, 3, 4, 5, 6, 7}, {3, 5, 7, 6, 4, 2, 1, 0}} {
		d := newTestDetector(t, j, Config{})
		// Four steps at a time, a rank after the other, as Watch reads.
		last := make([]int64, 8)
		for w := int64(0); w < 20; w += 4 {
			for _, r := range order {
				for n := w; n < w+4; n++ {
					if !skipped(r, n) {
						d.AddStep(r, steps[n][r])
						last[r] = n
					}
				}
			}
			if want := slices.Min(last); d.evaluated != want {
				t.Fatalf("order %v: evaluated step %d once every rank reported step %d or a later one", order, d.evaluated, want)
			}
		}
		if st := d.Stats(); st.IncompleteRows != 0 || st.LateSteps != 0 {
			t.Errorf("order %v: %d incomplete rows, %d late steps, want none", order, st.IncompleteRows, st.LateSteps)
		}
	}
}

// TestOrderOfRanksDoesNotMatter is a property: the verdict depends on what
// the ranks reported, not on which rank's steps arrived first.
func TestOrderOfRanksDoesNotMatter(t *testing.T) {
	j := newSyncJob(16, 4, 7)
	var steps [][]Step
	for n := int64(0); n < 60; n++ {
		if n == 30 {
			j.slow[11] = 1.4
		}
		steps = append(steps, j.steps(n))
	}
	var want *Result
	for seed := uint64(0); seed < 10; seed++ {
		rng := rand.New(rand.NewPCG(seed, 9))
		d := newTestDetector(t, j, Config{})
		// Deliver in windows of 4 steps, ranks shuffled, each rank in order.
		for w := 0; w < len(steps); w += 4 {
			perm := rng.Perm(16)
			for _, r := range perm {
				for n := w; n < min(w+4, len(steps)); n++ {
					d.AddStep(r, steps[n][r])
				}
			}
		}
		d.Flush()
		got := d.Result()
		got.History = nil
		if want == nil {
			want = got
			if !slices.Equal(want.SlowCalculateRanks, []int{11}) {
				t.Fatalf("slow ranks %v, want [11]", want.SlowCalculateRanks)
			}
			continue
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Fatalf("order %d changed the verdict (-first +this):\n%s", seed, diff)
		}
	}
}

func TestMemoryIsBoundedPerRank(t *testing.T) {
	j := newSyncJob(32, 8, 8)
	d := newTestDetector(t, j, Config{HistoryPoints: 64})
	j.run(d, 0, 3000)
	if len(d.rows) > 1 || len(d.free) > d.cfg.Horizon+1 {
		t.Errorf("%d rows open, %d free", len(d.rows), len(d.free))
	}
	for _, rs := range d.ranks {
		if cap(rs.hist.pts) != 64 || len(rs.asm.pending) != 0 || cap(rs.block) > 2*d.cfg.Window {
			t.Fatalf("rank %d: history %d, pending %d, block %d", rs.rank, cap(rs.hist.pts), len(rs.asm.pending), cap(rs.block))
		}
	}
	r := d.Result()
	if n := len(r.History.Rank(0, SeriesStep)); n > 64 || n < 32 {
		t.Errorf("history of %d points for 3000 steps, want 32..64", n)
	}
}

func TestMissingMarkersDegradeGracefully(t *testing.T) {
	d, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	for n := int64(0); n < 30; n++ {
		for r := range 4 {
			d.AddStep(r, Step{Number: n, Time: 100 * time.Millisecond, Compute: 100 * time.Millisecond})
		}
	}
	r := d.Result()
	want := []string{"forward", "dataloader", "checkpoint", "communication", "send", "trajectory"}
	if got := missingFigures(r); !slices.Equal(got, want) {
		t.Errorf("unavailable %v, want %v", got, want)
	}
	if r.IsSlow != 0 || r.LastStep != 29 {
		t.Errorf("isSlow %d lastStep %d", r.IsSlow, r.LastStep)
	}
}

// missingFigures returns the names of r.Unavailable.
func missingFigures(r *Result) []string {
	var out []string
	for _, m := range r.Unavailable {
		out = append(out, m.Figure)
	}
	return out
}

func TestConfigValidateNamesTheField(t *testing.T) {
	for _, tc := range []struct {
		cfg   Config
		field string
	}{
		{Config{NormalSteps: -1}, "NormalSteps"},
		{Config{NormalSteps: 1}, "NormalSteps"},
		{Config{DegradationPercentage: -0.1}, "DegradationPercentage"},
		{Config{NSigma: -1}, "NSigma"},
		{Config{Consecutive: -2}, "Consecutive"},
		{Config{ClusterMeanDistance: 0.9}, "ClusterMeanDistance"},
		{Config{RelativeThreshold: -1}, "RelativeThreshold"},
		{Config{MinEffect: 1}, "MinEffect"},
		{Config{Window: -1}, "Window"},
		{Config{SilentSteps: -1}, "SilentSteps"},
		{Config{Horizon: -1}, "Horizon"},
		{Config{TrailingGap: -1}, "TrailingGap"},
		{Config{HistoryPoints: -1}, "HistoryPoints"},
		{Config{MaxPendingRanges: -1}, "MaxPendingRanges"},
		{Config{MaxRanks: -1}, "MaxRanks"},
		{Config{RanksPerNode: -8}, "RanksPerNode"},
		{Config{PollInterval: -time.Second}, "PollInterval"},
		{Config{Readers: -1}, "Readers"},
		{Config{Readers: 1000}, "Readers"},
		{Config{Nodes: map[int]string{-1: "x"}}, "Nodes"},
	} {
		err := tc.cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), "Config."+tc.field) {
			t.Errorf("%+v: error %v, want one naming %s", tc.cfg, err, tc.field)
		}
		if _, err := New(tc.cfg); err == nil {
			t.Errorf("New accepted %+v", tc.cfg)
		}
	}
	if err := (Config{}).Validate(); err != nil {
		t.Errorf("zero Config: %v", err)
	}
}

func TestHostileInputIsBounded(t *testing.T) {
	d, err := New(Config{MaxRanks: 100})
	if err != nil {
		t.Fatal(err)
	}
	// A parallel_group.json naming a million ranks, and ops naming
	// ever new communicators.
	huge := make([]int, 1_000_000)
	for i := range huge {
		huge[i] = i
	}
	d.AddGroups(trace.ParallelGroups{"g": {GroupName: "pp", GlobalRanks: huge}})
	for i := range 3 * maxOps {
		name := commName("HcclAllReduce", fmt.Sprint("g", i))
		d.Add(i%10, rng(name, trace.DomainCommunication, uint64(i), uint64(i)+1))
	}
	if len(d.ranks) != 100 || d.Stats().IgnoredRanks != 1_000_000-100 {
		t.Errorf("%d ranks kept, %d ignored", len(d.ranks), d.Stats().IgnoredRanks)
	}
	if len(d.ops) > maxOps+1 || len(d.opIdx) > maxOpCache || len(d.groups) > maxGroups {
		t.Errorf("%d ops, %d cached names, %d groups", len(d.ops), len(d.opIdx), len(d.groups))
	}
	for i := range 10 {
		d.Add(i, rng("step 1", trace.DomainDefault, 0, uint64(4*maxOps)))
	}
	if _, err := d.Result().Marshal(); err != nil {
		t.Fatal(err)
	}
}

// TestRowCommSlots checks the comm slots of cells, those held in place
// and those beyond, in the row's overflow: two cells' overflows must not
// overlap, and a slot no op added to reads as NaN.
func TestRowCommSlots(t *testing.T) {
	var rw row
	rw.cells = make([]cell, 2)
	for i := range rw.cells {
		rw.setComm(&rw.cells[i], cellComm+2)
	}
	for i := range rw.cells {
		for k := range cellComm + 2 {
			if k != 1 {
				rw.addComm(&rw.cells[i], k, float64(10*i+k))
			}
		}
	}
	for i := range rw.cells {
		for k := range cellComm + 3 {
			got, want := rw.commAt(&rw.cells[i], k), float64(10*i+k)
			if k == 1 || k == cellComm+2 {
				want = math.NaN()
			}
			if got != want && !(math.IsNaN(got) && math.IsNaN(want)) {
				t.Errorf("cell %d slot %d holds %v, want %v", i, k, got, want)
			}
		}
	}
}

// TestConfigDocNamesTheDefaults reads the doc comment of each field of
// Config: the default it names is the one the code applies.
func TestConfigDocNamesTheDefaults(t *testing.T) {
	want := map[string]string{
		"NormalSteps": fmt.Sprint(DefaultNormalSteps), "DegradationPercentage": fmt.Sprint(DefaultDegradationPercentage),
		"NSigma": fmt.Sprint(DefaultNSigma), "Consecutive": fmt.Sprint(DefaultConsecutive),
		"ClusterMeanDistance": fmt.Sprint(DefaultClusterMeanDistance), "RelativeThreshold": fmt.Sprint(DefaultRelativeThreshold),
		"MinEffect": fmt.Sprint(DefaultMinEffect), "Window": fmt.Sprint(DefaultWindow), "SilentSteps": fmt.Sprint(DefaultSilentSteps),
		"Horizon": fmt.Sprint(DefaultHorizon), "TrailingGap": DefaultTrailingGap.String(), "HistoryPoints": fmt.Sprint(DefaultHistoryPoints),
		"MaxPendingRanges": fmt.Sprint(DefaultMaxPendingRanges), "MaxRanks": fmt.Sprint(DefaultMaxRanks),
		"RanksPerNode": fmt.Sprint(DefaultRanksPerNode), "PollInterval": DefaultPollInterval.String(),
	}
	var cfg Config
	cfg.setDefaults()
	applied := reflect.ValueOf(cfg)
	f, err := parser.ParseFile(token.NewFileSet(), "config.go", nil, parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	defaultRe := regexp.MustCompile(`Defaults? ([0-9][0-9.µsm]*)(?: and ([0-9][0-9.µsm]*))?`)
	var named []string // the defaults of the comment in force, for its fields in turn
	seen := map[string]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		ts, ok := n.(*ast.TypeSpec)
		if !ok || ts.Name.Name != "Config" {
			return true
		}
		for _, fld := range ts.Type.(*ast.StructType).Fields.List {
			if fld.Doc != nil {
				named = nil
				if m := defaultRe.FindStringSubmatch(strings.Join(strings.Fields(fld.Doc.Text()), " ")); m != nil {
					named = slices.DeleteFunc(m[1:], func(s string) bool { return s == "" })
				}
			}
			for _, id := range fld.Names {
				w, ok := want[id.Name]
				if !ok {
					continue
				}
				seen[id.Name] = true
				if len(named) == 0 {
					t.Errorf("Config.%s: its doc names no default; the code's is %s", id.Name, w)
					continue
				}
				got := strings.TrimSuffix(named[0], ".")
				named = named[1:]
				if got != w {
					t.Errorf("Config.%s: the doc says default %s, the code's is %s", id.Name, got, w)
				}
				if v := applied.FieldByName(id.Name); fmt.Sprint(v.Interface()) != w {
					t.Errorf("Config.%s: setDefaults applies %v, the constant is %s", id.Name, v.Interface(), w)
				}
			}
		}
		return false
	})
	if len(seen) != len(want) {
		t.Errorf("checked %d fields, want %d", len(seen), len(want))
	}
}
