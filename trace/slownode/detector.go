package slownode

import (
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/faultline-ml/faultline/trace"
)

// metric indexes the per-step figures the detector keeps per rank.
type metric uint8

const (
	mStep metric = iota
	mCompute
	mDataLoader
	mCheckpoint
	mSend
	mGap
	mFPBP
	mTrailing
	mComm
	mForward
	numMetrics
)

// Bounds on what hostile or unusual input can make the detector keep.
const (
	maxOpCache = 4096    // op names (JSON) whose parse is cached
	maxOps     = 1 << 14 // distinct (communicator, op) pairs
	maxGroups  = 1 << 14 // communicators
)

// minSpread floors the robust σ of a peer set at this fraction of its
// median, so that near-identical peers do not make noise significant.
const minSpread = 0.01

// Stats counts input the Detector set aside.
type Stats struct {
	Ranges         uint64 `json:"ranges"`         // ranges taken
	Steps          uint64 `json:"steps"`          // rank steps taken
	Evaluated      uint64 `json:"evaluated"`      // job steps evaluated
	IgnoredRanges  uint64 `json:"ignoredRanges"`  // ranges of no kind the detector uses, or of an ignored rank
	IgnoredRanks   uint64 `json:"ignoredRanks"`   // ranks refused: negative, or beyond MaxRanks
	BadRanges      uint64 `json:"badRanges"`      // ranges that end before they start
	BadCommOps     uint64 `json:"badCommOps"`     // communication ranges whose name is not an op
	DroppedRanges  uint64 `json:"droppedRanges"`  // ranges beyond MaxPendingRanges in one step
	LateSteps      uint64 `json:"lateSteps"`      // rank steps that arrived after their step was evaluated
	RepeatedSteps  uint64 `json:"repeatedSteps"`  // rank steps not after the rank's previous one
	IncompleteRows uint64 `json:"incompleteRows"` // steps evaluated before every live rank was done with them
}

// Detector is the streaming core: it takes ranges (or whole steps) per
// rank, evaluates each step once every live rank has reported it (or a
// later one, having skipped it), and keeps its findings up to date. It
// does no I/O, starts no goroutine, reads no clock, and its memory is
// bounded per rank and per communicator whatever the length of the job.
// A Detector is not safe for concurrent use.
type Detector struct {
	cfg Config

	ranks   []*rankState
	index   map[int]int32
	lastIdx int32 // dense index of the previous Add's rank, for the common run

	groups []*group
	gindex map[string]int32

	ops        []commOp
	opIdx      map[string]int32
	opKey      map[string]int32
	opOverflow int32

	rows      map[int64]*row
	open      []int64 // steps with a row, increasing
	free      []*row
	firstStep int64 // first step number seen, for ranks that never report one
	maxStep   int64
	evaluated int64 // last evaluated step
	live      int   // ranks not silent

	hold bool // a reading pass is under way: evaluate nothing yet

	job      jobState
	jitter   []stageJitter // per pipeline stage
	findings map[findingKey]*finding
	epoch    int // bumps at each phase change, resetting rank bests

	// changes counts what may change the lists of a verdict: a finding
	// made or cleared, a rank falling silent or back, its first step, a
	// phase change. afterStep, when set, is called after each evaluated
	// step: Watch passes on a changed verdict as of the step that changed
	// it.
	changes   uint64
	afterStep func()

	st       Step
	stOps    []int32                  // the op index of each of st.Comm
	slots    []int                    // addStep's: the comm slot of each of a step's ops
	stepHook func(rank int, st *Step) // tests: each step derived from ranges
	scratch  scratch
	stats    Stats
}

type rankState struct {
	ops     [recentOps]recentOp // the rank's latest communication names
	nextOp  int                 // the entry of ops to replace next
	rank    int
	node    string
	asm     assembler
	last    int64 // last step taken, -1 before the first
	silent  bool
	stage   int
	groups  []int32 // communicators, in the order of a cell's comm slots
	win     [numMetrics]window
	commWin window // total communication
	best    float64
	bestEp  int
	block   []float64
	hist    history
	steps   uint64
}

