package agent

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/faultline-ml/faultline/rescheduling"
	"github.com/faultline-ml/faultline/taskd"
)

// heldReport is what a node's agent tells the manager once its ranks are
// all stopped for a recovery: the steps each of its ranks holds intact in
// memory, the steps committed on its disk tier, and the restart its ranks
// are waiting for (the count of restarts so far), so that a report from an
// earlier recovery is never taken for this one.
type heldReport struct {
	Node    int             `json:"node"`
	Restart int             `json:"restart"`
	Ranks   map[int][]int64 `json:"ranks"`
	Disk    []int64         `json:"disk"`
}

// jobCheckpoints is the job's checkpoint store as the manager's recovery
// sees it (taskd.Checkpoints): the step to resume from is the newest that
// every rank of every node holds in memory, else the newest on disk, from
// what each node's agent reports. local is the agent the manager runs in,
// whose node it reads itself; nil for a manager apart.
type jobCheckpoints struct {
	nodes int
	local *Agent
	log   *slog.Logger
	// deadline bounds the wait for the nodes' reports; 0 derives it from
	// the state's size (reportDeadline), or reportTimeout apart.
	deadline time.Duration

	mu      sync.Mutex
	mgr     *taskd.Manager // learned from the handler's calls
	held    map[int]heldReport
	changed chan struct{} // closed and replaced when held changes
}

func newJobCheckpoints(nodes int, local *Agent, log *slog.Logger) *jobCheckpoints {
	return &jobCheckpoints{nodes: nodes, local: local, log: log, held: map[int]heldReport{}, changed: make(chan struct{})}
}

// reportTimeout bounds how long LoadNewest waits for every node's report
// when it cannot tell the size of the state (a manager apart from the
// agents); a node that never reports leaves the job to resume from disk.
const reportTimeout = time.Minute

// reportDeadline is how long LoadNewest waits for every node's report
// when the nodes hold bytes of segments each (as the manager's node
// does): each node checks the CRCs of what it holds, at a few hundred
// MB/s at worst, before it reports.
func reportDeadline(bytes int64) time.Duration {
	return 10*time.Second + time.Duration(bytes/(256<<20))*time.Second
}

// LoadNewest returns the step the job resumes from, -1 when there is none:
// the newest step every rank can load, from its memory or its node's disk
// (holdings.choose). A step that not every rank loads from memory is said
// why, on the agent's output and in the manager's log.
func (j *jobCheckpoints) LoadNewest(ctx context.Context) (int64, error) {
	round := -1
	h := holdings{memory: map[int][]int64{}, disk: map[int][]int64{}}
	perNode := 0
	deadline := cmp.Or(j.deadline, reportTimeout)
	if j.local != nil {
		a := j.local
		round = a.slots[0].restarts()
		h.memory, h.disk[a.cfg.NodeRank] = a.ckpts.holdings()
		perNode = a.cfg.ProcsPerNode
		deadline = cmp.Or(j.deadline, reportDeadline(a.ckpts.stateBytes()))
	}
	reports, missing, err := j.reports(ctx, round, deadline)
	if err != nil {
		return -1, err
	}
	for _, r := range reports {
		for rank, steps := range r.Ranks {
			h.memory[rank] = steps
		}
		h.disk[r.Node] = r.Disk
		perNode = max(perNode, len(r.Ranks))
	}
	var why []string
	if len(missing) > 0 {
		// What a node that never said holds in memory is unknown; its disk
		// is taken to be the shared folder the others report.
		why = append(why, fmt.Sprintf("nodes %v did not say what they hold within %v: their ranks load from disk", missing, deadline))
		var shared []int64
		for _, d := range h.disk {
			shared = append(shared, d...)
		}
		for _, n := range missing {
			h.disk[n] = shared
		}
	}
	if perNode == 0 {
		return -1, errors.New("agent: no node said what it holds")
	}
	h.nodeOf = func(rank int) int { return rank / perNode }
	ranks := make([]int, j.nodes*perNode)
	for i := range ranks {
		ranks[i] = i
	}
	plan, whyNot := h.choose(ranks)
	if whyNot != "" {
		why = append(why, whyNot)
	}
	j.log.Info("agent: the job's step to resume from", "step", plan.step, "from_disk", plan.disk, "why", why)
	if len(plan.disk) > 0 || plan.step < 0 && len(why) > 0 {
		line := fmt.Sprintf("the job resumes from step %d, ranks %v from disk: %s", plan.step, plan.disk, strings.Join(why, "; "))
		switch {
		case plan.step < 0:
			line = "the job starts over, with no step every rank holds in memory or on disk: " + strings.Join(why, "; ")
		case len(plan.disk) == len(ranks):
			line = fmt.Sprintf("the job resumes from disk step %d, not memory: %s", plan.step, strings.Join(why, "; "))
		}
		j.log.Warn("agent: " + line)
		if j.local != nil {
			fmt.Fprintf(j.local.cfg.Stderr, "faultline-run: %s\n", line)
		}
	}
	return plan.step, nil
}

