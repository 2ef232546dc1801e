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
	for i, n := range results {
		if !validVerdict(n.Verdict) {
			return nil, fmt.Errorf("netcheck: report: nodes[%d].verdict: unknown value %q", i, n.Verdict)
		}
		for j, e := range n.Evidence {
			if !validVerdict(e.PeerVerdict) {
				return nil, fmt.Errorf("netcheck: report: nodes[%d].evidence[%d].peer_verdict: unknown value %q", i, j, e.PeerVerdict)
			}
			switch e.Outcome {
			case Good, Slow, Failed:
			default:
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
	return tw.Flush()
}

// figures says what a measurement saw, briefly.
func figures(m Measurement) string {
	if m.Failed() {
		return m.Error
	}
	var parts []string
	if m.Bandwidth > 0 {
		parts = append(parts, fmt.Sprintf("%.1f MB/s", m.Bandwidth/1e6))
	}
	if m.RTT > 0 {
		parts = append(parts, "rtt "+m.RTT.Round(time.Microsecond).String())
	}
	parts = append(parts, "in "+m.Elapsed.Round(time.Microsecond).String())
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
	return r
}

// reason explains a verdict in a line.
func (p *Planner) reason(x int, st stats, j judgement, ev []Evidence) string {
	var peers []string
	for _, q := range j.badPeers[x] {
		peers = append(peers, p.names[q])
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
			if e.Outcome == Failed && e.PeerVerdict == Healthy {
				last = e.Error
			}
		}
		return fmt.Sprintf("failed against healthy %s: %s", strings.Join(peers, ", "), last)
	case Straggler:
		// The best probe with a healthy peer says by how much.
		var best *Evidence
		for i, e := range ev {
			if e.Outcome == Slow && e.PeerVerdict == Healthy && (best == nil || e.Elapsed < best.Elapsed) {
				best = &ev[i]
			}
		}
		why := ""
		switch m := best.Measurement; {
		case m.Elapsed > j.threshold:
			why = fmt.Sprintf("took %v, %.1f× the median best %v", m.Elapsed.Round(time.Microsecond),
				float64(m.Elapsed)/float64(max(st.median, 1)), st.median.Round(time.Microsecond))
		case p.pol.MinBandwidth > 0 && m.Bandwidth < p.pol.MinBandwidth:
			why = fmt.Sprintf("%.1f MB/s, below the floor of %.1f MB/s", m.Bandwidth/1e6, p.pol.MinBandwidth/1e6)
		default:
			why = fmt.Sprintf("rtt %v, above the ceiling of %v", m.RTT.Round(time.Microsecond), p.pol.MaxRTT)
		}
		return fmt.Sprintf("slow against healthy %s: at best %s", strings.Join(peers, ", "), why)
	}
	switch {
	case len(ev) == 0:
		return "not probed"
	case len(peers) == 0:
		return "no probe with a peer known to be healthy"
	default:
		return fmt.Sprintf("bad against %s only; %d healthy peers must agree", strings.Join(peers, ", "),
			p.pol.ConfirmPeers)
	}
}
