package rescheduling

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"
)

// DefaultLastCallTimeout is RendezvousConfig.LastCallTimeout's default,
// torch elastic's last_call_timeout.
const DefaultLastCallTimeout = 30 * time.Second

// RendezvousConfig configures elastic membership, DLRover's
// --nnodes=MinNodes:MaxNodes.
type RendezvousConfig struct {
	// MaxNodes is the most nodes a round admits; required.
	MaxNodes int
	// MinNodes is the fewest nodes a round starts with; default MaxNodes
	// (a fixed-size job).
	MinNodes int
	// NodeUnit: a round's size is a multiple of it (a data-parallel
	// group's nodes come and go together); default 1.
	NodeUnit int
	// LastCallTimeout: with at least MinNodes waiting, a round completes
	// when no node has joined (or been lost) for this long; default
	// DefaultLastCallTimeout.
	LastCallTimeout time.Duration
}

// Validate reports the first field that is out of range, or a
// combination that could never start a round.
func (c RendezvousConfig) Validate() error {
	switch {
	case c.MaxNodes < 1:
		return fmt.Errorf("rescheduling: RendezvousConfig.MaxNodes is %d, want >= 1", c.MaxNodes)
	case c.MinNodes < 0 || c.MinNodes > c.MaxNodes:
		return fmt.Errorf("rescheduling: RendezvousConfig.MinNodes is %d, want 1..MaxNodes (%d), or 0 for MaxNodes", c.MinNodes, c.MaxNodes)
	case c.NodeUnit < 0:
		return fmt.Errorf("rescheduling: RendezvousConfig.NodeUnit is %d, want >= 1, or 0 for 1", c.NodeUnit)
	case c.LastCallTimeout < 0:
		return fmt.Errorf("rescheduling: RendezvousConfig.LastCallTimeout is %v, want >= 0", c.LastCallTimeout)
	}
	d := c.withDefaults()
	if d.MaxNodes/d.NodeUnit*d.NodeUnit < d.MinNodes {
		return fmt.Errorf("rescheduling: RendezvousConfig.NodeUnit is %d: no multiple of it lies in MinNodes..MaxNodes (%d..%d)", d.NodeUnit, d.MinNodes, d.MaxNodes)
	}
	return nil
}

func (c RendezvousConfig) withDefaults() RendezvousConfig {
	c.MinNodes = cmp.Or(c.MinNodes, c.MaxNodes)
	c.NodeUnit = cmp.Or(c.NodeUnit, 1)
	c.LastCallTimeout = cmp.Or(c.LastCallTimeout, DefaultLastCallTimeout)
	return c
}

// Round is a completed rendezvous: the world the job runs with.
type Round struct {
	// Number counts rounds from 1.
	Number int
	// Nodes is the world in rank order: the previous round's members
	// first, in their order, then newcomers in the order they joined.
	Nodes []string
	// Added and Removed are the changes from the previous round.
	Added, Removed []string
	// Trigger is "max" (MaxNodes were waiting) or "last_call" (at least
	// MinNodes waited LastCallTimeout without a change).
	Trigger string
}

// Fault returns the membership fault that restarts every process with the
// new world; it consumes no budget.
func (r Round) Fault() Fault {
	return Fault{
		Kind:   KindMembership,
		Reason: "rendezvous round " + strconv.Itoa(r.Number) + ": " + strconv.Itoa(len(r.Nodes)) + " nodes",
		Evidence: []string{
			"trigger=" + r.Trigger,
			"added=" + strconv.Itoa(len(r.Added)),
			"removed=" + strconv.Itoa(len(r.Removed)),
		},
	}
}

// Rendezvous is elastic membership as a pure state machine: nodes Join
// and Leave, the embedder calls Step with the time, and Step completes a
// round when MaxNodes wait, or when at least MinNodes wait and nothing has
// changed for LastCallTimeout. A round's size is the number waiting,
// capped at MaxNodes and truncated to a multiple of NodeUnit; the rest
// wait. While a world runs, newcomers wait until they would make it
// larger (scale up); when a member is lost, the world re-forms with the
// survivors and newcomers once they still meet MinNodes (scale down),
// else it waits for joins.
//
// Unlike DLRover, a lost node also restarts the last call, so its
// replacement has LastCallTimeout to join before the world shrinks.
//
// A Rendezvous reads no clock and starts no goroutine: Deadline says
// when Step is next due. It is not safe for concurrent use.
type Rendezvous struct {
	cfg        RendezvousConfig
	round      Round    // the last round completed
	world      []string // its members still alive, in rank order
	broken     bool     // a member was lost since the round completed
	waiting    []string // nodes not in the world, in join order
	lastChange time.Time
}

