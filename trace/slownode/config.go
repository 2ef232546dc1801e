package slownode

import (
	"cmp"
	"fmt"
	"log/slog"
	"runtime"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	oteltrace "go.opentelemetry.io/otel/trace"
)

// Defaults of Config. The detection defaults are MindCluster's where it
// has one (normal number 15, +30%, 3σ, 3 consecutive, cluster distance
// 1.3, 8 cards a node); each threshold was measured, varied alone, on
// generated jobs and on real PyTorch jobs (TestCalibrate prints the
// table), and the defaults are where neither false nor missed findings
// grow:
//
//   - RelativeThreshold 0.15: from 0.05 to 0.2 alike; at 0.3, 9 of 60
//     weak generated slowdowns (a rank 1.15 or 1.25 times as slow) are
//     missed.
//   - MinEffect 0.02: at 0.03, 18 of those 60 are missed, at 0.05, 24
//     (data loading or sends 2 to 3 times as slow cost 3 to 5% of a
//     step); no real job gave a false finding at any value from 0.01.
//   - NSigma 3, ClusterMeanDistance 1.3, Consecutive 3,
//     DegradationPercentage 0.3: MindCluster's; the generated jobs are
//     found alike from 2 to 5, 1.1 to 2, 2 to 5 and 0.1 to 0.5, and on the
//     real jobs (4 ranks sharing two cores, whose figures jump by whole
//     time slices) NSigma 4 or Consecutive 4 trade a false finding for a
//     missed one.
const (
	DefaultNormalSteps           = 15
	DefaultDegradationPercentage = 0.3
	DefaultNSigma                = 3
	DefaultConsecutive           = 3
	DefaultClusterMeanDistance   = 1.3
	DefaultRelativeThreshold     = 0.15
	DefaultMinEffect             = 0.02
	DefaultWindow                = 8
	DefaultSilentSteps           = 100
	DefaultHorizon               = 128
	DefaultRanksPerNode          = 8
	DefaultTrailingGap           = 200 * time.Microsecond
	DefaultHistoryPoints         = 240
	DefaultPollInterval          = time.Second
	DefaultMaxPendingRanges      = 1 << 14
	DefaultMaxRanks              = 1 << 16
)

// maxReaders bounds Config.Readers.
const maxReaders = 256

