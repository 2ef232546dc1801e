package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/topology"
)

// An elastic job (Config.MinNodes below Config.Nodes) goes on with fewer
// nodes, whole ones, when nodes are lost and none takes their place
// within the node timeout, or are not there when it starts: node 0's
// manager renumbers the nodes left, in the order they had (or the
// topology's switch order), and every
// agent ends its run with a *Resized that says the node's place in the
// job that goes on; the launcher runs the node's agent again with it.
// Each rank's segment is renumbered with it, so that the ranks resume from
// the newest step they hold in memory: for a data-parallel job every
// rank's state is the model's, and the rank that takes a number loads the
// state its node's rank of the same local rank saved.

// Resized is the error Agent.Run returns when the job goes on with
// another number of nodes: run the node's agent again with Next.
type Resized struct {
	From, To int // the job's nodes before and after
	Node     int // this node's rank before
	NodeRank int // and after
	Restarts int // the restart count the ranks go on with
	// Generation counts the job's shapes: the next run's Config.Generation.
	Generation int
	Why        string // what changed: the nodes lost, or missing at the start, or come
	// Joining says that the job went on without this node, in a shape of
	// its own (Generation): the next run waits to join it, running no
	// rank, until the job takes it in at its next restart point (a
	// *Resized whose NodeRank is this node's place in the grown job) or
	// ends. From and To are 0.
	Joining bool
	// Waited says that this node waited to join the job in the run that
	// ended: it ran no rank and holds no replica.
	Waited bool

	name  string             // this node, as its operator knows it
	warm  map[int]*spareProc // the run's warm interpreters, for the next
	grown *growth            // how the next run's ranks start, when the job took in nodes
	dir   string             // the job's checkpoint folder, as the run knew it
}

// Error says how the job goes on, and why.
func (r *Resized) Error() string {
	name := r.name
	switch {
	case name != "":
	case r.From == r.To && r.Node >= r.From:
		name = fmt.Sprintf("spare node %d", r.Node)
	default:
		name = fmt.Sprintf("node %d", r.Node)
	}
	switch {
	case r.Joining:
		return fmt.Sprintf("agent: %s waits to join the job: %s", name, r.Why)
	case r.Waited && r.From < r.To:
		return fmt.Sprintf("agent: %s joins the job as node %d of %d: %s", name, r.NodeRank, r.To, r.Why)
	case r.From == r.To && r.Node >= r.From:
		return fmt.Sprintf("agent: %s takes the place of node %d: %s", name, r.NodeRank, r.Why)
	}
	return fmt.Sprintf("agent: the job goes on with %s instead of %d, %s as node %d: %s", nodesWord(r.To), r.From, name, r.NodeRank, r.Why)
}

// Next returns the configuration of the node's agent in the job that goes
// on: c with the job's new shape and restart count.
func (r *Resized) Next(c Config) Config {
	if c.maxNodes == 0 { // after the job's first run
		c.maxNodes, c.launchRank = max(c.Nodes, 1), c.NodeRank
	}
	if !r.Joining {
		c.Nodes = r.To
	}
	c.NodeRank, c.Restarts, c.Generation = r.NodeRank, r.Restarts, r.Generation
	c.joining, c.grown, c.ckptDir = r.Joining, r.grown, r.dir
	c.warm, r.warm = r.warm, nil // the warm interpreters go to one run
	return c
}

// kindResize, down: the job goes on with other nodes (resizeMsg).
const kindResize = "faultline-run/resize"

// resizeMsg is node 0's word that the job goes on with To nodes: each
// node's new rank by its old one (a node not named ends).
type resizeMsg struct {
	From       int         `json:"from"`
	To         int         `json:"to"`
	Ranks      map[int]int `json:"ranks"`
	Restarts   int         `json:"restarts"`
	Generation int         `json:"generation"`
	// Now: every node ends its run at once (the ranks have not started:
	// the job's first shape was not complete; or the job took in nodes
	// and its ranks are stopped).
	Now bool   `json:"now,omitempty"`
	Why string `json:"why"`
	// Grow: the job took in nodes. Every rank resumes from Step (-1: from
	// the start), and the ranks of each node named in Adopt (by its rank
	// before) take their state from those of the same local rank on the
	// node it names (by its rank after).
	Grow  bool        `json:"grow,omitempty"`
	Step  int64       `json:"step,omitempty"`
	Adopt map[int]int `json:"adopt,omitempty"`
}

