package slownode

import (
	"cmp"
	"math"
	"slices"
)

// Per-step flags of a rank.
const (
	fCompute     uint8 = 1 << iota // compute above its stage's peers
	fHomLow                        // waits least in a communicator that split
	fHomHigh                       // waits more in a communicator that split
	fIO                            // dataloader above its stage's peers
	fLink                          // send above its stage's peers
	fSlowCompute                   // attributed: slow compute
	fInDomain                      // member of a communicator found slow
)

type scratch struct {
	present []int32
	vals    []float64
	tmp     []float64
	keys    []uint64 // sortFloats' room
	stages  [][]int32
	flags   []uint8
	ref     [][numMetrics]float64 // per stage: peer medians
	sigma   [][numMetrics]float64 // per stage: the noise the peer tests allowed for
	healthy [][numMetrics]bool    // per stage: the peer test found a healthy cluster
	pairs   []rankValue
	buckets []groupRef
	gref    []float64 // per group: the healthy median of its bucket, NaN if untested
	above   []int32
	waited  []float64 // per rank: how long its peers waited for it, where homogenisation found it late
	waitGi  []int32   // per rank: the communicator of waited
	fwdRef  []float64 // per stage: the median forward time, NaN until asked for
}

type rankValue struct {
	v  float64
	ri int32
}

type groupRef struct {
	kind  string
	stage int
	gi    int32
}

// evaluate runs the detection of one step, all of whose ranks have
// reported or been given up on.
func (d *Detector) evaluate(rw *row) {
	s := rw.step
	d.evaluated = s
	d.stats.Evaluated++
	if !d.collectPresent(rw) {
		return
	}
	job := d.jobFigures(rw)
	effect := d.cfg.MinEffect * job[mStep]
	d.updateRanks(rw)
	d.testPeers(rw, effect)
	d.homogenise(rw, effect)
	if !d.cfg.JobGate || d.job.over(job[mStep]) {
		d.flagDomains(rw, effect)
		d.attribute(rw)
	}
	d.job.update(s, &job, d.settle(rw, effect), d)
}

// collectPresent lists the ranks that reported the step in
// d.scratch.present, and reports whether there is any.
func (d *Detector) collectPresent(rw *row) bool {
	sc := &d.scratch
	sc.present = sc.present[:0]
	for i := range rw.cells {
		if rw.cells[i].ok {
			sc.present = append(sc.present, int32(i))
		}
	}
	return len(sc.present) > 0
}

// jobFigures returns the job's figures of the step: medians over the
// ranks that have them. Those only the charts draw are taken over a
// sample of the ranks.
func (d *Detector) jobFigures(rw *row) [numMetrics]float64 {
	sc := &d.scratch
	var job [numMetrics]float64
	for i := range job {
		job[i] = math.NaN()
	}
	for _, m := range histMetrics {
		stride := 1
		if m != mStep && m != mCompute {
			stride = sampleStride(len(sc.present))
		}
		sc.vals = sc.vals[:0]
		for k := 0; k < len(sc.present); k += stride {
			if v := rw.cells[sc.present[k]].m[m]; !math.IsNaN(v) {
				sc.vals = append(sc.vals, v)
			}
		}
		job[m] = median(sc.vals)
	}
	return job
}

// updateRanks adds the step to each rank's history and windows, and its
// compute time to the blocks whose medians give the rank's best.
func (d *Detector) updateRanks(rw *row) {
	sc := &d.scratch
	for _, ri := range sc.present {
		rs, c := d.ranks[ri], &rw.cells[ri]
		for m := metric(0); m < numMetrics; m++ {
			if v := c.m[m]; !math.IsNaN(v) {
				rs.win[m].push(v)
			}
		}
		rs.hist.add(rw.step, &c.m)
		if math.IsNaN(c.m[mCompute]) {
			continue
		}
		rs.block = append(rs.block, c.m[mCompute])
		if len(rs.block) >= d.cfg.Window {
			sc.tmp = append(sc.tmp[:0], rs.block...)
			if b := median(sc.tmp); rs.bestEp != d.epoch+1 || b < rs.best {
				rs.best, rs.bestEp = b, d.epoch+1
			}
			rs.block = rs.block[:0]
		}
	}
}