// recentOps is how many communication names a rank remembers. A rank
// repeats a few ops (its tensor-, data- and pipeline-parallel
// collectives) step after step, and a reader hands it the same string for
// each, which compares equal at once; opIdx would hash the whole name.
const recentOps = 8

type recentOp struct {
	name string
	op   int32
}

// recentOp returns the op index of a communication name the rank used
// lately.
func (rs *rankState) recentOp(name string) (int32, bool) {
	for k := range rs.ops {
		if e := &rs.ops[k]; e.name == name && name != "" {
			return e.op, true
		}
	}
	return 0, false
}

// keepOp remembers the op index of a communication name in place of the
// one remembered longest ago.
func (rs *rankState) keepOp(name string, op int32) {
	rs.ops[rs.nextOp] = recentOp{name, op}
	rs.nextOp = (rs.nextOp + 1) % recentOps
}

type group struct {
	name     string
	kind     string
	pp       bool
	declared bool
	members  []int32
	value    float64 // this step's median communication time, NaN if none
	flagged  bool    // homogenisation found a split this step
	masked   bool    // waited more this step, but a member explains it
}

type row struct {
	step int64
	// n counts the ranks done with the step: those that reported it, and
	// those that reported a later one without it (a rank whose dotting
	// was switched on mid-step, or off for a while), which never will:
	// steps of one rank come in order.
	n     int
	cells []cell
	more  []float64 // the comm slots of cells beyond their first cellComm
}

// cellComm is how many communicators' figures a cell holds in place: a
// rank is in three or so (tensor, data and pipeline parallel). Keeping
// them there spares a cache miss a rank step, and leaves cells without
// pointers for the collector to scan.
const cellComm = 3

type cell struct {
	ok    bool
	nComm int32               // comm slots in use, per rankState.groups
	more  int32               // where slots from cellComm on start in the row's more
	m     [numMetrics]float64 // ms; NaN when unavailable
	comm  [cellComm]float64   // the first slots; NaN when none this step
}

// commAt returns the figure of comm slot k of c, NaN if none.
func (rw *row) commAt(c *cell, k int) float64 {
	switch {
	case k >= int(c.nComm):
		return math.NaN()
	case k < cellComm:
		return c.comm[k]
	}
	return rw.more[int(c.more)+k-cellComm]
}

// setComm makes c hold n comm slots, all NaN.
func (rw *row) setComm(c *cell, n int) {
	nan := math.NaN()
	c.nComm = int32(n)
	for i := range c.comm {
		c.comm[i] = nan
	}
	if n > cellComm {
		c.more = int32(len(rw.more))
		for range n - cellComm {
			rw.more = append(rw.more, nan)
		}
	}
}

// addComm adds t to comm slot k of c, which holds it.
func (rw *row) addComm(c *cell, k int, t float64) {
	var p *float64
	if k < cellComm {
		p = &c.comm[k]
	} else {
		p = &rw.more[int(c.more)+k-cellComm]
	}
	if math.IsNaN(*p) {
		*p = 0
	}
	*p += t
}

// New returns a Detector for cfg.
func New(cfg Config) (*Detector, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	cfg.Nodes = maps.Clone(cfg.Nodes) // setNode must not write to the caller's map
	d := &Detector{
		cfg:        cfg,
		index:      make(map[int]int32),
		lastIdx:    -1,
		gindex:     make(map[string]int32),
		opIdx:      make(map[string]int32),
		opKey:      make(map[string]int32),
		opOverflow: -1,
		rows:       make(map[int64]*row),
		findings:   make(map[findingKey]*finding),
		firstStep:  -1,
		maxStep:    -1,
		evaluated:  -1,
	}
	d.job = newJobState(&d.cfg)
	return d, nil
}

