package netcheck

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"time"
)

// Planner decides which probes to run and what their results say. It is
// pure logic: it does no I/O, reads no clock and starts no goroutines. The
// caller drives it one round at a time:
//
//	p, _ := netcheck.NewPlanner(names, "", netcheck.Policy{})
//	for round := p.Next(); round != nil; round = p.Next() {
//		for _, pair := range round { // each name appears once per round
//			p.Record(probe(pair))    // run them in parallel if you like
//		}
//	}
//	report := p.Report()
//
// Round 0 pairs neighbours in the order given (put the nodes in topology
// order so that neighbours share a switch). A probe that fails, or is slow
// next to the fastest seen (StragglerRatio times it), makes both its ends
// suspects; round 1 pairs the slowest suspects with the fastest nodes known
// to be good, as DLRover does, and later rounds go on testing each suspect
// against further known-good peers until it has passed once (healthy) or
// failed, or been slow, against ConfirmPeers of them (faulty or straggler).
// Suspicion is judged against the fastest probe so that slow nodes are
// re-tested even where they drag the median up; verdicts are judged
// against the median, as the Policy says. A suspect never pairs with
// another suspect while known-good peers exist, so k bad nodes among N cost
// about 3k+2 probes beyond round 0's N/2 (the property tests hold it to
// that).
//
// A good probe proves both its ends good, but only against a baseline:
// probes that show what a healthy link does. While every completed probe
// involves one participant, that one may be slow and drag all of them
// down alike, so there is none; the planner then probes pairs that avoid
// it, and a node whose speed no baseline can judge is unknown, never
// healthy. A bandwidth floor (Policy.MinBandwidth) is a baseline of its
// own.
//
// The reference, if given, is a participant reported apart from the nodes
// (the checker's own host, say): it takes the odd node of round 0,
// completes probes with at least two nodes so that even a tiny cluster has
// a baseline, and when no probe has been good yet (N = 2 or 3 with a bad
// node, or most nodes bad) it probes the likeliest good suspect while the
// others pair fastest with slowest. Its link must be at least as fast as
// the nodes', and it must not share a node's host, whose link its probes
// would measure. Without a reference such cases may end with nodes of
// unknown verdict: the planner never blames a node without evidence from a
// peer it has seen work.
type Planner struct {
	pol    Policy
	names  []string // the nodes, then the reference if any
	index  map[string]int
	n      int // number of nodes; names[n] is the reference when hasRef
	hasRef bool
	probes []probeRecord
	tried  map[pairKey]bool
	round  int              // rounds handed out
	cur    map[pairKey]bool // the current round's pairs: recorded or not
	order  [][2]int         // the current round's pairs, as handed out
	done   bool
}

type pairKey struct{ a, b int } // a < b

func key(a, b int) pairKey {
	if a > b {
		a, b = b, a
	}
	return pairKey{a, b}
}

type probeRecord struct {
	from, to int
	round    int
	m        Measurement
}

// NewPlanner returns a planner for the named nodes, in topology order, and
// an optional reference ("" for none). Names must be unique and non-empty.
func NewPlanner(nodes []string, reference string, pol Policy) (*Planner, error) {
	if err := pol.Validate(); err != nil {
		return nil, err
	}
	p := &Planner{
		pol:   pol.withDefaults(),
		names: slices.Clone(nodes),
		index: make(map[string]int, len(nodes)+1),
		n:     len(nodes),
		tried: make(map[pairKey]bool),
	}
	if reference != "" {
		p.names = append(p.names, reference)
		p.hasRef = true
	}
	for i, name := range p.names {
		if name == "" {
			return nil, fmt.Errorf("netcheck: node %d has an empty name", i)
		}
		if j, dup := p.index[name]; dup {
			return nil, fmt.Errorf("netcheck: name %q is used by nodes %d and %d", name, j, i)
		}
		p.index[name] = i
	}
	return p, nil
}

// Next ends the current round, treating each of its probes not recorded as
// failed, and returns the next round's probes. It returns nil when the
// check is over: every node has a verdict, no probe can tell more, or
// MaxRounds rounds have run.
func (p *Planner) Next() []Pair {
	if p.done {
		return nil
	}
	for _, pr := range p.order {
		if !p.cur[key(pr[0], pr[1])] {
			p.probes = append(p.probes, probeRecord{from: pr[0], to: pr[1], round: p.round - 1,
				m: Measurement{From: p.names[pr[0]], To: p.names[pr[1]], Error: "no result recorded"}})
		}
	}
	p.cur, p.order = nil, nil
	var pairs [][2]int
	switch {
	case p.round >= p.pol.MaxRounds:
	case p.round == 0:
		pairs = p.neighbours()
	default:
		pairs = p.plan()
	}
	if len(pairs) == 0 {
		p.done = true
		return nil
	}
	p.round++
	p.cur = make(map[pairKey]bool, len(pairs))
	p.order = pairs
	out := make([]Pair, len(pairs))
	for i, pr := range pairs {
		p.cur[key(pr[0], pr[1])] = false
		p.tried[key(pr[0], pr[1])] = true
		out[i] = Pair{From: p.names[pr[0]], To: p.names[pr[1]]}
	}
	return out
}

