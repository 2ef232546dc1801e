package slownode

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
)

// Result is the verdict on a job. Its first fields are MindCluster's
// ClusterJobResult, with the same JSON names, so that tools reading
// MindCluster's slow-node results read it; the rest is what
// ClusterJobResult lacks: evidence per finding, the onset step, a
// confidence, per-rank figures and what the input did not provide.
//
// Steps are compared across ranks by their number, never by timestamp:
// the clocks of different hosts are not comparable.
type Result struct {
	IsSlow                   int      `json:"isSlow"`           // 1 when something is slow
	DegradationLevel         string   `json:"degradationLevel"` // step time over baseline, "12.5%"
	JobID                    string   `json:"jobId"`
	SlowCalculateRanks       []int    `json:"slowCalculateRanks"`
	SlowCommunicationDomains [][]int  `json:"slowCommunicationDomains"` // members of each slow communicator
	SlowHostNodes            []string `json:"slowHostNodes"`
	SlowIORanks              []int    `json:"slowIORanks"`
	SlowCommunicationRanks   []int    `json:"slowCommunicationRanks"` // ranks with slow links (pipeline sends)

	OnsetStep    int64         `json:"onsetStep"`  // first slow step; -1 when not slow
	Confidence   float64       `json:"confidence"` // in [0, 1]; 0 when not slow
	LastStep     int64         `json:"lastStep"`   // latest step evaluated; -1 before the first
	BaselineMs   float64       `json:"baselineStepMs"`
	StepMs       float64       `json:"recentStepMs"`
	Findings     []Finding     `json:"findings"`
	PhaseChanges []PhaseChange `json:"phaseChanges"`
	SilentRanks  []int         `json:"silentRanks"` // stopped writing while the others went on
	Unavailable  []Missing     `json:"unavailable"` // figures no rank has, and why
	Ranks        []RankSummary `json:"ranks"`
	Input        InputStats    `json:"input"`

	// History holds the chart series; it is not part of the JSON form.
	History *History `json:"-"`
}

// Missing names a figure the input did not give, and why.
type Missing struct {
	Figure string `json:"figure"` // a name of Figures.Names, "relative score" or "individual score"
	Reason string `json:"reason"`
}

// Finding is one thing found slow, with its evidence: the figures that
// convicted it.
type Finding struct {
	Kind  string `json:"kind"` // KindCompute, KindIO, KindLink, KindCommunicationDomain, KindHost
	Ranks []int  `json:"ranks"`
	// Group is the communicator: the slow one of a
	// KindCommunicationDomain finding, or the one whose members waited
	// for a rank that homogenisation found late.
	Group     string `json:"group,omitempty"`
	GroupKind string `json:"groupKind,omitempty"` // "tp", "dp", ... from parallel_group.json
	Node      string `json:"node,omitempty"`
	// Metric names the figure of Baseline and Recent: compute, forward
	// (a rank whose compute the markers do not give), dataloader, send or
	// communication. The three are left out (0) where the subject's
	// figure was not computed: a rank found late by homogenisation alone,
	// whose evidence is then WaitedOn.
	Metric   string  `json:"metric"`
	Method   string  `json:"method"`               // relative, homogenisation, relative+homogenisation
	Baseline float64 `json:"baselineMs,omitempty"` // what the subject's peers took, recent median
	Recent   float64 `json:"recentMs,omitempty"`   // what the subject took, recent median
	Ratio    float64 `json:"ratio,omitempty"`      // Recent / Baseline
	// WaitedOn is, for a rank homogenisation found late, how long the
	// other members of Group waited for it a step: the median wait of
	// those who waited more, less its own (recent median).
	WaitedOn float64 `json:"waitedOnMs,omitempty"`
	// RelativeScore is the NVIDIA-style relative score of a rank: the
	// best of its stage's ranks over its own (1 is the best rank), and
	// IndividualScore its own best over its recent compute time.
	RelativeScore   float64 `json:"relativeScore,omitempty"`
	IndividualScore float64 `json:"individualScore,omitempty"`
	OnsetStep       int64   `json:"onsetStep"`
	DetectedStep    int64   `json:"detectedStep"`
	Confidence      float64 `json:"confidence"`
}