// shrink plans the job's going on with the nodes in live, of nodes, when
// it may: at least min of them, node 0 among them (it serves the ranks'
// store and the manager at the address every node was given), fewer than
// nodes. The nodes left keep their order, or, with a topology that knows
// every one's host (addrs, host:port by node), take its switch order
// (topology.Order), node 0 first. It says why not otherwise.
func shrink(nodes, min int, live []int, t *topology.Topology, addrs map[int]string, restarts, generation int, why string) (resizeMsg, string) {
	live = slices.Clone(live)
	slices.Sort(live)
	live = slices.Compact(live)
	live = slices.DeleteFunc(live, func(n int) bool { return n < 0 || n >= nodes })
	live = switchOrder(live, t, addrs)
	switch {
	case len(live) == nodes:
		return resizeMsg{}, "no node is missing"
	case len(live) < min:
		return resizeMsg{}, fmt.Sprintf("%s of %d left, fewer than the %d the job needs (--nnodes %d:%d)", nodesWord(len(live)), nodes, min, min, nodes)
	case live[0] != 0:
		return resizeMsg{}, "node 0, which serves the ranks' store and the job's manager, is lost"
	}
	m := resizeMsg{From: nodes, To: len(live), Ranks: map[int]int{}, Restarts: restarts, Generation: generation, Why: why}
	for i, n := range live {
		m.Ranks[n] = i
	}
	return m, ""
}

// switchOrder returns live (node ranks, node 0 first) in t's switch
// order, or as it is when t is nil or does not know every node's host.
func switchOrder(live []int, t *topology.Topology, addrs map[int]string) []int {
	if t == nil || len(live) < 2 {
		return live
	}
	hosts := make([]string, len(live))
	byHost := map[string]int{}
	for i, n := range live {
		host, _, err := net.SplitHostPort(addrs[n])
		if _, known := t.Lookup(host); err != nil || !known {
			return live
		}
		if _, dup := byHost[host]; dup {
			return live // nodes sharing a host: their order is theirs
		}
		hosts[i], byHost[host] = host, n
	}
	ordered := t.Order(hosts)
	if ordered[0] != hosts[0] {
		return live
	}
	out := make([]int, len(live))
	for i, h := range ordered {
		out[i] = byHost[h]
	}
	return out
}

// resizeWhy says which nodes the job goes on without.
func resizeWhy(nodes int, live []int, perNode int, what string) string {
	var gone []int
	for n := range nodes {
		if !slices.Contains(live, n) {
			gone = append(gone, n)
		}
	}
	return fmt.Sprintf("nodes %v %s; the job goes on with %s of %d (world %d → %d)", gone, what, nodesWord(len(live)), nodes, nodes*perNode, len(live)*perNode)
}

// nodesWord is "1 node", "2 nodes".
func nodesWord(n int) string {
	if n == 1 {
		return "1 node"
	}
	return fmt.Sprintf("%d nodes", n)
}

// addrs returns the replica address (host:port) of every node that said
// hello.
func (j *jobCheckpoints) addrs() map[int]string {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.core.peers()
}

// liveNodes returns the nodes in [from, to) of which a worker is
// registered with m: the job's nodes are [0, Config.Nodes), its spares
// the ones after.
func liveNodes(m *taskd.Manager, from, to int) []int {
	var live []int
	for _, mi := range m.Members() {
		n := mi.Position.Node
		if mi.Role == taskd.RoleWorker && n >= from && n < to && !slices.Contains(live, n) {
			live = append(live, mi.Position.Node)
		}
	}
	slices.Sort(live)
	return live
}

// elastic reports whether the job may go on with fewer nodes.
func (a *Agent) elastic() bool { return a.cfg.MinNodes < a.cfg.Nodes }

// resize, on node 0, tells every node that the job goes on as m says,
// and takes it itself: every node ends its run with a *Resized once
// recovery stops its ranks (or stopAll, at the start).
func (a *Agent) resize(ctx context.Context, m resizeMsg) error {
	// The live spares stay spares, numbered after the job's nodes; the
	// nodes waiting to join that it does not take in wait on.
	for i, s := range liveNodes(a.mgr, a.cfg.Nodes, a.cfg.Nodes+a.cfg.SpareNodes) {
		m.Ranks[s] = m.To + i
	}
	for _, n := range a.joiners() {
		if _, ok := m.Ranks[n]; !ok {
			m.Ranks[n] = n
		}
	}
	a.takeResize(m)
	b, _ := json.Marshal(m)
	ds, err := a.mgr.Broadcast(ctx, taskd.Target{All: true, Nodes: a.spares()}, kindResize, b)
	if err != nil {
		return fmt.Errorf("agent: tell the nodes that the job goes on with %d nodes: %w", m.To, err)
	}
	var errs []error
	for _, d := range ds {
		if d.Err != nil {
			errs = append(errs, fmt.Errorf("rank %d: %w", d.Rank, d.Err))
		}
	}
	return errors.Join(errs...)
}

