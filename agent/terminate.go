package agent

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// ErrTerminated: Terminate ended the job; the error names the signal.
var ErrTerminated = errors.New("agent: the job was terminated")

// Terminate ends the job as torchrun does on SIGTERM or SIGINT, and as
// Kubernetes expects in a pod's grace period: Run sends sig to every
// local rank's process group, so that the ranks' own handlers run, and
// waits for them to exit; those still running once three quarters of
// Config.GracePeriod have passed are killed. It then persists the newest
// step every local rank holds intact in memory within the rest of the
// grace period, and returns an error wrapping ErrTerminated. No rank's
// exit meanwhile is a fault, and none is restarted.
//
// Terminate returns at once; only its first call counts. Cancelling
// Run's context instead kills the ranks at once.
func (a *Agent) Terminate(sig syscall.Signal) {
	a.mu.Lock()
	first := a.termSig == 0
	if first {
		a.termSig, a.termAt = sig, time.Now()
	}
	a.mu.Unlock()
	if first {
		close(a.term)
	}
}

// terminating returns the signal the job is being terminated by, 0 when
// it is not.
func (a *Agent) terminating() syscall.Signal {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.termSig
}

// terminate carries out Terminate for Run.
func (a *Agent) terminate(ctx context.Context) error {
	a.mu.Lock()
	sig, at := a.termSig, a.termAt
	a.mu.Unlock()
	name := unix.SignalName(sig)
	if a.cfg.spare() {
		// A spare, or a node waiting to join: no rank, nothing to persist.
		for _, s := range a.slots {
			s.dropSpare()
		}
		fmt.Fprintf(a.cfg.Stderr, "faultline-run: %s: %s ends, running no rank\n", name, a.name())
		return fmt.Errorf("%w by %s", ErrTerminated, name)
	}
	grace := a.cfg.GracePeriod
	ranksGrace := grace - grace/4

	type running struct {
		rank int
		p    *rankProc
	}
	var ranks []running
	for _, s := range a.slots {
		s.dropSpare()
		s.mu.Lock()
		p := s.proc
		s.mu.Unlock()
		if p == nil {
			continue
		}
		select {
		case <-p.done:
			continue
		default:
		}
		// The whole group, as a terminal's Ctrl-C would reach it: data
		// loader workers get their own chance to end.
		if err := syscall.Kill(-p.pid, sig); err != nil {
			a.log.Warn("agent: signal not forwarded", "rank", s.rank, "pid", p.pid, "err", err)
		}
		ranks = append(ranks, running{s.rank, p})
	}
	fmt.Fprintf(a.cfg.Stderr, "faultline-run: %s: forwarded to %d ranks; they have %v to exit\n", name, len(ranks), ranksGrace)

	deadline := time.NewTimer(time.Until(at.Add(ranksGrace)))
	defer deadline.Stop()
	expired := false
	var ends []string
	for _, r := range ranks {
		if !expired {
			select {
			case <-r.p.done:
			case <-deadline.C:
				expired = true
			case <-ctx.Done():
				expired = true
			}
		}
		select {
		case <-r.p.done:
			ends = append(ends, exitWords(r.rank, r.p))
			continue
		default:
		}
		_ = killGroup(r.p.pid)
		<-r.p.done
		ends = append(ends, fmt.Sprintf("rank %d was killed, still running after %v", r.rank, time.Since(at).Round(time.Millisecond)))
	}
	if len(ends) > 0 {
		fmt.Fprintf(a.cfg.Stderr, "faultline-run: %s: %s\n", name, strings.Join(ends, "; "))
	}

	pctx, cancel := context.WithDeadline(ctx, at.Add(grace))
	defer cancel()
	fmt.Fprintf(a.cfg.Stderr, "faultline-run: %s: %s\n", name, a.persistNewest(pctx))
	return fmt.Errorf("%w by %s", ErrTerminated, name)
}

// persistNewest persists the newest step every local rank holds intact in
// memory, and says what it did.
func (a *Agent) persistNewest(ctx context.Context) string {
	step, err := a.ckpts.persistLocal(ctx)
	switch {
	case step < 0:
		return fmt.Sprintf("nothing to persist: %v", err)
	case err != nil:
		return fmt.Sprintf("step %d, the newest in memory, was not persisted: %v", step, err)
	}
	if disk := a.ckpts.diskStep(); disk < step {
		return fmt.Sprintf("step %d, the newest in memory, is not committed on disk (the newest step there is %d)", step, disk)
	}
	return fmt.Sprintf("step %d, the newest in memory, is persisted", step)
}

// exitWords says how p, a process of rank, ended.
func exitWords(rank int, p *rankProc) string {
	code, sig := exitOf(p.state)
	if sig != 0 {
		return fmt.Sprintf("rank %d ended by %s", rank, signalName(sig))
	}
	return fmt.Sprintf("rank %d exited with code %d", rank, code)
}