// Config configures a Detector, and Analyze and Watch, which drive one.
// The zero value is ready to use: every zero field takes the default
// named beside it.
type Config struct {
	// NormalSteps is how many evaluated steps form the job's baseline
	// (MindCluster's normalNumber). Default 15.
	NormalSteps int
	// DegradationPercentage and NSigma set the time detector's bound: a
	// step is anomalous when the job's step time exceeds both
	// baseline×(1+DegradationPercentage) and baseline+NSigma×σ. Defaults
	// 0.3 and 3.
	DegradationPercentage float64
	NSigma                float64
	// Consecutive is how many anomalous steps in a row make a finding,
	// and how many normal ones clear it: steps whose subject is back
	// under MinEffect, or within half of RelativeThreshold (or of
	// ClusterMeanDistance's margin), the whole of it from Window less
	// Consecutive steps after the last anomalous one. Default 3.
	Consecutive int
	// JobGate, when set, blames ranks and communicators only at steps
	// whose job step time exceeds the time detector's bound (above), as
	// MindCluster's FD-OL does: a rank that slows the job by less is
	// never named. Off by default: ranks are judged at every step on
	// their own figures, so that a rank 20% slower, which at scale costs
	// every other rank a wait each step, is named long before the job's
	// step time moves by DegradationPercentage (TestSensitivity measures
	// both).
	JobGate bool
	// ClusterMeanDistance is the homogenisation threshold: inside a
	// communicator, when the mean communication time of the ranks that
	// wait more exceeds that of those that wait less by this factor, the
	// latter are slow. Default 1.3.
	ClusterMeanDistance float64
	// RelativeThreshold is by how much a rank (or communicator) must
	// exceed the median of its healthy peers in the same step to be
	// anomalous, on top of NSigma deviations. Default 0.15.
	RelativeThreshold float64
	// MinEffect ignores differences smaller than this fraction of the
	// job's step time: a slow dataloader that costs 1% of a step is not
	// worth a page. Default 0.02.
	MinEffect float64
	// Window is how many recent steps per rank the evidence and the
	// scores are computed over; less Consecutive, how long after its last
	// anomalous step a finding clears only within half the margin (see
	// Consecutive). Default 8.
	Window int
	// SilentSteps: a rank whose last step is this many steps behind the
	// job's latest is silent (it stopped writing); it is reported as
	// such, not as fast, and no longer holds up evaluation. Default 100:
	// writers flush every few seconds, so ranks' files grow in bursts,
	// and 100 steps cover a 5 s flush at 50 ms a step.
	SilentSteps int
	// Horizon bounds how many steps may wait for their slowest rank
	// before they are evaluated without it; it is raised to SilentSteps+2
	// when below. Default 128.
	Horizon int
	// TrailingGap is the largest gap between two communication ops of
	// the trailing run (see Step). Default 200µs.
	TrailingGap time.Duration
	// HistoryPoints bounds the points of each chart series (per rank and
	// job-wide); older points are merged pairwise. Default 240.
	HistoryPoints int
	// MaxPendingRanges bounds the ranges a rank may accumulate inside
	// one step; beyond it ranges are dropped and counted. Default 16384.
	MaxPendingRanges int
	// MaxRanks bounds the ranks a Detector keeps state for (a few KiB
	// each); input for further ranks is counted and ignored. Default
	// 65536.
	MaxRanks int

	// Nodes maps ranks to host names (from a rank table, see
	// ParseRankTable). Ranks not in it are mapped by RanksPerNode.
	Nodes map[int]string
	// RanksPerNode puts ranks [k×n, (k+1)×n) on the node "node-k".
	// Default 8.
	RanksPerNode int

	// JobID names the job in the result (MindCluster's jobId). Analyze
	// and Watch default it to the job folder's name.
	JobID string

	// What follows is used by Analyze and Watch only.

	// PollInterval is how often Watch looks for new records. Default 1s.
	PollInterval time.Duration
	// Readers is how many goroutines read and parse rank folders ahead
	// of the detector, which takes their ranges one rank after another.
	// Default twice GOMAXPROCS: files not in the page cache are read from
	// disk, and the readers waiting on it leave the processors to others.
	Readers int
	// Logger receives warnings about bad input; nil discards them.
	Logger *slog.Logger
	// Registerer receives the metrics listed in the package
	// documentation; nil registers none.
	Registerer prometheus.Registerer
	// TracerProvider traces each analysis pass; nil traces nothing.
	TracerProvider oteltrace.TracerProvider
	// Progress, when set, is called about once a second during a reading
	// pass that lasts longer than a second, and once when such a pass
	// ends (Done set): a display for large inputs that stays quiet on
	// small ones.
	Progress func(Progress)
}

// Progress says how far Analyze or a Watch pass has read.
type Progress struct {
	Ranks    int    // rank folders being read
	Bytes    uint64 // bytes read so far
	Records  uint64 // records parsed so far
	LastStep int64  // latest step evaluated, -1 before the first
	Done     bool   // the pass has caught up
}

// ConfigError is the error of Config.Validate: the field that cannot be
// used, its value and why, for a caller that names its own setting (a
// flag) in its place.
type ConfigError struct {
	Field string // "MinEffect"
	Value any
	Why   string // "is outside [0, 1)"
}

func (e *ConfigError) Error() string {
	return fmt.Sprintf("slownode: Config.%s: %v %s", e.Field, e.Value, e.Why)
}