// takeResize notes that the job goes on as m says: the node's run ends
// with a *Resized, or for good when m leaves it out.
func (a *Agent) takeResize(m resizeMsg) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.resized != nil {
		return
	}
	to, ok := m.Ranks[a.cfg.NodeRank]
	if !ok {
		return // not in the job that goes on: it stops
	}
	r := &Resized{From: m.From, To: m.To, Node: a.cfg.NodeRank, NodeRank: to, Restarts: m.Restarts, Generation: m.Generation, Why: m.Why,
		Waited: a.cfg.joining, name: a.name()}
	switch {
	case a.cfg.growable() && to >= a.cfg.joinBase():
		// It waits on to join the job's new shape.
		r.From, r.To, r.Joining = 0, 0, true
	case m.Grow && to < m.To:
		from, ok := m.Adopt[a.cfg.NodeRank]
		if !ok {
			from = -1
		}
		r.grown = &growth{step: m.Step, from: from, adopters: map[int]int{}}
		for n, src := range m.Adopt {
			r.grown.adopters[m.Ranks[n]] = src
		}
	}
	a.resized = r
	a.log.Warn("agent: the job goes on with other nodes", "nodes", m.To, "was", m.From, "node_rank", to, "why", m.Why)
}

// resizedTo returns how the job goes on, nil when it does not.
func (a *Agent) resizedTo() *Resized {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.resized
}

// kindShaped, down: every node of an elastic job's shape is there; its
// ranks start.
const kindShaped = "faultline-run/shaped"

// shaped reports whether the node's ranks may start: at once in a job of
// fixed membership; in an elastic one, once node 0 said that every node
// of the job's shape is there.
func (a *Agent) shaped() bool {
	select {
	case <-a.shape:
		return true
	default:
		return false
	}
}

// takeShape lets the node's ranks start.
func (a *Agent) takeShape() { a.shapeOnce.Do(func() { close(a.shape) }) }

// deferStart starts the slot's first process, resuming from step, once
// the job's shape is known (Agent.shaped); a later call before then
// changes the step.
func (s *slot) deferStart(step int64) {
	s.mu.Lock()
	s.deferred = step
	first := !s.waiting
	s.waiting = true
	s.mu.Unlock()
	if !first {
		return
	}
	a := s.a
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.deferOff {
		return
	}
	a.wg.Go(func() {
		select {
		case <-a.shape:
		case <-a.runCtx.Done():
			return
		}
		if a.runCtx.Err() != nil {
			return // both were ready: Run is ending
		}
		s.mu.Lock()
		step, state := s.deferred, s.state
		s.waiting = false
		s.mu.Unlock()
		if state != slotIdle {
			return
		}
		if err := s.start(a.runCtx, step); err != nil {
			a.log.Warn("agent: rank not started", "rank", s.rank, "err", err)
		}
	})
}

// awaitNodes, on node 0 of an elastic job, waits until every node of the
// job's shape is registered, then lets every node's ranks start; or, once
// Config.MinNodes are and JoinTimeout more has passed, has the job go on
// with those there.
func (a *Agent) awaitNodes(ctx context.Context) {
	if !a.elastic() || a.mgr == nil {
		return
	}
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	var enough time.Time // when MinNodes were first there
	said := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		live := liveNodes(a.mgr, 0, a.cfg.Nodes)
		switch {
		case len(live) == a.cfg.Nodes:
			a.startShape(ctx)
			return
		case len(live) < a.cfg.MinNodes:
			continue
		case enough.IsZero():
			enough = time.Now()
		}
		// Said once nodes are late, not while they register one by one.
		if !said && time.Since(enough) > time.Second {
			said = true
			fmt.Fprintf(a.cfg.Stderr, "faultline-run: nodes %v are here, of %d; the job waits up to %v (--join-timeout) for more\n", live, a.cfg.Nodes, a.cfg.JoinTimeout)
		}
		if time.Since(enough) < a.cfg.JoinTimeout {
			continue
		}
		why := resizeWhy(a.cfg.Nodes, live, a.cfg.ProcsPerNode, fmt.Sprintf("did not join within --join-timeout %v", a.cfg.JoinTimeout))
		// No rank has started in this run (the gate): the count stays.
		m, whyNot := shrink(a.cfg.Nodes, a.cfg.MinNodes, live, a.cfg.Topology, a.job.addrs(), a.cfg.Restarts, a.cfg.Generation+1, why)
		if whyNot != "" {
			continue // a node left meanwhile
		}
		fmt.Fprintf(a.cfg.Stderr, "faultline-run: %s\n", why)
		m.Now = true
		if err := a.resize(ctx, m); err != nil {
			a.log.Warn("agent: resize", "err", err)
		}
		a.stopNode(why)
		return
	}
}

