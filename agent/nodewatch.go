package agent

import (
	"fmt"
	"time"
)

// nodeWatch is the node's side of who is lost and whom to wait for, kept
// pure: from what the node's workers see of the job's manager at each
// tick (connected to it; their ranks taken by another agent's workers),
// it decides when the node says hello, when it says it is apart from the
// manager, when it stops waiting for it (node 0, which runs it, lost in
// the standalone shape, or this node cut off), and when the node was
// replaced and must not touch the job again. The manager's side (which
// node is lost, which to wait for) is taskd's orchestration core.
type nodeWatch struct {
	node        string        // how the messages name the node
	nodeTimeout time.Duration // --node-timeout
	heartbeat   time.Duration // the heartbeat deadline

	said, warned, joined bool
	apartSince           time.Time // when the node was last connected, or its start
	takenSince           time.Time // zero while no other agent holds its ranks
}

// nodeActionKind is what the agent does for a nodeAction.
type nodeActionKind int

const (
	nodeHelloAction  nodeActionKind = iota // send the hello (and report the result with helloSent)
	nodeWarnAction                         // say why: the node is apart from the manager and waits
	nodeGiveUpAction                       // persist what the node holds, its replicas too, and end its ranks: why
	nodeFencedAction                       // end the node's ranks, touching nothing: why (replaced, or never joined)
)

// nodeAction is one thing the agent does.
type nodeAction struct {
	kind nodeActionKind
	why  string
}

func newNodeWatch(node string, nodeTimeout, heartbeat time.Duration, now time.Time) *nodeWatch {
	return &nodeWatch{node: node, nodeTimeout: nodeTimeout, heartbeat: heartbeat, apartSince: now}
}

// tick takes in what the workers see at now and returns what to do. After
// a give-up or a fence the node is done: tick is not called again.
func (w *nodeWatch) tick(now time.Time, connected, taken bool) []nodeAction {
	var acts []nodeAction
	switch {
	case connected && !w.said:
		acts = append(acts, nodeAction{kind: nodeHelloAction})
	case !connected:
		w.said = false // a manager that took over, or restarted, learns the nodes anew
	}
	// A node not yet joined may have started well before node 0, or node
	// 0 be starting its store and manager again (a run after a resize):
	// it waits at least as long as for the store.
	limit, also := w.nodeTimeout, ""
	if !w.joined && storeTimeout > limit {
		limit, also = storeTimeout, ", as long as node 0's store may take to start"
	}
	// One that has not joined holds nothing of the job's: it ends touching
	// nothing.
	end := nodeGiveUpAction
	if !w.joined {
		end = nodeFencedAction
	}
	switch apart := now.Sub(w.apartSince); {
	case connected:
		w.apartSince, w.warned, w.joined = now, false, true
	case apart > limit && taken:
		return append(acts, nodeAction{kind: end,
			why: fmt.Sprintf("%s has not joined the job for %v (--node-timeout %v): another live node's workers hold its ranks", w.node, apart.Round(time.Second), w.nodeTimeout)})
	case apart > limit:
		return append(acts, nodeAction{kind: end,
			why: fmt.Sprintf("%s has not reached the job's manager for %v (--node-timeout %v): node 0, which runs it, is lost, or this node cannot reach it or is refused", w.node, apart.Round(time.Second), w.nodeTimeout)})
	case apart > w.heartbeat && !w.warned && taken:
		w.warned = true
		acts = append(acts, nodeAction{kind: nodeWarnAction,
			why: fmt.Sprintf("%s has not joined the job for %v: another node's workers hold its ranks, a node it replaces, say, not yet declared lost; it waits up to %v%s (--node-timeout %v)", w.node, apart.Round(time.Second), limit, also, w.nodeTimeout)})
	case apart > w.heartbeat && !w.warned:
		w.warned = true
		acts = append(acts, nodeAction{kind: nodeWarnAction,
			why: fmt.Sprintf("%s has not reached the job's manager for %v; it waits up to %v%s (--node-timeout %v)", w.node, apart.Round(time.Second), limit, also, w.nodeTimeout)})
	}
	// Fenced: the job replaced this node while it was cut off or stalled,
	// and another agent's workers hold its ranks past a heartbeat
	// deadline (not a registration racing this node's reconnection). A
	// node that has not joined is none that was replaced: it is the
	// replacement, come before the node it replaces was declared lost,
	// which it waits for as for the manager (a live node's duplicate gives
	// up so).
	switch {
	case !taken || !w.joined:
		w.takenSince = time.Time{}
	case w.takenSince.IsZero():
		w.takenSince = now
	case now.Sub(w.takenSince) > w.heartbeat:
		acts = append(acts, nodeAction{kind: nodeFencedAction,
			why: fmt.Sprintf("%s was replaced: another agent's workers have held its ranks for %v", w.node, now.Sub(w.takenSince).Round(time.Second))})
	}
	return acts
}

// helloSent takes in whether the hello reached the manager: if not, the
// next tick sends it again.
func (w *nodeWatch) helloSent(ok bool) { w.said = ok }
