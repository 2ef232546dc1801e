package netcheck

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// Verdict is what a check concludes about one node.
type Verdict string

// Verdicts.
const (
	Healthy   Verdict = "healthy"   // a probe with it was good
	Faulty    Verdict = "faulty"    // its probes with healthy peers failed
	Straggler Verdict = "straggler" // its probes with healthy peers were slow
	Unknown   Verdict = "unknown"   // no healthy peer could tell
)

// Outcome is how one probe is judged.
type Outcome string

// Outcomes.
const (
	Good   Outcome = "good"
	Slow   Outcome = "slow"   // slower than the threshold or a floor
	Failed Outcome = "failed" // an error or a timeout
)

// Report is the result of a check: a verdict per node with its evidence.
// Its JSON form (Marshal, ParseReport) is stable.
type Report struct {
	Nodes []NodeResult `json:"nodes"`
	// Reference is the reference's own result, if one took part: a
	// reference that is not healthy gave no evidence.
	Reference *NodeResult `json:"reference,omitempty"`
	// MedianBest is the lower median of the participants' best probe times
	// (a failed probe counts as the probe timeout).
	MedianBest time.Duration `json:"median_best_ns"`
	// Threshold is StragglerRatio × MedianBest: a slower probe is slow.
	Threshold time.Duration `json:"straggler_threshold_ns"`
	Policy    Policy        `json:"policy"`
	Rounds    int           `json:"rounds"`
	Probes    int           `json:"probes"`
	// Links are the slow and failed probes that no verdict explains
	// (neither end is faulty or a straggler), in the order they ran: a bad
	// link between healthy nodes, or the links that fell short where no
	// node could be blamed (a floor above every link, no baseline).
	Links []LinkResult `json:"links,omitempty"`
	// Notes say what limited the check: no reference, no baseline.
	Notes []string `json:"notes,omitempty"`
}

// LinkResult is a probe judged slow or failed.
type LinkResult struct {
	Round   int     `json:"round"`
	Outcome Outcome `json:"outcome"`
	Measurement
}

// NodeResult is the verdict on one node and why.
type NodeResult struct {
	Name    string  `json:"name"`
	Verdict Verdict `json:"verdict"`
	// Reason says in a line why: which peers, which figures.
	Reason string `json:"reason"`
	// Evidence is every probe the node took part in, in order.
	Evidence []Evidence `json:"evidence"`
}

// Evidence is one probe as seen from one of its ends.
type Evidence struct {
	Round       int     `json:"round"`
	Peer        string  `json:"peer"`
	PeerVerdict Verdict `json:"peer_verdict"`
	Outcome     Outcome `json:"outcome"`
	Measurement
}

// Names returns the names of the nodes with verdict v, in check order.
func (r *Report) Names(v Verdict) []string {
	var names []string
	for _, n := range r.Nodes {
		if n.Verdict == v {
			names = append(names, n.Name)
		}
	}
	return names
}

// Bad returns the faulty and straggling nodes, in check order.
func (r *Report) Bad() []string {
	var names []string
	for _, n := range r.Nodes {
		if n.Verdict == Faulty || n.Verdict == Straggler {
			names = append(names, n.Name)
		}
	}
	return names
}

// OK reports whether every node is healthy.
func (r *Report) OK() bool { return len(r.Names(Healthy)) == len(r.Nodes) }

// Marshal returns the report as indented JSON.
func (r *Report) Marshal() ([]byte, error) {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("netcheck: marshal report: %w", err)
	}
	return append(b, '\n'), nil
}

