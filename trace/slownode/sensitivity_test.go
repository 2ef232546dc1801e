package slownode

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/faultline-ml/faultline/trace/slownode/internal/gen"
)

// sensJob is a job of the sensitivity table: its slow rank (-1: none),
// by how much, from which step.
type sensJob struct {
	source string // "gen 2%", "gen 5%", "real cpu", "real dev"
	name   string
	dir    string
	rank   int
	factor float64
	onset  int
}

// sensOnset and sensSteps: every job of the table runs sensSteps steps,
// and a slow rank slows down from sensOnset on.
const sensOnset, sensSteps = 30, 60

// sensConfigs are the configurations the table compares: the default,
// and MindCluster's gate (ranks examined only while the job's step time
// is degraded).
var sensConfigs = []struct {
	name string
	cfg  Config
}{{"default", Config{}}, {"JobGate", Config{JobGate: true}}}

// TestSensitivity measures how soon one rank whose compute slows down by
// 10 to 80% is found, and how many findings name a healthy subject, on
// generated jobs (8 data-parallel ranks, every duration with 2, 5 or 15%
// noise, outlier steps; healthy ones plain, with a phase change and with
// a job-wide slowdown) and on real PyTorch jobs (testdata/ddp.py: 4 gloo
// ranks computing on this machine's shared cores, or on a device modelled
// as a wait; see sensReal), with the default configuration and with
// MindCluster's gate; it prints the table (-v), each finding with the
// figures that convicted it, and the spread of healthy ranks' compute
// over their peers' over 10 steps: the noise a slowdown must rise above.
// A slow rank of 20% or more is found within 10 steps of its onset in
// generated jobs with 2% noise and in real jobs computing on a device
// (judged where its records show the slowdown asked for: on a loaded
// machine the shared cores stretch every rank's host work and dilute
// it), and, with the default configuration, no healthy job but those
// sharing the cores gives a finding. The real jobs run unless -short
// (about 80 s).
func TestSensitivity(t *testing.T) {
	jobs := sensGenerated(t)
	if !testing.Short() {
		jobs = append(jobs, sensReal(t)...)
	}
	type cell struct {
		jobs, found, false int
		steps              []int
	}
	type rowKey struct {
		source string
		factor float64
	}
	table := map[rowKey]*[2]cell{}
	var keys []rowKey
	var evidence strings.Builder
	spread := map[string][]float64{} // per source: healthy ranks' windowed compute over their peers'
	for _, j := range jobs {
		k := rowKey{j.source, j.factor}
		if table[k] == nil {
			table[k] = &[2]cell{}
			keys = append(keys, k)
		}
		for ci, c := range sensConfigs {
			r, err := Analyze(context.Background(), j.dir, c.cfg)
			if err != nil {
				t.Fatal(err)
			}
			cl := &table[k][ci]
			cl.jobs++
			hit := false
			if j.rank < 0 && ci == 0 {
				spread[j.source] = append(spread[j.source], windowRatios(r, 10)...)
			}
			for _, f := range r.Findings {
				if f.Kind == KindCompute && j.rank >= 0 && slices.Equal(f.Ranks, []int{j.rank}) && f.DetectedStep >= int64(j.onset) {
					cl.found++
					hit = true
					cl.steps = append(cl.steps, int(f.DetectedStep)-j.onset)
					if ci == 0 {
						fmt.Fprintf(&evidence, "%s ×%g %s: %s\n", j.source, j.factor, j.name, findingLine(f))
					}
					continue
				}
				cl.false++
				fmt.Fprintf(&evidence, "%s ×%g %s (%s): FALSE %s\n", j.source, j.factor, j.name, c.name, findingLine(f))
			}
			// MindCluster's gate sees only a rank that moves the job's
			// step time by DegradationPercentage.
			if j.source == "gen 2%" && j.factor > 0 && ci == 1 && hit != (j.factor >= 1.4) {
				t.Errorf("%s with JobGate: rank %d computing ×%g found %v, want %v", j.name, j.rank, j.factor, hit, j.factor >= 1.4)
			}
			// A rank 20% slower is found within 10 steps where the noise
			// leaves room for it: generated jobs with 2% noise, and real
			// jobs whose compute is on a device. Real jobs that compute
			// on the cores their four ranks share are reported, not
			// judged: their healthy ranks stray as far as the slowdown
			// (the table's spread; TestRealDDPJob judges them with its
			// margins).
			judged := j.source == "gen 2%" || j.source == "real dev"
			if judged && j.factor >= 1.2 && ci == 0 && (!hit || cl.steps[len(cl.steps)-1] > 10) {
				// A real job's records may show less than the slowdown
				// asked for, where other load on the machine stretched
				// the work its peers share with it: judged by what they
				// show.
				if got := realized(r, j.rank, j.onset, 10); got >= 0.98*j.factor {
					t.Errorf("%s: rank %d computing ×%g from step %d (×%.3f in its records) not found within 10 steps: %+v", j.name, j.rank, j.factor, j.onset, got, r.Findings)
				} else {
					t.Logf("%s: rank %d computes ×%.3f its peers' in the 10 steps from its onset, short of the ×%g asked for: not judged", j.name, j.rank, got, j.factor)
				}
			}
			if j.rank < 0 && ci == 0 && j.source != "real cpu" && len(r.Findings) > 0 {
				t.Errorf("%s (%s, healthy): findings %+v", j.name, j.source, r.Findings)
			}
		}
	}
	var out strings.Builder
	fmt.Fprintf(&out, "%-8s %-8s %4s | %-28s | %-28s\n", "jobs", "slowdown", "n", "default: found, steps, false", "JobGate: found, steps, false")
	for _, k := range keys {
		c := table[k]
		slow := "healthy"
		if k.factor > 0 {
			slow = "+" + strconv.Itoa(int((k.factor-1)*100+0.5)) + "%"
		}
		cellText := func(cl cell) string {
			if k.factor == 0 {
				return fmt.Sprintf("%-5s %-14s %d", "-", "-", cl.false)
			}
			steps := "-"
			if len(cl.steps) > 0 {
				slices.Sort(cl.steps)
				steps = fmt.Sprintf("%d..%d (med %d)", cl.steps[0], cl.steps[len(cl.steps)-1], cl.steps[len(cl.steps)/2])
			}
			return fmt.Sprintf("%d/%-3d %-16s %d", cl.found, cl.jobs, steps, cl.false)
		}
		fmt.Fprintf(&out, "%-8s %-8s %4d | %-28s | %-28s\n", k.source, slow, c[0].jobs, cellText(c[0]), cellText(c[1]))
	}
	out.WriteString("\nhealthy ranks' median compute over 10 steps, over their peers' (the noise a slowdown must rise above):\n")
	for _, k := range keys {
		if xs := spread[k.source]; k.factor == 0 && len(xs) > 0 {
			slices.Sort(xs)
			q := func(p float64) float64 { return xs[int(p*float64(len(xs)-1))] }
			fmt.Fprintf(&out, "%-8s min %.2f  p5 %.2f  p50 %.2f  p95 %.2f  max %.2f  (%d windows)\n", k.source, xs[0], q(.05), q(.5), q(.95), xs[len(xs)-1], len(xs))
		}
	}
	t.Logf("steps to detection: the finding's DetectedStep less the onset (step %d of %d)\n%s\nfindings (default configuration, and every false one):\n%s",
		sensOnset, sensSteps, out.String(), evidence.String())
}