// Record adds the result of one probe of the current round, matched by its
// From and To names in either order.
func (p *Planner) Record(m Measurement) error {
	a, okA := p.index[m.From]
	b, okB := p.index[m.To]
	k := key(a, b)
	recorded, inRound := p.cur[k]
	switch {
	case !okA || !okB || a == b || !inRound:
		return fmt.Errorf("netcheck: %s→%s is not a probe of the current round", m.From, m.To)
	case recorded:
		return fmt.Errorf("netcheck: %s→%s recorded twice", m.From, m.To)
	}
	p.cur[k] = true
	// Bad figures from a prober must not poison the medians.
	m.Elapsed = max(m.Elapsed, 0)
	m.RTT = max(m.RTT, 0)
	if !(m.Bandwidth > 0) || math.IsInf(m.Bandwidth, 0) {
		m.Bandwidth = 0
	}
	m.Bytes, m.Moved = max(m.Bytes, 0), max(m.Moved, 0)
	if m.Partial && m.Bandwidth == 0 && !m.Failed() {
		m.Error = "deadline reached with nothing moved"
	}
	p.probes = append(p.probes, probeRecord{from: a, to: b, round: p.round - 1, m: m})
	return nil
}

// Rounds returns how many rounds have been handed out.
func (p *Planner) Rounds() int { return p.round }

// neighbours is round 0: pairs in the given order, the odd node out with
// the reference.
func (p *Planner) neighbours() [][2]int {
	var pairs [][2]int
	for i := 0; i+1 < p.n; i += 2 {
		pairs = append(pairs, [2]int{i, i + 1})
	}
	if p.n%2 == 1 && p.hasRef {
		pairs = append(pairs, [2]int{p.n, p.n - 1})
	}
	return pairs
}

// plan is every later round: suspects against known-good peers, or, when
// none is known, against the reference and each other.
func (p *Planner) plan() [][2]int {
	st := p.stats()
	strict := p.judge(st, st.strict)
	final := p.judge(st, st.threshold)
	var suspects []int
	for x := range p.n {
		if (!strict.good[x] && strict.verdict[x] == Unknown) || final.verdict[x] == Unknown {
			suspects = append(suspects, x)
		}
	}
	busy := make([]bool, len(p.names))
	var pairs [][2]int
	add := func(from, to int) {
		busy[from], busy[to] = true, true
		pairs = append(pairs, [2]int{from, to})
	}
	// Faster first; a participant never probed counts as fastest.
	byBest := func(a, b int) int {
		if c := cmp.Compare(st.best[a], st.best[b]); c != 0 {
			return c
		}
		return a - b
	}
	ref := p.n
	refUsable := p.hasRef && (final.good[ref] || len(final.badPeers[ref]) == 0)

	var partners []int
	for x := range p.names {
		if final.good[x] {
			partners = append(partners, x)
		}
	}
	if len(partners) > 0 {
		slices.SortFunc(partners, byBest)
		if refUsable && !final.good[ref] {
			partners = append(partners, ref) // not yet seen working: last
		}
		// Slowest suspects first, each with the fastest free partner it
		// has not yet met. A suspect that finds none waits a round.
		slices.SortFunc(suspects, func(a, b int) int { return byBest(b, a) })
		for _, s := range suspects {
			for _, q := range partners {
				if !busy[q] && !busy[s] && q != s && !p.tried[key(q, s)] {
					add(q, s)
					break
				}
			}
		}
		// An idle reference completes probes with two nodes: in a tiny
		// cluster where every probe so far had a slow end, that is the only
		// way to learn what fast is.
		if refUsable && !busy[ref] && p.completedWith(ref) < min(2, p.n) {
			for _, q := range partners {
				if q != ref && !busy[q] && !p.tried[key(ref, q)] {
					add(ref, q)
					break
				}
			}
		}
		return pairs
	}

	// Nothing has worked yet. The reference takes the fastest suspect, the
	// likeliest to be good; the others pair fastest with slowest.
	slices.SortFunc(suspects, byBest)
	if refUsable {
		for _, s := range suspects {
			if !p.tried[key(ref, s)] {
				add(ref, s)
				break
			}
		}
	}
	for i, s := range suspects {
		for j := len(suspects) - 1; j > i && !busy[s]; j-- {
			if t := suspects[j]; !busy[t] && !p.tried[key(s, t)] {
				add(s, t)
			}
		}
	}
	return pairs
}

// completedWith counts the distinct participants that x finished a probe
// with.
func (p *Planner) completedWith(x int) int {
	seen := map[int]bool{}
	for _, r := range p.probes {
		if !r.m.Failed() && (r.from == x || r.to == x) {
			seen[r.from+r.to-x] = true
		}
	}
	return len(seen)
}

