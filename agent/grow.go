package agent

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/faultline-ml/faultline/taskd"
)

// An elastic job that runs below its MAX nodes takes in nodes that come
// to it: one that was lost and comes back, or a new one, started with the
// job's flags and any --node-rank. Such a node finds the job under the
// name of its newest shape (the manager's refusal of the name it was
// started with names it: taskd.Worker.OtherJob), and waits there as a
// spare does, running no rank, at a position past the job's nodes and
// spares (joinBase plus its launch rank, which no other node has). Node
// 0's manager sees it come (growCore) and takes it in at the job's next
// restart point: every rank of the job is stopped (the nodes first told
// that the exits to come are no faults), the job agrees on the newest
// step every rank holds, and every node ends its run with a *Resized
// naming its place in the grown job; the ranks of the nodes that joined
// take their state from those of the same local rank on a node of the
// job (a data-parallel job's every rank holds the model), which serves it
// from its segment (ckpt.Owner.Adopt), and every rank resumes from that
// step.

// kindGrow, down: the job takes in nodes (growMsg).
const kindGrow = "faultline-run/grow"

// growMsg is a step of taking in nodes: hold (the ranks' exits and
// failed collectives from now on are no faults), freeze (stop the ranks'
// processes where they are, SIGSTOP, so that none sees a peer end and
// fails, or saves again: they end with the run), or release (the job
// goes on as it was).
type growMsg struct {
	Round string `json:"round"`
	Phase string `json:"phase"`
}

// The phases of growMsg.
const (
	growHold    = "hold"
	growFreeze  = "freeze"
	growRelease = "release"
)

// growth is how the ranks of a run after the job took in nodes start:
// every rank from step (-1: none every rank held), and the ranks of a
// node that joined with the state of the rank of the same local rank on
// node from (-1: their own), whenever they hold no copy of their own of
// the step the job resumes from. adopters is every node that joined, and
// its from: node 0's manager plans each resume of the run with them.
type growth struct {
	step     int64
	from     int
	adopters map[int]int
}

// growCore is node 0's side of the nodes that come to join the job, kept
// pure: the nodes waiting (by position) and what the job does about them
// as time passes. The job takes them in at once when they bring it to
// its MAX, else once the join timeout has passed since the last came;
// then it waits for its ranks' next save, so that its restart loses only
// the step in flight, but not past the join timeout more.
type growCore struct {
	room  int           // the nodes the job may take in: MAX less its own
	wait  time.Duration // --join-timeout
	seen  map[int]time.Time
	said  map[int]bool
	due   time.Time // when the job decided to take them in, zero before
	saved int64     // node 0's ranks' newest save then
	after time.Time // no attempt before: the last one failed
	full  bool      // said that the job has its MAX nodes
}

// growActKind is what node 0 does for a growAct.
type growActKind int

const (
	growSayAction  growActKind = iota // say why
	growTakeAction                    // take in nodes: why
)

type growAct struct {
	kind  growActKind
	nodes []int // growTakeAction: the waiting nodes' positions
	why   string
}

func newGrowCore(room int, wait time.Duration) *growCore {
	return &growCore{room: room, wait: wait, seen: map[int]time.Time{}, said: map[int]bool{}, saved: -1}
}