// windowRatios returns, for each rank of r and each run of n steps (a
// step apart), the rank's median compute over the median of its peers'.
func windowRatios(r *Result, n int) []float64 {
	var series [][]float64
	for _, rs := range r.Ranks {
		var xs []float64
		for _, p := range r.History.Rank(rs.Rank, SeriesCompute) {
			xs = append(xs, p.Value)
		}
		series = append(series, xs)
	}
	var out []float64
	for i, xs := range series {
		for from := 0; from+n <= len(xs); from++ {
			mine := median(slices.Clone(xs[from : from+n]))
			var peers []float64
			for k, ys := range series {
				if k != i && from+n <= len(ys) {
					peers = append(peers, median(slices.Clone(ys[from:from+n])))
				}
			}
			if ref := median(peers); ref > 0 {
				out = append(out, mine/ref)
			}
		}
	}
	return out
}

// realized returns rank's median compute over the n steps from step
// from, over the median of its peers' medians there: the slowdown the
// job's own records show; 0 without them.
func realized(r *Result, rank, from, n int) float64 {
	var mine float64
	var peers []float64
	for _, rs := range r.Ranks {
		var xs []float64
		for _, p := range r.History.Rank(rs.Rank, SeriesCompute) {
			if p.Step >= int64(from) && p.Step < int64(from+n) {
				xs = append(xs, p.Value)
			}
		}
		switch {
		case len(xs) == 0:
		case rs.Rank == rank:
			mine = median(xs)
		default:
			peers = append(peers, median(xs))
		}
	}
	if len(peers) == 0 {
		return 0
	}
	return mine / median(peers)
}

