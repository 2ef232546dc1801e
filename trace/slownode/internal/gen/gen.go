// Package gen writes synthetic dotting traces of a training job through
// the real record format, with slow ranks, nodes, communicators, links
// and data loading injected where asked, for the tests and benchmarks of
// package slownode.
//
// The job is simulated step by step: every rank loads data, runs its
// pipeline stage's forward and backward chunks with a tensor-parallel
// all-reduce after each chunk, passes activations and gradients to its
// pipeline neighbours, and all-reduces gradients with its data-parallel
// peers. Collectives end when their last member arrives, so a slow rank
// makes its peers wait, as on real hardware.
package gen

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	"github.com/faultline-ml/faultline/trace"
)

// Kind is what an Injection makes slow.
type Kind int

// The injections.
const (
	SlowRank   Kind = iota // Rank computes Factor× slower
	SlowNode               // every rank of Node computes Factor× slower
	SlowTPComm             // the collectives of tensor-parallel group Group take Factor× longer
	SlowIO                 // Rank loads data Factor× slower
	SlowLink               // the pipeline sends of Rank take Factor× longer
	Phase                  // every rank computes Factor× slower: not a slow node
	Silent                 // Rank stops writing records
)

// Injection is one thing made slow from step From on.
type Injection struct {
	Kind   Kind
	Rank   int
	Node   int
	Group  int // tensor-parallel group index: ranks [Group×TP, (Group+1)×TP) of stage 0
	From   int
	Factor float64
}

// Config describes a job to generate.
type Config struct {
	Root, Job      string
	TP, PP, DP     int // world = TP×PP×DP; rank = tp + TP×(dp + DP×pp)
	RanksPerNode   int // default 8
	Steps          int
	Seed           uint64
	Noise          float64       // relative σ of every duration; default 0.02
	Outliers       int           // single-step compute spikes (2.5×) on random ranks
	Chunks         int           // forward and backward chunks per step, each with a TP all-reduce; default 2
	Compute        time.Duration // forward compute per chunk; backward takes twice that; default 10ms
	DataLoader     time.Duration // default 4ms
	CheckpointEach int           // save a checkpoint every n steps; 0: never
	NoComm         bool          // write no communication records (domain off)
	NoForward      bool          // write no forward records
	NCCL           bool          // NCCL op names instead of HCCL ones
	SkewMax        time.Duration // each rank's clock is off by up to this much; default 30s
	StepsPerFile   int           // a new record file every n steps; default 50
	Garbage        bool          // sprinkle garbage lines and unmatched ends
	Inject         []Injection
}

// Truth is what the injections should be found as.
type Truth struct {
	SlowCompute []int
	SlowHosts   []string
	SlowDomains [][]int
	SlowIO      []int
	SlowLinks   []int
	Silent      []int
	Onset       int // first step of the earliest injection; -1 if none
	Phase       bool
}

// Layout helpers.
func (c *Config) world() int { return c.TP * c.PP * c.DP }

func (c *Config) rank(tp, dp, pp int) int { return tp + c.TP*(dp+c.DP*pp) }

func (c *Config) coords(r int) (tp, dp, pp int) {
	return r % c.TP, (r / c.TP) % c.DP, r / (c.TP * c.DP)
}

// NodeName is the host name the generator gives node k, as a rank table
// would: the slownode package's default mapping names it the same.
func NodeName(k int) string { return "node-" + strconv.Itoa(k) }

type rankOut struct {
	dir      string
	buf      []byte
	file     string
	id       uint64
	skew     float64
	pid, tid uint32
	dev      uint32
	silent   bool
	stepAt   int // offset in buf where the current step's records begin
}

type sim struct {
	cfg   Config
	rng   *rand.Rand
	out   []rankOut
	t     []float64 // true time per rank, ns
	start float64
	names map[string]string // op name cache
	scale [numInj][]float64 // current factors
}

const (
	injCompute = iota
	injTP      // per TP group index in all stages
	injIO
	injLink
	numInj
)