// testPeers groups the ranks by pipeline stage (ranks of one stage do the
// same work), resets the per-rank scratch, and runs the peer tests of
// each stage.
func (d *Detector) testPeers(rw *row, effect float64) {
	sc := &d.scratch
	for i := range sc.stages {
		sc.stages[i] = sc.stages[i][:0]
	}
	for _, ri := range sc.present {
		st := d.ranks[ri].stage
		for len(sc.stages) <= st {
			sc.stages = append(sc.stages, nil)
		}
		sc.stages[st] = append(sc.stages[st], ri)
	}
	sc.flags = slices.Grow(sc.flags[:0], len(d.ranks))[:len(d.ranks)]
	clear(sc.flags)
	sc.waited = slices.Grow(sc.waited[:0], len(d.ranks))[:len(d.ranks)]
	clear(sc.waited)
	sc.waitGi = slices.Grow(sc.waitGi[:0], len(d.ranks))[:len(d.ranks)]
	sc.fwdRef = slices.Grow(sc.fwdRef[:0], len(sc.stages))[:len(sc.stages)]
	for i := range sc.fwdRef {
		sc.fwdRef[i] = math.NaN()
	}
	for len(sc.ref) < len(sc.stages) {
		sc.ref = append(sc.ref, [numMetrics]float64{})
		sc.sigma = append(sc.sigma, [numMetrics]float64{})
		sc.healthy = append(sc.healthy, [numMetrics]bool{})
	}
	for len(d.jitter) < len(sc.stages) {
		var j stageJitter
		for i := range j {
			j[i] = newWindow(d.cfg.Window)
		}
		d.jitter = append(d.jitter, j)
	}
	for st, peers := range sc.stages {
		for i := range sc.ref[st] {
			sc.ref[st][i], sc.sigma[st][i], sc.healthy[st][i] = math.NaN(), 0, false
		}
		for i, t := range peerTests {
			sc.ref[st][t.m], sc.sigma[st][t.m], sc.healthy[st][t.m] = d.peerTest(rw, peers, t.m, t.flag, effect, &d.jitter[st][i])
		}
	}

}

// homogenise splits the members of each communicator by their wait, and
// takes its median wait: those who wait least are late, the others wait
// for them.
func (d *Detector) homogenise(rw *row, effect float64) {
	sc := &d.scratch
	for gi, g := range d.groups {
		g.value, g.flagged, g.masked = math.NaN(), false, false
		sc.pairs = sc.pairs[:0]
		for _, ri := range g.members {
			if int(ri) >= len(rw.cells) || !rw.cells[ri].ok {
				continue
			}
			slot := slices.Index(d.ranks[ri].groups, int32(gi))
			if slot < 0 {
				continue
			}
			if v := rw.commAt(&rw.cells[ri], slot); !math.IsNaN(v) {
				sc.pairs = append(sc.pairs, rankValue{v, ri})
			}
		}
		n := len(sc.pairs)
		if n == 0 {
			continue
		}
		vals := sc.sortedValues(sc.pairs)
		if n%2 == 1 {
			g.value = vals[n/2]
		} else {
			g.value = (vals[n/2-1] + vals[n/2]) / 2
		}
		if g.pp || n < 3 {
			continue
		}
		cut, lo, hi := split2(vals)
		if cut*2 < n && hi > lo*d.cfg.ClusterMeanDistance && hi-lo >= effect {
			g.flagged = true
			late := vals[cut:] // those who wait more: the others are late
			peers := late[len(late)/2]
			if len(late)%2 == 0 {
				peers = (late[len(late)/2-1] + peers) / 2
			}
			for _, p := range sc.pairs {
				if p.v >= vals[cut] {
					sc.flags[p.ri] |= fHomHigh
					continue
				}
				sc.flags[p.ri] |= fHomLow
				if w := peers - p.v; w > sc.waited[p.ri] {
					sc.waited[p.ri], sc.waitGi[p.ri] = w, int32(gi)
				}
			}
		}
	}

}