// findingLine is a finding with the figures that convicted it.
func findingLine(f Finding) string {
	s := fmt.Sprintf("%s %v %s: %s %.3g ms against peers' %.3g (×%.3g), onset %d, detected %d",
		f.Kind, f.Ranks, f.Method, f.Metric, f.Recent, f.Baseline, f.Ratio, f.OnsetStep, f.DetectedStep)
	if f.WaitedOn > 0 {
		s += fmt.Sprintf(", %s waited %.3g ms on it", f.Group, f.WaitedOn)
	}
	return s
}

// sensGenerated writes the generated jobs of the table.
func sensGenerated(t *testing.T) []sensJob {
	root := t.TempDir()
	var jobs []sensJob
	for _, noise := range []float64{0.02, 0.05, 0.15} {
		source := "gen " + strconv.Itoa(int(noise*100)) + "%"
		base := gen.Config{Root: root, TP: 1, PP: 1, DP: 8, Steps: sensSteps, Noise: noise, Outliers: 1}
		add := func(name string, seed uint64, rank int, factor float64, in ...gen.Injection) {
			c := base
			c.Seed, c.Inject = seed, in
			c.Job = strings.ReplaceAll(source, " ", "") + "-" + name + "-" + strconv.FormatUint(seed, 10)
			if _, err := gen.Generate(c); err != nil {
				t.Fatal(err)
			}
			jobs = append(jobs, sensJob{source: source, name: c.Job, dir: filepath.Join(root, c.Job), rank: rank, factor: factor, onset: sensOnset})
		}
		for seed := uint64(1); seed <= 4; seed++ {
			add("healthy", seed, -1, 0)
		}
		for seed := uint64(1); seed <= 2; seed++ {
			add("phase", 10+seed, -1, 0, gen.Injection{Kind: gen.Phase, From: sensOnset, Factor: 1.5})
			add("jobwide", 20+seed, -1, 0, gen.Injection{Kind: gen.Phase, From: sensOnset, Factor: 1.2})
		}
		for _, f := range []float64{1.1, 1.2, 1.4, 1.8} {
			for seed := uint64(1); seed <= 4; seed++ {
				rank := int(seed+2) % 8
				add("slow"+strconv.FormatFloat(f, 'f', -1, 64), 100*seed+uint64(f*10), rank, f,
					gen.Injection{Kind: gen.SlowRank, Rank: rank, From: sensOnset, Factor: f})
			}
		}
	}
	return jobs
}

// sensDevice are the flags of a "real dev" job: a forward of 30 ms on
// the device (its backward takes twice as long), and layers and batches
// small enough that the cores' share of its compute is a few percent, as
// with an accelerator.
var sensDevice = []string{"--device-ms", "30", "--batch", "8", "--width", "64"}

// sensReal runs the real jobs of the table, 4 gloo ranks of
// testdata/ddp.py each: "real cpu" computes on this machine's cores,
// which the four ranks share (a slow rank sleeps as long again as its
// layers took, times the factor less one); "real dev" computes, as on an
// accelerator, on a device modelled as a wait of 30 ms in forward and
// twice that in backward (sensDevice), which the slow rank's factor
// stretches with the rest of its compute, while its data loading,
// autograd, DDP and gloo run on the cores.
func sensReal(t *testing.T) []sensJob {
	python := findTorchPython()
	if python == "" {
		t.Log("no python3 with torch: the real jobs are left out")
		return nil
	}
	root := t.TempDir()
	var jobs []sensJob
	add := func(source string, i int, f float64, args ...string) {
		prefix := strings.ReplaceAll(source, " ", "-")
		j := realJob{name: prefix + "-healthy-" + strconv.Itoa(i)}
		rank := -1
		if f > 0 {
			rank = 1 + i%3
			j = slowRealJob(prefix+"-slow-"+strconv.FormatFloat(f, 'f', -1, 64)+"-"+strconv.Itoa(i), rank, f, -1, 0)
		}
		j.args = append(j.args, args...)
		jobs = append(jobs, sensJob{source: source, name: j.name, dir: runRealJob(t, python, root, j), rank: rank, factor: f, onset: realOnset})
	}
	for i, f := range []float64{0, 1.2, 0, 1.4, 1.8} {
		add("real cpu", i, f)
	}
	for i, f := range []float64{0, 1.1, 1.2, 0, 1.2, 1.4} {
		add("real dev", i, f, sensDevice...)
	}
	return jobs
}