// Generate writes the job and returns what should be found.
func Generate(cfg Config) (Truth, error) {
	if cfg.TP < 1 || cfg.PP < 1 || cfg.DP < 1 || cfg.Steps < 1 {
		return Truth{}, errors.New("gen: TP, PP, DP and Steps must be positive")
	}
	def := func(p *int, v int) {
		if *p == 0 {
			*p = v
		}
	}
	def(&cfg.RanksPerNode, 8)
	def(&cfg.Chunks, 2)
	def(&cfg.StepsPerFile, 50)
	cfg.Noise = cmp.Or(cfg.Noise, 0.02)
	cfg.Compute = cmp.Or(cfg.Compute, 10*time.Millisecond)
	cfg.DataLoader = cmp.Or(cfg.DataLoader, 4*time.Millisecond)
	cfg.SkewMax = cmp.Or(cfg.SkewMax, 30*time.Second)
	s := &sim{cfg: cfg, rng: rand.New(rand.NewPCG(cfg.Seed, 0x5eed)), names: map[string]string{}}
	n := cfg.world()
	jobDir := filepath.Join(cfg.Root, cfg.Job)
	s.out = make([]rankOut, n)
	s.t = make([]float64, n)
	s.start = 1.7e18
	for i := range s.scale {
		s.scale[i] = make([]float64, n)
	}
	for r := range n {
		dir := filepath.Join(jobDir, strconv.Itoa(r))
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return Truth{}, err
		}
		o := &s.out[r]
		o.dir = dir
		o.skew = (s.rng.Float64()*2 - 1) * float64(cfg.SkewMax)
		o.pid = uint32(10000 + r)
		o.tid = o.pid
		o.dev = uint32(r % cfg.RanksPerNode)
		// The real format, without the fsyncs of trace.WriteParallelGroups:
		// thousands of them make tests slow and prove nothing here.
		b, err := s.groupsOf(r).Marshal()
		if err == nil {
			err = os.WriteFile(filepath.Join(dir, trace.ParallelGroupFile), b, 0o640)
		}
		if err != nil {
			return Truth{}, err
		}
	}
	outliers := map[[2]int]bool{}
	for range cfg.Outliers {
		outliers[[2]int{s.rng.IntN(cfg.Steps), s.rng.IntN(n)}] = true
	}
	for step := range cfg.Steps {
		s.applyInjections(step)
		if err := s.step(step, outliers); err != nil {
			return Truth{}, err
		}
	}
	for r := range s.out {
		if err := s.flush(r); err != nil {
			return Truth{}, err
		}
	}
	return s.truth(), nil
}

func (s *sim) commName(group string) string { return "group_" + group }

// groupsOf returns the parallel_group.json content of rank r.
func (s *sim) groupsOf(r int) trace.ParallelGroups {
	c := &s.cfg
	tp, dp, pp := c.coords(r)
	g := trace.ParallelGroups{}
	add := func(kind, name string, members []int) {
		g[s.commName(name)] = trace.ParallelGroup{GroupName: kind, GroupRank: slices.Index(members, r), GlobalRanks: members}
	}
	if c.TP > 1 {
		add("tp", s.tpName(dp, pp), s.tpMembers(dp, pp))
	}
	if c.DP > 1 {
		add("dp", s.dpName(tp, pp), s.dpMembers(tp, pp))
	}
	if c.PP > 1 {
		add("pp", s.ppName(tp, dp), s.ppMembers(tp, dp))
	}
	return g
}

func (s *sim) tpName(dp, pp int) string { return fmt.Sprintf("tp_%d", dp+s.cfg.DP*pp) }
func (s *sim) dpName(tp, pp int) string { return fmt.Sprintf("dp_%d", tp+s.cfg.TP*pp) }
func (s *sim) ppName(tp, dp int) string { return fmt.Sprintf("pp_%d", tp+s.cfg.TP*dp) }

func (s *sim) tpMembers(dp, pp int) []int {
	var m []int
	for tp := range s.cfg.TP {
		m = append(m, s.cfg.rank(tp, dp, pp))
	}
	return m
}

func (s *sim) dpMembers(tp, pp int) []int {
	var m []int
	for dp := range s.cfg.DP {
		m = append(m, s.cfg.rank(tp, dp, pp))
	}
	return m
}

