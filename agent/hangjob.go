package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/faultline-ml/faultline/hang"
	"github.com/faultline-ml/faultline/internal/atomicfile"
	"github.com/faultline-ml/faultline/taskd"
)

// A hang's verdict, job-wide. Each node sees the stacks of its own ranks
// alone: a rank stuck where its node's other ranks are not may be where
// every rank of the other nodes is. So a node that finds a hang sends its
// ranks' stacks to the manager (kindStacks), which asks every node for
// theirs (kindDump), merges them all and sends back the verdict with
// every rank's stacks (kindVerdict), which each node writes into its
// incident: one flame graph and one verdict naming the rank that is not
// where the others are, on whatever node. A node that cannot reach the
// manager keeps its own merge, marked partial, which names no culprit.

// Message kinds of a hang's verdict.
const (
	kindStacks  = "faultline-run/stacks"  // up: a node's ranks' stacks (stacksMsg)
	kindDump    = "faultline-run/dump"    // down: take your ranks' stacks and send them (the round)
	kindVerdict = "faultline-run/verdict" // down: the job-wide verdict (verdictMsg)
)

// stacksMsg is a node's ranks' stacks, in the stack file format.
type stacksMsg struct {
	Round  string   `json:"round,omitempty"` // "" when the node found the hang itself
	Node   int      `json:"node"`
	Reason string   `json:"reason,omitempty"`
	Dumps  [][]byte `json:"dumps"`
	// PythonPath is where the node's faultline package lies: its frames
	// are no rank's own code.
	PythonPath string `json:"python_path,omitempty"`
}

// verdictMsg is the job-wide verdict of a hang and every stack it rests on.
type verdictMsg struct {
	Round    string   `json:"round"`
	Reason   string   `json:"reason"`
	Culprits []int    `json:"culprits,omitempty"`
	Where    string   `json:"where,omitempty"`
	Nodes    []int    `json:"nodes"`   // the nodes whose stacks came
	Missing  []int    `json:"missing"` // ranks that gave none
	Dumps    [][]byte `json:"dumps"`
}

// stacksWait bounds how long the manager waits for every node's stacks.
const stacksWait = 10 * time.Second

// hangRounds is the manager's part: one round of stacks per hang.
type hangRounds struct {
	j *jobCheckpoints

	mu     sync.Mutex
	round  string
	reason string
	nodes  map[int][][]byte
	paths  []string      // the nodes' PythonPaths
	done   chan struct{} // closed when every node sent its stacks
}

// take takes in a node's stacks; the first of a hang starts a round: every
// node is asked for its ranks' stacks, and the verdict goes out when all
// came, or after stacksWait.
func (h *hangRounds) take(ctx context.Context, m *taskd.Manager, s stacksMsg) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if s.Round != "" && s.Round != h.round {
		return // an earlier round's
	}
	if h.round == "" {
		h.round, h.reason, h.nodes, h.done = newRound(), s.Reason, map[int][][]byte{}, make(chan struct{})
		round, done := h.round, h.done
		go h.finish(ctx, m, round, done)
	}
	h.nodes[s.Node] = s.Dumps
	if !slices.Contains(h.paths, s.PythonPath) {
		h.paths = append(h.paths, s.PythonPath)
	}
	if h.done != nil && len(h.nodes) == h.j.core.nodes {
		close(h.done)
		h.done = nil
	}
}

// finish asks every node for its stacks, waits for them, merges them and
// sends the verdict to every node.
func (h *hangRounds) finish(ctx context.Context, m *taskd.Manager, round string, done chan struct{}) {
	ctx = context.WithoutCancel(ctx)
	if _, err := m.Broadcast(ctx, taskd.AllWorkers(), kindDump, []byte(round)); err != nil {
		h.j.log.Warn("agent: not every node was asked for its stacks", "err", err)
	}
	select {
	case <-done:
	case <-time.After(stacksWait):
	}
	h.mu.Lock()
	nodes, reason, paths := h.nodes, h.reason, h.paths
	h.round, h.nodes, h.paths, h.done = "", nil, nil, nil
	h.mu.Unlock()
	v := verdictMsg{Round: round, Reason: reason}
	var dumps []*hang.Dump
	for n, ds := range nodes {
		v.Nodes = append(v.Nodes, n)
		for _, b := range ds {
			d, err := hang.ParseDump(b)
			if err != nil {
				h.j.log.Warn("agent: a node's stacks are unreadable", "node", n, "err", err)
				continue
			}
			dumps = append(dumps, d)
			v.Dumps = append(v.Dumps, b)
		}
	}
	slices.Sort(v.Nodes)
	if len(dumps) == 0 {
		return
	}
	world := dumps[0].World
	seen := map[int]bool{}
	for _, d := range dumps {
		seen[d.Rank] = true
	}
	for r := range world {
		if !seen[r] {
			v.Missing = append(v.Missing, r)
		}
	}
	// Ranks that gave no stacks (a node cut off or gone) may be the very
	// ones elsewhere: a merge without them names no culprit.
	if len(v.Missing) == 0 {
		v.Culprits, v.Where = hang.Culprit(dumps, ownFrame(paths...))
	}
	b, err := json.Marshal(v)
	if err != nil {
		return
	}
	if _, err := m.Broadcast(ctx, taskd.AllWorkers(), kindVerdict, b); err != nil {
		h.j.log.Warn("agent: not every node was told the hang's verdict", "err", err)
	}
}