// ParseReport reads a report written by Marshal, rejecting unknown fields,
// verdicts and outcomes.
func ParseReport(data []byte) (*Report, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var r Report
	if err := dec.Decode(&r); err != nil {
		return nil, fmt.Errorf("netcheck: report: %w", err)
	}
	if dec.More() {
		return nil, fmt.Errorf("netcheck: report: data after the JSON object")
	}
	results := r.Nodes
	if r.Reference != nil {
		results = append(slices.Clone(results), *r.Reference)
	}
	for i, l := range r.Links {
		if !validOutcome(l.Outcome) {
			return nil, fmt.Errorf("netcheck: report: links[%d].outcome: unknown value %q", i, l.Outcome)
		}
	}
	for i, n := range results {
		if !validVerdict(n.Verdict) {
			return nil, fmt.Errorf("netcheck: report: nodes[%d].verdict: unknown value %q", i, n.Verdict)
		}
		for j, e := range n.Evidence {
			if !validVerdict(e.PeerVerdict) {
				return nil, fmt.Errorf("netcheck: report: nodes[%d].evidence[%d].peer_verdict: unknown value %q", i, j, e.PeerVerdict)
			}
			if !validOutcome(e.Outcome) {
				return nil, fmt.Errorf("netcheck: report: nodes[%d].evidence[%d].outcome: unknown value %q", i, j, e.Outcome)
			}
		}
	}
	return &r, nil
}

func validVerdict(v Verdict) bool {
	switch v {
	case Healthy, Faulty, Straggler, Unknown:
		return true
	}
	return false
}

func validOutcome(o Outcome) bool {
	switch o {
	case Good, Slow, Failed:
		return true
	}
	return false
}

// WriteText writes the report for people: a summary line, a line per node,
// and the evidence under each node that is not healthy.
func (r *Report) WriteText(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "netcheck: %d nodes, %d probes in %d rounds; median best %v, slow above %v\n",
		len(r.Nodes), r.Probes, r.Rounds, r.MedianBest.Round(time.Microsecond), r.Threshold.Round(time.Microsecond))
	results := r.Nodes
	if r.Reference != nil {
		results = append(slices.Clone(results), *r.Reference)
	}
	for i, n := range results {
		name := n.Name
		if i == len(r.Nodes) {
			name += " (reference)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", n.Verdict, name, n.Reason)
		if n.Verdict == Healthy {
			continue
		}
		for _, e := range n.Evidence {
			fmt.Fprintf(tw, "\t  round %d %s→%s\t%s: %s\n", e.Round, e.From, e.To, e.Outcome, figures(e.Measurement))
		}
	}
	if len(r.Links) > 0 {
		fmt.Fprintf(tw, "links no verdict explains:\n")
	}
	for _, l := range r.Links {
		fmt.Fprintf(tw, "\t  round %d %s→%s\t%s: %s\n", l.Round, l.From, l.To, l.Outcome, figures(l.Measurement))
	}
	for _, n := range r.Notes {
		fmt.Fprintf(tw, "note: %s\n", n)
	}
	return tw.Flush()
}

// rate writes a bandwidth as operators read it, in bytes and in bits.
func rate(bps float64) string {
	return fmt.Sprintf("%.1f MB/s (%.0f Mbit/s)", bps/1e6, bps*8/1e6)
}

// figures says what a measurement saw, briefly.
func figures(m Measurement) string {
	if m.Failed() {
		return m.Error
	}
	var parts []string
	if m.Bandwidth > 0 {
		parts = append(parts, rate(m.Bandwidth))
	}
	if m.RTT > 0 {
		parts = append(parts, "rtt "+m.RTT.Round(time.Microsecond).String())
	}
	if m.Partial {
		parts = append(parts, fmt.Sprintf("cut by the deadline after %.1f MB in %v", float64(m.Moved)/1e6,
			m.Elapsed.Round(time.Millisecond)))
	} else {
		parts = append(parts, "in "+m.Elapsed.Round(time.Microsecond).String())
	}
	return strings.Join(parts, ", ")
}