// flagDomains flags the slow communicators: one that waits more than the
// others of its kind in the same stage, with no member to blame.
func (d *Detector) flagDomains(rw *row, effect float64) {
	sc := &d.scratch
	sc.buckets = sc.buckets[:0]
	sc.gref = slices.Grow(sc.gref[:0], len(d.groups))[:len(d.groups)]
	for gi, g := range d.groups {
		sc.gref[gi] = math.NaN()
		if g.pp || math.IsNaN(g.value) || len(g.members) == 0 {
			continue
		}
		sc.buckets = append(sc.buckets, groupRef{g.kind, d.ranks[g.members[0]].stage, int32(gi)})
	}
	slices.SortFunc(sc.buckets, func(a, b groupRef) int {
		return cmp.Or(cmp.Compare(a.kind, b.kind), cmp.Compare(a.stage, b.stage), cmp.Compare(a.gi, b.gi))
	})
	for lo := 0; lo < len(sc.buckets); {
		hi := lo + 1
		for hi < len(sc.buckets) && sc.buckets[hi].kind == sc.buckets[lo].kind && sc.buckets[hi].stage == sc.buckets[lo].stage {
			hi++
		}
		b := sc.buckets[lo:hi]
		lo = hi
		if len(b) < 3 {
			continue
		}
		sc.pairs = sc.pairs[:0]
		for _, r := range b {
			sc.pairs = append(sc.pairs, rankValue{d.groups[r.gi].value, r.gi})
		}
		sc.above = sc.above[:0]
		// A communicator's wait is the noisier figure (its members' noise
		// adds up in it): it must exceed the healthy ones by
		// ClusterMeanDistance, the homogenisation threshold.
		ref, _, _ := d.healthy(sc.pairs, d.cfg.ClusterMeanDistance-1, effect, 0, 1, func(gi int32) { sc.above = append(sc.above, gi) })
		for _, r := range b {
			sc.gref[r.gi] = ref
		}
		for _, gi := range sc.above {
			g := d.groups[gi]
			if d.memberToBlame(g, rw) {
				g.masked = true // neither slow nor healthy this step
				continue
			}
			d.flagSubject(findingKey{kindDomain, gi}, rw.step, g.value, ref, "relative", mComm, 0, -1)
			for _, ri := range g.members {
				sc.flags[ri] |= fInDomain
			}
		}
	}

}

// attribute flags the ranks' findings: homogenisation locates, the
// compute figure confirms, and lateness another finding explains is not
// slow compute.
func (d *Detector) attribute(rw *row) {
	sc := &d.scratch
	for _, ri := range sc.present {
		f := sc.flags[ri]
		hom := f&fHomLow != 0 && f&fHomHigh == 0 && f&(fIO|fLink|fInDomain) == 0 && d.computesMore(ri, rw)
		if f&fCompute != 0 || hom {
			sc.flags[ri] |= fSlowCompute
		}
	}
	for _, ri := range sc.present {
		rs := d.ranks[ri]
		f := sc.flags[ri]
		ref := &sc.ref[rs.stage]
		if f&fSlowCompute != 0 {
			method := "relative"
			switch {
			case f&fCompute == 0:
				method = "homogenisation"
			case f&fHomLow != 0 && f&fHomHigh == 0:
				method = "relative+homogenisation"
			}
			v, r, m := d.computeFigure(ri, rw)
			waited := 0.0
			if f&fHomLow != 0 && f&fHomHigh == 0 {
				waited = sc.waited[ri]
			}
			d.flagSubject(findingKey{kindCompute, ri}, rw.step, v, r, method, m, waited, sc.waitGi[ri])
		}
		if f&fIO != 0 {
			d.flagSubject(findingKey{kindIO, ri}, rw.step, rw.cells[ri].m[mDataLoader], ref[mDataLoader], "relative", mDataLoader, 0, -1)
		}
		if f&fLink != 0 && !d.neighbourSlow(ri) {
			d.flagSubject(findingKey{kindLink, ri}, rw.step, rw.cells[ri].m[mSend], ref[mSend], "relative", mSend, 0, -1)
		}
	}

}

