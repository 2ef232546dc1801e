package slownode

import (
	"math"
)

// PhaseChange is a change of the job's step time that hit every rank
// alike (a new learning-rate phase, a longer sequence length): the
// baseline moved to the new level and no rank was blamed.
type PhaseChange struct {
	Step     int64   `json:"step"`     // first step of the new phase
	Detected int64   `json:"detected"` // step at which it was recognised
	FromMs   float64 `json:"fromMs"`   // baseline step time before
	ToMs     float64 `json:"toMs"`     // baseline step time after
	Ratio    float64 `json:"ratio"`    // ToMs / FromMs
}

// jobState is MindCluster's time detector over the job's step time (the
// median over ranks of each step): a robust baseline of the first
// NormalSteps steps, a bound of +DegradationPercentage and NSigma σ, and
// Consecutive anomalies in a row. A shift that no finding explains is a
// phase change and moves the baseline, up or down.
type jobState struct {
	cfg      *Config
	base     []float64
	baseline float64
	sigma    float64
	ready    bool

	run, low int
	onset    int64
	lowOnset int64
	degraded bool
	detected int64
	calm     int
	since    []float64 // step times since onset, for the new baseline
	tmp      []float64
	recent   window
	phases   []PhaseChange // the latest maxPhases
	nPhases  uint64        // phase changes so far, uncapped: Watch tells a new one by it
	hist     history
	lastStep int64
}

func newJobState(cfg *Config) jobState {
	return jobState{cfg: cfg, recent: newWindow(cfg.Window), hist: newHistory(cfg.HistoryPoints), onset: -1, lastStep: -1}
}

// maxPhases bounds the phase changes a result lists; older ones go.
const maxPhases = 32

// update takes the job's figures of step s (medians over ranks); explained
// says whether a finding accounts for a slowdown.
func (j *jobState) update(s int64, fig *[numMetrics]float64, explained bool, d *Detector) {
	v := fig[mStep]
	j.lastStep = s
	j.recent.push(v)
	j.hist.add(s, fig)
	if !j.ready {
		j.base = append(j.base, v)
		if len(j.base) >= j.cfg.NormalSteps {
			// The median and a robust σ (MindCluster trims the mean):
			// outlier steps among the first ones must move neither the
			// baseline nor the bound.
			j.baseline, j.sigma, _ = medianMAD(j.base, nil)
			j.ready = true
			j.base = nil
		}
		return
	}
	bound := j.bound()
	lowBound := j.baseline * (1 - j.cfg.DegradationPercentage)
	keep := func() {
		if len(j.since) < 4*j.cfg.Window {
			j.since = append(j.since, v)
		} else {
			j.since[int(s)%len(j.since)] = v
		}
	}
	switch {
	case v > bound:
		j.low = 0
		j.calm = 0
		j.run++
		if j.run == 1 && !j.degraded {
			j.onset = s
			j.since = j.since[:0]
		}
		keep()
		if !j.degraded && j.run >= j.cfg.Consecutive {
			j.degraded, j.detected = true, s
		}
	case v < lowBound:
		j.run = 0
		j.low++
		if j.low == 1 {
			j.lowOnset = s
			j.since = j.since[:0]
		}
		keep()
		if j.low >= j.cfg.Consecutive && !explained {
			j.rebase(s, j.lowOnset, d)
		}
		return
	default:
		j.run, j.low = 0, 0
		if j.degraded {
			keep()
			j.calm++
			if j.calm >= j.cfg.Consecutive {
				j.degraded, j.calm, j.onset = false, 0, -1
			}
		}
	}
	// A degradation no finding explains after Consecutive more steps, and
	// that holds (the step is still anomalous, and so is the median since
	// the onset: a few outlier steps in a row are not a phase), is a phase
	// change: the findings had the time to appear.
	if j.degraded && !explained && j.calm == 0 && s-j.detected >= int64(j.cfg.Consecutive) &&
		median(append(j.tmp[:0], j.since...)) > bound {
		j.rebase(s, j.onset, d)
	}
}

// bound is the step time above which a step is anomalous.
func (j *jobState) bound() float64 {
	return math.Max(j.baseline*(1+j.cfg.DegradationPercentage), j.baseline+j.cfg.NSigma*j.sigma)
}

// over reports whether step time v exceeds the bound, once the baseline
// is known.
func (j *jobState) over(v float64) bool { return j.ready && v > j.bound() }

func (j *jobState) rebase(s, onset int64, d *Detector) {
	vals := append([]float64(nil), j.since...)
	to := median(vals)
	if math.IsNaN(to) || to <= 0 {
		return
	}
	ratio := to / j.baseline
	j.phases = append(j.phases, PhaseChange{Step: onset, Detected: s, FromMs: j.baseline, ToMs: to, Ratio: ratio})
	j.nPhases++
	if len(j.phases) > maxPhases {
		j.phases = j.phases[1:]
	}
	j.sigma *= ratio
	j.baseline = to
	j.degraded, j.run, j.low, j.calm, j.onset = false, 0, 0, 0, -1
	j.since = j.since[:0]
	d.epoch++ // ranks' own bests belong to the old phase
	d.changes++
}

// level returns the degradation of the recent step time over the
// baseline, in percent, 0 when faster or not yet known.
func (j *jobState) level(scratch []float64) float64 {
	if !j.ready || j.baseline <= 0 {
		return 0
	}
	r := median(j.recent.values(scratch[:0]))
	return math.Max(0, (r/j.baseline-1)*100)
}
