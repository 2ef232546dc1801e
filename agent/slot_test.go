package agent

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// alive reports whether pid runs (a zombie does not).
func alive(pid int) bool {
	st := procState(pid)
	return st != "" && !strings.HasPrefix(st, "Z")
}

// TestRankGroupEndsWithRank: what a rank started ends with it, however
// the rank ended: the child of a rank that exited with a code is gone
// before the rank is restarted, and so are those of the ranks that
// finished, and of the one the agent stopped.
func TestRankGroupEndsWithRank(t *testing.T) {
	// The child's pid file is whole or absent: a rank stopped between
	// opening and writing it would leave it empty.
	a, out, dir := shellAgent(t, 2, 1, `sleep 300 & echo $! > "$WORK/.child-$RANK" && mv "$WORK/.child-$RANK" "$WORK/child-$RANK-$TORCHELASTIC_RESTART_COUNT"
if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then
	[ "$RANK" = 1 ] && exit 5
	sleep 60
fi
if [ "$RANK" = 1 ]; then
	case "$(grep '^State:' "/proc/$(cat "$WORK/child-1-0")/status" 2>/dev/null)" in
	""|*Z*) echo "the failed rank's child is gone" ;;
	*) echo "the failed rank's child outlived it" ;;
	esac
fi`)
	var children []int
	t.Cleanup(func() {
		for _, pid := range children {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	})
	err := run(t, a)
	for _, name := range []string{"child-0-0", "child-1-0", "child-0-1", "child-1-1"} {
		b, rerr := os.ReadFile(filepath.Join(dir, name))
		if name == "child-0-0" && errors.Is(rerr, os.ErrNotExist) {
			continue // rank 0 was stopped before it started one
		}
		if rerr != nil {
			t.Fatalf("%v\n%s", rerr, output(t, out))
		}
		pid, perr := strconv.Atoi(strings.TrimSpace(string(b)))
		if perr != nil {
			t.Fatal(perr)
		}
		children = append(children, pid)
		if alive(pid) {
			t.Errorf("%s: pid %d outlived its rank", name, pid)
		}
	}
	if err != nil {
		t.Fatalf("Run: %v\n%s", err, output(t, out))
	}
	if got := output(t, out); !strings.Contains(got, "[rank1]: the failed rank's child is gone") {
		t.Errorf("the restarted rank 1 found its predecessor's child alive:\n%s", got)
	}
}

// TestExitedAlready: a rank's process that exited on its own is told
// from a live one, zombie or reaped, so that the agent stopping its
// peers does not take its exit for one it caused.
func TestExitedAlready(t *testing.T) {
	dead := exec.Command("sh", "-c", "exit 3")
	if err := dead.Start(); err != nil {
		t.Fatal(err)
	}
	p := &rankProc{pid: dead.Process.Pid, done: make(chan struct{})}
	waitExited(p.pid)
	if !exitedAlready(p) {
		t.Error("a zombie is taken for a live process")
	}
	dead.Wait()
	if !exitedAlready(p) {
		t.Error("a process reaped is taken for a live one")
	}
	// A process of threads whose leader is gone and the others not yet:
	// the shape of one the kernel is taking down, which no wait reports
	// until its last thread is gone.
	leaderless := exec.Command("/usr/bin/python3", "-c",
		"import ctypes, threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); ctypes.CDLL(None).pthread_exit(None)")
	if err := leaderless.Start(); err == nil {
		defer leaderless.Wait()
		defer leaderless.Process.Kill()
		pid := leaderless.Process.Pid
		testkit.WaitFor(t, "the leader thread gone", func() bool { return strings.HasPrefix(procState(pid), "Z") })
		if !exitedAlready(&rankProc{pid: pid, done: make(chan struct{})}) {
			t.Error("a process whose leader thread is gone is taken for a live one")
		}
	}
	live := exec.Command("sleep", "60")
	if err := live.Start(); err != nil {
		t.Fatal(err)
	}
	defer live.Wait()
	defer live.Process.Kill()
	if exitedAlready(&rankProc{pid: live.Process.Pid, done: make(chan struct{})}) {
		t.Error("a live process is taken for one that exited")
	}
}

// TestRecoveryStartsRanksAlike: a rank whose process had not started when
// another failed (its worker registered after the fault) starts, at the
// recovery, with the same restart count as the rank that failed, so that
// their rendezvous, keyed by it, meets.
func TestRecoveryStartsRanksAlike(t *testing.T) {
	a, _, _ := shellAgent(t, 2, 3, "exit 0")
	a.slots[1].starts = 1 // rank 1 started once and failed; rank 0 never started
	j := newJobCheckpoints(1, a, a.log)
	if _, err := j.LoadNewest(t.Context()); err != nil {
		t.Fatal(err)
	}
	for _, s := range a.slots {
		if s.starts != 1 {
			t.Errorf("rank %d starts with restart count %d, want 1, as the other rank", s.rank, s.starts)
		}
	}
}
