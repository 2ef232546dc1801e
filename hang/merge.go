package hang

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// MergeConfig tunes Merge and MergeDir. The zero value holds the defaults.
type MergeConfig struct {
	// World is the number of ranks in the job. 0: the world that most
	// stack files state (or their names, for MergeDir); with py-spy files
	// alone, the highest rank plus one.
	World int
	// MaxDepth bounds the frames kept per stack; deeper stacks (runaway
	// recursion) keep their outermost and innermost MaxDepth/2 frames
	// around one "[... N frames elided ...]" frame. 0 means 1024.
	MaxDepth int
}

// Validate reports a field that is out of range.
func (c MergeConfig) Validate() error {
	switch {
	case c.World < 0 || c.World > maxRank:
		return fmt.Errorf("hang: MergeConfig.World %d: must be in [0, %d]", c.World, maxRank)
	case c.MaxDepth < 0 || c.MaxDepth == 1:
		return fmt.Errorf("hang: MergeConfig.MaxDepth %d: must be 0 (default) or at least 2", c.MaxDepth)
	}
	return nil
}

// Node is a frame of a merged tree.
type Node struct {
	Frame Frame
	// Stuck holds the ranks with a thread whose stack passes through this
	// frame; the others (World minus Stuck) are the frame's leak set.
	Stuck Ranks
	// Ends holds the ranks with a thread whose stack ends here: this frame
	// is what that thread runs now.
	Ends Ranks
	// Children are the frames called from here, in label order.
	Children []*Node

	weight  int
	isState bool
	index   map[Frame]*Node // children by frame, once there are many
}

// Weight is the node's width in a flame graph: for every distinct stack
// through it, the number of ranks with that stack. A node's weight is
// its Ends count plus its children's weights.
func (n *Node) Weight() int { return n.weight }

// IsState reports whether n is a process-state frame ("State@<state>"),
// the children of a tree's root.
func (n *Node) IsState() bool { return n.isState }

// Merged is the stacks of many ranks folded into one tree per Kind.
type Merged struct {
	// World is the number of ranks in the job.
	World int
	// Ranks holds the ranks that gave at least one stack.
	Ranks Ranks
	// Missing holds the ranks in [0, World) that gave none: no file, or
	// only unreadable ones.
	Missing Ranks
	// Trees holds one tree per kind of stack. A root has the zero Frame;
	// its children are the process states (IsState), and below them the
	// outermost frames of the stacks.
	Trees map[Kind]*Node
	// Problems lists what was skipped or cut and why, each naming its file
	// or rank. The rest still merged.
	Problems []error

	hosts map[int]string
}

// Kinds returns the kinds that have a tree, in a fixed order: python,
// native, go, then any other alphabetically.
func (m *Merged) Kinds() []Kind {
	ks := slices.Collect(maps.Keys(m.Trees))
	slices.SortFunc(ks, func(a, b Kind) int {
		if c := cmp.Compare(kindOrder(a), kindOrder(b)); c != 0 {
			return c
		}
		return strings.Compare(string(a), string(b))
	})
	return ks
}

func kindOrder(k Kind) int {
	switch k {
	case KindPython:
		return 0
	case KindNative:
		return 1
	case KindGo:
		return 2
	}
	return 3
}

// Host returns the node that rank's dump named, or "".
func (m *Merged) Host(rank int) string { return m.hosts[rank] }

// Label returns n's label as xpu_timer's viewer writes it:
// "func@file:line@<stuck>|<leak>" with rank sets folded ("0-3/9"), the
// file "??" when unknown and ":line" only when known; a state node's
// label is "State@<state>".
func (m *Merged) Label(n *Node) string {
	if n.isState {
		return n.Frame.Func
	}
	b := make([]byte, 0, 64)
	b = append(b, n.Frame.Func...)
	b = append(b, '@')
	b = appendFileLine(b, n.Frame)
	b = append(b, '@')
	b = n.Stuck.appendText(b)
	b = append(b, '|')
	b = n.Stuck.complement(m.World).appendText(b)
	return string(b)
}