// startShape lets every node's ranks start: node 0's own at once, the
// others' when they hear it (said again to a node that did not take it).
func (a *Agent) startShape(ctx context.Context) {
	a.takeShape()
	for ctx.Err() == nil {
		ds, err := a.mgr.Broadcast(ctx, taskd.AllWorkers(), kindShaped, nil)
		if err == nil && !slices.ContainsFunc(ds, func(d taskd.Delivery) bool { return d.Err != nil }) {
			return
		}
		a.log.Warn("agent: not every node was told that the job's ranks start; telling them again", "err", err)
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

// promoteReplicas gives each local rank that holds no step, in a job that
// goes on resized, the newest step of a replica held here of a rank of
// the same local rank: its own (a spare that took a lost node's place
// holds its ranks' state so until they resume), or, the state of a
// data-parallel job being every rank's, another node's, as the shrink
// takes each rank's state from its node's rank of the same local rank.
func (c *checkpoints) promoteReplicas() {
	ctx, cancel := context.WithTimeout(context.Background(), persistTimeout)
	defer cancel()
	per := c.a.cfg.ProcsPerNode
	for _, s := range c.a.slots {
		if steps, _, _ := c.heldSteps(s.rank); len(steps) > 0 {
			continue
		}
		names, _ := filepath.Glob(filepath.Join(c.a.cfg.ShmDir, c.segmentName()+"-replica-*"))
		if len(names) == 0 {
			return
		}
		if _, _, err := c.segment(s.rank, "", 1); err != nil {
			c.a.log.Warn("agent: no replica taken in for a local rank", "rank", s.rank, "err", err)
			continue
		}
		o, err := c.owner(s.rank)
		if o == nil || err != nil {
			continue
		}
		held, _, err := o.Replicas()
		if err != nil {
			continue
		}
		from, step := -1, int64(-1)
		for r, steps := range held {
			if r%per != s.local || len(steps) == 0 {
				continue
			}
			if st := slices.Max(steps); from < 0 || r == s.rank && from != s.rank || st > step && from != s.rank {
				from, step = r, st
			}
		}
		if from < 0 {
			continue
		}
		// Both halves' steps, the older first: should a rank of the job
		// not hold the newest, the one before may be every rank's.
		steps := slices.Sorted(slices.Values(held[from]))
		for _, st := range steps[max(len(steps)-2, 0):] {
			if err := o.Adopt(ctx, s.rank, from, st); err != nil {
				c.a.log.Warn("agent: no replica taken in for a local rank", "rank", s.rank, "replica_of", from, "step", st, "err", err)
				continue
			}
			c.a.log.Info("agent: a local rank's state taken in from a replica held here", "rank", s.rank, "replica_of", from, "step", st)
		}
	}
}

// renumber, at the end of a run that goes on resized, gives each local
// rank's segment its rank's new number, so that the ranks resume from
// what they hold in memory, and drops the replicas of the old numbers.
// A spare's segments hold nothing (it ran no rank): they go, and so do
// those of a node the job went on without (Resized.Joining), older than
// what the job resumed from. A spare that takes a lost node's place keeps
// the replicas it holds, of ranks whose numbers stay: those of the node
// it becomes among them.
func (c *checkpoints) renumber(r *Resized) error {
	if r.Generation != c.a.cfg.Generation && !c.a.cfg.spare() && !r.Joining {
		c.promoteReplicas()
	}
	c.close()
	per := c.a.cfg.ProcsPerNode
	var errs []error
	for _, s := range c.a.slots {
		var err error
		if c.a.cfg.spare() || r.Joining {
			err = os.Remove(c.segmentPath(s.rank))
		} else {
			err = ckpt.RenameShard(c.a.cfg.ShmDir, c.segmentName(), s.rank, r.NodeRank*per+s.local)
		}
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	if r.Generation == c.a.cfg.Generation {
		return errors.Join(errs...) // a takeover: the job's ranks keep their numbers
	}
	replicas, _ := filepath.Glob(filepath.Join(c.a.cfg.ShmDir, c.segmentName()+"-replica-*"))
	for _, name := range replicas {
		if err := os.Remove(name); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