// RankSummary is one rank's recent figures (medians over the last Window
// evaluated steps, in milliseconds) and status. A figure the rank's
// markers do not give is 0 and named in Unavailable, and so is a score
// not computed (no compute figure, or too few steps for a best).
type RankSummary struct {
	Rank            int      `json:"rank"`
	Node            string   `json:"node"`
	Status          string   `json:"status"` // "ok", "slow", "silent", "waiting" (no step yet)
	Flags           []string `json:"flags,omitempty"`
	LastStep        int64    `json:"lastStep"`
	Stage           int      `json:"stage"`
	StepMs          float64  `json:"stepMs"`
	ComputeMs       float64  `json:"computeMs"`
	ForwardMs       float64  `json:"forwardMs"`
	GapMs           float64  `json:"gapMs"`
	FPBPMs          float64  `json:"fpbpMs"`
	TrailingMs      float64  `json:"trailingMs"`
	DataLoaderMs    float64  `json:"dataloaderMs"`
	CheckpointMs    float64  `json:"checkpointMs"` // median of the recent saves among the last Window steps
	CommMs          float64  `json:"commMs"`
	SendMs          float64  `json:"sendMs"`
	RelativeScore   float64  `json:"relativeScore,omitempty"`
	IndividualScore float64  `json:"individualScore,omitempty"`
	Unavailable     []string `json:"unavailable,omitempty"`
}

// InputStats counts what was read and what was set aside.
type InputStats struct {
	Ranks         int      `json:"ranks"`
	Bytes         uint64   `json:"bytes"`
	Records       uint64   `json:"records"`
	GarbageLines  uint64   `json:"garbageLines"`
	UnmatchedEnds uint64   `json:"unmatchedEnds"`
	Detector      Stats    `json:"detector"`
	Warnings      []string `json:"warnings,omitempty"`
}

// History is what the charts of the HTML report draw: the Series of each
// rank and of the job (medians over ranks), step by step. A figure never
// computed has no points.
type History struct {
	job   []histPoint
	ranks map[int][]histPoint // five figures to a point, as the detector keeps them
}

// Job returns the job's series s: the median over ranks at each step.
func (h *History) Job(s Series) []Point { return seriesOf(h.job, s) }

// Rank returns the series s of rank, nil for a rank h does not hold.
func (h *History) Rank(rank int, s Series) []Point { return seriesOf(h.ranks[rank], s) }

// ErrResult is wrapped by the errors of ParseResult.
var ErrResult = errors.New("slownode: invalid slow-node result")

// ParseResult parses a result in its JSON form. Unknown fields are
// ignored; the MindCluster fields must be present with the right types.
func ParseResult(data []byte) (*Result, error) {
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(data, &raw); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrResult, err)
	}
	for _, f := range []string{"isSlow", "degradationLevel", "slowCalculateRanks", "slowCommunicationDomains",
		"slowHostNodes", "slowIORanks", "slowCommunicationRanks"} {
		if _, ok := raw[f]; !ok {
			return nil, fmt.Errorf("%w: field %q missing", ErrResult, f)
		}
	}
	var r Result
	if err := json.Unmarshal(data, &r); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return nil, fmt.Errorf("%w: field %q: %s is not a %s", ErrResult, te.Field, te.Value, te.Type)
		}
		return nil, fmt.Errorf("%w: %v", ErrResult, err)
	}
	if r.IsSlow != 0 && r.IsSlow != 1 {
		return nil, fmt.Errorf("%w: field \"isSlow\": %d is neither 0 nor 1", ErrResult, r.IsSlow)
	}
	return &r, nil
}

// Marshal returns the indented JSON form of r with a final newline.
func (r *Result) Marshal() ([]byte, error) {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("slownode: marshal result: %w", err)
	}
	return append(b, '\n'), nil
}

// round3 keeps three decimals: enough for milliseconds and scores, and
// stable output.
func round3(x float64) float64 {
	if math.IsNaN(x) || math.IsInf(x, 0) {
		return 0
	}
	return math.Round(x*1000) / 1000
}

// Result returns the verdict as of the latest evaluated step. It does
// not change the detector.
func (d *Detector) Result() *Result {
	b := &resultBuilder{d: d}
	b.start()
	b.scoreRanks()
	b.addFindings()
	b.addHosts()
	b.summarise()
	b.addRanks()
	b.r.History = d.history()
	return b.r
}

// resultBuilder is a Result being built, a step of it at a time.
type resultBuilder struct {
	d   *Detector
	r   *Result
	tmp []float64

	recent      [][numMetrics]float64 // per rank: the medians of its windows
	bestOfStage map[int]float64       // the least recent compute of a live rank of the stage
	flags       map[int][]string      // per rank: the kinds of its findings
	computeSlow map[int]int64         // rank → onset of its slow compute
}

