package agent

import (
	"context"
	"fmt"
	"time"

	"github.com/faultline-ml/faultline/rescheduling"
	"github.com/faultline-ml/faultline/taskd"
)

// trainer is a slot as the taskd worker sees it: the manager's recovery
// pauses, restarts and resumes the rank through it. A process group
// cannot lose a member and carry on, so a rank is paused by freezing its
// process (SIGSTOP, after its stacks are taken) and resumed, after a
// fault anywhere, by a new process that loads the step the job agreed on.
// It is no taskd.StepRetrier (a process group cannot run a step again
// after a member failed), LinkSwitcher (a PyTorch rank's communicators
// pick their links when they are built) or StressTester.
type trainer struct{ s *slot }

var (
	_ taskd.Trainer        = trainer{}
	_ taskd.StrategyLister = trainer{}
)

// Pause takes the rank's stacks and ends its process: a process group
// cannot carry on without a member, so every rank is restarted when the
// job resumes (a frozen process would still hold rank 0's store port).
func (t trainer) Pause(ctx context.Context) (int64, error) {
	s := t.s
	s.a.incident.pausing(time.Now())
	s.stop("paused by recovery", s.a.incident.stackDir())
	s.mu.Lock()
	step := s.lastStep
	s.mu.Unlock()
	s.a.incident.paused(s.rank, time.Now())
	return step, nil
}

// Resume starts the rank's process when it has none running: from its
// warm spare, loading r.Step (-1: the newest step the job's ranks hold).
// A rank that finished is started again by a recovery, as torchrun
// restarts its whole worker group: its peers cannot rebuild their process
// group without it.
func (t trainer) Resume(ctx context.Context, r taskd.ResumeRequest) error {
	s := t.s
	s.mu.Lock()
	state := s.state
	s.mu.Unlock()
	if g := s.a.cfg.grown; g != nil && state == slotIdle && r.Step < 0 {
		r.Step = g.step // the job that took in nodes resumes from the step it agreed on
	}
	switch {
	case s.a.cfg.spare():
		return nil // a spare runs no rank until it takes a node's place
	case state == slotRunning && r.Step < 0 && len(r.Restarted) == 0:
		return nil
	case state == slotDone && r.Strategy == "":
		return nil // no recovery: it stays finished
	case state == slotStopped:
		return fmt.Errorf("agent: rank %d is %s", s.rank, state)
	case s.a.nodeFinished():
		return fmt.Errorf("agent: rank %d: every rank of node %d finished and left the job", s.rank, s.a.cfg.NodeRank)
	case state == slotIdle && !s.a.shaped():
		// An elastic job's ranks start once node 0 has said the job's
		// shape, so that they start once, with the world they train in.
		s.deferStart(r.Step)
		return nil
	}
	if why, spent := t.budgetSpent(); spent && state != slotIdle {
		// A restart the manager asks for without asking for strategies
		// first (a fault while the job was resuming): the budget holds.
		s.a.stop(why)
		return fmt.Errorf("agent: rank %d: %s", s.rank, why)
	}
	s.kill()
	// Noted before the process starts: however soon it fails, its fault
	// is a new one, not its peers' stopping.
	if state != slotIdle {
		s.a.incident.restarted(s.rank, r.Step, time.Now())
	}
	return s.start(ctx, r.Step)
}

// Strategies offers restarting the rank (every rank, in fact: in place,
// or with a lost node's ranks on the node that replaces it) while the
// job's restart budget lasts, and dump and exit after.
func (t trainer) Strategies(context.Context, taskd.FaultNotice) ([]taskd.Strategy, error) {
	why, spent := t.budgetSpent()
	if !spent {
		return strategies, nil
	}
	t.s.a.stop(why)
	return []taskd.Strategy{taskd.StrategyDump, taskd.StrategyExit}, nil
}

// refuseIncompleteRestart, on node 0 while its manager recovers the job
// from fault, stops the job when ranks of another node finished and left
// it: their agents are gone, so a restart would leave the others waiting
// for them for ever.
func (a *Agent) refuseIncompleteRestart(fault string) {
	if a.mgr == nil {
		return
	}
	if ranks := leftFinished(a.mgr.JobStatus()); len(ranks) > 0 {
		if f := a.incident.last(); f != "" {
			fault = f // this node's headline, said better than the manager's
		}
		a.stopJob(fmt.Sprintf("%s; ranks %v had finished and left the job, and a process group cannot be rebuilt without them: the job is not restarted", fault, ranks))
	}
}

// leftFinished returns the ranks that left the job after their last step.
func leftFinished(js taskd.JobStatus) []int {
	var ranks []int
	for _, d := range js.Departed {
		if d.Finished {
			ranks = append(ranks, d.Position.Rank)
		}
	}
	return ranks
}

// budgetSpent says whether the rank has been restarted as often as
// --max-restarts allows, and why not to restart it again.
func (t trainer) budgetSpent() (string, bool) {
	s := t.s
	s.mu.Lock()
	restarts := s.starts - 1 - s.a.cfg.Restarts // those of this run: a resize is none
	s.mu.Unlock()
	if restarts < s.a.cfg.MaxRestarts {
		return "", false
	}
	why := fmt.Sprintf("the restart budget is spent: %d restarts of %d allowed (--max-restarts)", restarts, s.a.cfg.MaxRestarts)
	if f := s.a.incident.last(); f != "" {
		why += "; the last fault: " + f
	}
	return why, true
}

// Stop ends the rank for good, and with it the node's others: they
// cannot go on without it.
func (t trainer) Stop(_ context.Context, reason string) error {
	go t.s.a.stopNode(reason) // the worker acknowledges the call first
	return nil
}

// executor is the rescheduling.Executor of a job whose agents restart
// processes themselves: recovery evicts the faulty ranks' workers, the
// agents register their successors, and every rank's process is replaced
// when the recovery resumes the job (Resume). Nothing is left to do here.
type executor struct{}

func (executor) RestartProcesses(context.Context, rescheduling.Decision) error { return nil }
func (executor) RecreatePods(context.Context, rescheduling.Decision) error     { return nil }
func (executor) RestartJob(context.Context, rescheduling.Decision) error       { return nil }
func (executor) AvoidNode(context.Context, rescheduling.Decision) error {
	return fmt.Errorf("%w: the agents restart processes where they are", rescheduling.ErrUnsupported)
}
