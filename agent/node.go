package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/faultline-ml/faultline/ckpt/layout"
	"github.com/faultline-ml/faultline/taskd"
)

// The node's side of the messages between the agents and the job's
// manager (job.go): what the manager asks of every node, and the hello
// with which a node joins.

// onMessage carries out a message from the job's manager. Every local
// rank's worker gets each broadcast: a round of reports is answered once.
func (a *Agent) onMessage(ctx context.Context, m taskd.Message) error {
	switch m.Kind {
	case kindReport:
		var req reportRequest
		if err := json.Unmarshal(m.Payload, &req); err != nil {
			return fmt.Errorf("agent: %s %q: %w", kindReport, m.Payload, err)
		}
		if a.firstOf(kindReport, req.Round) {
			a.ckpts.adoptDir(req.Dir)
			go a.sendHeld(req.Round) // the broadcast waits for this to return
		}
	case kindGeneration:
		var restart int
		if err := json.Unmarshal(m.Payload, &restart); err != nil {
			return fmt.Errorf("agent: %s %q: %w", kindGeneration, m.Payload, err)
		}
		a.setGeneration(restart)
	case kindPeers:
		var peers map[int]string
		if err := json.Unmarshal(m.Payload, &peers); err != nil {
			return fmt.Errorf("agent: %s %q: %w", kindPeers, m.Payload, err)
		}
		a.ckpts.setPeers(peers)
	case kindDump:
		if a.firstOf(kindDump, string(m.Payload)) {
			go a.sendStacks(string(m.Payload), "asked by the manager: a hang on another node")
		}
	case kindVerdict:
		var v verdictMsg
		if err := json.Unmarshal(m.Payload, &v); err != nil {
			return fmt.Errorf("agent: %s: %w", kindVerdict, err)
		}
		if a.firstOf(kindVerdict, v.Round) {
			go a.takeVerdict(v)
		}
	case kindCommit:
		sm, err := layout.ParseStepManifest(m.Payload)
		if err != nil {
			return fmt.Errorf("agent: %s: %w", kindCommit, err)
		}
		if a.firstOf(kindCommit, fmt.Sprint(sm.Step)) {
			a.ckpts.commit(sm)
		}
	case kindPersist:
		// The lost nodes' ranks are persisted from the replicas held here.
		var p persistMsg
		if len(m.Payload) > 0 {
			if err := json.Unmarshal(m.Payload, &p); err != nil {
				return fmt.Errorf("agent: %s: %w", kindPersist, err)
			}
		}
		if len(p.Lost) == 0 {
			_, err := a.ckpts.persistLocal(ctx)
			return err
		}
		// Every local worker gets it: the node persists once a round,
		// and its first worker answers with the outcome.
		if !a.firstOf(kindPersist, p.Round) {
			return nil
		}
		what, err := a.ckpts.persistWithReplicas(ctx, p.Lost)
		fmt.Fprintf(a.cfg.Stderr, "faultline-run: node %d: %s\n", a.cfg.NodeRank, what)
		return err
	case kindShaped:
		a.takeShape()
	case kindGrow:
		var g growMsg
		if err := json.Unmarshal(m.Payload, &g); err != nil {
			return fmt.Errorf("agent: %s: %w", kindGrow, err)
		}
		return a.takeGrow(g)
	case kindResize:
		var r resizeMsg
		if err := json.Unmarshal(m.Payload, &r); err != nil {
			return fmt.Errorf("agent: %s: %w", kindResize, err)
		}
		a.takeResize(r)
		if r.Now {
			go a.stopNode(r.Why) // the broadcast waits for this to return
		}
	case kindStop:
		go a.stopNode(string(m.Payload))
	case kindTakeover:
		var t takeoverMsg
		if err := json.Unmarshal(m.Payload, &t); err != nil {
			return fmt.Errorf("agent: %s: %w", kindTakeover, err)
		}
		if a.firstOf(kindTakeover, fmt.Sprint(t.Node)) {
			a.takeOver(t)
		}
	case kindJobEnded:
		if a.firstOf(kindJobEnded, "ended") {
			a.jobEnded(string(m.Payload))
		}
	}
	return nil
}

// firstOf reports whether round is new for messages of kind: every local
// rank's worker gets each broadcast, which the node carries out once.
func (a *Agent) firstOf(kind, round string) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.rounds == nil {
		a.rounds = map[string]string{}
	}
	first := a.rounds[kind] != round
	a.rounds[kind] = round
	return first
}