// settle adds the step's evidence to the findings not flagged in it, and
// counts those whose subject looked normal towards clearing (or ends the
// run of one building up). It reports whether a finding is active or
// building up.
//
// A subject still above its peers by the relative threshold (half of it
// for an active finding flagged lately) and effect, though not by NSigma
// of the noise, does not look normal: where ranks share their cores with
// other work the noise is as large as a slowdown, and many steps of a
// slow rank are such. Like a step with no healthy peers to compare with,
// such a step counts neither way: it neither clears a finding nor breaks
// a run, which must still fit in twice Consecutive steps.
func (d *Detector) settle(rw *row, effect float64) bool {
	s := rw.step
	anyPending := false
	for k, f := range d.findings {
		if f.flaggedAt == s {
			if f.run > 0 {
				anyPending = true
			}
			continue
		}
		v, ref, ok := d.subjectValue(k, rw)
		if !ok {
			continue // neither slow nor healthy this step
		}
		f.observe(v, ref, 0, false)
		threshold := d.cfg.RelativeThreshold
		if k.kind == kindDomain {
			threshold = d.cfg.ClusterMeanDistance - 1 // as flagDomains tests it
		}
		if f.active && s-f.flaggedAt < int64(d.cfg.Window-d.cfg.Consecutive) {
			// Hysteresis: a rank 20% slow whose noise dips under the
			// threshold for a few steps is still that rank, so an active
			// finding flagged lately clears only on steps back within
			// half the margin. One no longer flagged (a subject that
			// recovered partway) clears as it came, within Window steps
			// of its last anomalous one.
			threshold /= 2
		}
		if v > ref*(1+threshold) && v-ref >= effect {
			continue // still above its peers: neither slow nor healthy
		}
		f.run = 0
		if !f.active {
			delete(d.findings, k)
			continue
		}
		f.calm++
		if f.calm >= d.cfg.Consecutive {
			delete(d.findings, k)
			d.changes++
		}
	}
	for _, f := range d.findings {
		if f.active {
			anyPending = true
		}
	}
	return anyPending
}

// peerTests are the figures each rank is compared on with its stage's
// peers, and the flag a rank that stands above them gets.
var peerTests = [...]struct {
	m    metric
	flag uint8
}{{mCompute, fCompute}, {mDataLoader, fIO}, {mSend, fLink}}

// stageJitter holds, per peer test, the rank-to-rank noise of a stage's
// recent steps (see jitterOf).
type stageJitter [len(peerTests)]window

// jitterScale turns the median absolute deviation of differences of two
// draws into the σ of one: 1.4826 / √2.
const jitterScale = 1.4826 / math.Sqrt2

// peerTest flags the peers whose figure m stands above the healthy ones
// (see healthy) and returns the healthy peers' median, NaN for fewer than
// three peers, the noise σ the test allowed for, and whether it found a
// healthy cluster. jw keeps the stage's recent noise: no rank stands
// above by less than NSigma of it.
func (d *Detector) peerTest(rw *row, peers []int32, m metric, flag uint8, effect float64, jw *window) (ref, sigma float64, ok bool) {
	sc := &d.scratch
	sc.pairs = sc.pairs[:0]
	for _, ri := range peers {
		if v := rw.cells[ri].m[m]; !math.IsNaN(v) {
			sc.pairs = append(sc.pairs, rankValue{v, ri})
		}
	}
	sc.tmp = jw.values(sc.tmp[:0])
	noise := 0.0
	if len(sc.tmp) > 0 {
		noise = median(sc.tmp) * jitterScale
	}
	ref, sigma, ok = d.healthy(sc.pairs, d.cfg.RelativeThreshold, effect, noise, minHealthyRanks, func(ri int32) { sc.flags[ri] |= flag })
	if j, ok := d.jitterOf(rw, peers, m, ref); ok {
		jw.push(j)
	}
	return ref, sigma, ok
}