// Config returns the configuration in force, defaults filled in.
func (d *Detector) Config() Config { return d.cfg }

// Stats returns the counters of set-aside input.
func (d *Detector) Stats() Stats { return d.stats }

func (d *Detector) nodeOf(rank int) string {
	if n, ok := d.cfg.Nodes[rank]; ok {
		return n
	}
	return fmt.Sprintf("node-%d", rank/d.cfg.RanksPerNode)
}

// rankIdx returns the dense index of rank, adding it when new, or -1
// for a rank beyond MaxRanks.
func (d *Detector) rankIdx(rank int) int32 {
	if d.lastIdx >= 0 && d.ranks[d.lastIdx].rank == rank {
		return d.lastIdx
	}
	i, ok := d.index[rank]
	if !ok {
		if rank < 0 || len(d.ranks) >= d.cfg.MaxRanks {
			d.stats.IgnoredRanks++
			return -1
		}
		i = int32(len(d.ranks))
		rs := &rankState{rank: rank, node: d.nodeOf(rank), last: -1,
			hist: newHistory(d.cfg.HistoryPoints)}
		rs.asm.last = -1
		// One block for the rank's windows: a step pushes to each.
		w := d.cfg.Window
		buf := make([]float64, (len(rs.win)+1)*w)
		for m := range rs.win {
			rs.win[m] = window{buf: buf[m*w : (m+1)*w : (m+1)*w]}
		}
		rs.commWin = window{buf: buf[len(rs.win)*w:]}
		d.ranks = append(d.ranks, rs)
		d.index[rank] = i
		d.live++
		if d.maxStep >= 0 && d.maxStep-d.firstStep+1 > int64(d.cfg.SilentSteps) {
			rs.silent = true // joins late: silent until it reports a step
			d.live--
			d.changes++
		}
	}
	d.lastIdx = i
	return i
}

// AddRank declares a rank of the job before it reports anything, so that
// steps wait for it (until it is silent) and it is listed.
func (d *Detector) AddRank(rank int) { d.rankIdx(rank) }

// AddGroups declares the communicators of a rank's parallel_group.json:
// their kind ("tp", "dp", "pp", ...) and members. A communicator declared
// twice keeps its first declaration.
func (d *Detector) AddGroups(g trace.ParallelGroups) {
	names := make([]string, 0, len(g))
	for n := range g {
		names = append(names, n)
	}
	slices.Sort(names) // deterministic dense indexes
	for _, name := range names {
		p := g[name]
		gi := d.groupIdx(name)
		if gi < 0 {
			continue
		}
		gr := d.groups[gi]
		if gr.declared {
			continue
		}
		gr.declared = true
		gr.kind = p.GroupName
		gr.pp = strings.EqualFold(p.GroupName, "pp")
		members := make([]int32, 0, len(p.GlobalRanks))
		for pos, r := range p.GlobalRanks {
			ri := d.rankIdx(r)
			if ri < 0 {
				continue
			}
			d.join(ri, gi)
			if gr.pp {
				d.ranks[ri].stage = pos
			}
			members = append(members, ri)
		}
		gr.members = members // in declared order: a PP group's is its stages
	}
}

// groupIdx returns the index of the communicator name, adding it when
// new, or -1 beyond maxGroups.
func (d *Detector) groupIdx(name string) int32 {
	if i, ok := d.gindex[name]; ok {
		return i
	}
	if len(d.groups) >= maxGroups {
		return -1
	}
	i := int32(len(d.groups))
	d.groups = append(d.groups, &group{name: name})
	d.gindex[name] = i
	return i
}

// join makes rank ri a member of group gi and returns its slot.
func (d *Detector) join(ri, gi int32) int {
	rs := d.ranks[ri]
	if k := slices.Index(rs.groups, gi); k >= 0 {
		return k
	}
	rs.groups = append(rs.groups, gi)
	g := d.groups[gi]
	if !slices.Contains(g.members, ri) {
		g.members = append(g.members, ri)
	}
	return len(rs.groups) - 1
}

