package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"time"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/taskd"
)

// A job's spare nodes (Config.SpareNodes) are taskd workers of the spare
// nodes past the job's (taskd.ManagerConfig.SpareNodes): they beat and
// take messages as the job's nodes do, but no recovery waits for them and
// their loss is no fault. Each keeps warm interpreters, and holds the
// replicas the job's nodes send it as they send them to any node (it
// says hello with its replica address). When node 0's manager declares a
// node of the job lost, node 0 waits a heartbeat interval for the nodes
// lost with it, then hands each lost node's place to a live spare, those
// that hold a lost node's replicas to that node first (kindTakeover): the
// spare ends its run with a *Resized naming that node rank, and runs again as the node, registering its ranks as
// any replacement does, at once rather than after an operator started
// one. Its ranks resume from the replicas of the lost node's ranks, held
// in its own memory when the lost node sent them there.

// Down, to a spare node: take the place of a lost node (takeoverMsg).
// Down, to the spare nodes: the job finished (kindStop tells them it
// stopped).
const (
	kindTakeover = "faultline-run/takeover"
	kindJobEnded = "faultline-run/job-ended"
)

// takeoverMsg hands a lost node's place to a spare.
type takeoverMsg struct {
	Node  int `json:"node"`  // the lost node
	Spare int `json:"spare"` // the spare that takes its place
	// Nodes is the job's nodes now: a node waiting to join an elastic
	// job, which takes a lost node's place as a spare does, knows only
	// the job's MAX.
	Nodes int `json:"nodes"`
}

// jobShape is the job's shape as this node was given it at its launch.
func (a *Agent) jobShape() shape {
	return shape{Nodes: a.cfg.maxNodes, SpareNodes: a.cfg.SpareNodes, ProcsPerNode: a.cfg.ProcsPerNode}
}

// spares returns the node ranks at which nodes run no rank: the job's
// spare nodes, and the nodes waiting to join an elastic job.
func (a *Agent) spares() []int {
	var out []int
	for n := a.cfg.Nodes; n < a.cfg.Nodes+a.cfg.SpareNodes; n++ {
		out = append(out, n)
	}
	if a.cfg.growable() {
		for n := a.cfg.joinBase(); n < 2*a.cfg.joinBase(); n++ {
			out = append(out, n)
		}
	}
	return out
}

// handout is the manager's side of the spares' takeovers: the lost nodes
// that wait for a spare, and the spare each was handed until it registers
// as that node.
type handout struct {
	waiting []int       // lost nodes, in the order they were lost
	handed  map[int]int // lost node -> the spare handed its place
	said    map[int]bool
}

// pairSpares hands the waiting nodes' places to the free spares: first
// each spare to a lost node whose replicas it holds (holds(spare, node)),
// so that the node's ranks resume from its memory and two nodes lost at
// once do not leave one of them without its replicas, then the rest in
// order. It returns the pairs, lost node -> spare.
func pairSpares(waiting, free []int, holds func(spare, node int) bool) map[int]int {
	out := map[int]int{}
	free = slices.Clone(free)
	take := func(node, spare int) {
		out[node] = spare
		free = slices.DeleteFunc(free, func(s int) bool { return s == spare })
	}
	for _, n := range waiting {
		for _, s := range free {
			if holds(s, n) {
				take(n, s)
				break
			}
		}
	}
	for _, n := range waiting {
		if _, ok := out[n]; !ok && len(free) > 0 {
			take(n, free[0])
		}
	}
	return out
}

// settle is how long the manager waits, after a node is declared lost,
// for the losses the same fault brings (every rank of the node, other
// nodes: a switch or a rack lost), before it hands out the spares: nodes
// that die together are declared lost within a heartbeat interval of
// each other (a sixth of the deadline), and a check's tick.
func (a *Agent) settle() time.Duration {
	interval, _ := a.cfg.heartbeats()
	return interval + 200*time.Millisecond
}

// silentFor returns how long to wait before handing out the spares, 0
// for not at all: a heartbeat interval while a job node (below nodes, not
// among those known lost) still registered has not beaten for two of
// them, unless it has been silent past the deadline plus an interval, by
// when it would have been declared lost.
func silentFor(members []taskd.MemberInfo, nodes int, lost []int, now time.Time, interval, deadline time.Duration) time.Duration {
	for _, mi := range members {
		n := mi.Position.Node
		if mi.Role != taskd.RoleWorker || n >= nodes || slices.Contains(lost, n) || mi.LastSeen.IsZero() {
			continue
		}
		if quiet := now.Sub(mi.LastSeen); quiet > 2*interval && quiet < deadline+interval {
			return interval
		}
	}
	return 0
}