// NewRendezvous returns a rendezvous with no node yet.
func NewRendezvous(cfg RendezvousConfig) (*Rendezvous, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Rendezvous{cfg: cfg.withDefaults()}, nil
}

// ErrEmptyNode is returned by Join for a node named "".
var ErrEmptyNode = errors.New("rescheduling: rendezvous: empty node name")

// Join adds node to the waiting nodes at now. A node already waiting or in
// the running world is left as it is.
func (r *Rendezvous) Join(node string, now time.Time) error {
	if node == "" {
		return ErrEmptyNode
	}
	if slices.Contains(r.world, node) || slices.Contains(r.waiting, node) {
		return nil
	}
	r.waiting = append(r.waiting, node)
	r.lastChange = now
	return nil
}

// Leave removes a lost node at now. Losing a member of the world breaks it
// until the next round; an unknown node is ignored.
func (r *Rendezvous) Leave(node string, now time.Time) {
	if i := slices.Index(r.waiting, node); i >= 0 {
		r.waiting = slices.Delete(r.waiting, i, i+1)
		return
	}
	if i := slices.Index(r.world, node); i >= 0 {
		r.world = slices.Delete(r.world, i, i+1)
		r.broken = true
		r.lastChange = now
	}
}

// size returns how many of n available nodes a round admits.
func (r *Rendezvous) size(n int) int {
	n = min(n, r.cfg.MaxNodes)
	return n / r.cfg.NodeUnit * r.cfg.NodeUnit
}

// pending reports whether a new round is wanted: there is no running
// world, or the waiting nodes would make it larger.
func (r *Rendezvous) pending() bool {
	n := len(r.world) + len(r.waiting)
	if r.round.Number == 0 || r.broken {
		return n > 0
	}
	return r.size(n) > len(r.world)
}

// Deadline returns when Step next has a round to complete, if nothing
// changes before: a time at or before now when one is due, false when
// none is in sight (too few nodes, or the world is complete).
func (r *Rendezvous) Deadline() (time.Time, bool) {
	n := len(r.world) + len(r.waiting)
	if !r.pending() || r.size(n) < r.cfg.MinNodes {
		return time.Time{}, false
	}
	if n >= r.cfg.MaxNodes {
		return r.lastChange, true
	}
	return r.lastChange.Add(r.cfg.LastCallTimeout), true
}

// Step completes a round if one is due at now and returns it.
func (r *Rendezvous) Step(now time.Time) (Round, bool) {
	at, ok := r.Deadline()
	if !ok || now.Before(at) {
		return Round{}, false
	}
	pool := append(slices.Clip(r.world), r.waiting...)
	k := r.size(len(pool))
	next := Round{Number: r.round.Number + 1, Nodes: slices.Clone(pool[:k]), Trigger: "last_call"}
	if len(pool) >= r.cfg.MaxNodes {
		next.Trigger = "max"
	}
	for _, n := range next.Nodes {
		if !slices.Contains(r.round.Nodes, n) {
			next.Added = append(next.Added, n)
		}
	}
	for _, n := range r.round.Nodes {
		if !slices.Contains(next.Nodes, n) {
			next.Removed = append(next.Removed, n)
		}
	}
	r.round = next
	r.world = slices.Clone(next.Nodes)
	r.waiting = slices.Clone(pool[k:])
	r.broken = false
	return next, true
}

// World returns the running round with its members, false before the
// first round and while a lost member keeps it broken.
func (r *Rendezvous) World() (Round, bool) {
	if r.round.Number == 0 || r.broken {
		return Round{}, false
	}
	w := r.round
	w.Nodes = slices.Clone(w.Nodes)
	return w, true
}

// Waiting returns the nodes waiting for a round, in join order.
func (r *Rendezvous) Waiting() []string { return slices.Clone(r.waiting) }
