package topology

import (
	"cmp"
	"fmt"
	"slices"
)

// Order returns world, a list of node addresses in rank order (world[0] is
// rank 0), reordered so that collective traffic between neighbouring ranks
// stays under one switch:
//
//   - the nodes under one ASW are contiguous, rank 0's ASW first;
//   - the ASWs under one PSW are adjacent, rank 0's PSW first;
//   - otherwise ASWs and PSWs keep the order in which world first names
//     them, and nodes under one ASW keep their order in world;
//   - nodes the topology does not know come last, in their order in world.
//
// Order never renames a node: the result holds the strings of world,
// permuted. It is pure and stable: Order(Order(w)) equals Order(w).
func (t *Topology) Order(world []string) []string {
	out := make([]string, len(world))
	for i, j := range t.perm(world) {
		out[i] = world[j]
	}
	return out
}

// perm returns the permutation Order applies: out[i] = world[perm[i]].
func (t *Topology) perm(world []string) []int {
	// A counting sort keyed by ASW: O(len(world)) plus one map lookup per
	// node, so that ordering a 100k-node world costs about as much as
	// hashing its addresses.
	const unknown = -1
	aswOf := make([]int32, len(world)) // ASW number per world entry
	aswSeen := make([]int32, len(t.aswPSW))
	for i := range aswSeen {
		aswSeen[i] = unknown // ASW position in order of first appearance
	}
	var aswOrder []int32 // ASWs in order of first appearance in world
	for i, ip := range world {
		n, ok := t.index(ip)
		if !ok {
			aswOf[i] = unknown
			continue
		}
		a := t.asw[n]
		aswOf[i] = a
		if aswSeen[a] == unknown {
			aswSeen[a] = int32(len(aswOrder))
			aswOrder = append(aswOrder, a)
		}
	}
	// Keep ASWs under one PSW adjacent, PSWs in order of first appearance.
	pswSeen := make(map[int32]int32) // PSW -> position of first appearance
	for _, a := range aswOrder {
		if _, ok := pswSeen[t.aswPSW[a]]; !ok {
			pswSeen[t.aswPSW[a]] = int32(len(pswSeen))
		}
	}
	slices.SortStableFunc(aswOrder, func(a, b int32) int {
		return cmp.Compare(pswSeen[t.aswPSW[a]], pswSeen[t.aswPSW[b]])
	})
	// Bucket start offsets in the final order; unknown nodes after all.
	count := make([]int, len(t.aswPSW))
	unknowns := 0
	for _, a := range aswOf {
		if a == unknown {
			unknowns++
		} else {
			count[a]++
		}
	}
	next := make([]int, len(t.aswPSW))
	off := 0
	for _, a := range aswOrder {
		next[a] = off
		off += count[a]
	}
	perm := make([]int, len(world))
	for i, a := range aswOf {
		if a == unknown {
			perm[off] = i
			off++
			continue
		}
		perm[next[a]] = i
		next[a]++
	}
	return perm
}

// Parallel describes how a training job splits its ranks, in Megatron's
// default order: tensor parallel fastest, then data parallel, then pipeline
// parallel. So a TP group is TP consecutive ranks and a pipeline stage
// (the DP groups of one stage together) is TP×DP consecutive ranks.
type Parallel struct {
	DevicesPerNode int // ranks per node; 0 means 8
	TP             int // tensor-parallel size; 0 means 1
	PP             int // pipeline-parallel size; 0 means 1
	DP             int // data-parallel size; 0 means whatever the world leaves
}

// withDefaults fills the zero fields for a world of nodes nodes and checks
// that the sizes fit it.
func (p Parallel) withDefaults(nodes int) (Parallel, error) {
	p.DevicesPerNode = cmp.Or(p.DevicesPerNode, 8)
	p.TP = cmp.Or(p.TP, 1)
	p.PP = cmp.Or(p.PP, 1)
	for _, f := range [...]struct {
		name string
		v    int
	}{{"DevicesPerNode", p.DevicesPerNode}, {"TP", p.TP}, {"PP", p.PP}, {"DP", p.DP}} {
		if f.v < 0 {
			return p, fmt.Errorf("topology: Parallel.%s = %d: must not be negative", f.name, f.v)
		}
	}
	ranks := nodes * p.DevicesPerNode
	// Compare by division so that absurd sizes cannot overflow.
	fits := p.TP <= ranks && p.PP <= ranks/p.TP && ranks%(p.TP*p.PP) == 0
	if fits && p.DP == 0 {
		p.DP = ranks / (p.TP * p.PP)
	}
	if !fits || p.DP != ranks/(p.TP*p.PP) {
		return p, fmt.Errorf("topology: Parallel TP=%d PP=%d DP=%d does not fit %d ranks (%d nodes × %d devices): want TP×PP×DP = %d",
			p.TP, p.PP, p.DP, ranks, nodes, p.DevicesPerNode, ranks)
	}
	if p.TP%p.DevicesPerNode != 0 && p.DevicesPerNode%p.TP != 0 {
		return p, fmt.Errorf("topology: Parallel.TP = %d: must divide or be a multiple of DevicesPerNode = %d",
			p.TP, p.DevicesPerNode)
	}
	return p, nil
}

// FitParallel orders world like Order and then fits the job's groups to the
// switches: it places as many whole TP groups, and then whole pipeline
// stages, under a single ASW as the ASW sizes allow, so that a TP group
// straddles two ASWs only when no order could fit it inside one. The nodes
// that fill no whole TP group under their ASW go last, in switch order, so
// that the groups they form at least share a PSW where they can.
//
// A TP group within one node (TP ≤ DevicesPerNode) never leaves its node,
// so only the stage fitting matters then. Like Order, FitParallel is pure,
// stable and never renames a node.
func (t *Topology) FitParallel(world []string, p Parallel) ([]string, error) {
	if len(world) == 0 {
		return nil, nil
	}
	p, err := p.withDefaults(len(world))
	if err != nil {
		return nil, err
	}
	block := max(1, p.TP/p.DevicesPerNode)      // nodes per TP group
	stage := max(1, p.TP*p.DP/p.DevicesPerNode) // nodes per pipeline stage

	ordered := t.Order(world)
	out := make([]string, 0, len(world))
	var blocks, rest []string // whole TP groups, then loose nodes
	for len(ordered) > 0 {
		run := t.aswRun(ordered)
		full := len(run) / stage * stage
		out = append(out, run[:full]...)
		run = run[full:]
		nb := len(run) / block * block
		blocks = append(blocks, run[:nb]...)
		rest = append(rest, run[nb:]...)
		ordered = ordered[len(run)+full:]
	}
	out = append(out, blocks...)
	return append(out, rest...), nil
}

// aswRun returns the prefix of ordered under one ASW; an unknown node is a
// run of its own, since nothing says it shares a switch with anyone.
func (t *Topology) aswRun(ordered []string) []string {
	first, ok := t.index(ordered[0])
	if !ok {
		return ordered[:1]
	}
	n := 1
	for n < len(ordered) {
		j, ok := t.index(ordered[n])
		if !ok || t.asw[j] != t.asw[first] {
			break
		}
		n++
	}
	return ordered[:n]
}