// start fills in the job's figures.
func (b *resultBuilder) start() {
	d := b.d
	r := &Result{
		JobID:                    d.cfg.JobID,
		SlowCalculateRanks:       []int{},
		SlowCommunicationDomains: [][]int{},
		SlowHostNodes:            []string{},
		SlowIORanks:              []int{},
		SlowCommunicationRanks:   []int{},
		OnsetStep:                -1,
		LastStep:                 d.evaluated,
		Findings:                 []Finding{},
		PhaseChanges:             slices.Clone(d.job.phases),
		SilentRanks:              []int{},
		Unavailable:              []Missing{},
		Input:                    InputStats{Ranks: len(d.ranks), Detector: d.stats},
	}
	if r.PhaseChanges == nil {
		r.PhaseChanges = []PhaseChange{}
	}
	for i := range r.PhaseChanges {
		p := &r.PhaseChanges[i]
		p.FromMs, p.ToMs, p.Ratio = round3(p.FromMs), round3(p.ToMs), round3(p.Ratio)
	}
	if d.job.ready {
		r.BaselineMs = round3(d.job.baseline)
	}
	r.StepMs = round3(median(d.job.recent.values(b.tmp[:0])))
	b.r = r
}

// scoreRanks takes the recent medians per rank, and the best per stage
// for relative scores.
func (b *resultBuilder) scoreRanks() {
	d := b.d
	b.recent = make([][numMetrics]float64, len(d.ranks))
	b.bestOfStage = map[int]float64{}
	for i, rs := range d.ranks {
		for m := metric(0); m < numMetrics; m++ {
			b.tmp = rs.win[m].values(b.tmp[:0])
			b.recent[i][m] = median(b.tmp)
		}
		if c := b.recent[i][mCompute]; !rs.silent && !math.IsNaN(c) {
			if best, ok := b.bestOfStage[rs.stage]; !ok || c < best {
				b.bestOfStage[rs.stage] = c
			}
		}
	}
}

// relScore is rank i's relative score: the best compute of its stage over
// its own.
func (b *resultBuilder) relScore(i int) float64 {
	c := b.recent[i][mCompute]
	best, ok := b.bestOfStage[b.d.ranks[i].stage]
	if !ok || math.IsNaN(c) || c <= 0 {
		return 0
	}
	return round3(best / c)
}

// indScore is rank i's individual score: its own best compute over its
// recent one.
func (b *resultBuilder) indScore(i int) float64 {
	rs := b.d.ranks[i]
	c := b.recent[i][mCompute]
	if rs.bestEp != b.d.epoch+1 || math.IsNaN(c) || c <= 0 {
		return 0
	}
	return round3(math.Min(1, rs.best/c))
}

// addFindings adds the active findings, in a fixed order, and the lists
// of slow ranks and communicators they make.
func (b *resultBuilder) addFindings() {
	d, r := b.d, b.r
	keys := make([]findingKey, 0, len(d.findings))
	for k, f := range d.findings {
		if f.active && (k.kind == kindDomain || !d.ranks[k.id].silent) {
			keys = append(keys, k)
		}
	}
	slices.SortFunc(keys, func(a, b findingKey) int {
		return cmp.Or(cmp.Compare(a.kind, b.kind), cmp.Compare(d.subjectOrder(a), d.subjectOrder(b)))
	})
	b.flags = make(map[int][]string)
	b.computeSlow = make(map[int]int64)
	for _, k := range keys {
		f := d.findings[k]
		thr := d.cfg.RelativeThreshold
		recentV, ref, waited, conf := f.evidence(thr, b.tmp)
		fd := Finding{
			Kind: k.kind.String(), Metric: metricNames[f.metric], Method: f.method,
			OnsetStep: f.onset, DetectedStep: f.detected, Confidence: round3(conf),
		}
		if !math.IsNaN(recentV) && !math.IsNaN(ref) {
			fd.Baseline, fd.Recent = round3(ref), round3(recentV)
			if ref > 0 {
				fd.Ratio = round3(recentV / ref)
			}
		} else if k.kind == kindCompute {
			fd.Metric = metricNames[mComm]
		}
		if waited > 0 && f.group >= 0 {
			g := d.groups[f.group]
			fd.Group, fd.GroupKind, fd.WaitedOn = g.name, g.kind, round3(waited)
		}
		if k.kind == kindDomain {
			g := d.groups[k.id]
			fd.Group, fd.GroupKind = g.name, g.kind
			fd.Ranks = d.groupRanks(g)
			r.SlowCommunicationDomains = append(r.SlowCommunicationDomains, fd.Ranks)
			for _, rk := range fd.Ranks {
				b.flags[rk] = append(b.flags[rk], KindCommunicationDomain)
			}
		} else {
			rs := d.ranks[k.id]
			fd.Ranks = []int{rs.rank}
			fd.Node = rs.node
			fd.RelativeScore, fd.IndividualScore = b.relScore(int(k.id)), b.indScore(int(k.id))
			b.flags[rs.rank] = append(b.flags[rs.rank], fd.Kind)
			switch k.kind {
			case kindCompute:
				r.SlowCalculateRanks = append(r.SlowCalculateRanks, rs.rank)
				b.computeSlow[rs.rank] = f.onset
			case kindIO:
				r.SlowIORanks = append(r.SlowIORanks, rs.rank)
			case kindLink:
				r.SlowCommunicationRanks = append(r.SlowCommunicationRanks, rs.rank)
				for _, gi := range rs.groups {
					if g := d.groups[gi]; g.pp {
						if ranks := d.groupRanks(g); !containsDomain(r.SlowCommunicationDomains, ranks) {
							r.SlowCommunicationDomains = append(r.SlowCommunicationDomains, ranks)
						}
					}
				}
			}
		}
		r.Findings = append(r.Findings, fd)
	}

}