// Add takes a completed range of rank, in the order the rank's file holds
// them. Ranges of no kind the detector uses are counted and ignored.
func (d *Detector) Add(rank int, r trace.Range) {
	m := markerOf(&r)
	d.add(rank, &m)
}

// marker is what the detector takes of a range: its name, bounds, and
// whether it is a communication op and on a device's clock. A rank's
// queue holds markers between its reader and the detector: half the
// bytes of a trace.Range, and one pointer for the collector, not two.
type marker struct {
	name       string
	start, end uint64
	comm       bool // in the communication domain
	device     bool // a device range, whose clock wins over the host's
}

// markerOf returns the marker of r.
func markerOf(r *trace.Range) marker {
	return marker{name: r.Name, start: r.Start, end: r.End,
		comm: r.Domain == trace.DomainCommunication, device: r.SourceKind == trace.SourceKindDevice}
}

// add is Add for a marker.
func (d *Detector) add(rank int, r *marker) { d.addAt(d.rankIdx(rank), r) }

// addAt is add for the rank of dense index ri, -1 for a refused one.
func (d *Detector) addAt(ri int32, r *marker) {
	if ri < 0 {
		d.stats.IgnoredRanges++
		return
	}
	d.stats.Ranges++
	if r.end < r.start {
		d.stats.BadRanges++
		return
	}
	rs := d.ranks[ri]
	a := &rs.asm
	var kind spanKind
	var op int32
	switch {
	case r.comm:
		i, ok := rs.recentOp(r.name)
		if !ok {
			if i, ok = d.opIdx[r.name]; !ok {
				c, err := trace.ParseCommOp(r.name)
				if err != nil {
					d.stats.BadCommOps++
					return
				}
				i = d.opOf(c.GroupName, c.OpName)
				if len(d.opIdx) < maxOpCache {
					d.opIdx[r.name] = i
				}
			}
			rs.keepOp(r.name, i)
		}
		if !a.useSource(1<<spanComm, r.device) {
			return
		}
		kind, op = spanComm, i
		a.have |= FigComm
	case strings.HasPrefix(r.name, trace.StepMarkerPrefix):
		if !a.useSource(stepBit, r.device) {
			return
		}
		n, ok := parseStepNumber(r.name)
		if !ok {
			n = a.last + 1
		}
		a.finish(&d.st, &d.stOps, n, r.start, r.end, d.ops, uint64(d.cfg.TrailingGap))
		a.last = n
		if d.stepHook != nil {
			d.stepHook(rs.rank, &d.st)
		}
		d.addStep(ri, &d.st, d.stOps)
		return
	case r.name == trace.MarkerForward:
		kind = spanForward
		a.have |= FigForward | FigTrajectory
	case r.name == trace.MarkerDataLoader:
		kind = spanDataLoader
		a.have |= FigDataLoader
	case r.name == trace.MarkerSaveCheckpoint:
		kind = spanCheckpoint
		a.have |= FigCheckpoint
	default:
		d.stats.IgnoredRanges++
		return
	}
	if kind != spanComm && !a.useSource(1<<kind, r.device) {
		return
	}
	if len(a.pending) >= d.cfg.MaxPendingRanges {
		d.stats.DroppedRanges++
		return
	}
	a.pending = append(a.pending, span{kind: kind, op: op, start: r.start, end: r.end})
}

// AddStep takes a step of rank derived elsewhere (a live stream, another
// agent). Steps of one rank must come in increasing order; others are
// counted and dropped.
func (d *Detector) AddStep(rank int, st Step) {
	ri := d.rankIdx(rank)
	switch {
	case ri < 0:
		return
	case st.Number < 0:
		d.stats.RepeatedSteps++
		return
	}
	d.addStep(ri, &st, nil)
}