// healthy calls above for each of pairs that stands above the healthy
// ones by threshold (a fraction), and returns their median and the σ it
// allowed for; NaN for fewer than three pairs. noise floors that σ, as a
// fraction of the median; a healthy cluster holds at least minRef pairs.
// ok is false where no healthy cluster was found: fewer than three pairs,
// or too many of them standing apart above the rest.
//
// The values are split in two clusters (1-D 2-means), peeling upper
// clusters off while they stand apart by RelativeThreshold and the rest
// still holds a third of the pairs: an outlier step on one rank and a
// slow host holding half a stage may both be there, and a median over
// all would show neither. What remains is the healthy reference; a value
// above its median by threshold, NSigma of its standard
// deviations and effect stands above. With no such cluster (most values
// high), the median of all is returned and nothing stands above.
func (d *Detector) healthy(pairs []rankValue, threshold, effect, noise float64, minRef int, above func(id int32)) (ref, sd float64, ok bool) {
	sc := &d.scratch
	n := len(pairs)
	if n < 3 {
		return math.NaN(), 0, false
	}
	if v := pairs[0].v; v >= 0 && same(pairs) {
		// What the clustering comes to for one value repeated (a figure
		// nobody has, such as the send time of ranks with no pipeline),
		// without sorting it: its median, with nothing above it.
		return v, 0, true
	}
	sc.sortedValues(pairs)
	cut := n
	for {
		c, lo, hi := split2(sc.vals[:cut])
		if c >= cut || c*3 < n || c < minRef || !(hi > lo*(1+d.cfg.RelativeThreshold)) {
			break
		}
		cut = c
	}
	if cut == n {
		c, lo, hi := split2(sc.vals)
		if c*2 < n || c < minRef {
			// No cluster holds enough values to be the reference. Where
			// the upper one stands apart, most are slow and none is known
			// healthy; where not, they are all alike.
			return median(sc.vals), 0, !(hi > lo*(1+d.cfg.RelativeThreshold))
		}
		cut = c
	}
	low := sc.vals[:cut]
	if cut%2 == 1 {
		ref = low[cut/2]
	} else {
		ref = (low[cut/2-1] + low[cut/2]) / 2
	}
	var mean float64
	for _, v := range low {
		mean += v
	}
	mean /= float64(cut)
	for _, v := range low {
		sd += (v - mean) * (v - mean)
	}
	if cut > 1 {
		sd = math.Sqrt(sd / float64(cut-1))
	}
	sd = max(sd, ref*noise, ref*minSpread)
	for _, p := range pairs {
		if p.v >= sc.vals[cut] && p.v > ref*(1+threshold) && p.v-ref > d.cfg.NSigma*sd && p.v-ref >= effect {
			above(p.ri)
		}
	}
	return ref, sd, true
}

// sampleSize is how many ranks a median the detector only estimates (a
// noise level, a chart's line) is taken over, at most.
const sampleSize = 128

// sampleStride returns the stride that takes about sampleSize of n ranks,
// spread over all of them.
func sampleStride(n int) int { return max(1, n/sampleSize) }

