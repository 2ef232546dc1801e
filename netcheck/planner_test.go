package netcheck

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// fault is what is wrong with a simulated node.
type fault int

const (
	ok   fault = iota
	slow       // every probe with it takes 3–10× longer
	cut        // every probe with it fails
)

// sim answers probes consistently: a probe takes as long as its slower
// end, and fails if either end is cut.
type sim struct {
	time  map[string]time.Duration
	fault map[string]fault
}

const base = 10 * time.Millisecond

func newSim(r *rand.Rand, names []string, faults map[string]fault) *sim {
	s := &sim{time: map[string]time.Duration{}, fault: faults}
	for _, n := range names {
		jitter := 1 + 0.3*r.Float64()
		if faults[n] == slow {
			jitter = 3 + 7*r.Float64()
		}
		s.time[n] = time.Duration(float64(base) * jitter)
	}
	return s
}

func (s *sim) probe(p Pair) Measurement {
	m := Measurement{From: p.From, To: p.To, Bytes: 1 << 20}
	if s.fault[p.From] == cut || s.fault[p.To] == cut {
		m.Error = "i/o timeout"
		m.Elapsed = time.Second
		return m
	}
	m.Elapsed = max(s.time[p.From], s.time[p.To])
	m.RTT = m.Elapsed / 100
	m.Bandwidth = float64(m.Bytes) / m.Elapsed.Seconds()
	return m
}

// drive runs the planner against the simulation and checks the planner's
// promises about rounds on the way.
func drive(t *testing.T, p *Planner, s *sim) (*Report, int) {
	t.Helper()
	round0 := 0
	for i, round := 0, p.Next(); round != nil; i, round = i+1, p.Next() {
		seen := map[string]bool{}
		for _, pr := range round {
			if seen[pr.From] || seen[pr.To] || pr.From == pr.To {
				t.Fatalf("round %d uses a name twice: %v", i, round)
			}
			seen[pr.From], seen[pr.To] = true, true
			if err := p.Record(s.probe(pr)); err != nil {
				t.Fatal(err)
			}
		}
		if i == 0 {
			round0 = len(round)
		}
	}
	return p.Report(), round0
}

func names(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("n%02d", i)
	}
	return out
}

