package slownode

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"

	"github.com/faultline-ml/faultline/trace/slownode/internal/gen"
)

// scenario is one generated job and what should be found in it.
type scenario struct {
	name   string
	cfg    gen.Config
	inject []gen.Injection
}

type layout struct{ tp, pp, dp int }

func (l layout) String() string { return fmt.Sprintf("tp%d-pp%d-dp%d", l.tp, l.pp, l.dp) }

// scenarios returns the injected cases for a layout, those the layout can
// show: a slow host needs more than one node, a slow communicator three
// of its kind, a slow link a pipeline.
func scenarios(l layout, steps int, seed uint64) []scenario {
	world := l.tp * l.pp * l.dp
	from := steps / 2
	base := gen.Config{TP: l.tp, PP: l.pp, DP: l.dp, Steps: steps, Seed: seed, Outliers: world / 8, CheckpointEach: 25, Garbage: true}
	var out []scenario
	add := func(name string, in ...gen.Injection) {
		c := base
		c.Seed = seed + uint64(len(out))
		out = append(out, scenario{name: l.String() + "/" + name, cfg: c, inject: in})
	}
	add("healthy")
	add("slow-rank", gen.Injection{Kind: gen.SlowRank, Rank: world - 3, From: from, Factor: 1.4})
	if world > 8 {
		add("slow-node", gen.Injection{Kind: gen.SlowNode, Node: world/8 - 1, From: from, Factor: 1.4})
	}
	if l.tp > 1 && l.dp >= 3 {
		add("slow-tp-comm", gen.Injection{Kind: gen.SlowTPComm, Group: 1, From: from, Factor: 4})
	}
	add("slow-io", gen.Injection{Kind: gen.SlowIO, Rank: 1, From: from, Factor: 6})
	add("phase-change", gen.Injection{Kind: gen.Phase, From: from, Factor: 2})
	if l.pp > 1 {
		add("slow-link", gen.Injection{Kind: gen.SlowLink, Rank: l.tp * l.dp / 2, From: from, Factor: 6})
	}
	return out
}

// score counts true and false positives and negatives over every kind of
// thing a result names.
type score struct{ tp, fp, fn int }

func (s *score) add(want, got []string) {
	for _, g := range got {
		if slices.Contains(want, g) {
			s.tp++
		} else {
			s.fp++
		}
	}
	for _, w := range want {
		if !slices.Contains(got, w) {
			s.fn++
		}
	}
}

func (s score) precision() float64 {
	if s.tp+s.fp == 0 {
		return 1
	}
	return float64(s.tp) / float64(s.tp+s.fp)
}

func (s score) recall() float64 {
	if s.tp+s.fn == 0 {
		return 1
	}
	return float64(s.tp) / float64(s.tp+s.fn)
}

func items(kind string, ranks []int) []string {
	var out []string
	for _, r := range ranks {
		out = append(out, kind+":"+strconv.Itoa(r))
	}
	return out
}

func truthItems(t gen.Truth) []string {
	out := items("compute", t.SlowCompute)
	out = append(out, items("io", t.SlowIO)...)
	out = append(out, items("link", t.SlowLinks)...)
	for _, h := range t.SlowHosts {
		out = append(out, "host:"+h)
	}
	for _, d := range t.SlowDomains {
		out = append(out, fmt.Sprint("domain:", d))
	}
	return out
}

func resultItems(r *Result) []string {
	out := items("compute", r.SlowCalculateRanks)
	out = append(out, items("io", r.SlowIORanks)...)
	out = append(out, items("link", r.SlowCommunicationRanks)...)
	for _, h := range r.SlowHostNodes {
		out = append(out, "host:"+h)
	}
	for _, d := range r.SlowCommunicationDomains {
		out = append(out, fmt.Sprint("domain:", d))
	}
	return out
}

func runScenario(t testing.TB, root string, sc scenario) (gen.Truth, *Result) {
	t.Helper()
	cfg := sc.cfg
	cfg.Root, cfg.Job, cfg.Inject = root, filepath.Base(sc.name)+"-"+strconv.FormatUint(cfg.Seed, 10), sc.inject
	truth, err := gen.Generate(cfg)
	if err != nil {
		t.Fatal(err)
	}
	jobDir := filepath.Join(root, cfg.Job)
	r, err := Analyze(context.Background(), jobDir, Config{})
	if err != nil {
		t.Fatal(err)
	}
	os.RemoveAll(jobDir)
	return truth, r
}

func checkScenarios(t *testing.T, layouts []layout, steps int) {
	checkScenariosSeed(t, layouts, steps, 1)
}