// jitterOf returns how much the figure m of the stage's ranks moved from
// their previous step to this one: the median over the ranks (a sample of
// sampleSize) of |Δ|, relative to ref. A few ranks' jumps (a slow rank's
// onset, an outlier step) do not move it, nor, in the window's median, a
// step that moved every rank (a phase); what is left is the noise of the
// ranks' figures, which a single step's cannot show where a stage has
// few ranks.
func (d *Detector) jitterOf(rw *row, peers []int32, m metric, ref float64) (float64, bool) {
	if !(ref > 0) {
		return 0, false
	}
	sc := &d.scratch
	sc.tmp = sc.tmp[:0]
	for k := 0; k < len(peers); k += sampleStride(len(peers)) {
		ri := peers[k]
		v := rw.cells[ri].m[m]
		if math.IsNaN(v) {
			continue
		}
		if prev, ok := d.ranks[ri].win[m].prev(); ok {
			sc.tmp = append(sc.tmp, v-prev)
		}
	}
	if len(sc.tmp) < 3 {
		return 0, false
	}
	for i, x := range sc.tmp {
		sc.tmp[i] = math.Abs(x)
	}
	return median(sc.tmp) / ref, true
}

// minHealthyRanks is the fewest ranks a healthy reference is made of:
// with two, noise that two ranks share (a core they both wait for) makes
// the other two look slow. A communicator's wait, a median over its
// members, is steadier: a reference of one will do.
const minHealthyRanks = 3

// same reports whether all pairs hold one value.
func same(pairs []rankValue) bool {
	for _, p := range pairs[1:] {
		if p.v != pairs[0].v {
			return false
		}
	}
	return true
}

// sortedValues returns the values of pairs, which hold no NaN, in
// increasing order, in sc.vals: sorting plain floats costs less than
// sorting the pairs does, and a pair's side of a cut is told by its value.
func (sc *scratch) sortedValues(pairs []rankValue) []float64 {
	sc.vals = sc.vals[:0]
	for _, p := range pairs {
		sc.vals = append(sc.vals, p.v)
	}
	sc.keys = sortFloats(sc.vals, sc.keys)
	return sc.vals
}

// memberToBlame reports whether a member of g explains its waiting this
// step: one slow to compute, to load data or to send, or, when
// homogenisation split g, one that waits least and computes more than its
// stage's peers or receives from a slow link.
func (d *Detector) memberToBlame(g *group, rw *row) bool {
	sc := &d.scratch
	for _, ri := range g.members {
		if int(ri) >= len(rw.cells) || !rw.cells[ri].ok {
			continue
		}
		f := sc.flags[ri]
		if f&(fCompute|fIO|fLink) != 0 {
			return true
		}
		if g.flagged && f&fHomLow != 0 && d.neighbourFlagged(ri, fLink) {
			return true // late because a pipeline neighbour's send was slow
		}
		if g.flagged && f&fHomLow != 0 && d.computesMore(ri, rw) {
			return true
		}
	}
	return false
}

// computesMore reports whether rank ri's compute this step backs what
// homogenisation found (that it came late): above its stage's healthy
// median by half of what the peer test asks, RelativeThreshold and NSigma
// alike, or unknown. With no healthy cluster among its peers (most of
// them slow too) it backs nothing.
func (d *Detector) computesMore(ri int32, rw *row) bool {
	sc := &d.scratch
	st := d.ranks[ri].stage
	ref, sigma := sc.ref[st][mCompute], sc.sigma[st][mCompute]
	c := rw.cells[ri].m[mCompute]
	switch {
	case math.IsNaN(ref) || math.IsNaN(c):
		return true
	case !sc.healthy[st][mCompute]:
		return false
	}
	return c >= ref*(1+d.cfg.RelativeThreshold/2) && c-ref >= d.cfg.NSigma/2*sigma
}

// neighbourSlow reports whether a pipeline neighbour of ri (the previous
// or next stage of one of its PP communicators) is slow to compute or to
// load data this step: a send that waits for a late receiver is not a
// slow link.
func (d *Detector) neighbourSlow(ri int32) bool { return d.neighbourFlagged(ri, fSlowCompute|fIO) }

// neighbourFlagged reports whether a pipeline neighbour of ri has one of
// the flags this step.
func (d *Detector) neighbourFlagged(ri int32, flags uint8) bool {
	for _, gi := range d.ranks[ri].groups {
		g := d.groups[gi]
		if !g.pp {
			continue
		}
		k := slices.Index(g.members, ri)
		for _, j := range []int{k - 1, k + 1} {
			if j >= 0 && j < len(g.members) && d.scratch.flags[g.members[j]]&flags != 0 {
				return true
			}
		}
	}
	return false
}