// stats are the figures every judgement starts from.
type stats struct {
	best      []time.Duration // per participant: fastest probe, -1 if none
	median    time.Duration   // lower median of best over probed participants
	threshold time.Duration   // StragglerRatio × median: the verdicts' bar
	strict    time.Duration   // StragglerRatio × fastest best: the planner's bar
	// baseline: the probes say what a healthy link does, because a floor
	// does or because no participant is in every completed probe.
	baseline bool
	hub      int // without a baseline, one in every completed probe; -1 if none completed
}

// elapsed is a probe's time for medians: a failure counts as the timeout,
// and a probe the deadline cut short as the time its transfer would have
// taken at the rate it moved.
func (p *Planner) elapsed(m Measurement) time.Duration {
	switch {
	case m.Failed():
		return p.pol.ProbeTimeout
	case m.Partial && m.Bytes > 0:
		return max(m.Elapsed, time.Duration(min(2*float64(m.Bytes)/m.Bandwidth*1e9, math.MaxInt64)))
	}
	return m.Elapsed
}

// baseline reports whether the probes have a baseline: a floor, or
// completed probes that do not all share an end. hub is a participant in
// every completed probe, -1 if there is none or no probe completed.
func (p *Planner) baseline() (ok bool, hub int) {
	ends, n := [2]int{-1, -1}, 0
	for _, r := range p.probes {
		if r.m.Failed() {
			continue
		}
		if n == 0 {
			ends = [2]int{r.from, r.to}
		}
		for i, e := range ends {
			if e != r.from && e != r.to {
				ends[i] = -1
			}
		}
		n++
	}
	hub = ends[0]
	if hub < 0 {
		hub = ends[1]
	}
	return p.pol.MinBandwidth > 0 || (n > 0 && hub < 0), hub
}

func (p *Planner) stats() stats {
	st := stats{best: make([]time.Duration, len(p.names))}
	for i := range st.best {
		st.best[i] = -1
	}
	for _, r := range p.probes {
		e := p.elapsed(r.m)
		for _, x := range [2]int{r.from, r.to} {
			if st.best[x] < 0 || e < st.best[x] {
				st.best[x] = e
			}
		}
	}
	var bests []time.Duration
	for _, b := range st.best {
		if b >= 0 {
			bests = append(bests, b)
		}
	}
	if len(bests) > 0 {
		slices.Sort(bests)
		st.median = bests[(len(bests)-1)/2]
		st.threshold = scale(st.median, p.pol.StragglerRatio)
		st.strict = scale(bests[0], p.pol.StragglerRatio)
	}
	st.baseline, st.hub = p.baseline()
	return st
}

func scale(d time.Duration, f float64) time.Duration {
	v := float64(d) * f
	if v >= math.MaxInt64 {
		return math.MaxInt64
	}
	return time.Duration(v)
}

// judgement is what the probes say under one time threshold.
type judgement struct {
	threshold time.Duration
	outcome   []Outcome // per probe
	good      []bool    // per participant: in a good probe, so good itself
	verdict   []Verdict // per participant
	badPeers  [][]int   // per participant: good peers it failed or was slow against
	slowPeer  []bool    // per participant: finished a probe with a good peer, slowly
}

func (p *Planner) outcome(m Measurement, threshold time.Duration) Outcome {
	switch {
	case m.Failed():
		return Failed
	case p.elapsed(m) > threshold,
		p.pol.MinBandwidth > 0 && m.Bandwidth < p.pol.MinBandwidth,
		p.pol.MaxRTT > 0 && m.RTT > p.pol.MaxRTT:
		return Slow
	}
	return Good
}

func (p *Planner) judge(st stats, threshold time.Duration) judgement {
	j := judgement{
		threshold: threshold,
		outcome:   make([]Outcome, len(p.probes)),
		good:      make([]bool, len(p.names)),
		verdict:   make([]Verdict, len(p.names)),
		badPeers:  make([][]int, len(p.names)),
		slowPeer:  make([]bool, len(p.names)),
	}
	for i, r := range p.probes {
		j.outcome[i] = p.outcome(r.m, threshold)
		if j.outcome[i] == Good {
			j.good[r.from], j.good[r.to] = true, true
		}
	}
	goods := 0
	for _, g := range j.good {
		if g {
			goods++
		}
	}
	for i, r := range p.probes {
		for _, e := range [2][2]int{{r.from, r.to}, {r.to, r.from}} {
			x, peer := e[0], e[1]
			if j.good[x] || !j.good[peer] {
				continue
			}
			if !slices.Contains(j.badPeers[x], peer) {
				j.badPeers[x] = append(j.badPeers[x], peer)
			}
			if j.outcome[i] == Slow {
				j.slowPeer[x] = true
			}
		}
	}
	need := min(p.pol.ConfirmPeers, goods)
	for x := range p.names {
		switch {
		case j.good[x] && st.baseline:
			j.verdict[x] = Healthy
		case j.good[x]:
			j.verdict[x] = Unknown
		case need > 0 && len(j.badPeers[x]) >= need && j.slowPeer[x]:
			j.verdict[x] = Straggler
		case need > 0 && len(j.badPeers[x]) >= need:
			j.verdict[x] = Faulty
		default:
			j.verdict[x] = Unknown
		}
	}
	return j
}
