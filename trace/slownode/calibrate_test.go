package slownode

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/faultline-ml/faultline/trace/slownode/internal/gen"
)

// calJob is a job the calibration analyses, and what should be found.
type calJob struct {
	set  string // "gen", "gen-weak" or "real"
	name string
	dir  string
	want []string // truthItems
}

// TestCalibrate measures how the detection thresholds trade false
// findings for missed ones, each varied alone around the defaults, on
// generated jobs (the scenarios of TestPrecisionRecall, and weaker
// slowdowns near the limit of what a page is worth) and on real PyTorch
// jobs (testdata/ddp.py: healthy, one rank computing 1.5 or 2 times as
// slowly, one loading its batches 3 or 5 times as slowly). The defaults
// of Config were chosen from its table; set FAULTLINE_SLOWNODE_CALIBRATE=1
// to print it (a few minutes: the real jobs run first, where torch is
// installed; FAULTLINE_SLOWNODE_REAL=dir keeps them for the next run). The
// jobs run 60 steps, and the slow ones slow down from step 30.
func TestCalibrate(t *testing.T) {
	if os.Getenv("FAULTLINE_SLOWNODE_CALIBRATE") == "" {
		t.Skip("set FAULTLINE_SLOWNODE_CALIBRATE=1 to measure the thresholds")
	}
	jobs := calibrationJobs(t)
	type knob struct {
		name string
		vals []float64
		set  func(*Config, float64)
	}
	knobs := []knob{
		{"RelativeThreshold", []float64{0.05, 0.1, 0.15, 0.2, 0.3}, func(c *Config, v float64) { c.RelativeThreshold = v }},
		{"MinEffect", []float64{0.01, 0.02, 0.03, 0.05, 0.1}, func(c *Config, v float64) { c.MinEffect = v }},
		{"NSigma", []float64{2, 2.5, 3, 4, 5}, func(c *Config, v float64) { c.NSigma = v }},
		{"ClusterMeanDistance", []float64{1.1, 1.2, 1.3, 1.5, 2}, func(c *Config, v float64) { c.ClusterMeanDistance = v }},
		{"Consecutive", []float64{2, 3, 4, 5}, func(c *Config, v float64) { c.Consecutive = int(v) }},
		{"DegradationPercentage", []float64{0.1, 0.2, 0.3, 0.5}, func(c *Config, v float64) { c.DegradationPercentage = v }},
	}
	var out strings.Builder
	fmt.Fprintf(&out, "%-22s %6s | %-26s | %-26s | %-26s\n", "threshold", "value",
		"generated: fp fn (items)", "generated weak: fp fn", "real: fp fn (jobs)")
	for _, k := range knobs {
		for _, v := range k.vals {
			cfg := Config{}
			k.set(&cfg, v)
			scores := map[string]*score{"gen": {}, "gen-weak": {}, "real": {}}
			for _, j := range jobs {
				r, err := Analyze(context.Background(), j.dir, cfg)
				if err != nil {
					t.Fatal(err)
				}
				scores[j.set].add(j.want, resultItems(r))
			}
			cell := func(s *score) string {
				return fmt.Sprintf("%3d %3d (of %d)", s.fp, s.fn, s.tp+s.fn)
			}
			fmt.Fprintf(&out, "%-22s %6.3g | %-26s | %-26s | %-26s\n", k.name, v,
				cell(scores["gen"]), cell(scores["gen-weak"]), cell(scores["real"]))
		}
	}
	t.Log("\n" + out.String())
}

// calibrationJobs writes (or finds) the jobs TestCalibrate analyses.
func calibrationJobs(t *testing.T) []calJob {
	root := t.TempDir()
	var jobs []calJob
	for _, l := range []layout{{8, 1, 1}, {4, 1, 4}, {4, 2, 4}, {8, 2, 4}} {
		for _, seed := range []uint64{1, 2, 3} {
			for _, sc := range scenarios(l, 60, seed*1000) {
				jobs = append(jobs, genJob(t, root, "gen", sc))
			}
			world := l.tp * l.pp * l.dp
			base := gen.Config{TP: l.tp, PP: l.pp, DP: l.dp, Steps: 60, Seed: seed*1000 + 77, Outliers: world / 8, Garbage: true}
			weak := []struct {
				name string
				in   gen.Injection
			}{
				{"slow-rank-1.15", gen.Injection{Kind: gen.SlowRank, Rank: world - 2, From: 30, Factor: 1.15}},
				{"slow-rank-1.25", gen.Injection{Kind: gen.SlowRank, Rank: 1, From: 30, Factor: 1.25}},
				{"slow-io-2", gen.Injection{Kind: gen.SlowIO, Rank: world / 2, From: 30, Factor: 2}},
				{"slow-io-3", gen.Injection{Kind: gen.SlowIO, Rank: 0, From: 30, Factor: 3}},
			}
			if l.pp > 1 {
				weak = append(weak, struct {
					name string
					in   gen.Injection
				}{"slow-link-3", gen.Injection{Kind: gen.SlowLink, Rank: l.tp * l.dp / 2, From: 30, Factor: 3}})
			}
			for i, w := range weak {
				c := base
				c.Seed += uint64(i)
				jobs = append(jobs, genJob(t, root, "gen-weak", scenario{name: l.String() + "/" + w.name, cfg: c, inject: []gen.Injection{w.in}}))
			}
		}
	}
	real := os.Getenv("FAULTLINE_SLOWNODE_REAL")
	if real == "" {
		real = filepath.Join(root, "real")
	}
	python := findTorchPython()
	for i := 1; i <= 4; i++ {
		n := strconv.Itoa(i)
		for _, j := range []realJob{
			{name: "healthy-" + n},
			slowRealJob("slow-rank-2x-"+n, i%4, 2, -1, 0),
			slowRealJob("slow-rank-1.5x-"+n, (i+1)%4, 1.5, -1, 0),
			slowRealJob("slow-io-5x-"+n, -1, 0, (i+2)%4, 5),
			slowRealJob("slow-io-3x-"+n, -1, 0, (i+3)%4, 3),
		} {
			dir := filepath.Join(real, j.name)
			if _, err := os.Stat(dir); err != nil {
				if python == "" {
					t.Log("no python3 with torch: the real jobs are left out")
					return jobs
				}
				runRealJob(t, python, real, j)
			}
			want := items("compute", j.compute)
			want = append(want, items("io", j.io)...)
			jobs = append(jobs, calJob{set: "real", name: j.name, dir: dir, want: want})
		}
	}
	return jobs
}

func genJob(t *testing.T, root, set string, sc scenario) calJob {
	cfg := sc.cfg
	cfg.Root, cfg.Job, cfg.Inject = root, strings.ReplaceAll(sc.name, "/", "-")+"-"+strconv.FormatUint(cfg.Seed, 10), sc.inject
	truth, err := gen.Generate(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return calJob{set: set, name: sc.name, dir: filepath.Join(root, cfg.Job), want: truthItems(truth)}
}