func appendFileLine(b []byte, f Frame) []byte {
	if f.File == "" {
		b = append(b, "??"...)
	} else {
		b = append(b, f.File...)
	}
	if f.Line > 0 {
		b = append(b, ':')
		b = strconv.AppendInt(b, int64(f.Line), 10)
	}
	return b
}

// ErrNoStacks is returned by MergeDir for a folder without stack files.
var ErrNoStacks = errors.New("hang: no stack files")

// Merge folds the dumps of many ranks into one tree per kind. When two
// dumps give the same rank stacks of the same kind, the first in rank
// order wins and the other is named in Problems. Dumps for ranks outside
// [0, World) are skipped and named in Problems.
func Merge(dumps []*Dump, cfg MergeConfig) (*Merged, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	sorted := slices.Clone(dumps)
	sorted = slices.DeleteFunc(sorted, func(d *Dump) bool { return d == nil })
	slices.SortStableFunc(sorted, func(a, b *Dump) int { return cmp.Compare(a.Rank, b.Rank) })
	world := cfg.World
	if world == 0 {
		worlds := make([]int, 0, len(sorted))
		for _, d := range sorted {
			worlds = append(worlds, d.World)
		}
		world = majorityWorld(worlds)
	}
	if world == 0 && len(sorted) > 0 {
		world = sorted[len(sorted)-1].Rank + 1
	}
	mg := newMerger(world, cfg)
	for _, d := range sorted {
		mg.add(d, "dump")
	}
	return mg.finish(), nil
}

// MergeDir reads every stack file in dir (FileName's form) and every
// py-spy `dump --json` file named by rank (see ParsePySpyFileName) and
// merges them. A file that cannot be read or parsed is named in
// Problems and its rank counts as missing; the rest still merges. Python
// stacks from a py-spy file are used only for ranks whose stack file has
// none. It returns ErrNoStacks when dir holds no stack file at all.
func MergeDir(dir string, cfg MergeConfig) (*Merged, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("hang: merge: %w", err)
	}
	type file struct {
		path        string
		rank, world int
	}
	var stackFiles, pyspyFiles []file
	var worlds []int
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		name := e.Name()
		if r, w, ok := ParseFileName(name); ok {
			stackFiles = append(stackFiles, file{filepath.Join(dir, name), r, w})
			worlds = append(worlds, w)
		} else if r, w, ok := ParsePySpyFileName(name); ok {
			pyspyFiles = append(pyspyFiles, file{filepath.Join(dir, name), r, w})
			if w > 0 {
				worlds = append(worlds, w)
			}
		}
	}
	if len(stackFiles)+len(pyspyFiles) == 0 {
		return nil, fmt.Errorf("%w in %s (want %s or py-spy JSON files named by rank)", ErrNoStacks, dir, FileName(0, 8))
	}
	world := cfg.World
	if world == 0 {
		world = majorityWorld(worlds)
	}
	if world == 0 {
		for _, f := range pyspyFiles {
			world = max(world, f.rank+1)
		}
	}
	byRank := func(a, b file) int {
		if c := cmp.Compare(a.rank, b.rank); c != 0 {
			return c
		}
		return strings.Compare(a.path, b.path)
	}
	slices.SortFunc(stackFiles, byRank)
	slices.SortFunc(pyspyFiles, byRank)

	mg := newMerger(world, cfg)
	states := map[int]string{} // py-spy files do not say the process state
	for _, f := range stackFiles {
		d, err := ReadStackFile(f.path)
		if err != nil {
			mg.problem(err)
			continue
		}
		states[d.Rank] = d.State
		if d.Rank != f.rank || d.World != f.world {
			mg.problem(fmt.Errorf("hang: %s: says rank %d of %d, its name rank %d of %d; using what it says", f.path, d.Rank, d.World, f.rank, f.world))
		}
		if d.World != world {
			mg.problem(fmt.Errorf("hang: %s: world %d disagrees with the job's %d", f.path, d.World, world))
		}
		mg.add(d, f.path)
	}
	for _, f := range pyspyFiles {
		data, err := readLimited(f.path, MaxFileBytes)
		if err != nil {
			mg.problem(err)
			continue
		}
		threads, pid, err := ParsePySpyJSON(data)
		if err != nil {
			mg.problem(fmt.Errorf("%s: %w", f.path, err))
			continue
		}
		mg.add(&Dump{Rank: f.rank, World: world, Pid: pid, State: states[f.rank], Threads: threads}, f.path)
	}
	return mg.finish(), nil
}

