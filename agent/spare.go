package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"time"
)

// spareBoot is what a spare interpreter runs: it imports torch and waits
// for the agent to hand it a rank (faultline.spare).
const spareBoot = "import faultline.spare as s; s.main()"

// spareProc is a warm interpreter kept for a slot: it has imported torch,
// so that a restart skips seconds of imports.
type spareProc struct {
	p     *rankProc
	ready chan net.Conn // its connection, once it said it is ready
}

// prepareSpare starts the slot's next spare unless it has one.
func (s *slot) prepareSpare() {
	c := &s.a.cfg
	if c.NoPython || c.NoSpares || s.a.terminating() != 0 {
		return
	}
	s.mu.Lock()
	if s.spare != nil || s.closed || s.state == slotStopped || s.state == slotDone {
		s.mu.Unlock()
		return
	}
	env := s.env(s.starts, -1)
	delete(env, "FAULTLINE_RESUME_STEP")
	env["FAULTLINE_SPARE"] = "1"
	cmd := exec.Command(c.Python, "-c", spareBoot)
	cmd.Env = s.environ(env)
	if wd, err := os.Getwd(); err == nil {
		cmd.Dir = wd
	}
	_, err := s.launch(cmd, func(p *rankProc) { s.spare = &spareProc{p: p, ready: make(chan net.Conn, 1)} })
	s.mu.Unlock()
	if err != nil {
		s.a.log.Warn("agent: no spare interpreter", "rank", s.rank, "err", err)
	}
}

// run hands the spare the rank: env are the variables of the rank's
// process. own makes the spare the slot's process before it is told. It
// returns once the spare has them.
func (sp *spareProc) run(ctx context.Context, env map[string]string, c Config, own func(*rankProc)) error {
	var conn net.Conn
	t := time.NewTimer(2 * time.Minute)
	defer t.Stop()
	select {
	case conn = <-sp.ready:
	case <-sp.p.done:
		return fmt.Errorf("spare pid %d exited before it was ready: %v", sp.p.pid, sp.p.state)
	case <-t.C:
		return errors.New("spare not ready after 2 minutes")
	case <-ctx.Done():
		return ctx.Err()
	}
	defer conn.Close()
	vars := map[string]any{}
	for k, v := range env {
		vars[k] = v
	}
	vars["FAULTLINE_SPARE"] = nil
	wd, _ := os.Getwd()
	msg, err := json.Marshal(map[string]any{"ok": true, "env": vars, "argv": c.Command, "module": c.Module, "cwd": wd})
	if err != nil {
		return err
	}
	sp.p.started = time.Now()
	own(sp.p)
	conn.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := conn.Write(append(msg, '\n')); err != nil {
		return fmt.Errorf("spare pid %d: %w", sp.p.pid, err)
	}
	return nil
}

// warmSpares takes the slots' warm spares that are ready (imported torch
// and waiting), by local rank, for the node's next run (Resized.Next),
// whose slots adopt them instead of importing torch again.
func (a *Agent) warmSpares() map[int]*spareProc {
	out := map[int]*spareProc{}
	for _, s := range a.slots {
		s.mu.Lock()
		if sp := s.spare; sp != nil {
			select {
			case conn := <-sp.ready:
				sp.ready <- conn // put back: ready holds one
				s.spare, out[s.local] = nil, sp
			default: // still importing: it goes with the run
			}
		}
		s.mu.Unlock()
	}
	return out
}

// adopt makes sp, a warm spare of the last run of the node, the slot's.
func (s *slot) adopt(sp *spareProc) {
	sp.p.owner.Store(s)
	sp.p.out.set(s.out)
	sp.p.errOut.set(s.errOut)
	s.mu.Lock()
	s.spare = sp
	s.mu.Unlock()
}

// dropWarm kills warm spares that no slot adopted.
func dropWarm(warm map[int]*spareProc) {
	for _, sp := range warm {
		sp.p.owner.Load().killProc(sp.p)
	}
}

// offer takes in a spare's "spare" request: its connection waits there
// until the spare is handed a rank.
func (s *slot) offer(pid int, conn net.Conn) bool {
	s.mu.Lock()
	sp := s.spare
	s.mu.Unlock()
	if sp == nil || sp.p.pid != pid {
		return false
	}
	select {
	case sp.ready <- conn:
		return true
	default:
		return false
	}
}