func (s *sim) ppMembers(tp, dp int) []int {
	var m []int
	for pp := range s.cfg.PP {
		m = append(m, s.cfg.rank(tp, dp, pp))
	}
	return m
}

func (s *sim) applyInjections(step int) {
	n := s.cfg.world()
	for i := range s.scale {
		for r := range n {
			s.scale[i][r] = 1
		}
	}
	for _, in := range s.cfg.Inject {
		if step < in.From {
			continue
		}
		switch in.Kind {
		case SlowRank:
			s.scale[injCompute][in.Rank] *= in.Factor
		case SlowNode:
			for r := in.Node * s.cfg.RanksPerNode; r < min(n, (in.Node+1)*s.cfg.RanksPerNode); r++ {
				s.scale[injCompute][r] *= in.Factor
			}
		case Phase:
			for r := range n {
				s.scale[injCompute][r] *= in.Factor
			}
		case SlowTPComm:
			s.scale[injTP][in.Group] *= in.Factor
		case SlowIO:
			s.scale[injIO][in.Rank] *= in.Factor
		case SlowLink:
			s.scale[injLink][in.Rank] *= in.Factor
		case Silent:
			s.out[in.Rank].silent = true
		}
	}
}

// noisy returns d (ns) with multiplicative log-normal noise.
func (s *sim) noisy(d float64) float64 {
	return d * math.Exp(s.rng.NormFloat64()*s.cfg.Noise)
}

// emit writes a range of rank r from true times a to b.
func (s *sim) emit(r int, name, domain string, a, b float64, host bool) {
	o := &s.out[r]
	if o.silent {
		return
	}
	o.id++
	rec := trace.Record{Kind: trace.ActivityKindMarker, Flag: trace.FlagDeviceStart, SourceKind: trace.SourceKindDevice,
		Timestamp: uint64(s.start + a + o.skew), ID: o.id, ProcessID: o.pid, ThreadID: o.tid, DeviceID: o.dev,
		Name: name, Domain: domain}
	if host {
		rec.Flag, rec.SourceKind = trace.FlagHostStart, trace.SourceKindHost
	}
	o.buf = rec.AppendJSON(o.buf)
	o.buf = append(o.buf, '\n')
	rec.Flag <<= 1 // start → end: 2 → 4, 16 → 32
	rec.Timestamp = uint64(s.start + b + o.skew)
	rec.Name = "" // mspti names only the start
	o.buf = rec.AppendJSON(o.buf)
	o.buf = append(o.buf, '\n')
}

func (s *sim) op(kind, group string) string {
	key := kind + "\x00" + group
	if n, ok := s.names[key]; ok {
		return n
	}
	name := map[bool]map[string]string{
		false: {"allreduce": "HcclAllReduce", "send": "HcclSend", "recv": "HcclRecv"},
		true:  {"allreduce": "ncclAllReduce", "send": "ncclSend", "recv": "ncclRecv"},
	}[s.cfg.NCCL][kind]
	op := trace.CommOp{OpName: name, GroupName: s.commName(group), Count: 1 << 20, DataType: "fp16", StreamID: 3}
	n := string(op.AppendJSON(nil))
	s.names[key] = n
	return n
}

// collective runs one collective over members that arrive at t[r]
// (after compute of their own): it ends when the last arrives plus dur.
func (s *sim) collective(members []int, group string, dur float64) {
	end := 0.0
	for _, r := range members {
		end = max(end, s.t[r])
	}
	end += s.noisy(dur)
	name := s.op("allreduce", group)
	for _, r := range members {
		if !s.cfg.NoComm {
			s.emit(r, name, trace.DomainCommunication, s.t[r], end, false)
		}
		s.t[r] = end
	}
}