// majorityWorld returns the world most often given (the larger on a tie),
// ignoring values below 1; 0 when there is none.
func majorityWorld(worlds []int) int {
	count := map[int]int{}
	best := 0
	for _, w := range worlds {
		if w < 1 {
			continue
		}
		count[w]++
		if c, b := count[w], count[best]; c > b || c == b && w > best {
			best = w
		}
	}
	return best
}

// merger builds the trees one dump at a time, so that MergeDir holds one
// parsed file at a time, not thousands.
type merger struct {
	world    int
	maxDepth int
	m        *Merged
	have     map[Kind]*Ranks // ranks whose stacks of a kind are merged

	lastState, lastStateLabel string // saves building "State@..." per dump
}

func newMerger(world int, cfg MergeConfig) *merger {
	depth := cfg.MaxDepth
	if depth == 0 {
		depth = 1024
	}
	return &merger{
		world:    world,
		maxDepth: depth,
		m:        &Merged{World: world, Trees: map[Kind]*Node{}, hosts: map[int]string{}},
		have:     map[Kind]*Ranks{},
	}
}

func (mg *merger) problem(err error) { mg.m.Problems = append(mg.m.Problems, err) }

func (mg *merger) add(d *Dump, source string) {
	if d.Rank < 0 || d.Rank >= mg.world {
		mg.problem(fmt.Errorf("hang: %s: rank %d outside the job's world of %d; skipped", source, d.Rank, mg.world))
		return
	}
	if len(d.Threads) == 0 {
		msg := "no stacks"
		if len(d.Notes) > 0 {
			msg += " (" + strings.Join(d.Notes, "; ") + ")"
		}
		mg.problem(fmt.Errorf("hang: %s: rank %d: %s", source, d.Rank, msg))
		return
	}
	state := cmp.Or(d.State, "unknown")
	if state != mg.lastState {
		mg.lastState, mg.lastStateLabel = state, "State@"+state
	}
	state = mg.lastStateLabel
	// Decide per kind before inserting, so that a dump's many threads of
	// one kind are not mistaken for a second source of that kind.
	type decision struct {
		kind Kind
		skip bool
	}
	var buf [4]decision
	decided := buf[:0]
	skip := func(k Kind) (skip, seen bool) {
		for _, x := range decided {
			if x.kind == k {
				return x.skip, true
			}
		}
		return false, false
	}
	for _, t := range d.Threads {
		if _, seen := skip(t.Kind); seen {
			continue
		}
		x := decision{kind: t.Kind}
		if !isToken(string(t.Kind)) {
			mg.problem(fmt.Errorf("hang: %s: rank %d: thread kind %q is not lower-case letters, digits or _; its threads are ignored", source, d.Rank, t.Kind))
			x.skip = true
		} else if have := mg.have[t.Kind]; have != nil && have.Has(d.Rank) {
			mg.problem(fmt.Errorf("hang: %s: rank %d already has %s stacks; these are ignored", source, d.Rank, t.Kind))
			x.skip = true
		}
		decided = append(decided, x)
	}
	added := false
	for ti := range d.Threads {
		t := &d.Threads[ti]
		if s, _ := skip(t.Kind); s {
			continue
		}
		mg.insert(t, d.Rank, state, source)
		added = true
	}
	for _, x := range decided {
		if x.skip {
			continue
		}
		if mg.have[x.kind] == nil {
			mg.have[x.kind] = &Ranks{}
		}
		mg.have[x.kind].add(d.Rank)
	}
	if added {
		mg.m.Ranks.add(d.Rank)
		if d.Host != "" {
			mg.m.hosts[d.Rank] = d.Host
		}
	}
}