// addHosts adds the slow hosts: every live rank of the node is slow to
// compute.
func (b *resultBuilder) addHosts() {
	d, r := b.d, b.r
	nodes := map[string][]int{}
	for _, rs := range d.ranks {
		if !rs.silent && rs.steps > 0 {
			nodes[rs.node] = append(nodes[rs.node], rs.rank)
		}
	}
	var hostFindings []Finding
	for node, ranks := range nodes {
		onset, detected := int64(math.MaxInt64), int64(-1)
		all := true
		for _, rk := range ranks {
			o, ok := b.computeSlow[rk]
			if !ok {
				all = false
				break
			}
			onset = min(onset, o)
		}
		if !all || len(ranks) == 0 {
			continue
		}
		slices.Sort(ranks)
		r.SlowHostNodes = append(r.SlowHostNodes, node)
		// The mean of its ranks' evidence, over those that have one.
		var ratio, conf, base, rec float64
		var n int
		for _, f := range r.Findings {
			if f.Kind == KindCompute && slices.Contains(ranks, f.Ranks[0]) {
				conf = max(conf, f.Confidence)
				detected = max(detected, f.DetectedStep)
				if f.Metric == "compute" && f.Baseline > 0 {
					ratio, base, rec, n = ratio+f.Ratio, base+f.Baseline, rec+f.Recent, n+1
				}
			}
		}
		hf := Finding{Kind: KindHost, Ranks: ranks, Node: node, Metric: "compute",
			Method: "all ranks of the node", OnsetStep: onset, DetectedStep: detected, Confidence: conf}
		if n > 0 {
			hf.Baseline, hf.Recent, hf.Ratio = round3(base/float64(n)), round3(rec/float64(n)), round3(ratio/float64(n))
		}
		hostFindings = append(hostFindings, hf)
		for _, rk := range ranks {
			b.flags[rk] = append(b.flags[rk], KindHost)
		}
	}
	slices.Sort(r.SlowHostNodes)
	slices.SortFunc(hostFindings, func(a, b Finding) int { return cmp.Compare(a.Node, b.Node) })
	r.Findings = append(r.Findings, hostFindings...)
	slices.Sort(r.SlowCalculateRanks)
	slices.Sort(r.SlowIORanks)
	slices.Sort(r.SlowCommunicationRanks)

}

// summarise says whether the job is slow, since when, and how much.
func (b *resultBuilder) summarise() {
	d, r := b.d, b.r
	if len(r.Findings) > 0 {
		r.IsSlow = 1
		r.OnsetStep = math.MaxInt64
		for _, f := range r.Findings {
			r.OnsetStep = min(r.OnsetStep, f.OnsetStep)
			r.Confidence = max(r.Confidence, f.Confidence)
		}
		if d.job.degraded && d.job.onset >= 0 {
			r.OnsetStep = min(r.OnsetStep, d.job.onset)
		}
	}
	r.DegradationLevel = "0.0%"
	if r.IsSlow == 1 {
		r.DegradationLevel = strconv.FormatFloat(d.job.level(b.tmp), 'f', 1, 64) + "%"
	}

}