// Validate reports the first field that cannot be used, as a
// *ConfigError.
func (c Config) Validate() error {
	bad := func(field string, v any, why string) error {
		return &ConfigError{Field: field, Value: v, Why: why}
	}
	switch {
	case c.NormalSteps < 0:
		return bad("NormalSteps", c.NormalSteps, "is negative")
	case c.NormalSteps == 1:
		return bad("NormalSteps", c.NormalSteps, "is too few for a baseline (want at least 2)")
	case c.DegradationPercentage < 0 || c.DegradationPercentage > 100:
		return bad("DegradationPercentage", c.DegradationPercentage, "is outside [0, 100]")
	case c.NSigma < 0 || c.NSigma > 100:
		return bad("NSigma", c.NSigma, "is outside [0, 100]")
	case c.Consecutive < 0 || c.Consecutive > 1000:
		return bad("Consecutive", c.Consecutive, "is outside [0, 1000]")
	case c.ClusterMeanDistance != 0 && c.ClusterMeanDistance <= 1:
		return bad("ClusterMeanDistance", c.ClusterMeanDistance, "must exceed 1")
	case c.RelativeThreshold < 0 || c.RelativeThreshold > 100:
		return bad("RelativeThreshold", c.RelativeThreshold, "is outside [0, 100]")
	case c.MinEffect < 0 || c.MinEffect >= 1:
		return bad("MinEffect", c.MinEffect, "is outside [0, 1)")
	case c.Window < 0 || c.Window > 4096:
		return bad("Window", c.Window, "is outside [0, 4096]")
	case c.SilentSteps < 0:
		return bad("SilentSteps", c.SilentSteps, "is negative")
	case c.Horizon < 0 || c.Horizon > 1<<16:
		return bad("Horizon", c.Horizon, "is outside [0, 65536]")
	case c.TrailingGap < 0:
		return bad("TrailingGap", c.TrailingGap, "is negative")
	case c.HistoryPoints < 0 || c.HistoryPoints > 1<<16:
		return bad("HistoryPoints", c.HistoryPoints, "is outside [0, 65536]")
	case c.MaxPendingRanges < 0:
		return bad("MaxPendingRanges", c.MaxPendingRanges, "is negative")
	case c.MaxRanks < 0:
		return bad("MaxRanks", c.MaxRanks, "is negative")
	case c.RanksPerNode < 0:
		return bad("RanksPerNode", c.RanksPerNode, "is negative")
	case c.PollInterval < 0:
		return bad("PollInterval", c.PollInterval, "is negative")
	case c.Readers < 0 || c.Readers > maxReaders:
		return bad("Readers", c.Readers, "is outside [0, 256]")
	}
	for r := range c.Nodes {
		if r < 0 {
			return bad("Nodes", r, "is a negative rank")
		}
	}
	return nil
}

func (c *Config) setDefaults() {
	def := func(p *int, v int) {
		if *p == 0 {
			*p = v
		}
	}
	deff := func(p *float64, v float64) {
		if *p == 0 {
			*p = v
		}
	}
	def(&c.NormalSteps, DefaultNormalSteps)
	deff(&c.DegradationPercentage, DefaultDegradationPercentage)
	deff(&c.NSigma, DefaultNSigma)
	def(&c.Consecutive, DefaultConsecutive)
	deff(&c.ClusterMeanDistance, DefaultClusterMeanDistance)
	deff(&c.RelativeThreshold, DefaultRelativeThreshold)
	deff(&c.MinEffect, DefaultMinEffect)
	def(&c.Window, DefaultWindow)
	def(&c.SilentSteps, DefaultSilentSteps)
	def(&c.Horizon, DefaultHorizon)
	def(&c.HistoryPoints, DefaultHistoryPoints)
	def(&c.MaxPendingRanges, DefaultMaxPendingRanges)
	def(&c.MaxRanks, DefaultMaxRanks)
	def(&c.RanksPerNode, DefaultRanksPerNode)
	c.TrailingGap = cmp.Or(c.TrailingGap, DefaultTrailingGap)
	c.PollInterval = cmp.Or(c.PollInterval, DefaultPollInterval)
	def(&c.Readers, min(2*runtime.GOMAXPROCS(0), maxReaders))
	if c.Horizon < c.SilentSteps+2 {
		c.Horizon = c.SilentSteps + 2
	}
}