// held is what the node holds, for round: each local rank's steps intact
// in memory, the replicas it holds of other nodes' ranks, the steps
// committed on its disk tier, and its restarts so far.
func (a *Agent) held(round string) heldReport {
	memory, disk := a.ckpts.holdings()
	a.ckpts.mu.Lock()
	dir := a.ckpts.dir
	a.ckpts.mu.Unlock()
	return heldReport{Round: round, Node: a.cfg.NodeRank, Dir: dir, Ranks: memory, Replicas: a.ckpts.replicaHoldings(), Disk: disk,
		Restarts: a.slots[0].restarts()}
}

// sendHeld sends the node's report of round through any of its workers.
func (a *Agent) sendHeld(round string) {
	b, _ := json.Marshal(a.held(round))
	a.send(kindHeld, b)
}

// send sends a message up through the first local worker that takes it.
func (a *Agent) send(kind string, payload []byte) bool {
	for _, s := range a.slots {
		s.mu.Lock()
		w := s.worker
		s.mu.Unlock()
		if w != nil && w.Send(kind, payload) == nil {
			return true
		}
	}
	return false
}

// setGeneration makes restart the count the node's ranks start with next,
// unless they are past it: a node that replaces a lost one joins the
// others' rendezvous, which is keyed by it (TORCHELASTIC_RESTART_COUNT).
func (a *Agent) setGeneration(restart int) {
	for _, s := range a.slots {
		s.mu.Lock()
		if s.starts < restart {
			a.log.Info("agent: the job's ranks resume with restart count", "rank", s.rank, "restart", restart, "was", s.starts)
			s.starts = restart
		}
		s.mu.Unlock()
	}
}

// announce says hello to the job's manager, with the node's ranks and
// replica address, once a local worker is registered, and again after
// every reconnection (a manager that took over, or one restarted, learns
// the nodes anew). It also ends the node when the job replaced it.
func (a *Agent) announce(ctx context.Context) {
	ranks := make([]int, len(a.slots))
	for i, s := range a.slots {
		ranks[i] = s.rank
	}
	b, _ := json.Marshal(nodeHello{Node: a.cfg.NodeRank, Ranks: ranks, Replicas: a.ckpts.replicaAddr(), Instance: a.instance, Shape: a.jobShape()})
	t := time.NewTicker(time.Second)
	defer t.Stop()
	w := newNodeWatch(a.name(), a.cfg.NodeTimeout, a.cfg.HeartbeatDeadline, time.Now())
	for {
		connected, taken, other := false, false, ""
		for _, s := range a.slots {
			s.mu.Lock()
			sw := s.worker
			s.mu.Unlock()
			connected = connected || sw != nil && sw.Connected()
			taken = taken || sw != nil && sw.Taken()
			if sw != nil && other == "" {
				other = sw.OtherJob()
			}
		}
		if other != "" && a.otherJob(other) {
			return
		}
		for _, act := range w.tick(time.Now(), connected, taken) {
			switch act.kind {
			case nodeHelloAction:
				w.helloSent(a.send(kindHello, b))
			case nodeWarnAction:
				fmt.Fprintf(a.cfg.Stderr, "faultline-run: %s\n", act.why)
			case nodeGiveUpAction:
				fmt.Fprintf(a.cfg.Stderr, "faultline-run: %s; this node's ranks end\n", act.why)
				if a.cfg.spare() {
					a.stopNode(act.why)
					return
				}
				// What the node holds of the others (replicas) goes to
				// disk with its own shards: the next run resumes from
				// that step.
				var others []int
				for n := range a.cfg.Nodes {
					if n != a.cfg.NodeRank {
						others = append(others, n)
					}
				}
				pctx, cancel := context.WithTimeout(ctx, persistTimeout)
				what, _ := a.ckpts.persistWithReplicas(pctx, others)
				fmt.Fprintf(a.cfg.Stderr, "faultline-run: node %d: %s\n", a.cfg.NodeRank, what)
				cancel()
				a.stopNode(act.why)
				return
			case nodeFencedAction:
				// Another agent's workers hold its ranks, or it never
				// joined: it must not touch the job.
				fmt.Fprintf(a.cfg.Stderr, "faultline-run: %s; this node's ranks end\n", act.why)
				a.stopNode(act.why)
				return
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
