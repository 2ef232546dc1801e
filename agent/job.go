package agent

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/faultline-ml/faultline/rescheduling"
	"github.com/faultline-ml/faultline/taskd"
)

// Message kinds between the agents and the job's manager.
const (
	kindHello      = "faultline-run/hello"      // up: a node's agent joins: its ranks and replica address (nodeHello)
	kindPeers      = "faultline-run/peers"      // down: every node's replica address (map node -> host:port)
	kindReport     = "faultline-run/report"     // down: say what you hold (reportRequest)
	kindHeld       = "faultline-run/held"       // up: what a node holds (heldReport)
	kindGeneration = "faultline-run/generation" // down: the restart count the ranks resume with
	kindPersist    = "faultline-run/persist"    // down: persist the newest step every shard holds
	kindDurable    = "faultline-run/durable"    // up: a shard of a step is durable on its node's disk (durableShard)
	kindCommit     = "faultline-run/commit"     // down: every shard of a step is durable: commit it (layout.StepManifest)
	kindStop       = "faultline-run/stop"       // down: recovery gave up; stop every rank
)

// jobCheckpoints is the agents' side of the job's manager (in node 0's
// agent, or in a taskd-manager apart): the taskd.Checkpoints of its
// recovery, which asks every node what it holds and resumes the job from
// the newest step every rank can load (its memory, a replica in another
// node's memory, its node's disk), and the handler that keeps the nodes'
// replica addresses and sends them to every node. local is the agent the
// manager runs in, whose node it reads itself; nil for a manager apart.
type jobCheckpoints struct {
	local *Agent
	log   *slog.Logger
	// deadline bounds the wait for the nodes' reports; 0 derives it from
	// the state's size (reportDeadline), or reportTimeout apart.
	deadline time.Duration

	hangs hangRounds

	mu      sync.Mutex
	core    *jobCore
	spares  handout
	mgr     *taskd.Manager // learned from the handler's calls
	changed chan struct{}  // closed and replaced when a report comes
}

func newJobCheckpoints(nodes int, local *Agent, log *slog.Logger) *jobCheckpoints {
	j := &jobCheckpoints{local: local, log: log, core: newJobCore(nodes), spares: handout{handed: map[int]int{}, said: map[int]bool{}}, changed: make(chan struct{})}
	j.hangs.j = j
	return j
}

// reportTimeout bounds how long LoadNewest waits for every node's report
// when it cannot tell the size of the state (a manager apart from the
// agents); a node that never reports holds nothing it can count on.
const reportTimeout = time.Minute

// reportDeadline is how long LoadNewest waits for every node's report
// when the nodes hold bytes of segments each (as the manager's node
// does): each node checks the CRCs of what it holds, at a few hundred
// MB/s at worst, before it reports.
func reportDeadline(bytes int64) time.Duration {
	return 10*time.Second + time.Duration(bytes/(256<<20))*time.Second
}

// manager returns the manager to reach the nodes through.
func (j *jobCheckpoints) manager() *taskd.Manager {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.mgr == nil && j.local != nil {
		return j.local.mgr
	}
	return j.mgr
}