// nodeLost, on the manager's side, notes that node was declared lost and
// hands out the spares a moment later.
func (j *jobCheckpoints) nodeLost(ctx context.Context, m *taskd.Manager, node int) {
	a := j.local
	if a == nil || len(a.spares()) == 0 || node <= 0 || node >= j.core.nodes {
		return
	}
	j.mu.Lock()
	_, handed := j.spares.handed[node]
	if handed || slices.Contains(j.spares.waiting, node) {
		j.mu.Unlock()
		return
	}
	j.spares.waiting = append(j.spares.waiting, node)
	j.mu.Unlock()
	time.AfterFunc(a.settle(), func() { j.handOut(ctx, m) })
}

// handOut hands the places of the lost nodes that wait to the live spares
// not handed one (pairSpares), telling each spare; it says on node 0's
// output which node waits with no spare live.
func (j *jobCheckpoints) handOut(ctx context.Context, m *taskd.Manager) {
	if ctx.Err() != nil {
		return // the manager, and the run it served, ended
	}
	a := j.local
	interval, deadline := a.cfg.heartbeats()
	j.mu.Lock()
	lost := append(slices.Clone(j.spares.waiting), slices.Collect(maps.Keys(j.spares.handed))...)
	j.mu.Unlock()
	if wait := silentFor(m.Members(), a.cfg.Nodes, lost, time.Now(), interval, deadline); wait > 0 {
		// Another node of the job has not beaten since about when the lost
		// one stopped: on a loaded machine, nodes that died together are
		// declared lost further apart than settle. Its verdict (lost, or
		// a beat) comes within the deadline; the spares wait for it, so
		// that each goes to the node whose replicas it holds.
		time.AfterFunc(wait, func() { j.handOut(ctx, m) })
		return
	}
	// The spares first; then the nodes waiting to join, which hold no
	// replica.
	live := append(liveNodes(m, a.cfg.Nodes, a.cfg.Nodes+a.cfg.SpareNodes), a.joiners()...)
	back := liveNodes(m, 0, a.cfg.Nodes)
	j.mu.Lock()
	h := &j.spares
	// A node declared lost that is live again (it was cut off, not lost)
	// keeps its place.
	h.waiting = slices.DeleteFunc(h.waiting, func(n int) bool { return slices.Contains(back, n) })
	given := slices.Collect(maps.Values(h.handed))
	free := slices.DeleteFunc(live, func(s int) bool { return slices.Contains(given, s) })
	// A node's replicas go where PickPeers sends them among the nodes that
	// said hello: the spare holds a lost node's if it is among them.
	var known []string
	for n := range j.core.peers() {
		known = append(known, strconv.Itoa(n))
	}
	domains := a.ckpts.domainsOf(j.core.peers())
	pairs := pairSpares(h.waiting, free, func(spare, node int) bool {
		return slices.Contains(ckpt.PickPeers(strconv.Itoa(node), known, domains, max(a.cfg.Replicas, 1)), strconv.Itoa(spare))
	})
	var alone []int
	for _, n := range h.waiting {
		if _, ok := pairs[n]; !ok && !h.said[n] {
			h.said[n] = true
			alone = append(alone, n)
		}
	}
	h.waiting = slices.DeleteFunc(h.waiting, func(n int) bool { _, ok := pairs[n]; return ok })
	for n, s := range pairs {
		h.handed[n] = s
		delete(j.core.hellos, s) // replicas no longer go to it as a spare
	}
	peers := j.core.peers()
	j.mu.Unlock()
	for _, n := range alone {
		fmt.Fprintf(a.cfg.Stderr, "faultline-run: node %d is lost and no spare node is live to take its place; the job waits for a replacement, or a spare, up to --node-timeout %v\n", n, a.cfg.NodeTimeout)
	}
	if len(pairs) == 0 {
		return
	}
	pb, _ := json.Marshal(peers)
	for _, n := range slices.Sorted(maps.Keys(pairs)) {
		s := pairs[n]
		fmt.Fprintf(a.cfg.Stderr, "faultline-run: node %d is lost; %s takes its place\n", n, a.nodeName(s))
		b, _ := json.Marshal(takeoverMsg{Node: n, Spare: s, Nodes: a.cfg.Nodes})
		// Sent on its own: a handler must not wait for the workers.
		go func() {
			bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			ds, err := m.Broadcast(bctx, taskd.NodeWorkers(s), kindTakeover, b)
			if err == nil && slices.ContainsFunc(ds, func(d taskd.Delivery) bool { return d.Err == nil }) {
				return
			}
			// No worker of the spare took it: the place goes to another.
			j.log.Warn("agent: a spare node was not told to take a lost node's place", "node", n, "spare", s, "err", err)
			j.mu.Lock()
			if h.handed[n] == s {
				delete(h.handed, n)
				h.waiting = append(h.waiting, n)
			}
			j.mu.Unlock()
			time.AfterFunc(a.settle(), func() { j.handOut(ctx, m) })
		}()
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		if _, err := m.Broadcast(ctx, taskd.AllWorkers(), kindPeers, pb); err != nil {
			j.log.Warn("agent: not every node was told its peers' replica addresses", "err", err)
		}
	}()
}