// addRanks adds each rank's summary and what no rank has.
func (b *resultBuilder) addRanks() {
	d, r := b.d, b.r
	var have Figures
	var scored [2]bool // some rank has a relative, an individual score
	for i, rs := range d.ranks {
		have |= rs.asm.have
		s := RankSummary{Rank: rs.rank, Node: rs.node, Status: "ok", LastStep: rs.last, Stage: rs.stage,
			Flags: b.flags[rs.rank]}
		switch {
		case rs.silent:
			s.Status = "silent"
			r.SilentRanks = append(r.SilentRanks, rs.rank)
		case rs.steps == 0:
			s.Status = "waiting"
		case len(s.Flags) > 0:
			s.Status = "slow"
		}
		m := b.recent[i]
		s.StepMs, s.ComputeMs, s.ForwardMs = round3(m[mStep]), round3(m[mCompute]), round3(m[mForward])
		s.GapMs, s.FPBPMs, s.TrailingMs = round3(m[mGap]), round3(m[mFPBP]), round3(m[mTrailing])
		s.DataLoaderMs, s.CheckpointMs = round3(m[mDataLoader]), round3(m[mCheckpoint])
		s.CommMs, s.SendMs = round3(m[mComm]), round3(m[mSend])
		s.RelativeScore, s.IndividualScore = b.relScore(i), b.indScore(i)
		if rs.steps > 0 {
			s.Unavailable = (allFigures &^ rs.asm.have).Names()
			if s.RelativeScore == 0 {
				s.Unavailable = append(s.Unavailable, relativeScore)
			}
			if s.IndividualScore == 0 {
				s.Unavailable = append(s.Unavailable, individualScore)
			}
		}
		scored[0] = scored[0] || s.RelativeScore > 0
		scored[1] = scored[1] || s.IndividualScore > 0
		r.Ranks = append(r.Ranks, s)
	}
	slices.SortFunc(r.Ranks, func(a, b RankSummary) int { return cmp.Compare(a.Rank, b.Rank) })
	slices.Sort(r.SilentRanks)
	if len(d.ranks) > 0 {
		for _, name := range (allFigures &^ have).Names() {
			r.Unavailable = append(r.Unavailable, Missing{name, missingReason(name, have)})
		}
		needs := "needs compute"
		if have&FigCompute != 0 {
			needs = "needs " + strconv.Itoa(d.cfg.Window) + " steps with compute since the start or the last phase change"
		}
		if !scored[0] {
			r.Unavailable = append(r.Unavailable, Missing{relativeScore, "needs compute"})
		}
		if !scored[1] {
			r.Unavailable = append(r.Unavailable, Missing{individualScore, needs})
		}
	}
	if r.Ranks == nil {
		r.Ranks = []RankSummary{}
	}

}

// history is the charts' history of the job and of each rank.
func (d *Detector) history() *History {
	h := &History{job: d.job.hist.snapshot(), ranks: make(map[int][]histPoint, len(d.ranks))}
	for _, rs := range d.ranks {
		h.ranks[rs.rank] = rs.hist.snapshot()
	}
	return h
}

// Names of the scores in Missing and RankSummary.Unavailable.
const (
	relativeScore   = "relative score"
	individualScore = "individual score"
)

// missingReason says why the figure name is missing from every rank,
// have being the figures some rank has.
func missingReason(name string, have Figures) string {
	switch name {
	case "step":
		return `no "step <n>" markers`
	case "compute":
		return "communication ranges covered forward and backward in every step"
	case "forward":
		return "no forward markers (the FP switch is off)"
	case "dataloader":
		return "no dataloader markers (the DataLoader switch is off)"
	case "checkpoint":
		return "no save_checkpoint markers: no checkpoint saved, or the SaveCheckpoint switch off"
	case "communication":
		return "no communication markers (the CommunicationOperator switch is off)"
	case "send":
		if have&FigComm == 0 {
			return "no communication markers (the CommunicationOperator switch is off)"
		}
		return "no send among the communication ops (no pipeline parallelism)"
	case "trajectory":
		return "needs forward markers (the FP switch is off)"
	}
	return "not in the markers"
}

func (d *Detector) subjectOrder(k findingKey) int {
	if k.kind == kindDomain {
		return int(k.id)
	}
	return d.ranks[k.id].rank
}

func (d *Detector) groupRanks(g *group) []int {
	out := make([]int, 0, len(g.members))
	for _, ri := range g.members {
		out = append(out, d.ranks[ri].rank)
	}
	slices.Sort(out)
	return out
}

func containsDomain(ds [][]int, ranks []int) bool {
	for _, d := range ds {
		if slices.Equal(d, ranks) {
			return true
		}
	}
	return false
}