// tick takes in, at now, the positions of the nodes waiting (name gives
// how to call each), whether the job can take them in now (busy: its
// ranks not started, a recovery running, a node missing) and the newest
// step node 0's ranks all saved. After a growTakeAction the run ends:
// tick is not called again.
func (c *growCore) tick(now time.Time, waiting []int, busy bool, saved int64, name func(int) string) []growAct {
	var acts []growAct
	for _, n := range waiting {
		if _, ok := c.seen[n]; !ok {
			c.seen[n] = now
		}
	}
	for n := range c.seen {
		if !slices.Contains(waiting, n) {
			delete(c.seen, n)
			delete(c.said, n)
		}
	}
	if len(c.seen) == 0 {
		c.due = time.Time{}
		return nil
	}
	order := slices.SortedFunc(maps.Keys(c.seen), func(a, b int) int {
		return cmp.Or(c.seen[a].Compare(c.seen[b]), cmp.Compare(a, b))
	})
	if c.room <= 0 {
		if !c.full {
			c.full = true
			acts = append(acts, growAct{kind: growSayAction, why: fmt.Sprintf("%s waits to join the job, which has its MAX nodes: it joins once the job has room for it", names(order, name))})
		}
		return acts
	}
	var come []int
	for _, n := range order {
		if !c.said[n] {
			c.said[n] = true
			come = append(come, n)
		}
	}
	if len(come) > 0 {
		acts = append(acts, growAct{kind: growSayAction, why: fmt.Sprintf("%s came to join the job, which takes in the nodes that come at its next restart point: the next step its ranks save once it has room for no more (%d), or --join-timeout %v after the last came", names(come, name), c.room, c.wait)})
	}
	if busy || now.Before(c.after) {
		return acts
	}
	if c.due.IsZero() {
		last := c.seen[order[len(order)-1]]
		if len(order) < c.room && now.Sub(last) < c.wait {
			return acts
		}
		c.due, c.saved = now, saved
	}
	if saved <= c.saved && now.Sub(c.due) < c.wait {
		return acts
	}
	take := order[:min(len(order), c.room)]
	return append(acts, growAct{kind: growTakeAction, nodes: take})
}

// failed notes that taking the nodes in failed at now: the job tries
// again a second later.
func (c *growCore) failed(now time.Time) {
	c.due, c.after = time.Time{}, now.Add(time.Second)
}

// names is "node 5" or "nodes 5, 6" as name calls each.
func names(nodes []int, name func(int) string) string {
	s := make([]string, len(nodes))
	for i, n := range nodes {
		s[i] = name(n)
	}
	if len(s) == 1 {
		return s[0]
	}
	return strings.Join(s, ", ")
}

// joinerName says which node waits at position n: the --node-rank it was
// started with.
func (a *Agent) joinerName(n int) string {
	return fmt.Sprintf("the node started as --node-rank %d", n-a.cfg.joinBase())
}

// nodeName names the node at position n, as its operator knows it.
func (a *Agent) nodeName(n int) string {
	if a.cfg.growable() && n >= a.cfg.joinBase() {
		return a.joinerName(n) + " (waiting to join)"
	}
	if n >= a.cfg.Nodes {
		return fmt.Sprintf("spare node %d", n)
	}
	return fmt.Sprintf("node %d", n)
}

// name names this node, as its operator knows it.
func (a *Agent) name() string { return a.nodeName(a.cfg.NodeRank) }

// joiners returns the positions of the nodes waiting to join the job that
// said hello to node 0 (so with the job's shape).
func (a *Agent) joiners() []int {
	if !a.cfg.growable() || a.mgr == nil {
		return nil
	}
	live := liveNodes(a.mgr, a.cfg.joinBase(), 2*a.cfg.joinBase())
	a.job.mu.Lock()
	defer a.job.mu.Unlock()
	return slices.DeleteFunc(live, func(n int) bool { _, ok := a.job.core.hellos[n]; return !ok })
}

// watchJoiners, on node 0 of an elastic job, takes in the nodes that
// come to join it, up to its MAX (growCore).
func (a *Agent) watchJoiners(ctx context.Context) {
	if !a.cfg.growable() || a.mgr == nil {
		return
	}
	core := newGrowCore(a.cfg.maxNodes-a.cfg.Nodes, a.cfg.JoinTimeout)
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		waiting := a.joiners()
		busy := !a.shaped() || a.nodeFinished() || a.terminating() != 0 || a.resizedTo() != nil ||
			a.mgr.Orchestrations(^uint64(0)).Current != nil || len(liveNodes(a.mgr, 0, a.cfg.Nodes)) < a.cfg.Nodes
		for _, act := range core.tick(time.Now(), waiting, busy, a.savedStep(), a.joinerName) {
			switch act.kind {
			case growSayAction:
				fmt.Fprintf(a.cfg.Stderr, "faultline-run: %s\n", act.why)
			case growTakeAction:
				if a.grow(ctx, act.nodes) {
					return
				}
				core.failed(time.Now())
			}
		}
	}
}

