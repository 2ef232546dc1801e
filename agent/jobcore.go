package agent

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// The job's decisions that the manager takes for the agents, kept pure:
// the nodes and their replica addresses, what each reported holding in a
// round of reports, and from that the step every rank resumes from and
// the restart count the ranks resume with. Messages, timers and waiting
// are jobCheckpoints' (job.go), which feeds this core and acts on what it
// says.

// nodeHello is what a node's agent says of itself when it joins: its
// ranks and the address of its replica server (the port of its first
// local rank's; the others' follow it).
type nodeHello struct {
	Node     int    `json:"node"`
	Ranks    []int  `json:"ranks"`
	Replicas string `json:"replicas,omitempty"` // host:port, "" when it serves none
	Instance string `json:"instance"`           // the agent's, new at each start
	// The job's shape as the node was given it: node 0 ends a node given
	// another (a node started as one of the job's at a spare's place, say).
	Shape shape `json:"shape"`
}

// shape is the job's shape as a node's configuration gives it.
type shape struct {
	Nodes        int `json:"nodes"`
	SpareNodes   int `json:"spare_nodes,omitempty"`
	ProcsPerNode int `json:"procs_per_node"`
}

// String is the shape as faultline-run's flags give it.
func (s shape) String() string {
	return fmt.Sprintf("--nnodes %d --spare-nodes %d --nproc-per-node %d", s.Nodes, s.SpareNodes, s.ProcsPerNode)
}

// heldReport is what a node's agent says it holds in round: the steps
// each of its ranks holds intact in memory, those it holds as replicas of
// other nodes' ranks, the steps committed on its disk tier, and the
// restarts its ranks have been through.
type heldReport struct {
	Round    string          `json:"round"`
	Node     int             `json:"node"`
	Dir      string          `json:"dir,omitempty"` // the job's checkpoint folder, "" before a rank named it
	Ranks    map[int][]int64 `json:"ranks"`
	Replicas map[int][]int64 `json:"replicas,omitempty"`
	Disk     []int64         `json:"disk"`
	Restarts int             `json:"restarts"`
}

// jobCore is the pure part of the manager's side of the agents.
type jobCore struct {
	nodes   int
	hellos  map[int]nodeHello
	round   string
	reports map[int]heldReport // of round, by node
	// dir is the job's checkpoint folder as the nodes name it: a node
	// that replaced another, whose ranks have not named it yet, reads its
	// disk tier there (the same folder, if the nodes share one; an empty
	// one of its own if not).
	dir string
	// durable are the shards each step has persisted on their nodes'
	// disks, by step, until every shard has and the step is committed;
	// committed is the newest step committed so.
	durable   map[int64]map[int]layout.ShardRef
	committed int64
	// adopters are the nodes that joined the job in its last resize, by
	// node, and the node whose ranks' state theirs take while they hold
	// none of their own (growth.adopters).
	adopters map[int]int
}

// durableShard is what a node says when one of its shards of a step is
// durable on its disk tier: the job commits the step once every shard is,
// wherever each lies (a folder per node, or one they share).
type durableShard struct {
	Node      int             `json:"node"`
	Step      int64           `json:"step"`
	NumShards int             `json:"num_shards"`
	Ref       layout.ShardRef `json:"ref"`
}

// shardDurable notes d and returns the step's manifest when every shard
// of it is now durable: the nodes then commit it, each in its folder. A
// step older than one committed is not (DISK steps commit in order).
func (c *jobCore) shardDurable(d durableShard) (layout.StepManifest, bool) {
	if d.Step <= c.committed || d.NumShards < 1 || d.Ref.Shard < 0 || d.Ref.Shard >= d.NumShards {
		return layout.StepManifest{}, false
	}
	if c.durable == nil {
		c.durable = map[int64]map[int]layout.ShardRef{}
	}
	refs := c.durable[d.Step]
	if refs == nil {
		refs = map[int]layout.ShardRef{}
		c.durable[d.Step] = refs
	}
	refs[d.Ref.Shard] = d.Ref
	if len(refs) < d.NumShards {
		return layout.StepManifest{}, false
	}
	// Each shard looked up: nodes that disagree on NumShards (a bad
	// message) must not index past the manifest.
	m := layout.StepManifest{Step: d.Step, Shards: make([]layout.ShardRef, d.NumShards)}
	for i := range d.NumShards {
		r, ok := refs[i]
		if !ok {
			return layout.StepManifest{}, false
		}
		m.Shards[i] = r
	}
	c.committed = d.Step
	for st := range c.durable {
		if st <= d.Step {
			delete(c.durable, st)
		}
	}
	return m, true
}