// subjectValue returns the figure a finding watches at this step, and
// whether the step bears on it: not where the figure or its reference is
// missing, nor where no peers were healthy to compare with (most were
// slow too, or too few were alike) unless the figure is at or below the
// median of its stage: no slower than most of its peers, whatever they
// do.
func (d *Detector) subjectValue(k findingKey, rw *row) (v, ref float64, ok bool) {
	sc := &d.scratch
	if k.kind == kindDomain {
		g := d.groups[k.id]
		if g.masked || math.IsNaN(g.value) || int(k.id) >= len(sc.gref) || math.IsNaN(sc.gref[k.id]) {
			return 0, 0, false
		}
		return g.value, sc.gref[k.id], true
	}
	if int(k.id) >= len(rw.cells) || !rw.cells[k.id].ok {
		return 0, 0, false
	}
	m := k.kind.metric()
	st := d.ranks[k.id].stage
	v, ref = rw.cells[k.id].m[m], sc.ref[st][m]
	if k.kind == kindCompute {
		v, ref, m = d.computeFigure(k.id, rw)
		if math.IsNaN(v) && math.IsNaN(ref) {
			// Found by homogenisation alone, with no figure of its
			// compute: a step that did not find it late clears it.
			return v, ref, true
		}
	}
	if math.IsNaN(v) || math.IsNaN(ref) || m != mForward && !sc.healthy[st][m] && v > ref {
		return 0, 0, false
	}
	return v, ref, true
}

// computeFigure returns what rank ri computed this step and the median of
// its stage's peers: its compute, or its forward time where compute is not
// computed, or NaNs where neither is.
func (d *Detector) computeFigure(ri int32, rw *row) (v, ref float64, m metric) {
	sc := &d.scratch
	st := d.ranks[ri].stage
	c := &rw.cells[ri]
	if v := c.m[mCompute]; !math.IsNaN(v) {
		return v, sc.ref[st][mCompute], mCompute
	}
	v = c.m[mForward]
	if math.IsNaN(v) {
		return math.NaN(), math.NaN(), mCompute
	}
	if math.IsNaN(sc.fwdRef[st]) {
		sc.vals = sc.vals[:0]
		for _, p := range sc.stages[st] {
			if f := rw.cells[p].m[mForward]; !math.IsNaN(f) {
				sc.vals = append(sc.vals, f)
			}
		}
		if len(sc.vals) >= 3 {
			sc.fwdRef[st] = median(sc.vals)
		}
	}
	return v, sc.fwdRef[st], mForward
}

// flagSubject counts an anomaly of a subject at step s.
// v and ref are the subject's figure m and its peers'; waited is how long
// the peers in communicator gi waited for it (homogenisation), 0 if not.
func (d *Detector) flagSubject(k findingKey, s int64, v, ref float64, method string, m metric, waited float64, gi int32) {
	f := d.findings[k]
	if f == nil {
		w := d.cfg.Window
		f = &finding{key: k, flaggedAt: -1, group: -1,
			val: newWindow(w), ref: newWindow(w), hits: newWindow(w), waited: newWindow(w)}
		d.findings[k] = f
	}
	if f.flaggedAt == s {
		return
	}
	f.flaggedAt = s
	f.method, f.metric = method, m
	if waited > 0 {
		f.group = gi
	}
	f.observe(v, ref, waited, true)
	f.calm = 0
	if !f.active && f.run > 0 && s-f.onset >= 2*int64(d.cfg.Consecutive) {
		// Steps that could not be compared (no healthy peers) neither
		// break a run nor make one: a run takes at most twice
		// Consecutive steps.
		f.run = 0
	}
	f.run++
	if f.run == 1 && !f.active {
		f.onset = s
	}
	if !f.active && f.run >= d.cfg.Consecutive {
		f.active, f.detected = true, s
		d.changes++
	}
}
