package topology

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"slices"
	"sort"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func mustParse(t testing.TB, s string) *Topology {
	t.Helper()
	topo, err := Parse([]byte(s))
	if err != nil {
		t.Fatal(err)
	}
	return topo
}

func TestOrder(t *testing.T) {
	topo := mustParse(t, `
a1 p1 10.0.0.1
a1 p1 10.0.0.2
a2 p1 10.0.0.3
a3 p2 10.0.1.1
a3 p2 10.0.1.2
a4 p1 10.0.0.4
`)
	world := []string{"10.0.1.1", "10.0.0.1", "10.9.9.9", "10.0.0.4", "10.0.1.2", "10.0.0.3", "10.0.0.2"}
	// Rank 0 (10.0.1.1) keeps its ASW and PSW first; a4 and a1 (both p1)
	// are adjacent in order of first appearance, then a2; the unknown
	// node goes last.
	want := []string{"10.0.1.1", "10.0.1.2", "10.0.0.1", "10.0.0.2", "10.0.0.4", "10.0.0.3", "10.9.9.9"}
	if diff := cmp.Diff(want, topo.Order(world)); diff != "" {
		t.Fatalf("Order (-want +got):\n%s", diff)
	}
	// Identity is kept: another spelling of an address stays as written.
	if got := topo.Order([]string{"10.9.9.9", "::ffff:10.0.0.1"}); got[0] != "10.9.9.9" {
		// ::ffff:10.0.0.1 is not 10.0.0.1 to netip, so both are unknown.
		t.Fatalf("Order = %v", got)
	}
	v6 := mustParse(t, "a p fd00::1\nb p fd00::2\n")
	if got := v6.Order([]string{"fd00:0::2", "x", "fd00::1"}); !slices.Equal(got, []string{"fd00:0::2", "fd00::1", "x"}) {
		t.Fatalf("Order with other spellings = %v", got)
	}
	if got := topo.Order(nil); len(got) != 0 {
		t.Fatalf("Order(nil) = %v", got)
	}
}

// randomTopology returns a topology of n nodes under a few switches and the
// nodes' IPs.
func randomTopology(t testing.TB, r *rand.Rand, n int) (*Topology, []string) {
	psws := 1 + r.IntN(4)
	asws := 1 + r.IntN(8)
	nodes := make([]Node, n)
	ips := make([]string, n)
	for i := range nodes {
		a := r.IntN(asws)
		ip := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
		nodes[i] = Node{IP: ip.String(), ASW: fmt.Sprintf("asw%d", a), PSW: fmt.Sprintf("psw%d", a%psws)}
		ips[i] = ip.String()
	}
	topo, err := New(nodes)
	if err != nil {
		t.Fatal(err)
	}
	return topo, ips
}

// randomWorld picks a shuffled subset of ips plus a few unknown nodes.
func randomWorld(r *rand.Rand, ips []string) []string {
	var w []string
	for _, ip := range ips {
		if r.IntN(5) > 0 {
			w = append(w, ip)
		}
	}
	for i := range r.IntN(4) {
		w = append(w, fmt.Sprintf("192.168.77.%d", i))
	}
	r.Shuffle(len(w), func(i, j int) { w[i], w[j] = w[j], w[i] })
	return w
}

func TestOrderProperties(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for iter := range 500 {
		topo, ips := randomTopology(t, r, 1+r.IntN(60))
		world := randomWorld(r, ips)
		got := topo.Order(world)
		checkOrder(t, topo, world, got)
		if again := topo.Order(got); !slices.Equal(again, got) {
			t.Fatalf("iteration %d: Order is not idempotent:\n%v\n%v", iter, got, again)
		}
	}
}

func checkOrder(t *testing.T, topo *Topology, world, got []string) {
	t.Helper()
	a, b := slices.Clone(world), slices.Clone(got)
	sort.Strings(a)
	sort.Strings(b)
	if !slices.Equal(a, b) {
		t.Fatalf("Order(%v) = %v is not a permutation", world, got)
	}
	pos := make(map[string]int, len(world))
	for i, ip := range world {
		pos[ip] = i
	}
	firstASW := map[string]int{} // first appearance in world
	firstPSW := map[string]int{}
	for i, ip := range world {
		if n, ok := topo.Lookup(ip); ok {
			if _, seen := firstASW[n.ASW]; !seen {
				firstASW[n.ASW] = i
			}
			if _, seen := firstPSW[n.PSW]; !seen {
				firstPSW[n.PSW] = i
			}
		}
	}
	var prev *Node
	prevPos := -1
	doneASW, donePSW := map[string]bool{}, map[string]bool{}
	unknown := false
	for i, ip := range got {
		n, ok := topo.Lookup(ip)
		if !ok {
			unknown = true
			if prevPos > pos[ip] && prev == nil {
				t.Fatalf("unknown nodes out of input order at %d: %v", i, got)
			}
			prev, prevPos = nil, pos[ip]
			continue
		}
		if unknown {
			t.Fatalf("known node %s after an unknown one: %v", ip, got)
		}
		if prev == nil || prev.ASW != n.ASW {
			if doneASW[n.ASW] {
				t.Fatalf("ASW %s is not contiguous: %v", n.ASW, got)
			}
			if prev != nil && prev.PSW == n.PSW && firstASW[prev.ASW] > firstASW[n.ASW] {
				t.Fatalf("ASWs under %s not in order of first appearance: %v", n.PSW, got)
			}
			if prev != nil {
				doneASW[prev.ASW] = true
			}
		} else if pos[ip] < prevPos {
			t.Fatalf("nodes under %s out of input order: %v", n.ASW, got)
		}
		if prev == nil || prev.PSW != n.PSW {
			if donePSW[n.PSW] {
				t.Fatalf("PSW %s is not contiguous: %v", n.PSW, got)
			}
			if prev != nil {
				if firstPSW[prev.PSW] > firstPSW[n.PSW] {
					t.Fatalf("PSWs not in order of first appearance: %v", got)
				}
				donePSW[prev.PSW] = true
			}
		}
		prev, prevPos = &n, pos[ip]
	}
	if len(world) > 0 {
		if _, ok := topo.Lookup(world[0]); ok && got[0] != world[0] {
			t.Fatalf("rank 0 %s moved: %v", world[0], got)
		}
	}
}