// savedStep is the newest step every local rank said it saved, -1 before.
func (a *Agent) savedStep() int64 {
	st := int64(-1)
	for i, s := range a.slots {
		s.mu.Lock()
		n := s.saved
		s.mu.Unlock()
		if i == 0 || n < st {
			st = n
		}
	}
	return st
}

// grow, on node 0, takes the nodes waiting at positions joiners into the
// job: it has every node hold its ranks' faults, then freeze its ranks,
// asks every node what it holds (the newest step every rank holds is the
// one the grown job resumes from), and tells every node its place in the
// grown job, which each takes by ending its run. It returns false when
// the job goes on as it was (a node did not take the hold).
func (a *Agent) grow(ctx context.Context, joiners []int) bool {
	round := newRound()
	tell := func(phase string) error {
		b, _ := json.Marshal(growMsg{Round: round, Phase: phase})
		ds, err := a.mgr.Broadcast(ctx, taskd.AllWorkers(), kindGrow, b)
		if err != nil {
			return err
		}
		var errs []error
		for _, d := range ds {
			if d.Err != nil {
				errs = append(errs, fmt.Errorf("rank %d: %w", d.Rank, d.Err))
			}
		}
		return errors.Join(errs...)
	}
	a.holdGrow(round)
	err := tell(growHold)
	if err == nil && a.mgr.Orchestrations(^uint64(0)).Current != nil {
		err = errors.New("a recovery began")
	}
	if err != nil {
		fmt.Fprintf(a.cfg.Stderr, "faultline-run: the job does not take in %s now: %v; it tries again\n", names(joiners, a.joinerName), err)
		a.releaseGrow(round)
		if err := tell(growRelease); err != nil {
			a.log.Warn("agent: not every node was told that the job goes on as it was", "err", err)
		}
		return false
	}
	// From here the job grows, whatever a node says: its ranks may be
	// frozen already.
	if err := tell(growFreeze); err != nil {
		a.log.Warn("agent: not every node froze its ranks for the job to take in nodes", "err", err)
	}
	step, err := a.job.LoadNewest(ctx)
	if err != nil {
		// The job goes on as it was: its ranks thaw where they froze.
		fmt.Fprintf(a.cfg.Stderr, "faultline-run: the job does not take in %s now: the step it would resume from is unknown: %v; it tries again\n", names(joiners, a.joinerName), err)
		a.releaseGrow(round)
		if err := tell(growRelease); err != nil {
			a.log.Warn("agent: not every node was told that the job goes on as it was", "err", err)
		}
		return false
	}
	per := a.cfg.ProcsPerNode
	to := a.cfg.Nodes + len(joiners)
	var started []int
	for _, n := range joiners {
		started = append(started, n-a.cfg.joinBase())
	}
	from := "from step " + strconv.FormatInt(step, 10)
	if step < 0 {
		from = "from the start: no step every rank holds"
	}
	why := fmt.Sprintf("the nodes started as --node-rank %v joined; the job goes on with %s of %d (world %d → %d), %s", started, nodesWord(to), a.cfg.maxNodes, a.cfg.Nodes*per, to*per, from)
	m := resizeMsg{From: a.cfg.Nodes, To: to, Ranks: map[int]int{}, Restarts: a.slots[0].restarts() + 1, Generation: a.cfg.Generation + 1,
		Now: true, Why: why, Grow: true, Step: step, Adopt: map[int]int{}}
	for n := range a.cfg.Nodes {
		m.Ranks[n] = n
	}
	for i, n := range joiners {
		m.Ranks[n] = a.cfg.Nodes + i
		m.Adopt[n] = i % a.cfg.Nodes // spread the state's transfers over the job's nodes
	}
	fmt.Fprintf(a.cfg.Stderr, "faultline-run: %s\n", why)
	if err := a.resize(ctx, m); err != nil {
		a.log.Warn("agent: not every node was told that the job takes in nodes", "err", err)
	}
	a.stopNode(why)
	return true
}