// opOf interns a (communicator, op) pair. Beyond maxOps distinct pairs,
// further ones share one entry with no communicator: their time still
// counts for the rank, not for a communicator.
func (d *Detector) opOf(group, op string) int32 {
	k := group + "\x00" + op
	if i, ok := d.opKey[k]; ok {
		return i
	}
	if len(d.ops) >= maxOps {
		if d.opOverflow < 0 {
			d.opOverflow = int32(len(d.ops))
			d.ops = append(d.ops, commOp{gi: -1}) // no communicator
		}
		return d.opOverflow
	}
	i := int32(len(d.ops))
	d.ops = append(d.ops, commOp{group: group, op: op, send: isSend(op), gi: unresolved})
	d.opKey[k] = i
	return i
}

// opGroup returns the communicator index of op, -1 for none, looked up
// by name the first time only.
func (d *Detector) opGroup(op int32) int32 {
	o := &d.ops[op]
	if o.gi == unresolved {
		o.gi = -1
		if o.group != "" {
			o.gi = d.groupIdx(o.group)
		}
	}
	return o.gi
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }

// addStep takes a step of rank ri. ops, when not nil, holds the op index
// of each of st.Comm, which spares looking their communicators up by name.
func (d *Detector) addStep(ri int32, st *Step, ops []int32) {
	rs := d.ranks[ri]
	d.stats.Steps++
	switch {
	case st.Number <= rs.last:
		d.stats.RepeatedSteps++
		return
	case st.Number <= d.evaluated:
		d.stats.LateSteps++
		rs.last = st.Number
		return
	}
	if d.firstStep < 0 {
		d.firstStep = st.Number
	}
	d.skip(rs.last, st.Number)
	rw := d.rows[st.Number]
	if rw == nil {
		rw = d.newRow(st.Number)
	}
	if n := len(d.ranks); len(rw.cells) < n {
		rw.cells = slices.Grow(rw.cells, n-len(rw.cells))[:n]
	}
	c := &rw.cells[ri]
	if !c.ok {
		rw.n++
	}
	c.ok = true
	nan := math.NaN()
	for i := range c.m {
		c.m[i] = nan
	}
	c.m[mStep] = ms(st.Time)
	have := st.Have | FigStep
	if st.Compute > 0 {
		c.m[mCompute] = ms(st.Compute)
		have |= FigCompute
	} else {
		have &^= FigCompute
	}
	if have&FigDataLoader != 0 {
		c.m[mDataLoader] = ms(st.DataLoader)
	}
	if st.Checkpoint > 0 { // most steps save none: keep the saves only
		c.m[mCheckpoint] = ms(st.Checkpoint)
	}
	if have&FigForward != 0 {
		c.m[mForward] = ms(st.Forward)
	}
	if have&FigTrajectory != 0 {
		c.m[mGap], c.m[mFPBP], c.m[mTrailing] = ms(st.Gap), ms(st.FPBP), ms(st.Trailing)
	}
	// The rank joins the communicators of its ops first, so that the
	// cell is laid out for all of them.
	slots := d.slots[:0]
	for i, ct := range st.Comm {
		gi := int32(-1)
		switch {
		case ops != nil:
			gi = d.opGroup(ops[i])
		case ct.Group != "":
			gi = d.groupIdx(ct.Group)
		}
		slot := -1
		if gi >= 0 {
			slot = d.join(ri, gi)
		}
		slots = append(slots, slot)
	}
	d.slots = slots
	rw.setComm(c, len(rs.groups))
	if have&FigComm != 0 || len(st.Comm) > 0 {
		var total, send float64
		for i, ct := range st.Comm {
			t := ms(ct.Time)
			total += t
			if isSend(ct.Op) {
				send += t
				have |= FigSend
			}
			if slots[i] >= 0 {
				rw.addComm(c, slots[i], t)
			}
		}
		c.m[mComm], c.m[mSend] = total, send
	}
	rs.asm.have |= have
	rs.last = st.Number
	rs.steps++
	if rs.steps == 1 {
		d.changes++ // its host's ranks now include it
	}
	if rs.silent {
		rs.silent = false
		d.live++
		d.changes++
	}
	if st.Number > d.maxStep {
		d.maxStep = st.Number
		if !d.hold {
			d.updateSilence()
		}
	}
	d.advance(false)
}

