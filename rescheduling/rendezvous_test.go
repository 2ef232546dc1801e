package rescheduling

import (
	"errors"
	"fmt"
	oldrand "math/rand"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
	"testing/quick"
	"time"

	"github.com/google/go-cmp/cmp"
)

func newTestRendezvous(t testing.TB, cfg RendezvousConfig) *Rendezvous {
	t.Helper()
	r, err := NewRendezvous(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// op is one step of a rendezvous scenario: "+a" joins a, "-a" loses a,
// "30s" advances the clock, "step" calls Step and expects no round, and
// "round N a,b,c trigger" expects Step to complete that round.
func runScenario(t *testing.T, r *Rendezvous, ops []string) {
	t.Helper()
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for i, op := range ops {
		switch {
		case strings.HasPrefix(op, "+"):
			if err := r.Join(op[1:], now); err != nil {
				t.Fatalf("op %d %q: %v", i, op, err)
			}
		case strings.HasPrefix(op, "-"):
			r.Leave(op[1:], now)
		case op == "step":
			if got, ok := r.Step(now); ok {
				t.Fatalf("op %d: unexpected round %+v", i, got)
			}
		case strings.HasPrefix(op, "round "):
			got, ok := r.Step(now)
			if !ok {
				d, dok := r.Deadline()
				t.Fatalf("op %d %q: no round (deadline %v %v, waiting %v)", i, op, d.Sub(now), dok, r.Waiting())
			}
			want := fmt.Sprintf("round %d %s %s", got.Number, strings.Join(got.Nodes, ","), got.Trigger)
			if want != op {
				t.Fatalf("op %d: got %q, want %q", i, want, op)
			}
		case strings.HasPrefix(op, "waiting "):
			if got := strings.Join(r.Waiting(), ","); got != strings.TrimPrefix(op, "waiting ") {
				t.Fatalf("op %d: waiting %q, want %q", i, got, op)
			}
		case op == "broken":
			if w, ok := r.World(); ok {
				t.Fatalf("op %d: world %+v, want none", i, w)
			}
		default:
			d, err := time.ParseDuration(op)
			if err != nil {
				t.Fatalf("op %d %q: %v", i, op, err)
			}
			now = now.Add(d)
		}
	}
}

func TestRendezvousScenarios(t *testing.T) {
	tests := []struct {
		name string
		cfg  RendezvousConfig
		ops  []string
	}{
		{"fixed size waits for all", RendezvousConfig{MaxNodes: 4},
			[]string{"+a", "+b", "+c", "1h", "step", "+d", "round 1 a,b,c,d max"}},
		{"min reached, last call", RendezvousConfig{MinNodes: 2, MaxNodes: 4},
			[]string{"+a", "step", "1h", "step", "+b", "29s", "step", "1s", "round 1 a,b last_call"}},
		{"a join restarts the last call", RendezvousConfig{MinNodes: 2, MaxNodes: 4},
			[]string{"+a", "+b", "20s", "+c", "29s", "step", "1s", "round 1 a,b,c last_call"}},
		{"max completes at once", RendezvousConfig{MinNodes: 1, MaxNodes: 3},
			[]string{"+a", "+b", "+c", "round 1 a,b,c max", "+d", "+e", "1h", "step", "waiting d,e"}},
		{"truncated to node unit, the rest wait", RendezvousConfig{MinNodes: 2, MaxNodes: 6, NodeUnit: 2},
			[]string{"+a", "+b", "+c", "30s", "round 1 a,b last_call", "waiting c",
				"1h", "step", // c alone cannot grow the world by a unit
				"+d", "29s", "step", "1s", "round 2 a,b,c,d last_call", "waiting "}},
		{"scale down keeps min and unit", RendezvousConfig{MinNodes: 2, MaxNodes: 4, NodeUnit: 2},
			[]string{"+a", "+b", "+c", "+d", "round 1 a,b,c,d max", "-c", "broken",
				"29s", "step", "1s", "round 2 a,b last_call", "waiting d"}},
		{"a replacement within the last call keeps the size", RendezvousConfig{MinNodes: 2, MaxNodes: 4},
			[]string{"+a", "+b", "+c", "+d", "round 1 a,b,c,d max", "-b", "10s", "+e", "round 2 a,c,d,e max"}},
		{"below min waits for joins", RendezvousConfig{MinNodes: 3, MaxNodes: 3},
			[]string{"+a", "+b", "+c", "round 1 a,b,c max", "-a", "-b", "1h", "step", "broken",
				"+x", "1h", "step", "+y", "round 2 c,x,y max"}},
		{"a waiting node that leaves is forgotten", RendezvousConfig{MinNodes: 2, MaxNodes: 3},
			[]string{"+a", "+b", "-a", "1h", "step", "waiting b", "+c", "30s", "round 1 b,c last_call"}},
		{"joining twice and leaving unknown nodes change nothing", RendezvousConfig{MinNodes: 2, MaxNodes: 2},
			[]string{"+a", "+a", "-zz", "step", "+b", "round 1 a,b max", "+a", "step", "waiting "}},
		{"scale up by a unit", RendezvousConfig{MinNodes: 1, MaxNodes: 8, NodeUnit: 2, LastCallTimeout: time.Minute},
			[]string{"+a", "+b", "1m", "round 1 a,b last_call", "+c", "+d", "+e", "59s", "step", "1s",
				"round 2 a,b,c,d last_call", "waiting e"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			runScenario(t, newTestRendezvous(t, tt.cfg), tt.ops)
		})
	}
}

func TestRendezvousRoundDetails(t *testing.T) {
	r := newTestRendezvous(t, RendezvousConfig{MinNodes: 1, MaxNodes: 3})
	now := time.Unix(0, 0)
	for _, n := range []string{"a", "b", "c"} {
		r.Join(n, now)
	}
	r1, _ := r.Step(now)
	r.Leave("b", now)
	r.Join("d", now)
	r2, ok := r.Step(now)
	if !ok {
		t.Fatal("no second round")
	}
	want := Round{Number: 2, Nodes: []string{"a", "c", "d"}, Added: []string{"d"}, Removed: []string{"b"}, Trigger: "max"}
	if diff := cmp.Diff(want, r2); diff != "" {
		t.Errorf("round 2 (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]string{"a", "b", "c"}, r1.Added); diff != "" {
		t.Errorf("round 1 added: %s", diff)
	}
	w, ok := r.World()
	if !ok || !cmp.Equal(w, r2) {
		t.Errorf("World() = %+v %v", w, ok)
	}
	f := r2.Fault()
	if f.Kind != KindMembership || Classify(f) != ClassMembership || !strings.Contains(f.Reason, "round 2: 3 nodes") {
		t.Errorf("fault %+v", f)
	}
	if err := r.Join("", now); !errors.Is(err, ErrEmptyNode) {
		t.Errorf("Join(\"\") = %v", err)
	}
}

func TestRendezvousValidate(t *testing.T) {
	tests := []struct {
		cfg   RendezvousConfig
		field string
	}{
		{RendezvousConfig{}, "MaxNodes"},
		{RendezvousConfig{MaxNodes: 2, MinNodes: 3}, "MinNodes"},
		{RendezvousConfig{MaxNodes: 2, MinNodes: -1}, "MinNodes"},
		{RendezvousConfig{MaxNodes: 2, NodeUnit: -1}, "NodeUnit"},
		{RendezvousConfig{MaxNodes: 2, LastCallTimeout: -1}, "LastCallTimeout"},
		{RendezvousConfig{MaxNodes: 5, MinNodes: 5, NodeUnit: 2}, "NodeUnit is 2: no multiple"},
		{RendezvousConfig{MaxNodes: 3, MinNodes: 1, NodeUnit: 4}, "NodeUnit is 4"},
	}
	for _, tt := range tests {
		if err := tt.cfg.Validate(); err == nil || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("Validate(%+v) = %v, want an error naming %s", tt.cfg, err, tt.field)
		}
	}
}

// TestRendezvousValidateQuick: Validate accepts exactly the configs that
// can start a round, and NewRendezvous agrees with it.
func TestRendezvousValidateQuick(t *testing.T) {
	prop := func(maxN, minN, unit int8, lastCall int16) bool {
		cfg := RendezvousConfig{MaxNodes: int(maxN), MinNodes: int(minN), NodeUnit: int(unit), LastCallTimeout: time.Duration(lastCall)}
		min, u := cfg.MinNodes, cfg.NodeUnit
		if min == 0 {
			min = cfg.MaxNodes
		}
		if u == 0 {
			u = 1
		}
		feasible := cfg.MaxNodes >= 1 && cfg.MinNodes >= 0 && cfg.MinNodes <= cfg.MaxNodes &&
			cfg.NodeUnit >= 0 && lastCall >= 0 && cfg.MaxNodes/u*u >= min
		_, err := NewRendezvous(cfg)
		return (cfg.Validate() == nil) == feasible && (err == nil) == feasible
	}
	if err := quick.Check(prop, &quick.Config{MaxCount: 5000, Rand: newQuickRand()}); err != nil {
		t.Error(err)
	}
}

// rdzvModel is what the property tests know from outside: which nodes are
// alive and when membership last changed.
type rdzvModel struct {
	alive      map[string]bool
	lastChange time.Time
}

// checkRendezvous checks the invariants that hold after every operation.
func checkRendezvous(t *testing.T, r *Rendezvous, m *rdzvModel, now time.Time, where string) {
	t.Helper()
	seen := map[string]bool{}
	for _, n := range append(slices.Clone(r.world), r.waiting...) {
		if seen[n] {
			t.Fatalf("%s: node %s twice in world %v + waiting %v", where, n, r.world, r.waiting)
		}
		if !m.alive[n] {
			t.Fatalf("%s: lost node %s still held: world %v waiting %v", where, n, r.world, r.waiting)
		}
		seen[n] = true
	}
	if len(seen) != len(m.alive) {
		t.Fatalf("%s: alive %v but world %v + waiting %v", where, m.alive, r.world, r.waiting)
	}
	if w, ok := r.World(); ok {
		checkRound(t, r.cfg, w, where)
	}
	// Step leaves no round due.
	if d, ok := r.Deadline(); ok && !now.Before(d) {
		t.Fatalf("%s: a round is due at %v (now %v) after Step", where, d, now)
	}
}

func checkRound(t *testing.T, cfg RendezvousConfig, w Round, where string) {
	t.Helper()
	n := len(w.Nodes)
	if n > cfg.MaxNodes || n < cfg.MinNodes || n%cfg.NodeUnit != 0 {
		t.Fatalf("%s: round %d has %d nodes, want %d..%d in units of %d", where, w.Number, n, cfg.MinNodes, cfg.MaxNodes, cfg.NodeUnit)
	}
}

// walkStep applies one random operation and, when a round completes,
// checks why it was allowed to.
func walkStep(t *testing.T, rng *rand.Rand, r *Rendezvous, m *rdzvModel, now *time.Time, universe []string, where string) {
	t.Helper()
	prev := r.round
	switch k := rng.IntN(10); {
	case k < 4:
		n := universe[rng.IntN(len(universe))]
		r.Join(n, *now)
		if !m.alive[n] {
			m.alive[n], m.lastChange = true, *now
		}
	case k < 6:
		n := universe[rng.IntN(len(universe))]
		if slices.Contains(r.world, n) {
			m.lastChange = *now
		}
		r.Leave(n, *now)
		delete(m.alive, n)
	default:
		*now = now.Add(time.Duration(rng.IntN(int(2*r.cfg.LastCallTimeout/time.Millisecond))) * time.Millisecond)
	}
	pool := len(r.world) + len(r.waiting)
	members := slices.Clone(r.world)
	if round, ok := r.Step(*now); ok {
		checkRound(t, r.cfg, round, where)
		if round.Number != prev.Number+1 {
			t.Fatalf("%s: round %d after %d", where, round.Number, prev.Number)
		}
		switch round.Trigger {
		case "max":
			if pool < r.cfg.MaxNodes {
				t.Fatalf("%s: trigger max with %d nodes", where, pool)
			}
		case "last_call":
			if now.Sub(m.lastChange) < r.cfg.LastCallTimeout {
				t.Fatalf("%s: last call after %v", where, now.Sub(m.lastChange))
			}
		default:
			t.Fatalf("%s: trigger %q", where, round.Trigger)
		}
		// The surviving members keep their ranks' order.
		var kept []string
		for _, n := range members {
			if slices.Contains(round.Nodes, n) {
				kept = append(kept, n)
			}
		}
		if !slices.Equal(kept, round.Nodes[:len(kept)]) {
			t.Fatalf("%s: previous members %v not first in order in %v", where, kept, round.Nodes)
		}
	}
	checkRendezvous(t, r, m, *now, where)
}

// TestRendezvousRandomWalk: random joins, losses and clock moves (fixed
// seeds) over random configs never break the invariants: a round never
// has more than MaxNodes or fewer than MinNodes, its size is a multiple
// of NodeUnit, it starts only on max or after a full last call, and no
// round is left due after Step.
func TestRendezvousRandomWalk(t *testing.T) {
	universe := []string{"a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l"}
	rounds := 0
	for seed := range uint64(300) {
		rng := rand.New(rand.NewPCG(seed, 11))
		unit := 1 + rng.IntN(3)
		maxN := unit * (1 + rng.IntN(4))
		maxN += rng.IntN(unit) // not always a multiple
		minN := 1 + rng.IntN(maxN/unit*unit)
		cfg := RendezvousConfig{MinNodes: minN, MaxNodes: maxN, NodeUnit: unit, LastCallTimeout: time.Duration(1+rng.IntN(60)) * time.Second}
		r := newTestRendezvous(t, cfg)
		m := &rdzvModel{alive: map[string]bool{}}
		now := time.Unix(1e9, 0)
		for step := range 300 {
			walkStep(t, rng, r, m, &now, universe, fmt.Sprintf("seed %d %+v step %d", seed, cfg, step))
		}
		rounds += r.round.Number
	}
	if rounds < 1000 {
		t.Errorf("only %d rounds completed: the walk explores too little", rounds)
	}
}

// deepEnv, when set, makes the exhaustive tests go deeper (minutes).
const deepEnv = "FAULTLINE_RESCHEDULING_DEEP"

// TestRendezvousExhaustive tries every sequence of operations up to a
// depth on small configs, checking the invariants after each.
func TestRendezvousExhaustive(t *testing.T) {
	depth := 5 // about 0.1 M states per config
	switch {
	case os.Getenv(deepEnv) != "":
		depth = 6
	case testing.Short():
		depth = 4
	}
	const lastCall = 10 * time.Second
	ops := []string{"+a", "+b", "+c", "+d", "-a", "-b", "-c", "-d", "half", "full"}
	for _, cfg := range []RendezvousConfig{
		{MinNodes: 2, MaxNodes: 3, NodeUnit: 1, LastCallTimeout: lastCall},
		{MinNodes: 2, MaxNodes: 4, NodeUnit: 2, LastCallTimeout: lastCall},
		{MinNodes: 1, MaxNodes: 3, NodeUnit: 2, LastCallTimeout: lastCall},
	} {
		states := 0
		var walk func(r *Rendezvous, m *rdzvModel, now time.Time, path []string)
		walk = func(r *Rendezvous, m *rdzvModel, now time.Time, path []string) {
			states++
			if len(path) == depth {
				return
			}
			for _, op := range ops {
				r2 := r.clone()
				m2 := &rdzvModel{alive: maps(m.alive), lastChange: m.lastChange}
				now2 := now
				switch op[0] {
				case '+':
					r2.Join(op[1:], now2)
					if !m2.alive[op[1:]] {
						m2.alive[op[1:]], m2.lastChange = true, now2
					}
				case '-':
					if slices.Contains(r2.world, op[1:]) {
						m2.lastChange = now2
					}
					r2.Leave(op[1:], now2)
					delete(m2.alive, op[1:])
				case 'h':
					now2 = now2.Add(lastCall / 2)
				case 'f':
					now2 = now2.Add(lastCall)
				}
				p := append(slices.Clip(path), op)
				if round, ok := r2.Step(now2); ok {
					checkRound(t, cfg, round, fmt.Sprint(cfg, p))
					if round.Trigger == "last_call" && now2.Sub(m2.lastChange) < lastCall {
						t.Fatalf("%v %v: early last call", cfg, p)
					}
				}
				checkRendezvous(t, r2, m2, now2, fmt.Sprint(cfg, p))
				walk(r2, m2, now2, p)
			}
		}
		walk(newTestRendezvous(t, cfg), &rdzvModel{alive: map[string]bool{}}, time.Unix(1e9, 0), nil)
		t.Logf("%+v: %d states", cfg, states)
	}
}

func (r *Rendezvous) clone() *Rendezvous {
	c := *r
	c.world = slices.Clone(r.world)
	c.waiting = slices.Clone(r.waiting)
	c.round.Nodes = slices.Clone(r.round.Nodes)
	return &c
}

func maps(m map[string]bool) map[string]bool {
	c := make(map[string]bool, len(m))
	for k, v := range m {
		c[k] = v
	}
	return c
}

// newQuickRand seeds testing/quick so that its cases are the same each run.
func newQuickRand() *oldrand.Rand { return oldrand.New(oldrand.NewSource(1)) }