func TestFitParallel(t *testing.T) {
	// Three ASWs of 3, 2 and 3 nodes; TP spans 2 nodes of 8 devices.
	topo := mustParse(t, `
a1 p1 10.0.0.1
a1 p1 10.0.0.2
a1 p1 10.0.0.3
a2 p1 10.0.0.4
a2 p1 10.0.0.5
a3 p2 10.0.1.1
a3 p2 10.0.1.2
a3 p2 10.0.1.3
`)
	world := []string{"10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5", "10.0.1.1", "10.0.1.2", "10.0.1.3"}
	// Order alone puts a TP group across a1|a2 and another across a2|a3.
	got, err := topo.FitParallel(world, Parallel{DevicesPerNode: 8, TP: 16})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"10.0.0.1", "10.0.0.2", "10.0.0.4", "10.0.0.5", "10.0.1.1", "10.0.1.2", "10.0.0.3", "10.0.1.3"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("FitParallel (-want +got):\n%s", diff)
	}
	// With stages of 4 nodes (TP 16 × DP 2), a1's first two nodes cannot
	// make a stage under one ASW, so only whole TP groups are kept.
	got, err = topo.FitParallel(world, Parallel{DevicesPerNode: 8, TP: 16, DP: 2, PP: 2})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("FitParallel with stages (-want +got):\n%s", diff)
	}
	// TP inside a node: nothing to fit but stages; Order's result stands
	// when stages are one node.
	got, err = topo.FitParallel(world, Parallel{DevicesPerNode: 8, TP: 4, PP: 16})
	if err != nil || !slices.Equal(got, topo.Order(world)) {
		t.Fatalf("FitParallel(TP 4, PP 16) = %v, %v; want Order's result", got, err)
	}

	for _, bad := range []Parallel{
		{DevicesPerNode: 8, TP: 3},
		{DevicesPerNode: 8, TP: 16, PP: 3},
		{DevicesPerNode: 8, TP: 8, PP: 1, DP: 7},
		{DevicesPerNode: -1},
		{DevicesPerNode: 8, TP: 1 << 40, PP: 1 << 40, DP: 1 << 40},
	} {
		if _, err := topo.FitParallel(world, bad); err == nil {
			t.Errorf("FitParallel(%+v) succeeded", bad)
		}
	}
}

func TestFitParallelProperties(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for range 500 {
		topo, ips := randomTopology(t, r, 1+r.IntN(60))
		world := randomWorld(r, ips)
		k := 1 + r.IntN(4) // nodes per TP group
		n := len(world) / k * k
		world = world[:n]
		if n == 0 {
			continue
		}
		dp := 1
		if (n/k)%2 == 0 && r.IntN(2) == 0 {
			dp = 2
		}
		p := Parallel{DevicesPerNode: 4, TP: 4 * k, DP: dp, PP: n / k / dp}
		got, err := topo.FitParallel(world, p)
		if err != nil {
			t.Fatal(err)
		}
		a, b := slices.Clone(world), slices.Clone(got)
		sort.Strings(a)
		sort.Strings(b)
		if !slices.Equal(a, b) {
			t.Fatalf("not a permutation: %v -> %v", world, got)
		}
		// Count TP groups under one ASW; the best any order can do is
		// the sum over ASWs of floor(size / k).
		inside := 0
		for i := 0; i < n; i += k {
			if sameASW(topo, got[i:i+k]) {
				inside++
			}
		}
		sizes := map[string]int{}
		for _, ip := range world {
			if node, ok := topo.Lookup(ip); ok {
				sizes[node.ASW]++
			}
		}
		best := 0
		for _, s := range sizes {
			best += s / k
		}
		if inside != best {
			t.Fatalf("k=%d: %d TP groups under one ASW, best is %d: %v", k, inside, best, got)
		}
	}
}

func sameASW(topo *Topology, ips []string) bool {
	first, ok := topo.Lookup(ips[0])
	if !ok {
		return false
	}
	for _, ip := range ips[1:] {
		if n, ok := topo.Lookup(ip); !ok || n.ASW != first.ASW {
			return false
		}
	}
	return true
}

// BenchmarkOrder100k orders 100k nodes under 1250 ASWs and 25 PSWs; the
// baseline sorts the same 100k addresses with sort.Strings.
func BenchmarkOrder100k(b *testing.B) {
	const n = 100_000
	nodes := make([]Node, n)
	world := make([]string, n)
	for i := range nodes {
		ip := netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}).String()
		a := i / 80
		nodes[i] = Node{IP: ip, ASW: fmt.Sprintf("asw-%d", a), PSW: fmt.Sprintf("psw-%d", a/50)}
		world[i] = ip
	}
	topo, err := New(nodes)
	if err != nil {
		b.Fatal(err)
	}
	rand.New(rand.NewPCG(5, 6)).Shuffle(n, func(i, j int) { world[i], world[j] = world[j], world[i] })
	b.Run("Order", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			topo.Order(world)
		}
	})
	b.Run("baseline=sort.Strings", func(b *testing.B) {
		b.ReportAllocs()
		buf := make([]string, n)
		for b.Loop() {
			copy(buf, world)
			sort.Strings(buf)
		}
	})
}