// growHolds is the node's side of the job taking in nodes: while round is
// held, its ranks' exits and failed collectives are no faults (the ranks
// are about to be stopped, here and on the other nodes).
type growHolds struct {
	mu     sync.Mutex
	round  string
	expiry *time.Timer // releases a hold that nothing ended
}

// holdTTL bounds a hold that no resize or release ends (node 0 lost as
// the job was taking in nodes, or its release lost): the node's ranks
// thaw, and their faults count again.
const holdTTL = 2 * time.Minute

// holdGrow holds the node's faults for round.
func (a *Agent) holdGrow(round string) {
	a.grows.mu.Lock()
	defer a.grows.mu.Unlock()
	if a.grows.round == round {
		return
	}
	if a.grows.expiry != nil {
		a.grows.expiry.Stop()
	}
	a.grows.round = round
	a.grows.expiry = time.AfterFunc(holdTTL, func() { a.releaseGrow(round) })
}

// growing reports whether a grow holds the node's faults.
func (a *Agent) growing() bool {
	a.grows.mu.Lock()
	defer a.grows.mu.Unlock()
	return a.grows.round != ""
}

// releaseGrow ends round's hold: the job goes on as it was, its ranks
// thawed where they froze, and an exit held meanwhile is taken in now as
// the fault it is.
func (a *Agent) releaseGrow(round string) {
	a.grows.mu.Lock()
	if a.grows.round != round || a.resizedTo() != nil {
		a.grows.mu.Unlock()
		return
	}
	a.grows.round = ""
	a.grows.expiry.Stop()
	a.grows.mu.Unlock()
	for _, s := range a.slots {
		s.thaw()
		s.mu.Lock()
		p := s.proc
		held := p != nil && p.heldExit
		if held {
			p.heldExit = false
		}
		s.mu.Unlock()
		if held {
			s.exited(p)
		}
	}
}

// freezeForGrow stops the node's ranks' processes where they are
// (SIGSTOP to each one's process group), for round: they end with the run.
func (a *Agent) freezeForGrow(round string) {
	a.grows.mu.Lock()
	held := a.grows.round == round
	a.grows.mu.Unlock()
	if !held {
		return // released, or another round's
	}
	for _, s := range a.slots {
		s.freeze()
	}
}

// takeGrow carries out a step of the job taking in nodes on this node.
func (a *Agent) takeGrow(g growMsg) error {
	switch g.Phase {
	case growHold:
		a.holdGrow(g.Round)
	case growFreeze:
		a.freezeForGrow(g.Round)
	case growRelease:
		a.releaseGrow(g.Round)
	default:
		return fmt.Errorf("agent: %s: phase %q, want %s, %s or %s", kindGrow, g.Phase, growHold, growFreeze, growRelease)
	}
	return nil
}

// generationOf returns the generation of job whose control-plane name is
// served (controlJob's): 0 for job itself, N for job-gN.
func generationOf(job, served string) (int, bool) {
	if served == job {
		return 0, true
	}
	rest, ok := strings.CutPrefix(served, job+"-g")
	if !ok {
		return 0, false
	}
	g, err := strconv.Atoi(rest)
	if err != nil || g < 1 || strconv.Itoa(g) != rest {
		return 0, false
	}
	return g, true
}

// otherJob takes in that the job's manager serves served, not this run's
// job: an elastic job that went on in a newer shape without this node,
// which then waits to join it, its run ending with a *Resized that says
// so. It reports whether it was so.
func (a *Agent) otherJob(served string) bool {
	g, ok := generationOf(a.cfg.Job, served)
	if !ok || g <= a.cfg.Generation || !a.cfg.growable() {
		return false
	}
	why := fmt.Sprintf("the job went on as %s without this node", served)
	a.mu.Lock()
	first := a.resized == nil
	if first {
		a.resized = &Resized{Joining: true, Waited: a.cfg.joining, Node: a.cfg.NodeRank, NodeRank: a.cfg.joinBase() + a.cfg.launchRank,
			Restarts: a.cfg.Restarts, Generation: g, Why: why, name: a.name()}
	}
	a.mu.Unlock()
	if first {
		a.log.Warn("agent: the job went on without this node; it waits to join it", "job", served)
		a.stopNode(why)
	}
	return true
}