func (mg *merger) insert(t *Thread, rank int, state, source string) {
	root := mg.m.Trees[t.Kind]
	if root == nil {
		root = &Node{}
		mg.m.Trees[t.Kind] = root
	}
	root.Stuck.add(rank)
	n := root.child(Frame{Func: state})
	n.isState = true
	n.Stuck.add(rank)

	frames := t.Frames
	keepInner, elided := len(frames), 0
	if len(frames) > mg.maxDepth {
		keepInner = mg.maxDepth / 2
		elided = len(frames) - 2*keepInner
		mg.problem(fmt.Errorf("hang: %s: rank %d %s thread %d: %d frames; %d in the middle elided", source, rank, t.Kind, t.ID, len(frames), elided))
	}
	for i := len(frames) - 1; i >= 0; i-- {
		if elided > 0 && i == keepInner+elided-1 {
			n = n.child(Frame{Func: fmt.Sprintf("[... %d frames elided ...]", elided)})
			n.Stuck.add(rank)
			i = keepInner
			continue
		}
		n = n.child(frames[i])
		n.Stuck.add(rank)
	}
	n.Ends.add(rank)
}

// child returns n's child for frame f, creating it.
func (n *Node) child(f Frame) *Node {
	if n.index != nil {
		if c := n.index[f]; c != nil {
			return c
		}
	} else {
		for _, c := range n.Children {
			if c.Frame == f {
				return c
			}
		}
	}
	c := &Node{Frame: f}
	n.Children = append(n.Children, c)
	switch {
	case n.index != nil:
		n.index[f] = c
	case len(n.Children) > 16:
		n.index = make(map[Frame]*Node, 2*len(n.Children))
		for _, c := range n.Children {
			n.index[c.Frame] = c
		}
	}
	return c
}

func (mg *merger) finish() *Merged {
	m := mg.m
	m.Missing = m.Ranks.complement(m.World)
	for _, root := range m.Trees {
		finishNode(root)
	}
	return m
}

// finishNode sorts children into label order and computes weights,
// without recursion so that a 100k-frame stack cannot overflow anything.
func finishNode(root *Node) {
	var order []*Node // pre-order
	stack := []*Node{root}
	for len(stack) > 0 {
		n := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		order = append(order, n)
		n.index = nil
		slices.SortFunc(n.Children, func(a, b *Node) int { return compareFrames(a.Frame, b.Frame) })
		stack = append(stack, n.Children...)
	}
	for i := len(order) - 1; i >= 0; i-- {
		n := order[i]
		n.weight = n.Ends.Len()
		for _, c := range n.Children {
			n.weight += c.weight
		}
	}
}

func compareFrames(a, b Frame) int {
	if c := strings.Compare(a.Func, b.Func); c != 0 {
		return c
	}
	if c := strings.Compare(a.File, b.File); c != 0 {
		return c
	}
	return cmp.Compare(a.Line, b.Line)
}

// walk calls fn for every node below root in depth-first label order, with
// the path from the first state node down to the node. It does not
// recurse.
func walk(root *Node, fn func(path []*Node)) {
	type item struct {
		n     *Node
		depth int
	}
	var path []*Node
	stack := make([]item, 0, 64)
	for i := len(root.Children) - 1; i >= 0; i-- {
		stack = append(stack, item{root.Children[i], 0})
	}
	for len(stack) > 0 {
		it := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		path = append(path[:it.depth], it.n)
		fn(path)
		for i := len(it.n.Children) - 1; i >= 0; i-- {
			stack = append(stack, item{it.n.Children[i], it.depth + 1})
		}
	}
}