// takeoverWait bounds how long a spare that left to take a place may
// take to register as that node before the place goes to another: 30 s,
// or half the node timeout, within which the job gives up on the node.
func (a *Agent) takeoverWait() time.Duration { return min(30*time.Second, a.cfg.NodeTimeout/2) }

// spareGone, on the manager's side, forgets the replica address of node,
// a spare that left (on purpose: left) or was lost, and tells the job's
// nodes: the last one sends its replicas to the next node instead,
// rather than to none. A place it was handed and has not taken goes to
// another spare: a moment after it was lost (settle), after takeoverWait
// when it left (to take it, or ended).
func (j *jobCheckpoints) spareGone(ctx context.Context, m *taskd.Manager, node int, left bool) {
	a := j.local
	if a == nil || node < a.cfg.Nodes || !slices.Contains(a.spares(), node) {
		return
	}
	untaken := func() bool {
		j.mu.Lock()
		defer j.mu.Unlock()
		again := false
		for n, s := range j.spares.handed {
			if s == node && !slices.Contains(liveNodes(m, n, n+1), n) {
				delete(j.spares.handed, n)
				j.spares.waiting = append(j.spares.waiting, n)
				again = true
			}
		}
		return again
	}
	if left {
		time.AfterFunc(a.takeoverWait(), func() {
			if untaken() {
				j.handOut(ctx, m)
			}
		})
	} else if untaken() {
		time.AfterFunc(a.settle(), func() { j.handOut(ctx, m) })
	}
	j.mu.Lock()
	_, known := j.core.hellos[node]
	delete(j.core.hellos, node)
	peers := j.core.peers()
	j.mu.Unlock()
	if !known {
		return // its other ranks' departure, or one handed a place
	}
	b, _ := json.Marshal(peers)
	// Sent on its own: a handler must not wait for the workers.
	go func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		if _, err := m.Broadcast(ctx, taskd.AllWorkers(), kindPeers, b); err != nil {
			j.log.Warn("agent: not every node was told its peers' replica addresses", "err", err)
		}
	}()
}

// registered, on the manager's side, takes in that a worker of node
// registered: a job node's place is taken (by the spare handed it, or a
// replacement), and a spare that comes may take a place that waits.
func (j *jobCheckpoints) registered(ctx context.Context, m *taskd.Manager, node int) {
	j.mu.Lock()
	delete(j.spares.handed, node)
	j.spares.waiting = slices.DeleteFunc(j.spares.waiting, func(n int) bool { return n == node })
	delete(j.spares.said, node)
	wait := len(j.spares.waiting) > 0
	j.mu.Unlock()
	if a := j.local; wait && a != nil && node >= a.cfg.Nodes {
		time.AfterFunc(a.settle(), func() { j.handOut(ctx, m) })
	}
}

// takeOver, on a spare node (or one waiting to join), ends its run to run
// again as the lost node.
func (a *Agent) takeOver(t takeoverMsg) {
	nodes := a.cfg.Nodes
	if a.cfg.joining {
		nodes = t.Nodes
	}
	if !a.cfg.spare() || t.Spare != a.cfg.NodeRank || t.Node < 0 || t.Node >= nodes {
		a.log.Warn("agent: a takeover that is not this node's", "node", t.Node, "spare", t.Spare)
		return
	}
	why := fmt.Sprintf("node %d was lost; %s takes its place", t.Node, a.name())
	fmt.Fprintf(a.cfg.Stderr, "faultline-run: %s\n", why)
	a.takeResize(resizeMsg{From: nodes, To: nodes, Ranks: map[int]int{a.cfg.NodeRank: t.Node},
		Restarts: a.cfg.Restarts, Generation: a.cfg.Generation, Why: why})
	go a.stopNode(why) // the broadcast waits for this to return
}

// tellSpares, on node 0, tells the spare nodes that the job ended, why
// being jobFinished when its ranks finished: they end too, as it did.
func (a *Agent) tellSpares(why string) {
	if a.mgr == nil || len(a.spares()) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := a.mgr.Broadcast(ctx, taskd.NodeWorkers(a.spares()...), kindJobEnded, []byte(why)); err != nil {
		a.log.Warn("agent: the spare nodes were not told that the job ended", "err", err)
	}
}

// jobEnded, on a spare node, ends its run as the job's: at once, with no
// error when it finished.
func (a *Agent) jobEnded(why string) {
	if !a.cfg.spare() {
		return
	}
	if why != jobFinished {
		go a.stopNode(why)
		return
	}
	a.incident.finish(why)
	a.once.Do(func() { close(a.finished) })
}

// jobFinished is kindJobEnded's word for a job whose ranks all finished.
const jobFinished = "the job finished"