func (s *sim) step(step int, outliers map[[2]int]bool) error {
	c := &s.cfg
	n := c.world()
	ms := float64(time.Millisecond)
	fc := float64(c.Compute)
	tpDur, dpDur, sendDur := 1.5*ms, 6*ms, 2*ms
	stepStart := make([]float64, n)
	for r := range n {
		stepStart[r] = s.t[r]
		if err := s.flushIfDue(r, step); err != nil {
			return err
		}
	}
	comp := func(r int) float64 {
		f := s.scale[injCompute][r]
		if outliers[[2]int{step, r}] {
			f *= 2.5
		}
		return f
	}
	// Data loading.
	for r := range n {
		d := s.noisy(float64(c.DataLoader)) * s.scale[injIO][r]
		s.emit(r, trace.MarkerDataLoader, trace.DomainDefault, s.t[r], s.t[r]+d, true)
		s.t[r] += d
	}
	fwdSend := make([]float64, n)
	bwdSend := make([]float64, n)
	fwdStart := make([]float64, n)
	for pp := range c.PP {
		for dp := range c.DP {
			members := s.tpMembers(dp, pp)
			tpGroup := dp + c.DP*pp
			for _, r := range members {
				if pp > 0 {
					prev := c.rank(r%c.TP, dp, pp-1)
					a := s.t[r]
					s.t[r] = max(s.t[r], fwdSend[prev])
					if !c.NoComm {
						s.emit(r, s.op("recv", s.ppName(r%c.TP, dp)), trace.DomainCommunication, a, s.t[r], false)
					}
				}
				fwdStart[r] = s.t[r]
			}
			for range c.Chunks {
				for _, r := range members {
					s.t[r] += s.noisy(fc) * comp(r)
				}
				if c.TP > 1 {
					s.collective(members, s.tpName(dp, pp), tpDur*s.scale[injTP][tpGroup])
				}
			}
			for _, r := range members {
				if !c.NoForward {
					s.emit(r, trace.MarkerForward, trace.DomainDefault, fwdStart[r], s.t[r], false)
				}
				if pp < c.PP-1 {
					d := s.noisy(sendDur) * s.scale[injLink][r]
					if !c.NoComm {
						s.emit(r, s.op("send", s.ppName(r%c.TP, dp)), trace.DomainCommunication, s.t[r], s.t[r]+d, false)
					}
					s.t[r] += d
					fwdSend[r] = s.t[r]
				}
			}
		}
	}
	for pp := c.PP - 1; pp >= 0; pp-- {
		for dp := range c.DP {
			members := s.tpMembers(dp, pp)
			tpGroup := dp + c.DP*pp
			for _, r := range members {
				if pp < c.PP-1 {
					next := c.rank(r%c.TP, dp, pp+1)
					a := s.t[r]
					s.t[r] = max(s.t[r], bwdSend[next])
					if !c.NoComm {
						s.emit(r, s.op("recv", s.ppName(r%c.TP, dp)), trace.DomainCommunication, a, s.t[r], false)
					}
				}
			}
			for range c.Chunks {
				for _, r := range members {
					s.t[r] += 2 * s.noisy(fc) * comp(r)
				}
				if c.TP > 1 {
					s.collective(members, s.tpName(dp, pp), tpDur*s.scale[injTP][tpGroup])
				}
			}
			for _, r := range members {
				if pp > 0 {
					d := s.noisy(sendDur) * s.scale[injLink][r]
					if !c.NoComm {
						s.emit(r, s.op("send", s.ppName(r%c.TP, dp)), trace.DomainCommunication, s.t[r], s.t[r]+d, false)
					}
					s.t[r] += d
					bwdSend[r] = s.t[r]
				}
			}
		}
	}
	if c.DP > 1 {
		for pp := range c.PP {
			for tp := range c.TP {
				s.collective(s.dpMembers(tp, pp), s.dpName(tp, pp), dpDur)
			}
		}
	}
	for r := range n {
		s.t[r] += s.noisy(2*ms) * comp(r) // optimizer
		if c.CheckpointEach > 0 && step > 0 && step%c.CheckpointEach == 0 {
			d := s.noisy(20 * ms)
			s.emit(r, trace.MarkerSaveCheckpoint, trace.DomainDefault, s.t[r], s.t[r]+d, false)
			s.t[r] += d
		}
	}
	// The step range: its start record goes before the step's other
	// records, as a writer emits it at the step's start.
	for r := range n {
		s.stepRange(r, step, stepStart[r])
		if c.Garbage && s.rng.IntN(20) == 0 {
			s.garbage(r)
		}
	}
	return nil
}