// LoadNewest returns the step the job resumes from, -1 when there is none:
// it asks every node what it holds and picks the newest step every rank
// can load (jobCore.plan). A step that not every rank loads from its own
// memory is said why, on the agent's output and in the manager's log.
// Before it returns, every node learns the restart count the ranks resume
// with, so that a node that replaced a lost one joins the others'
// rendezvous.
func (j *jobCheckpoints) LoadNewest(ctx context.Context) (int64, error) {
	deadline := cmp.Or(j.deadline, reportTimeout)
	var local *heldReport
	if j.local != nil {
		r := j.local.held("")
		local = &r
		deadline = cmp.Or(j.deadline, reportDeadline(j.local.ckpts.stateBytes()))
	}
	j.mu.Lock()
	if local != nil {
		j.core.report(*local) // the folder it names
	}
	req, _ := json.Marshal(j.core.startRound(newRound()))
	j.mu.Unlock()
	m := j.manager()
	if j.core.nodes > 1 || j.local == nil {
		if m == nil {
			return -1, errors.New("agent: no manager to reach the nodes through")
		}
		if _, err := m.Broadcast(ctx, taskd.AllWorkers(), kindReport, req); err != nil {
			return -1, fmt.Errorf("agent: ask the nodes what they hold: %w", err)
		}
		if err := j.awaitReports(ctx, local, deadline); err != nil {
			return -1, err
		}
	}
	j.mu.Lock()
	plan, restart, why := j.core.plan(local, deadline)
	j.mu.Unlock()
	j.log.Info("agent: the job's step to resume from", "step", plan.step, "from_replica", plan.replica, "from_disk", plan.disk, "restart", restart, "why", why)
	// Said whenever a rank does not resume from its own memory, or newer
	// steps are passed over.
	if plan.step < 0 || len(plan.replica)+len(plan.disk) > 0 {
		line := fmt.Sprintf("the job resumes from step %d", plan.step)
		if len(plan.replica) > 0 {
			line += fmt.Sprintf(", ranks %v from replicas in memory", plan.replica)
		}
		if len(plan.disk) > 0 {
			line += fmt.Sprintf(", ranks %v from disk", plan.disk)
		}
		if plan.step < 0 {
			line = "the job starts over, with no step every rank holds in memory, in a replica or on disk"
		}
		if why != "" {
			line += ": " + why
		}
		j.log.Warn("agent: " + line)
		if j.local != nil {
			fmt.Fprintf(j.local.cfg.Stderr, "faultline-run: %s\n", line)
		}
	}
	// Every rank of the job starts with this count, those of the
	// manager's own node too: one that had not started yet (its worker
	// registered after the fault) would otherwise start with 0 while the
	// others start with 1, and their rendezvous, keyed by it, never meets.
	if j.local != nil {
		j.local.setGeneration(restart)
	}
	if m != nil && (j.core.nodes > 1 || j.local == nil) {
		b, _ := json.Marshal(restart)
		if _, err := m.Broadcast(ctx, taskd.AllWorkers(), kindGeneration, b); err != nil {
			return -1, fmt.Errorf("agent: tell the nodes the restart count: %w", err)
		}
	}
	return plan.step, nil
}