// wantsReports reports whether other nodes report to this store.
func (j *jobCheckpoints) wantsReports() bool { return j.local == nil || j.nodes > 1 }

// reports waits up to deadline for a report of round from every node the
// store does not read itself, and returns them, and the nodes that did not
// report in time. A store apart takes the newest round reported as the
// round.
func (j *jobCheckpoints) reports(ctx context.Context, round int, deadline time.Duration) ([]heldReport, []int, error) {
	if !j.wantsReports() {
		return nil, nil, nil
	}
	t := time.NewTimer(deadline)
	defer t.Stop()
	for {
		j.mu.Lock()
		ch := j.changed
		want := round
		if want < 0 {
			for _, r := range j.held {
				want = max(want, r.Restart)
			}
		}
		var got []heldReport
		for n := range j.nodes {
			if j.local != nil && n == j.local.cfg.NodeRank {
				continue
			}
			if r, ok := j.held[n]; ok && r.Restart == want {
				got = append(got, r)
			}
		}
		complete := want >= 0 && len(got) == j.nodes-btoi(j.local != nil)
		var missing []int
		for n := range j.nodes {
			if j.local != nil && n == j.local.cfg.NodeRank {
				continue
			}
			if r, ok := j.held[n]; !ok || r.Restart != want {
				missing = append(missing, n)
			}
		}
		j.mu.Unlock()
		if complete {
			return got, nil, nil
		}
		select {
		case <-ch:
		case <-t.C:
			return got, missing, nil
		case <-ctx.Done():
			return nil, nil, ctx.Err()
		}
	}
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// PersistNewest has every node persist the newest step all its shards
// hold in memory, for the dump strategy, and returns the newest step
// committed on disk after it (-1 when it cannot tell).
func (j *jobCheckpoints) PersistNewest(ctx context.Context) (int64, error) {
	j.mu.Lock()
	m := j.mgr
	j.mu.Unlock()
	if m == nil && j.local != nil {
		m = j.local.mgr
	}
	if j.local != nil && j.nodes == 1 {
		if _, err := j.local.ckpts.persistLocal(ctx); err != nil {
			return -1, err
		}
		return j.local.ckpts.diskStep(), nil
	}
	if m == nil {
		return -1, fmt.Errorf("agent: no manager to reach the nodes through")
	}
	ds, err := m.Broadcast(ctx, taskd.AllWorkers(), kindPersist, nil)
	if err != nil {
		return -1, err
	}
	for _, d := range ds {
		if d.Err != nil {
			return -1, fmt.Errorf("rank %d: %w", d.Rank, d.Err)
		}
	}
	if j.local != nil {
		return j.local.ckpts.diskStep(), nil
	}
	return -1, nil
}

// handler takes in the nodes' reports on the manager.
func (j *jobCheckpoints) handler() taskd.Handler {
	return taskd.Handler{Name: "faultline-run checkpoints", Handle: func(_ context.Context, m *taskd.Manager, ev taskd.Event) error {
		j.mu.Lock()
		j.mgr = m
		j.mu.Unlock()
		if ev.Kind != taskd.EventMessage || ev.Message.Kind != kindHeld {
			return nil
		}
		var r heldReport
		if err := json.Unmarshal(ev.Message.Payload, &r); err != nil {
			return fmt.Errorf("%s from %v: %w", kindHeld, ev.Position, err)
		}
		if r.Node != ev.Position.Node {
			return fmt.Errorf("%s from %v speaks for node %d", kindHeld, ev.Position, r.Node)
		}
		j.mu.Lock()
		j.held[r.Node] = r
		close(j.changed)
		j.changed = make(chan struct{})
		j.mu.Unlock()
		return nil
	}}
}

// reportHeld tells the job's manager what this node holds, once its ranks
// are all stopped, when the manager needs it (it runs apart, or the job
// has other nodes).
func (a *Agent) reportHeld() {
	if a.mgr != nil && a.cfg.Nodes == 1 {
		return
	}
	for _, s := range a.slots {
		if s.stateIs(slotRunning) || s.stateIs(slotIdle) {
			return
		}
	}
	memory, disk := a.ckpts.holdings()
	b, _ := json.Marshal(heldReport{Node: a.cfg.NodeRank, Restart: a.slots[0].restarts(), Ranks: memory, Disk: disk})
	for _, s := range a.slots {
		s.mu.Lock()
		w := s.worker
		s.mu.Unlock()
		if w != nil && w.Send(kindHeld, b) == nil {
			return
		}
	}
}

// strategies are the recovery strategies of a job of torch.distributed
// ranks: a process group dies with any member, so every rank is
// restarted, and those that keep processes (retry) are out.
var strategies = []taskd.Strategy{taskd.StrategyRecoverInPlace, taskd.StrategyDump, taskd.StrategyExit}

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
