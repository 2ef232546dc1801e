package hang

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
)

// Split is a frame below which the ranks that reach it part ways: some of
// them go into a child frame that the others do not, or stop there.
type Split struct {
	Kind Kind
	// Path runs from the process state (Path[0], a "State@..." frame)
	// to the frame where the ranks split. It is empty when they split on
	// the process state itself.
	Path []Frame
	// Ranks are the ranks that reach the split frame.
	Ranks Ranks
	// Groups are the ways out that not all of Ranks take, smallest first.
	Groups []Group
}

// Group is the ranks that go one way at a split.
type Group struct {
	Ranks Ranks
	// Frame is the frame they go into; for Ends, the split frame itself.
	Frame Frame
	// Ends is true for the ranks whose stack ends at the split frame.
	Ends bool
}

// Splits returns where ranks part ways in every tree, the split with the
// smallest group first (the few ranks that differ from the rest are
// usually where the culprit is), then the shallower, then by kind.
func (m *Merged) Splits() []Split {
	var out []Split
	for _, k := range m.Kinds() {
		root := m.Trees[k]
		if s, ok := splitAt(k, root, nil); ok {
			out = append(out, s)
		}
		walk(root, func(path []*Node) {
			if s, ok := splitAt(k, path[len(path)-1], path); ok {
				out = append(out, s)
			}
		})
	}
	slices.SortStableFunc(out, func(a, b Split) int {
		if c := a.Groups[0].Ranks.compare(b.Groups[0].Ranks); c != 0 {
			return c
		}
		if c := cmp.Compare(len(a.Path), len(b.Path)); c != 0 {
			return c
		}
		return cmp.Compare(kindOrder(a.Kind), kindOrder(b.Kind))
	})
	return out
}

func splitAt(k Kind, n *Node, path []*Node) (Split, bool) {
	var groups []Group
	for _, c := range n.Children {
		if !c.Stuck.Equal(n.Stuck) {
			groups = append(groups, Group{Ranks: c.Stuck, Frame: c.Frame})
		}
	}
	if !n.Ends.isEmpty() && !n.Ends.Equal(n.Stuck) {
		groups = append(groups, Group{Ranks: n.Ends, Frame: n.Frame, Ends: true})
	}
	if len(groups) == 0 {
		return Split{}, false
	}
	slices.SortStableFunc(groups, func(a, b Group) int { return a.Ranks.compare(b.Ranks) })
	s := Split{Kind: k, Ranks: n.Stuck, Groups: groups}
	for _, p := range path {
		s.Path = append(s.Path, p.Frame)
	}
	return s, true
}

// Verdict returns a short text for an operator: which ranks gave stacks
// and which are missing, then per kind the frames where ranks split, the
// smallest groups first, then the problems met while reading.
func (m *Merged) Verdict() string {
	const maxSplits, maxGroups, maxProblems = 8, 6, 10
	var b strings.Builder
	fmt.Fprintf(&b, "world %d: stacks from %d ranks (%s)", m.World, m.Ranks.Len(), shortRanks(m.Ranks, 48))
	if !m.Missing.isEmpty() {
		fmt.Fprintf(&b, "; %d missing (%s): no readable stack file", m.Missing.Len(), shortRanks(m.Missing, 48))
	}
	b.WriteString("\n")
	splits := m.Splits()
	for _, k := range m.Kinds() {
		root := m.Trees[k]
		var mine []Split
		for _, s := range splits {
			if s.Kind == k {
				mine = append(mine, s)
			}
		}
		fmt.Fprintf(&b, "%s stacks from %d ranks", k, root.Stuck.Len())
		if !root.Stuck.Equal(m.Ranks) {
			fmt.Fprintf(&b, " (none from %s)", shortRanks(subtract(m.Ranks, root.Stuck), 48))
		}
		if len(mine) == 0 {
			b.WriteString(": no split, all share every frame\n")
			continue
		}
		fmt.Fprintf(&b, ": %d %s, smallest groups first\n", len(mine), plural(len(mine), "split", "splits"))
		for i, s := range mine {
			if i == maxSplits {
				fmt.Fprintf(&b, "  ... %d more splits\n", len(mine)-maxSplits)
				break
			}
			at := "the process state"
			if len(s.Path) > 0 {
				at = frameText(s.Path[len(s.Path)-1])
			}
			fmt.Fprintf(&b, "  below %s (%d ranks: %s):\n", at, s.Ranks.Len(), shortRanks(s.Ranks, 48))
			for j, g := range s.Groups {
				if j == maxGroups {
					fmt.Fprintf(&b, "      ... %d more groups\n", len(s.Groups)-maxGroups)
					break
				}
				to := frameText(g.Frame)
				if g.Ends {
					to = "(stack ends here)"
				} else if len(s.Path) == 0 {
					to = g.Frame.Func
				}
				fmt.Fprintf(&b, "    %5d %-5s %-16s -> %s\n", g.Ranks.Len(), plural(g.Ranks.Len(), "rank", "ranks"), shortRanks(g.Ranks, 48), to)
			}
		}
	}
	if len(m.Problems) > 0 {
		fmt.Fprintf(&b, "problems (%d):\n", len(m.Problems))
		for i, err := range m.Problems {
			if i == maxProblems {
				fmt.Fprintf(&b, "  ... %d more\n", len(m.Problems)-maxProblems)
				break
			}
			fmt.Fprintf(&b, "  %s\n", cleanLabel(err.Error(), false))
		}
	}
	return b.String()
}

func frameText(f Frame) string {
	b := append([]byte(f.Func), '@')
	return cleanLabel(string(appendFileLine(b, f)), false)
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

// subtract returns the members of a that are not in b.
func subtract(a, b Ranks) Ranks {
	var out Ranks
	for r := range a.All() {
		if !b.Has(r) {
			out.add(r)
		}
	}
	return out
}

// shortRanks returns the folded form of r cut after about limit bytes at a
// run boundary, with "/..." marking the cut; the full sets are in the
// labels of the other outputs.
func shortRanks(r Ranks, limit int) string {
	if r.isEmpty() {
		return "none"
	}
	s := r.String()
	if len(s) <= limit {
		return s
	}
	i := strings.LastIndexByte(s[:limit], '/')
	if i <= 0 {
		i = strings.IndexByte(s, '/')
	}
	return s[:i] + "/..."
}