func (d *Detector) newRow(step int64) *row {
	var rw *row
	if n := len(d.free); n > 0 {
		rw, d.free = d.free[n-1], d.free[:n-1]
	} else {
		rw = &row{}
	}
	rw.step, rw.n, rw.more = step, 0, rw.more[:0]
	for i := range rw.cells {
		rw.cells[i].ok = false
	}
	if step < d.maxStep {
		// Ranks already past the step never report it.
		for _, rs := range d.ranks {
			if rs.last > step {
				rw.n++
			}
		}
	}
	d.rows[step] = rw
	i, _ := slices.BinarySearch(d.open, step)
	d.open = slices.Insert(d.open, i, step)
	return rw
}

// skip counts a rank that reported step to after step from as done with
// the open steps it skipped in between.
func (d *Detector) skip(from, to int64) {
	if to-from <= 1 || len(d.open) == 0 {
		return
	}
	i, _ := slices.BinarySearch(d.open, from+1)
	for ; i < len(d.open) && d.open[i] < to; i++ {
		d.rows[d.open[i]].n++
	}
}

// updateSilence marks ranks whose last step is SilentSteps behind.
func (d *Detector) updateSilence() {
	for _, rs := range d.ranks {
		last := rs.last
		if last < 0 {
			last = d.firstStep - 1
		}
		silent := d.maxStep-last > int64(d.cfg.SilentSteps)
		if silent != rs.silent {
			rs.silent = silent
			d.changes++
			if silent {
				d.live--
			} else {
				d.live++
			}
		}
	}
}

// advance evaluates the oldest steps that every live rank is done with
// (see row.n), or all of them when flush is set, or as many as exceed the
// horizon.
func (d *Detector) advance(flush bool) {
	for len(d.open) > 0 && (!d.hold || flush) {
		s := d.open[0]
		rw := d.rows[s]
		complete := rw.n >= d.live
		if !complete && !flush && len(d.open) <= d.cfg.Horizon && d.maxStep-s <= int64(d.cfg.Horizon) {
			return
		}
		if !complete {
			d.stats.IncompleteRows++
		}
		d.open = d.open[1:]
		delete(d.rows, s)
		d.evaluate(rw)
		d.free = append(d.free, rw)
		if d.afterStep != nil {
			d.afterStep()
		}
	}
}

// Flush evaluates every step still waiting for a rank, as at the end of
// the input of a finished job.
func (d *Detector) Flush() {
	d.release()
	d.advance(true)
}

// holdEvaluation suspends evaluation while a reader brings the ranks'
// files up to date one rank after another: until they meet, a rank read
// later would look silent.
func (d *Detector) holdEvaluation() { d.hold = true }

// release ends holdEvaluation and evaluates what is complete.
func (d *Detector) release() {
	if !d.hold {
		return
	}
	d.hold = false
	d.updateSilence()
	d.advance(false)
}

// rankLast returns the last step rank has completed, -1 if none.
func (d *Detector) rankLast(rank int) int64 {
	if i, ok := d.index[rank]; ok {
		return d.ranks[i].asm.last
	}
	return -1
}

// setNode names the host of rank, overriding RanksPerNode.
func (d *Detector) setNode(rank int, node string) {
	if d.cfg.Nodes == nil {
		d.cfg.Nodes = map[int]string{}
	}
	d.cfg.Nodes[rank] = node
	if i, ok := d.index[rank]; ok {
		d.ranks[i].node = node
	}
}