// awaitReports waits until every node but the local one reported in the
// round, or deadline passed.
func (j *jobCheckpoints) awaitReports(ctx context.Context, local *heldReport, deadline time.Duration) error {
	t := time.NewTimer(deadline)
	defer t.Stop()
	for {
		j.mu.Lock()
		ch := j.changed
		var have []int
		if local != nil {
			have = append(have, local.Node)
		}
		missing := j.core.missing(have...)
		j.mu.Unlock()
		if len(missing) == 0 {
			return nil
		}
		select {
		case <-ch:
		case <-t.C:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// newRound names a round of reports.
func newRound() string {
	b := make([]byte, 8)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// persistMsg asks the nodes to persist their newest step; those whose
// replicas cover the lost nodes' ranks persist those too.
type persistMsg struct {
	Round string `json:"round"`
	Lost  []int  `json:"lost,omitempty"`
}

// PersistNewest has every node persist the newest step all its shards
// hold in memory, for the dump strategy, and returns the newest step
// committed on disk after it (-1 when it cannot tell).
func (j *jobCheckpoints) PersistNewest(ctx context.Context) (int64, error) {
	if j.local != nil && j.core.nodes == 1 {
		if _, err := j.local.ckpts.persistLocal(ctx); err != nil {
			return -1, err
		}
		return j.local.ckpts.diskStep(), nil
	}
	m := j.manager()
	if m == nil {
		return -1, fmt.Errorf("agent: no manager to reach the nodes through")
	}
	// The nodes no worker is registered from are lost: the others persist
	// the replicas they hold of their ranks.
	live := map[int]bool{}
	for _, mi := range m.Members() {
		if mi.Role == taskd.RoleWorker {
			live[mi.Position.Node] = true
		}
	}
	var lost []int
	for n := range j.core.nodes {
		if !live[n] {
			lost = append(lost, n)
		}
	}
	payload, _ := json.Marshal(persistMsg{Round: newRound(), Lost: lost})
	ds, err := m.Broadcast(ctx, taskd.AllWorkers(), kindPersist, payload)
	if err != nil {
		return -1, err
	}
	var errs []error
	for _, d := range ds {
		if d.Err != nil {
			errs = append(errs, fmt.Errorf("rank %d: %w", d.Rank, d.Err))
		}
	}
	// An elastic job goes on without the lost nodes, from what the nodes
	// left hold in memory, whether or not their step committed.
	if a := j.local; a != nil && a.elastic() && len(lost) > 0 {
		live := liveNodes(m, 0, j.core.nodes)
		what := fmt.Sprintf("were lost and no node took their place within --node-timeout %v", a.cfg.NodeTimeout)
		if _, spent := (trainer{a.slots[0]}).budgetSpent(); spent {
			// A node taking their place would restart every rank.
			what = fmt.Sprintf("were lost with the restart budget spent (--max-restarts %d), so that no node takes their place", a.cfg.MaxRestarts)
		}
		why := resizeWhy(j.core.nodes, live, a.cfg.ProcsPerNode, what)
		rm, whyNot := shrink(j.core.nodes, a.cfg.MinNodes, live, a.cfg.Topology, j.addrs(), a.slots[0].restarts()+1, a.cfg.Generation+1, why)
		if whyNot == "" {
			fmt.Fprintf(a.cfg.Stderr, "faultline-run: %s\n", why)
			if err := a.resize(ctx, rm); err != nil {
				j.log.Warn("agent: not every node was told that the job goes on resized", "err", err)
			}
		} else {
			fmt.Fprintf(a.cfg.Stderr, "faultline-run: the job cannot go on with fewer nodes: %s\n", whyNot)
		}
	}
	if len(errs) > 0 {
		return -1, errs[0]
	}
	if j.local != nil {
		return j.local.ckpts.diskStep(), nil
	}
	return -1, nil
}

// handler takes in the nodes' hellos and reports on the manager.
func (j *jobCheckpoints) handler() taskd.Handler {
	return taskd.Handler{Name: "faultline-run checkpoints", Handle: func(ctx context.Context, m *taskd.Manager, ev taskd.Event) error {
		j.mu.Lock()
		j.mgr = m
		j.mu.Unlock()
		switch {
		case ev.Kind == taskd.EventFault && ev.Fault.Kind == taskd.FaultLost:
			j.nodeLost(ctx, m, ev.Fault.Position.Node)
			return nil
		case ev.Kind == taskd.EventRegistered && ev.Role == taskd.RoleWorker:
			j.registered(ctx, m, ev.Position.Node)
			return nil
		case ev.Kind == taskd.EventLeft && ev.Role == taskd.RoleWorker:
			j.spareGone(ctx, m, ev.Position.Node, ev.Departure.Left)
			return nil
		case ev.Kind != taskd.EventMessage:
			return nil
		}
		switch ev.Message.Kind {
		case kindHello:
			var h nodeHello
			if err := json.Unmarshal(ev.Message.Payload, &h); err != nil {
				return fmt.Errorf("%s from %v: %w", kindHello, ev.Position, err)
			}
			if h.Node != ev.Position.Node {
				return fmt.Errorf("%s from %v speaks for node %d", kindHello, ev.Position, h.Node)
			}
			if a := j.local; a != nil && h.Shape != a.jobShape() {
				// A node of another shape would run ranks of another world.
				why := fmt.Sprintf("%s was started with %s, the job's node 0 with %s: give every node, spares too, the same", a.nodeName(h.Node), h.Shape, a.jobShape())
				fmt.Fprintf(a.cfg.Stderr, "faultline-run: %s; it is stopped\n", why)
				go func() {
					if _, err := m.Broadcast(context.WithoutCancel(ctx), taskd.NodeWorkers(h.Node), kindStop, []byte(why)); err != nil {
						j.log.Warn("agent: a node of another shape was not told to stop", "node", h.Node, "err", err)
					}
				}()
				return nil
			}
			j.mu.Lock()
			peers, changed := j.core.hello(h)
			j.mu.Unlock()
			if a := j.local; a != nil && a.elastic() && a.shaped() {
				// A node that said hello after the job's ranks started
				// (one that replaces a lost node) starts its own.
				go func() {
					if _, err := m.Broadcast(context.WithoutCancel(ctx), taskd.NodeWorkers(h.Node), kindShaped, nil); err != nil {
						j.log.Warn("agent: a node that joined was not told that the job's ranks start", "node", h.Node, "err", err)
					}
				}()
			}
			if changed {
				b, _ := json.Marshal(peers)
				// Sent on its own: a handler must not wait for the workers.
				go func() {
					if _, err := m.Broadcast(context.WithoutCancel(ctx), taskd.AllWorkers(), kindPeers, b); err != nil {
						j.log.Warn("agent: not every node was told its peers' replica addresses", "err", err)
					}
				}()
			}
		case kindStacks:
			var st stacksMsg
			if err := json.Unmarshal(ev.Message.Payload, &st); err != nil {
				return fmt.Errorf("%s from %v: %w", kindStacks, ev.Position, err)
			}
			if st.Node != ev.Position.Node {
				return fmt.Errorf("%s from %v speaks for node %d", kindStacks, ev.Position, st.Node)
			}
			j.hangs.take(ctx, m, st)
		case kindDurable:
			var d durableShard
			if err := json.Unmarshal(ev.Message.Payload, &d); err != nil {
				return fmt.Errorf("%s from %v: %w", kindDurable, ev.Position, err)
			}
			if d.Node != ev.Position.Node {
				return fmt.Errorf("%s from %v speaks for node %d", kindDurable, ev.Position, d.Node)
			}
			j.mu.Lock()
			sm, done := j.core.shardDurable(d)
			j.mu.Unlock()
			if done {
				b, err := sm.Marshal()
				if err != nil {
					return err
				}
				j.log.Info("agent: every shard of a step is durable; the nodes commit it", "step", sm.Step, "shards", len(sm.Shards))
				go func() {
					if _, err := m.Broadcast(context.WithoutCancel(ctx), taskd.AllWorkers(), kindCommit, b); err != nil {
						j.log.Warn("agent: not every node was told to commit a step", "step", sm.Step, "err", err)
					}
				}()
			}
		case kindHeld:
			var r heldReport
			if err := json.Unmarshal(ev.Message.Payload, &r); err != nil {
				return fmt.Errorf("%s from %v: %w", kindHeld, ev.Position, err)
			}
			if r.Node != ev.Position.Node {
				return fmt.Errorf("%s from %v speaks for node %d", kindHeld, ev.Position, r.Node)
			}
			j.mu.Lock()
			if j.core.report(r) {
				close(j.changed)
				j.changed = make(chan struct{})
			}
			j.mu.Unlock()
		}
		return nil
	}}
}

// strategies are the recovery strategies of a job of torch.distributed
// ranks: a process group dies with any member, so every rank is
// restarted (in place, or, for a lost node, by the node that replaces
// it), and those that keep processes (retry) are out.
var strategies = []taskd.Strategy{taskd.StrategyRecoverInPlace, taskd.StrategyRecover, taskd.StrategyDump, taskd.StrategyExit}

// newPolicy is the rescheduling policy of such a job: the restart budget
// is the agents' (Config.MaxRestarts, counted for the whole job), so the
// policy only orders the restarts of one recovery, without waiting.
func newPolicy(log *slog.Logger) (*rescheduling.Policy, error) {
	return rescheduling.NewPolicy(rescheduling.Config{
		MaxRestarts: 1 << 30, PodRestarts: 1 << 30, JobRestarts: 1 << 30, FailWindow: -1,
		Backoff: rescheduling.Backoff{Initial: time.Millisecond, Max: time.Millisecond, Jitter: -1},
		Logger:  log,
	})
}

// Orchestration is what a taskd manager running apart from the agents
// (taskd-manager --agents, and faultline-run --manager ADDR on every node)
// needs to recover a job of nodes nodes whose ranks faultline-run agents
// run: their restart executor, the store that picks the step to resume
// from by what each node's agent reports, the strategies of a
// torch.distributed job and a policy that leaves the budget to the agents.
// Install the handler with the manager (ManagerConfig.Handlers) and close
// the policy (cfg.Policy.Close) when the manager is done.
func Orchestration(nodes int, log *slog.Logger) (*taskd.OrchestrationConfig, taskd.Handler, error) {
	if nodes < 1 {
		return nil, taskd.Handler{}, fmt.Errorf("%w: nodes = %d: at least 1", errConfig, nodes)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	p, err := newPolicy(log)
	if err != nil {
		return nil, taskd.Handler{}, err
	}
	j := newJobCheckpoints(nodes, nil, log)
	return &taskd.OrchestrationConfig{Policy: p, Executor: executor{}, Checkpoints: j, Strategies: strategies}, j.handler(), nil
}