// TestPlannerProperties runs the planner over many random fault sets with
// consistent probes.
func TestPlannerProperties(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	iterations := 3000
	if testing.Short() {
		iterations = 300
	}
	for it := range iterations {
		n := 2 + r.IntN(40)
		if it%4 == 0 {
			n = 2 + r.IntN(2) // many small cases: N = 2 and 3
		}
		nodes := names(n)
		ref := ""
		if r.IntN(3) > 0 {
			ref = "checker"
		}
		k := r.IntN(n + 1)
		if r.IntN(2) == 0 {
			k = r.IntN(n/2 + 1) // healthy majority more often
		}
		faults := map[string]fault{}
		for _, i := range r.Perm(n)[:k] {
			faults[nodes[i]] = fault(1 + r.IntN(2))
		}
		s := newSim(r, append(slices.Clone(nodes), "checker"), faults)
		p, err := NewPlanner(nodes, ref, Policy{ProbeTimeout: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		rep, round0 := drive(t, p, s)
		desc := fmt.Sprintf("iteration %d: N=%d k=%d ref=%q faults=%v", it, n, k, ref, faults)

		// Never blame a healthy node, and blame for the right reason.
		for _, res := range rep.Nodes {
			switch f := faults[res.Name]; {
			case f == ok && res.Verdict != Healthy && res.Verdict != Unknown:
				t.Fatalf("%s: healthy %s judged %s: %s", desc, res.Name, res.Verdict, res.Reason)
			case f == slow && res.Verdict == Faulty, f == cut && res.Verdict == Straggler:
				t.Fatalf("%s: %s judged %s", desc, res.Name, res.Verdict)
			}
		}
		if rep.Reference != nil && rep.Reference.Verdict != Healthy && rep.Reference.Verdict != Unknown {
			t.Fatalf("%s: reference judged %s", desc, rep.Reference.Verdict)
		}
		// Never healthy without a baseline.
		if len(rep.Names(Healthy)) > 0 && slices.ContainsFunc(rep.Notes, func(n string) bool { return strings.HasPrefix(n, "no baseline") }) {
			t.Fatalf("%s: healthy nodes without a baseline: %v", desc, rep.Notes)
		}

		// When there are fewer bad nodes than round-0 probes, round 0 has
		// a probe between two healthy participants, which tells what fast
		// is; then every node gets its verdict, and the probes beyond
		// round 0 stay O(k). (Not N = 2 without a reference: its one
		// probe is no baseline.) With a reference, so does the classic
		// N = 2 case that fails in DLRover, but for the healthy node of
		// N = 2 with the other cut: its one completed probe, with the
		// reference, has nothing to be compared with.
		tiny := ref != "" && n == 2 && k == 1
		if (k < round0 && (n > 2 || ref != "")) || tiny {
			for _, res := range rep.Nodes {
				want := map[fault]Verdict{ok: Healthy, slow: Straggler, cut: Faulty}[faults[res.Name]]
				if tiny && want == Healthy && slices.Contains(slices.Collect(maps.Values(faults)), cut) {
					want = Unknown
				}
				if res.Verdict != want {
					t.Fatalf("%s: %s judged %s, want %s: %s", desc, res.Name, res.Verdict, want, res.Reason)
				}
			}
			if extra := rep.Probes - round0; extra > 3*k+2 {
				t.Fatalf("%s: %d probes beyond round 0, want at most 3k+2 = %d", desc, extra, 3*k+2)
			}
		}
	}
}

func TestPlannerSmallClusters(t *testing.T) {
	for _, tc := range []struct {
		n      int
		ref    string
		faults map[string]fault
		want   string // verdicts in node order, one letter each: h f s u
	}{
		// Only n01–checker completes: nothing to compare it with, so n01
		// is unknown, slow or not (a bandwidth floor would tell).
		{2, "checker", map[string]fault{"n00": cut}, "fu"},
		{2, "checker", map[string]fault{"n01": cut}, "uf"},
		{2, "checker", map[string]fault{"n00": cut, "n01": slow}, "fu"},
		{2, "checker", map[string]fault{"n00": slow}, "sh"},
		{2, "checker", map[string]fault{}, "hh"},
		// Without a reference, one probe: no baseline, whatever it saw.
		{2, "", map[string]fault{"n00": cut}, "uu"},
		{2, "", map[string]fault{"n00": slow}, "uu"},
		{2, "", map[string]fault{}, "uu"},
		{3, "checker", map[string]fault{"n02": cut}, "hhf"},
		{3, "checker", map[string]fault{"n00": slow, "n02": cut}, "shf"},
		{3, "checker", map[string]fault{"n00": cut, "n01": cut}, "ffu"},
		// Without a reference, the pair that round 0 left out is probed
		// to have a baseline.
		{3, "", map[string]fault{"n00": slow}, "shh"},
		{3, "", map[string]fault{"n02": slow}, "hhs"},
		{3, "", map[string]fault{}, "hhh"},
		{3, "", map[string]fault{"n01": cut}, "ufu"},
		{3, "", map[string]fault{"n00": cut, "n01": cut}, "uuu"},
		{1, "checker", map[string]fault{"n00": slow}, "u"},
		{1, "checker", map[string]fault{"n00": cut}, "u"}, // or is the checker cut?
		{1, "", map[string]fault{}, "u"},
	} {
		t.Run(fmt.Sprintf("N=%d,ref=%q,%v", tc.n, tc.ref, tc.faults), func(t *testing.T) {
			nodes := names(tc.n)
			s := newSim(rand.New(rand.NewPCG(1, 1)), append(nodes, "checker"), tc.faults)
			p, err := NewPlanner(nodes, tc.ref, Policy{})
			if err != nil {
				t.Fatal(err)
			}
			rep, _ := drive(t, p, s)
			var got strings.Builder
			for _, res := range rep.Nodes {
				got.WriteByte(string(res.Verdict)[0])
			}
			if got.String() != tc.want {
				var b strings.Builder
				rep.WriteText(&b)
				t.Fatalf("verdicts %s, want %s\n%s", got.String(), tc.want, b.String())
			}
		})
	}
}

func TestPlannerRoundsAndRecord(t *testing.T) {
	p, err := NewPlanner(names(5), "", Policy{})
	if err != nil {
		t.Fatal(err)
	}
	round := p.Next()
	want := []Pair{{"n00", "n01"}, {"n02", "n03"}}
	if !slices.Equal(round, want) {
		t.Fatalf("round 0 = %v, want neighbours %v", round, want)
	}
	if err := p.Record(Measurement{From: "n00", To: "n02"}); err == nil {
		t.Fatal("a pair outside the round was accepted")
	}
	if err := p.Record(Measurement{From: "n01", To: "n00", Elapsed: base}); err != nil {
		t.Fatalf("a pair in reverse order: %v", err)
	}
	if err := p.Record(Measurement{From: "n00", To: "n01"}); err == nil {
		t.Fatal("a pair recorded twice was accepted")
	}
	// n02–n03 is never recorded: it counts as failed, so both become
	// suspects; n04 was never probed. Round 1 gives each a healthy peer.
	round = p.Next()
	if len(round) != 2 {
		t.Fatalf("round 1 = %v, want two probes (healthy peers are n00 and n01)", round)
	}
	for _, pr := range round {
		if pr.From != "n00" && pr.From != "n01" {
			t.Fatalf("round 1 probe %v does not start from a known-good node", pr)
		}
	}
	rep := p.Report()
	if rep.Nodes[2].Evidence[0].Error != "no result recorded" {
		t.Fatalf("evidence of n02 = %+v", rep.Nodes[2].Evidence)
	}

	// Probes not recorded are added in the order they were handed out,
	// whatever the run.
	var first []Pair
	for range 20 {
		p, err := NewPlanner(names(40), "checker", Policy{})
		if err != nil {
			t.Fatal(err)
		}
		p.Next()
		p.Next()
		var got []Pair
		for _, e := range p.Report().Links {
			got = append(got, Pair{e.From, e.To})
		}
		if first == nil {
			first = got
			if len(first) != 20 || first[0] != (Pair{"n00", "n01"}) || first[19] != (Pair{"n38", "n39"}) {
				t.Fatalf("unrecorded probes %v, want round 0's 20 in order", first)
			}
		} else if !slices.Equal(got, first) {
			t.Fatalf("unrecorded probes in another order: %v, then %v", first, got)
		}
	}

	if _, err := NewPlanner([]string{"a", "a"}, "", Policy{}); err == nil {
		t.Fatal("duplicate names accepted")
	}
	if _, err := NewPlanner([]string{"a", ""}, "", Policy{}); err == nil {
		t.Fatal("empty name accepted")
	}
	if _, err := NewPlanner([]string{"a"}, "a", Policy{}); err == nil {
		t.Fatal("a reference named like a node accepted")
	}
	if _, err := NewPlanner([]string{"a"}, "", Policy{StragglerRatio: 0.5}); err == nil || !strings.Contains(err.Error(), "StragglerRatio") {
		t.Fatalf("bad policy: err = %v", err)
	}
}

func TestPlannerFloors(t *testing.T) {
	// All nodes equally fast but one below the bandwidth floor and one
	// above the RTT ceiling: the ratio alone would not see them.
	nodes := names(6)
	p, err := NewPlanner(nodes, "", Policy{MinBandwidth: 50e6, MaxRTT: 5 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	for round := p.Next(); round != nil; round = p.Next() {
		for _, pr := range round {
			m := Measurement{From: pr.From, To: pr.To, Elapsed: base, RTT: time.Millisecond, Bandwidth: 100e6}
			if pr.From == "n01" || pr.To == "n01" {
				m.Bandwidth = 10e6
			}
			if pr.From == "n04" || pr.To == "n04" {
				m.RTT = 20 * time.Millisecond
			}
			if err := p.Record(m); err != nil {
				t.Fatal(err)
			}
		}
	}
	rep := p.Report()
	if got := rep.Bad(); !slices.Equal(got, []string{"n01", "n04"}) {
		t.Fatalf("bad = %v, want [n01 n04]", got)
	}
	if r := rep.Nodes[1].Reason; !strings.Contains(r, "below the floor") {
		t.Fatalf("reason for n01: %s", r)
	}
	if r := rep.Nodes[4].Reason; !strings.Contains(r, "above the ceiling") {
		t.Fatalf("reason for n04: %s", r)
	}
}

// TestPlannerFloorAboveEveryLink: when no link reaches the floor, no node
// can be blamed, and the report names every link below it.
func TestPlannerFloorAboveEveryLink(t *testing.T) {
	p, err := NewPlanner(names(5), "", Policy{MinBandwidth: 50e6})
	if err != nil {
		t.Fatal(err)
	}
	for round := p.Next(); round != nil; round = p.Next() {
		for _, pr := range round {
			if err := p.Record(Measurement{From: pr.From, To: pr.To, Elapsed: base, Bandwidth: 10e6, Bytes: 1 << 20}); err != nil {
				t.Fatal(err)
			}
		}
	}
	rep := p.Report()
	var text strings.Builder
	rep.WriteText(&text)
	if got := rep.Names(Unknown); len(got) != 5 {
		t.Fatalf("unknown nodes %v, want all five\n%s", got, text.String())
	}
	if len(rep.Links) != rep.Probes || rep.Probes < 3 {
		t.Fatalf("%d links named for %d probes\n%s", len(rep.Links), rep.Probes, text.String())
	}
	for _, l := range rep.Links {
		if l.Outcome != Slow || l.Bandwidth != 10e6 {
			t.Fatalf("link %+v", l)
		}
	}
	if r := rep.Nodes[0].Reason; !strings.HasPrefix(r, "below the floor of 50.0 MB/s (400 Mbit/s) with every peer") {
		t.Fatalf("reason for n00: %s", r)
	}
	for _, want := range []string{"links no verdict explains", "n00→n01", "slow: 10.0 MB/s (80 Mbit/s)"} {
		if !strings.Contains(text.String(), want) {
			t.Errorf("text lacks %q:\n%s", want, text.String())
		}
	}
}

// TestPlannerFloorIsABaseline: two nodes and no reference have one probe
// and no baseline; a floor that the probe passes is one.
func TestPlannerFloorIsABaseline(t *testing.T) {
	for _, tc := range []struct {
		floor float64
		want  []string
	}{
		{0, nil},
		{50e6, []string{"n00", "n01"}},
	} {
		p, err := NewPlanner(names(2), "", Policy{MinBandwidth: tc.floor})
		if err != nil {
			t.Fatal(err)
		}
		for round := p.Next(); round != nil; round = p.Next() {
			for _, pr := range round {
				p.Record(Measurement{From: pr.From, To: pr.To, Elapsed: base, Bandwidth: 100e6})
			}
		}
		rep := p.Report()
		if got := rep.Names(Healthy); !slices.Equal(got, tc.want) {
			t.Errorf("floor %v: healthy %v, want %v; notes %q", tc.floor, got, tc.want, rep.Notes)
		}
		if noted := len(rep.Notes) > 0 && strings.HasPrefix(rep.Notes[0], "no baseline"); noted != (tc.floor == 0) {
			t.Errorf("floor %v: notes %q", tc.floor, rep.Notes)
		}
	}
}

// TestPlannerPartialProbe: a probe that the deadline cut short is judged
// by the rate it moved at, so a slow link is a straggler with its figure;
// one that moved nothing fails.
func TestPlannerPartialProbe(t *testing.T) {
	p, err := NewPlanner(names(4), "", Policy{ProbeTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	for round := p.Next(); round != nil; round = p.Next() {
		for _, pr := range round {
			m := Measurement{From: pr.From, To: pr.To, Elapsed: base, Bandwidth: 100e6, Bytes: 1e6}
			switch {
			case pr.From == "n01" || pr.To == "n01": // 1 MB/s: 2 MB take 2 s, past the deadline
				m = Measurement{From: pr.From, To: pr.To, Elapsed: time.Second, Bandwidth: 1e6, Bytes: 1e6, Moved: 1e6, Partial: true}
			case pr.From == "n03" || pr.To == "n03":
				m = Measurement{From: pr.From, To: pr.To, Elapsed: time.Second, Bytes: 1e6, Partial: true}
			}
			if err := p.Record(m); err != nil {
				t.Fatal(err)
			}
		}
	}
	rep := p.Report()
	var text strings.Builder
	rep.WriteText(&text)
	if got := []Verdict{rep.Nodes[0].Verdict, rep.Nodes[1].Verdict, rep.Nodes[2].Verdict, rep.Nodes[3].Verdict}; !slices.Equal(got, []Verdict{Healthy, Straggler, Healthy, Faulty}) {
		t.Fatalf("verdicts %v\n%s", got, text.String())
	}
	if r := rep.Nodes[1].Reason; !strings.Contains(r, "1.0 MB/s (8 Mbit/s), cut by the deadline after 1.0 MB in 1s") {
		t.Fatalf("reason for n01: %s", r)
	}
	if r := rep.Nodes[3].Reason; !strings.Contains(r, "nothing moved") {
		t.Fatalf("reason for n03: %s", r)
	}
}

// TestPlannerIsDeterministic plans one check again and again: the probes,
// in order, and the report are the same each time, so that two runs of a
// check on one cluster can be compared probe by probe.
func TestPlannerIsDeterministic(t *testing.T) {
	nodes := names(40)
	faults := map[string]fault{"n03": slow, "n17": cut, "n18": slow, "n31": cut}
	run := func() ([][]Pair, *Report) {
		s := newSim(rand.New(rand.NewPCG(7, 8)), nodes, faults)
		p, err := NewPlanner(nodes, "", Policy{})
		if err != nil {
			t.Fatal(err)
		}
		var rounds [][]Pair
		for round := p.Next(); round != nil; round = p.Next() {
			rounds = append(rounds, round)
			for _, pr := range round {
				if err := p.Record(s.probe(pr)); err != nil {
					t.Fatal(err)
				}
			}
		}
		return rounds, p.Report()
	}
	wantRounds, wantRep := run()
	for i := range 20 {
		rounds, rep := run()
		if !slices.EqualFunc(rounds, wantRounds, slices.Equal) {
			t.Fatalf("run %d planned %v, the first %v", i, rounds, wantRounds)
		}
		if diff := cmp.Diff(wantRep, rep); diff != "" {
			t.Fatalf("run %d reported otherwise than the first (-first +run):\n%s", i, diff)
		}
	}
}