// Report returns what the probes recorded so far say. Call it after Next
// has returned nil for the final report.
func (p *Planner) Report() *Report {
	st := p.stats()
	j := p.judge(st, st.threshold)
	r := &Report{
		MedianBest: st.median,
		Threshold:  st.threshold,
		Policy:     p.pol,
		Rounds:     p.round,
		Probes:     len(p.probes),
		Nodes:      make([]NodeResult, p.n),
	}
	for x := range p.names {
		res := NodeResult{Name: p.names[x], Verdict: j.verdict[x], Evidence: []Evidence{}}
		for i, pr := range p.probes {
			peer := pr.to
			if peer == x {
				peer = pr.from
			} else if pr.from != x {
				continue
			}
			res.Evidence = append(res.Evidence, Evidence{Round: pr.round, Peer: p.names[peer],
				PeerVerdict: j.verdict[peer], Outcome: j.outcome[i], Measurement: pr.m})
		}
		res.Reason = p.reason(x, st, j, res.Evidence)
		if x < p.n {
			r.Nodes[x] = res
		} else {
			r.Reference = &res
		}
	}
	blamed := func(x int) bool { return j.verdict[x] == Faulty || j.verdict[x] == Straggler }
	for i, pr := range p.probes {
		if j.outcome[i] != Good && !blamed(pr.from) && !blamed(pr.to) {
			r.Links = append(r.Links, LinkResult{Round: pr.round, Outcome: j.outcome[i], Measurement: pr.m})
		}
	}
	if !st.baseline && st.hub >= 0 {
		r.Notes = append(r.Notes, fmt.Sprintf("no baseline: every probe that completed involves %s, "+
			"which may be slow itself, so none shows what a healthy link does; set a bandwidth floor, or let a "+
			"reference off the nodes' hosts take part", p.names[st.hub]))
	}
	return r
}

// reason explains a verdict in a line.
func (p *Planner) reason(x int, st stats, j judgement, ev []Evidence) string {
	var peers []string
	for _, q := range j.badPeers[x] {
		peers = append(peers, p.names[q])
	}
	// Without a baseline, peers in a good probe are known to work, not to
	// be healthy.
	good := "healthy"
	if !st.baseline {
		good = "working"
	}
	switch j.verdict[x] {
	case Healthy:
		for _, e := range ev {
			if e.Outcome == Good {
				return fmt.Sprintf("good against %s: %s", e.Peer, figures(e.Measurement))
			}
		}
	case Faulty:
		last := ""
		for _, e := range ev {
			if e.Outcome == Failed && j.good[p.index[e.Peer]] {
				last = e.Error
			}
		}
		return fmt.Sprintf("failed against %s %s: %s", good, strings.Join(peers, ", "), last)
	case Straggler:
		// The best probe with a healthy peer says by how much.
		var best *Evidence
		for i, e := range ev {
			if e.Outcome == Slow && j.good[p.index[e.Peer]] && (best == nil || p.elapsed(e.Measurement) < p.elapsed(best.Measurement)) {
				best = &ev[i]
			}
		}
		why := ""
		switch m := best.Measurement; {
		case m.Partial:
			why = fmt.Sprintf("%s, cut by the deadline after %.1f MB in %v", rate(m.Bandwidth), float64(m.Moved)/1e6,
				m.Elapsed.Round(time.Millisecond))
		case m.Elapsed > j.threshold:
			why = fmt.Sprintf("took %v, %.1f× the median best %v", m.Elapsed.Round(time.Microsecond),
				float64(m.Elapsed)/float64(max(st.median, 1)), st.median.Round(time.Microsecond))
		case p.pol.MinBandwidth > 0 && m.Bandwidth < p.pol.MinBandwidth:
			why = fmt.Sprintf("%s, below the floor of %s", rate(m.Bandwidth), rate(p.pol.MinBandwidth))
		default:
			why = fmt.Sprintf("rtt %v, above the ceiling of %v", m.RTT.Round(time.Microsecond), p.pol.MaxRTT)
		}
		return fmt.Sprintf("slow against %s %s: at best %s", good, strings.Join(peers, ", "), why)
	}
	switch {
	case len(ev) == 0:
		return "not probed"
	case j.good[x]:
		for _, e := range ev {
			if e.Outcome == Good {
				return fmt.Sprintf("no baseline to judge its speed by (see the notes); reached %s: %s", e.Peer, figures(e.Measurement))
			}
		}
	case len(peers) > 0:
		return fmt.Sprintf("bad against %s only; %d healthy peers must agree", strings.Join(peers, ", "),
			p.pol.ConfirmPeers)
	case p.pol.MinBandwidth > 0 && !slices.ContainsFunc(ev, func(e Evidence) bool {
		return e.Failed() || e.Bandwidth >= p.pol.MinBandwidth
	}):
		return fmt.Sprintf("below the floor of %s with every peer, and no peer known to be healthy to tell which end is slow; see the links",
			rate(p.pol.MinBandwidth))
	}
	return "no probe with a peer known to be healthy"
}