func checkScenariosSeed(t *testing.T, layouts []layout, steps int, seed uint64) {
	root := t.TempDir()
	var total score
	for _, l := range layouts {
		for _, sc := range scenarios(l, steps, seed) {
			truth, r := runScenario(t, root, sc)
			want, got := truthItems(truth), resultItems(r)
			var s score
			s.add(want, got)
			total.add(want, got)
			if s.fp+s.fn > 0 {
				t.Errorf("%s: want %v, got %v", sc.name, want, got)
			}
			wantSlow := 0
			if len(want) > 0 {
				wantSlow = 1
			}
			if r.IsSlow != wantSlow {
				t.Errorf("%s: isSlow %d, want %d", sc.name, r.IsSlow, wantSlow)
			}
			if truth.Phase && len(r.PhaseChanges) == 0 {
				t.Errorf("%s: no phase change reported", sc.name)
			}
			if !truth.Phase && len(r.PhaseChanges) > 0 {
				t.Errorf("%s: phase changes %+v where there was none", sc.name, r.PhaseChanges)
			}
			// Detection latency: every finding of an injected slowdown
			// is reported within 3 steps of its onset.
			for _, f := range r.Findings {
				if truth.Onset >= 0 && (f.DetectedStep-int64(truth.Onset) > 3 || f.OnsetStep < int64(truth.Onset)) {
					t.Errorf("%s: %s %v: onset %d detected %d, injected at %d", sc.name, f.Kind, f.Ranks, f.OnsetStep, f.DetectedStep, truth.Onset)
				}
			}
			// One noisy step may hide the first anomalous one.
			if r.IsSlow == 1 && truth.Onset >= 0 && (r.OnsetStep < int64(truth.Onset) || r.OnsetStep > int64(truth.Onset)+1) {
				t.Errorf("%s: onset step %d, want %d", sc.name, r.OnsetStep, truth.Onset)
			}
			if len(r.SilentRanks) > 0 {
				t.Errorf("%s: silent ranks %v", sc.name, r.SilentRanks)
			}
		}
	}
	t.Logf("precision %.3f recall %.3f (tp %d fp %d fn %d)", total.precision(), total.recall(), total.tp, total.fp, total.fn)
	if total.precision() < 0.95 || total.recall() < 0.95 {
		t.Errorf("precision %.3f recall %.3f, want both ≥ 0.95", total.precision(), total.recall())
	}
}

func TestPrecisionRecall(t *testing.T) {
	layouts := []layout{{8, 1, 1}, {4, 1, 4}, {4, 2, 4}, {8, 2, 4}}
	checkScenarios(t, layouts, 60)
}

// TestPrecisionRecallLarge runs the cases at 128 and 512 ranks, and the
// small layouts with ten more seeds; set FAULTLINE_SLOWNODE_LARGE=1 to run
// it (about two minutes on two cores).
func TestPrecisionRecallLarge(t *testing.T) {
	if os.Getenv("FAULTLINE_SLOWNODE_LARGE") == "" {
		t.Skip("set FAULTLINE_SLOWNODE_LARGE=1 to run the 128- and 512-rank cases and more seeds")
	}
	checkScenarios(t, []layout{{8, 4, 4}, {8, 4, 16}}, 60)
	for seed := uint64(100); seed <= 1000; seed += 100 {
		t.Run(fmt.Sprint("seed-", seed), func(t *testing.T) {
			checkScenariosSeed(t, []layout{{8, 1, 1}, {4, 1, 4}, {4, 2, 4}, {8, 2, 4}}, 60, seed)
		})
	}
}

// TestMissingMarkerKinds turns marker kinds off in the writer: the slow
// rank is still found from what is left, and the result says which
// figures are missing.
func TestMissingMarkerKinds(t *testing.T) {
	root := t.TempDir()
	for _, tc := range []struct {
		name        string
		tp, dp      int
		noComm, noF bool
		unavailable []string
	}{
		// Without communication markers only forward shows compute, and
		// only where no collective runs inside it: data parallelism.
		{"no-communication", 1, 16, true, false, []string{"checkpoint", "communication", "send"}},
		{"no-forward", 4, 4, false, true, []string{"forward", "checkpoint", "send", "trajectory"}},
	} {
		_, err := gen.Generate(gen.Config{Root: root, Job: tc.name, TP: tc.tp, DP: tc.dp, PP: 1, Steps: 50, Seed: 5,
			NoComm: tc.noComm, NoForward: tc.noF, NCCL: true,
			Inject: []gen.Injection{{Kind: gen.SlowRank, Rank: 10, From: 25, Factor: 1.5}}})
		if err != nil {
			t.Fatal(err)
		}
		r, err := Analyze(context.Background(), filepath.Join(root, tc.name), Config{})
		if err != nil {
			t.Fatal(err)
		}
		if got := missingFigures(r); !slices.Equal(r.SlowCalculateRanks, []int{10}) || !slices.Equal(got, tc.unavailable) {
			t.Errorf("%s: slow %v unavailable %v; want [10] and %v", tc.name, r.SlowCalculateRanks, got, tc.unavailable)
		}
	}
}