// sendStacks sends the manager the stacks of the node's ranks in the open
// incident (taken now, for a live rank not taken yet), for round ("" when
// the node found the hang itself).
func (a *Agent) sendStacks(round, reason string) {
	dir := a.incident.stackDir()
	var wg sync.WaitGroup
	for _, s := range a.slots {
		s.mu.Lock()
		p := s.proc
		s.mu.Unlock()
		if p != nil {
			wg.Go(func() { s.dumpStacks(context.Background(), p, "hang: "+reason, dir) })
		}
	}
	wg.Wait()
	msg := stacksMsg{Round: round, Node: a.cfg.NodeRank, Reason: reason, PythonPath: a.cfg.PythonPath}
	for _, s := range a.slots {
		if b, err := os.ReadFile(filepath.Join(dir, hang.FileName(s.rank, a.world))); err == nil {
			msg.Dumps = append(msg.Dumps, b)
		}
	}
	b, _ := json.Marshal(msg)
	if !a.send(kindStacks, b) {
		a.log.Warn("agent: the node's stacks did not reach the manager: its verdict stays partial")
	}
}

// takeVerdict writes the job-wide verdict of a hang into the open
// incident: every rank's stacks, the flame graphs and verdict.txt of their
// merge, and the culprit.
func (a *Agent) takeVerdict(v verdictMsg) {
	c := a.incident.current()
	if c == nil {
		return
	}
	stacks := filepath.Join(c.Dir, "stacks")
	var dumps []*hang.Dump
	for _, b := range v.Dumps {
		d, err := hang.ParseDump(b)
		if err != nil {
			continue
		}
		dumps = append(dumps, d)
		if err := os.MkdirAll(stacks, 0o750); err == nil {
			if _, err := hang.WriteStackFile(stacks, d); err != nil {
				a.log.Warn("agent: stack file not written", "rank", d.Rank, "err", err)
			}
		}
	}
	merged, err := hang.Merge(dumps, hang.MergeConfig{World: a.world})
	if err != nil {
		a.log.Warn("agent: stacks not merged", "err", err)
		return
	}
	if _, err := merged.WriteFiles(c.Dir); err != nil {
		a.log.Warn("agent: merged stacks not written", "err", err)
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "Hang: %s\n", v.Reason)
	scope := "job-wide"
	switch {
	case len(v.Missing) > 0:
		scope = "partial"
		fmt.Fprintf(&b, "Culprit: partial, ranks %v gave no stacks and may be the ones elsewhere, so none is named.\n", v.Missing)
	case len(v.Culprits) > 0:
		fmt.Fprintf(&b, "Culprit: %s.\n", v.Where)
	default:
		b.WriteString("Culprit: the stacks single out no rank: every rank is in the same code.\n")
	}
	fmt.Fprintf(&b, "Job-wide: the stacks of %d ranks on nodes %v", len(dumps), v.Nodes)
	if len(v.Missing) > 0 {
		fmt.Fprintf(&b, "; ranks %v gave none", v.Missing)
	}
	b.WriteString(".\n\n")
	b.WriteString(merged.Verdict())
	if err := atomicfile.WriteFile(filepath.Join(c.Dir, "verdict.txt"), b.Bytes(), 0o644); err != nil {
		a.log.Warn("agent: verdict not written", "err", err)
	}
	verdict := strings.TrimSuffix(strings.SplitN(b.String(), "\n", 3)[1], ".")
	a.incident.setVerdict(c, verdict, v.Culprits)
	fmt.Fprintf(a.cfg.Stderr, "faultline-run: hang, %s: %s (stacks of %d ranks on nodes %v; flame graphs in %s)\n", scope, verdict, len(dumps), v.Nodes, c.Dir)
}