// stepRange inserts the step's start record before the records written
// since the step began, and appends its end.
func (s *sim) stepRange(r, step int, start float64) {
	o := &s.out[r]
	if o.silent {
		return
	}
	mark := len(o.buf)
	s.emit(r, trace.StepMarkerPrefix+strconv.Itoa(step), trace.DomainDefault, start, s.t[r], false)
	// emit appended start+end; move the start line to the step's beginning.
	lines := o.buf[mark:]
	nl := slices.Index(lines, '\n')
	startLine := slices.Clone(lines[:nl+1])
	endLine := slices.Clone(lines[nl+1:])
	o.buf = o.buf[:mark]
	at := o.stepAt
	o.buf = slices.Insert(o.buf, at, startLine...)
	o.buf = append(o.buf, endLine...)
	o.stepAt = len(o.buf)
}

func (s *sim) garbage(r int) {
	o := &s.out[r]
	if o.silent {
		return
	}
	junk := []string{"\x00\x01\x02garbage", `{"Kind":1,"Flag":`, "not json at all", `{"Kind":1,"Flag":32,"SourceKind":1,"Timestamp":5,"Id":999999999}`}
	o.buf = append(o.buf, junk[s.rng.IntN(len(junk))]...)
	o.buf = append(o.buf, '\n')
	o.stepAt = len(o.buf)
}

// flushIfDue writes out the rank's buffer, and starts a new record file
// every StepsPerFile steps, named by the rank's own clock as a writer
// names them.
func (s *sim) flushIfDue(r, step int) error {
	o := &s.out[r]
	if step%s.cfg.StepsPerFile != 0 {
		if len(o.buf) > 64<<10 {
			return s.flush(r)
		}
		return nil
	}
	if err := s.flush(r); err != nil {
		return err
	}
	name := trace.RecordFileName(time.Unix(0, int64(s.start+s.t[r]+o.skew)))
	if name <= o.file {
		sec, _ := strconv.ParseInt(o.file, 10, 64)
		name = fmt.Sprintf("%010d", sec+1)
	}
	o.file = name
	return nil
}

// flush appends the rank's finished steps to its current file.
func (s *sim) flush(r int) error {
	o := &s.out[r]
	if o.stepAt == 0 || o.file == "" {
		return nil
	}
	f, err := os.OpenFile(filepath.Join(o.dir, o.file), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o640)
	if err != nil {
		return err
	}
	_, err = f.Write(o.buf[:o.stepAt])
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	o.buf = append(o.buf[:0], o.buf[o.stepAt:]...)
	o.stepAt = 0
	return err
}

func (s *sim) truth() Truth {
	c := &s.cfg
	t := Truth{Onset: -1}
	onset := math.MaxInt
	for _, in := range c.Inject {
		if in.Kind != Silent {
			onset = min(onset, in.From)
		}
		switch in.Kind {
		case SlowRank:
			t.SlowCompute = append(t.SlowCompute, in.Rank)
		case SlowNode:
			for r := in.Node * c.RanksPerNode; r < min(c.world(), (in.Node+1)*c.RanksPerNode); r++ {
				t.SlowCompute = append(t.SlowCompute, r)
			}
			t.SlowHosts = append(t.SlowHosts, NodeName(in.Node))
		case SlowTPComm:
			dp, pp := in.Group%c.DP, in.Group/c.DP
			t.SlowDomains = append(t.SlowDomains, s.tpMembers(dp, pp))
		case SlowIO:
			t.SlowIO = append(t.SlowIO, in.Rank)
		case SlowLink:
			t.SlowLinks = append(t.SlowLinks, in.Rank)
			tp, dp, _ := c.coords(in.Rank)
			t.SlowDomains = append(t.SlowDomains, s.ppMembers(tp, dp))
		case Phase:
			t.Phase = true
		case Silent:
			t.Silent = append(t.Silent, in.Rank)
		}
	}
	if onset != math.MaxInt {
		t.Onset = onset
	}
	slices.Sort(t.SlowCompute)
	return t
}