// reportRequest is what the manager asks every node in a round of
// reports.
type reportRequest struct {
	Round string `json:"round"`
	Dir   string `json:"dir,omitempty"`
}

func newJobCore(nodes int) *jobCore {
	return &jobCore{nodes: nodes, hellos: map[int]nodeHello{}, reports: map[int]heldReport{}, committed: -1}
}

// hello takes in a node's hello and returns the replica addresses of every
// node known, and whether they changed (to be sent to every node).
func (c *jobCore) hello(h nodeHello) (map[int]string, bool) {
	old, known := c.hellos[h.Node]
	c.hellos[h.Node] = h
	return c.peers(), !known || old.Replicas != h.Replicas || old.Instance != h.Instance
}

// peers returns the replica address of every node that has one.
func (c *jobCore) peers() map[int]string {
	out := map[int]string{}
	for n, h := range c.hellos {
		if h.Replicas != "" {
			out[n] = h.Replicas
		}
	}
	return out
}

// startRound begins a round of reports: those of earlier rounds no longer
// count.
func (c *jobCore) startRound(round string) reportRequest {
	c.round = round
	clear(c.reports)
	return reportRequest{Round: round, Dir: c.dir}
}

// report takes in a node's report; one of another round is dropped.
func (c *jobCore) report(r heldReport) bool {
	if r.Dir != "" {
		c.dir = r.Dir
	}
	if r.Round != c.round {
		return false
	}
	c.reports[r.Node] = r
	return true
}

// missing returns the nodes whose report of the round has not come, but
// the ones in have (the manager's own node, read directly).
func (c *jobCore) missing(have ...int) []int {
	var out []int
	for n := range c.nodes {
		if _, ok := c.reports[n]; !ok && !slices.Contains(have, n) {
			out = append(out, n)
		}
	}
	return out
}

// plan returns the step every rank resumes from, given the reports of the
// round (and local, the report of the manager's own node, if any), where
// each rank loads it, the restart count the ranks resume with, and why the
// step is older than every rank's newest in memory, when it is. A node
// that did not report within waited is taken to hold nothing in memory;
// its ranks load from a replica or the disk the others report (a shared
// folder).
func (c *jobCore) plan(local *heldReport, waited time.Duration) (resumePlan, int, string) {
	reports := maps.Clone(c.reports)
	if local != nil {
		reports[local.Node] = *local
	}
	h := holdings{memory: map[int][]int64{}, replica: map[int][]int64{}, disk: map[int][]int64{}}
	restarts, perNode := 0, 0
	for n, r := range reports {
		for rank, steps := range r.Ranks {
			h.memory[rank] = steps
		}
		for rank, steps := range r.Replicas {
			h.replica[rank] = append(h.replica[rank], steps...)
		}
		h.disk[n] = r.Disk
		restarts = max(restarts, r.Restarts)
		perNode = max(perNode, len(r.Ranks))
	}
	for _, hl := range c.hellos {
		perNode = max(perNode, len(hl.Ranks))
	}
	var why []string
	var missing []int
	for n := range c.nodes {
		if _, ok := reports[n]; ok {
			continue
		}
		missing = append(missing, n)
		var shared []int64
		for _, r := range reports {
			shared = append(shared, r.Disk...)
		}
		h.disk[n] = shared
	}
	if len(missing) > 0 {
		why = append(why, fmt.Sprintf("nodes %v did not say what they hold within %v", missing, waited))
	}
	if perNode == 0 {
		return resumePlan{step: -1}, restarts + 1, "no node said what it holds"
	}
	// Every node runs as many ranks, in node order (torchrun's numbering).
	ranks := make([]int, c.nodes*perNode)
	for i := range ranks {
		ranks[i] = i
	}
	h.nodeOf = func(rank int) int { return rank / perNode }
	// A rank of a node that joined, holding nothing of its own yet, loads
	// the state of the rank of its local rank on its source node, from that
	// one's memory or a replica of it: a data-parallel job's every rank's.
	for n, src := range c.adopters {
		for l := range perNode {
			r, from := n*perNode+l, src*perNode+l
			if len(h.memory[r])+len(h.replica[r]) == 0 {
				h.replica[r] = slices.Concat(h.memory[from], h.replica[from])
			}
		}
	}
	plan, whyNot := h.choose(ranks)
	if whyNot != "" {
		why = append(why, whyNot)
	}
	return plan, restarts + 1, strings.Join(why, "; ")
}
