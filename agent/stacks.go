package agent

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/faultline-ml/faultline/hang"
)

// dumpStacks has the rank's faulthandler dump its Python stacks (it does
// so from its signal handler, even while the rank is blocked inside a
// collective) and writes them to dir as the rank's hang stack file. It
// returns the dump, nil when the rank gave none (not a Python rank, or
// one that never called faultline.torch.init).
func (s *slot) dumpStacks(ctx context.Context, p *rankProc, reason, dir string) *hang.Dump {
	s.mu.Lock()
	ready := p.hello
	s.mu.Unlock()
	select {
	case <-p.done:
		return nil // gone
	default:
	}
	if !ready || strings.HasPrefix(procState(p.pid), "Z") {
		return nil // its faulthandler is not registered (the signal would kill it), or it is dead
	}
	if dir != "" {
		if _, err := os.Stat(filepath.Join(dir, hang.FileName(s.rank, s.a.world))); err == nil {
			return nil // taken already for this incident, before anything moved
		}
	}
	pid := p.pid
	if err := os.Truncate(s.stackFile, 0); err != nil {
		return nil // no faulthandler registered: it creates the file
	}
	if err := syscall.Kill(pid, stackSignal); err != nil {
		return nil
	}
	// The dump is written at once, in a few write calls: wait until the
	// file holds something and has stopped growing.
	var size int64
	stable := 0
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline) && stable < 4 && ctx.Err() == nil; {
		time.Sleep(5 * time.Millisecond)
		fi, err := os.Stat(s.stackFile)
		if err != nil {
			return nil
		}
		if fi.Size() > 0 && fi.Size() == size {
			stable++
		} else {
			stable = 0
		}
		size = fi.Size()
	}
	b, err := os.ReadFile(s.stackFile)
	if err != nil || len(b) == 0 {
		s.a.log.Warn("agent: rank dumped no stacks", "rank", s.rank, "pid", pid)
		return nil
	}
	host, _ := os.Hostname()
	d := &hang.Dump{Rank: s.rank, World: s.a.world, Pid: pid, Host: host, Time: time.Now(), Reason: reason,
		State: procState(pid), Notes: []string{"python: faulthandler"}, Threads: hang.ParseFaulthandler(b)}
	if dir != "" {
		if err := os.MkdirAll(dir, 0o750); err == nil {
			if _, err := hang.WriteStackFile(dir, d); err != nil {
				s.a.log.Warn("agent: stack file not written", "rank", s.rank, "err", err)
			}
		}
	}
	return d
}

// procState is the State line of /proc/<pid>/status.
func procState(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "State:"); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// ownFrame says whether a stack frame is the job's own Python code: not
// the interpreter's library or torch (whose paths the stack parser
// shortened) and not the faultline package, extracted under pythonPaths.
func ownFrame(pythonPaths ...string) func(hang.Kind, hang.Frame) bool {
	return func(k hang.Kind, f hang.Frame) bool {
		if k != hang.KindPython || !filepath.IsAbs(f.File) {
			return false
		}
		for _, p := range pythonPaths {
			if p != "" && strings.HasPrefix(f.File, p+string(filepath.Separator)) {
				return false
			}
		}
		return true
	}
}
