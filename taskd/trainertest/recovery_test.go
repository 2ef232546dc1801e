package trainertest_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/taskd"
)

func recoveryTimeouts() taskd.Timeouts {
	return taskd.Timeouts{Pause: 5 * time.Second, Notify: 5 * time.Second, Decide: 5 * time.Second, Retry: 5 * time.Second,
		Restart: 30 * time.Second, Replace: 30 * time.Second, Load: 10 * time.Second, Resume: 10 * time.Second,
		Dump: 10 * time.Second, Exit: 5 * time.Second, Switch: 10 * time.Second, Stress: 10 * time.Second}
}

// TestRecovery runs a job of real processes on loopback, 2 nodes of 4
// ranks (4 of 8 with TASKD_HEAVY=1), breaks it in each way recovery
// handles, and checks the states each orchestration went through, how it
// ended, and that the ranks lost no step beyond the newest intact
// checkpoint.
func TestRecovery(t *testing.T) {
	cfg := jobConfig{nodes: 2, ppn: 4, stepTime: 20 * time.Millisecond, switchTime: 300 * time.Millisecond, saveEvery: 5, hangAfter: 3 * time.Second, timeouts: recoveryTimeouts()}
	if heavy() {
		cfg.nodes, cfg.ppn = 4, 8
	}
	j := startJob(t, cfg)
	last := cfg.ppn + 1 // a rank of node 1
	inPlace := []taskd.State{taskd.StateStopping, taskd.StateNotifying, taskd.StateDeciding, taskd.StateRestarting, taskd.StateLoading, taskd.StateResuming, taskd.StateRecovered}

	t.Run("SIGKILL: the rank restarts in place and every rank resumes from the newest intact checkpoint", func(t *testing.T) {
		for deadline := time.Now().Add(time.Minute); j.committed() < 0; time.Sleep(20 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("no checkpoint committed within a minute")
			}
		}
		from, committed := j.marks(), j.committed()
		j.signal(t, last, syscall.SIGKILL)
		rec := j.next(t, taskd.KindRecovery)
		wantStates(t, rec, inPlace...)
		if rec.Strategy != taskd.StrategyRecoverInPlace || !slices.Equal(rec.FaultyRanks, []int{last}) || rec.Round != 1 {
			t.Fatalf("recovery: %+v", rec)
		}
		j.checkResumed(t, rec, from, committed, j.lastSaveBefore(last, from[last], "event start"))
		if rec.Detected <= 0 || rec.Stopped < rec.Detected || rec.Resumed < rec.Stopped {
			t.Fatalf("figures: detected %v, stopped %v, resumed %v", rec.Detected, rec.Stopped, rec.Resumed)
		}
		t.Logf("fault -> detected %v, stopped %v, resumed %v (step %d)", rec.Detected, rec.Stopped, rec.Resumed, rec.ResumedStep)
	})

	t.Run("hang: the detector's verdict restarts the hung rank", func(t *testing.T) {
		from, committed := j.marks(), j.committed()
		j.signal(t, 2, syscall.SIGUSR1)
		rec := j.next(t, taskd.KindRecovery)
		wantStates(t, rec, inPlace...)
		if rec.Faults[0].Kind != taskd.FaultHang || !slices.Equal(rec.FaultyRanks, []int{2}) {
			t.Fatalf("recovery: %+v", rec)
		}
		j.checkResumed(t, rec, from, committed, j.lastSaveBefore(2, from[2], "event hang"))
	})

	t.Run("hangs on ranks of two nodes at once: each restarts on its own node", func(t *testing.T) {
		from, committed := j.marks(), j.committed()
		// A hang verdict names the stuck ranks, one report each, in quick
		// succession: the first starts the recovery, the others arrive
		// while it stops the job. Their processes still run.
		hung := []int{1, 3, cfg.ppn + 3}
		for _, r := range hung {
			if _, _, err := j.m.ReportFault(taskd.Fault{Kind: taskd.FaultHang, Position: taskd.Position{Node: r / cfg.ppn, Rank: r}, Message: "allreduce stuck"}); err != nil {
				t.Fatal(err)
			}
		}
		rec := j.next(t, taskd.KindRecovery)
		wantStates(t, rec, inPlace...)
		if rec.Strategy != taskd.StrategyRecoverInPlace || !slices.Equal(rec.FaultyRanks, hung) || rec.Round != 1 {
			t.Fatalf("recovery: %+v", rec)
		}
		lastSaved := int64(-1)
		for _, r := range hung {
			j.out[r].Wait(t, from[r], "event start", 10*time.Second)
			lastSaved = max(lastSaved, j.lastSaveBefore(r, from[r], "event start"))
		}
		j.checkResumed(t, rec, from, committed, lastSaved) // waits for every rank's resume
		for r := range j.out {
			if !slices.Contains(hung, r) && slices.ContainsFunc(j.out[r].From(from[r]), func(l string) bool { return strings.HasPrefix(l, "event start") }) {
				t.Errorf("rank %d restarted: %q", r, j.out[r].From(from[r]))
			}
		}
	})

	t.Run("faults on two nodes that need their replacement: both nodes are replaced", func(t *testing.T) {
		from, committed := j.marks(), j.committed()
		lost := []int{2, cfg.ppn + 1}
		for _, r := range lost {
			if _, _, err := j.m.ReportFault(taskd.Fault{Kind: taskd.FaultLost, Position: taskd.Position{Node: r / cfg.ppn, Rank: r}, Message: "heartbeats stopped"}); err != nil {
				t.Fatal(err)
			}
		}
		rec := j.next(t, taskd.KindRecovery)
		wantStates(t, rec, taskd.StateStopping, taskd.StateNotifying, taskd.StateDeciding, taskd.StateReplacing, taskd.StateLoading, taskd.StateResuming, taskd.StateRecovered)
		if rec.Strategy != taskd.StrategyRecover || !slices.Equal(rec.FaultyRanks, lost) || rec.Round != 1 {
			t.Fatalf("recovery: %+v", rec)
		}
		lastSaved := int64(-1)
		for r := range j.out {
			j.out[r].Wait(t, from[r], "event start", 10*time.Second) // every rank of both nodes
			lastSaved = max(lastSaved, j.lastSaveBefore(r, from[r], "event start"))
		}
		j.checkResumed(t, rec, from, committed, lastSaved)
	})

	t.Run("op error: every rank retries the step, nothing restarts", func(t *testing.T) {
		from := j.marks()
		j.signal(t, 1, syscall.SIGHUP)
		rec := j.next(t, taskd.KindRecovery)
		wantStates(t, rec, taskd.StateStopping, taskd.StateNotifying, taskd.StateRetrying, taskd.StateResuming, taskd.StateRecovered)
		if rec.ResumedStep != -1 || rec.Strategy != taskd.StrategyRetry {
			t.Fatalf("recovery: %+v", rec)
		}
		for r, l := range j.out {
			for _, line := range l.From(from[r]) {
				if strings.HasPrefix(line, "event start") {
					t.Fatalf("rank %d restarted: %q", r, l.From(from[r]))
				}
			}
			pause := l.Wait(t, from[r], "event pause", 10*time.Second)
			_, paused, _, _ := event(l.From(pause)[0])
			resume := l.Wait(t, pause, "event resume", 10*time.Second)
			if _, step, _, _ := event(l.From(resume)[0]); step != paused {
				t.Fatalf("rank %d paused after step %d and resumed after %d", r, paused, step)
			}
		}
	})

	t.Run("a link switch that fails on one rank hands over to recovery, which replaces the node", func(t *testing.T) {
		from, committed := j.marks(), j.committed()
		j.signal(t, last, syscall.SIGUSR2)
		sw, err := j.m.SwitchLink(context.Background(), taskd.LinkRequest{Node: 1, Devices: []int{0, 1}, Target: taskd.LinkStandby})
		if !errors.Is(err, taskd.ErrOrchestrationFailed) {
			t.Fatalf("switch: %v", err)
		}
		wantStates(t, sw, taskd.StatePausing, taskd.StateSwitching, taskd.StateFailed)
		rec := j.next(t, taskd.KindRecovery)
		wantStates(t, rec, taskd.StateStopping, taskd.StateNotifying, taskd.StateDeciding, taskd.StateReplacing, taskd.StateLoading, taskd.StateResuming, taskd.StateRecovered)
		if rec.HandedOverFrom != sw.ID || sw.HandedOverTo != rec.ID || rec.Faults[0].Kind != taskd.FaultLink || !slices.Equal(rec.FaultyRanks, []int{last}) {
			t.Fatalf("handover: %+v\n%+v", sw, rec)
		}
		if st := j.m.Orchestrations(0); len(st.Links) != 0 {
			t.Fatalf("links after a failed switch: %+v", st.Links)
		}
		j.checkResumed(t, rec, from, committed, j.lastSaveBefore(last, from[last], "event switch-link"))
		// Every rank of node 1 was replaced.
		for r := cfg.ppn; r < 2*cfg.ppn; r++ {
			j.out[r].Wait(t, from[r], "event start", 10*time.Second)
		}
	})

	t.Run("a link switch and its switchback", func(t *testing.T) {
		ctx := context.Background()
		sw, err := j.m.SwitchLink(ctx, taskd.LinkRequest{Node: 1, Devices: []int{0, 1}, Target: taskd.LinkStandby})
		if err != nil {
			t.Fatal(err)
		}
		wantStates(t, sw, taskd.StatePausing, taskd.StateSwitching, taskd.StateContinuing, taskd.StateSwitched)
		if st := j.m.Orchestrations(0); len(st.Links) != 2 {
			t.Fatalf("links: %+v", st.Links)
		}
		if _, err := j.m.SwitchLink(ctx, taskd.LinkRequest{Node: 1, Devices: []int{0, 1}, Target: taskd.LinkPrimary}); err != nil {
			t.Fatal(err)
		}
		if st := j.m.Orchestrations(0); len(st.Links) != 0 {
			t.Fatalf("links after the switchback: %+v", st.Links)
		}
	})

	t.Run("a fault during recovery starts another round", func(t *testing.T) {
		from, committed := j.marks(), j.committed()
		second := cfg.ppn + 2
		killed := j.onEnter(t, taskd.StateRestarting, func() error { return j.kill(second, syscall.SIGKILL) })
		j.signal(t, 0, syscall.SIGKILL)
		waitClosed(t, killed, "the second fault")
		rec := j.next(t, taskd.KindRecovery)
		if rec.State != taskd.StateRecovered || rec.Round < 2 || !slices.Equal(rec.FaultyRanks, []int{0, second}) {
			t.Fatalf("recovery: %+v", rec)
		}
		j.checkResumed(t, rec, from, committed, max(j.lastSaveBefore(0, from[0], "event start"), j.lastSaveBefore(second, from[second], "event start")))
	})

	t.Run("a second fault during a link switch: the switch ends its step and hands over", func(t *testing.T) {
		from, committed := j.marks(), j.committed()
		killed := j.onEnter(t, taskd.StateSwitching, func() error { return j.kill(last, syscall.SIGKILL) }) // node 1, not switching
		sw, err := j.m.SwitchLink(context.Background(), taskd.LinkRequest{Node: 0, Devices: []int{3}, Target: taskd.LinkStandby})
		waitClosed(t, killed, "the second fault")
		if !errors.Is(err, taskd.ErrOrchestrationFailed) {
			t.Fatalf("switch: %v", err)
		}
		wantStates(t, sw, taskd.StatePausing, taskd.StateSwitching, taskd.StateFailed)
		rec := j.next(t, taskd.KindRecovery)
		wantStates(t, rec, inPlace...)
		if rec.HandedOverFrom != sw.ID || !slices.Equal(rec.FaultyRanks, []int{last}) {
			t.Fatalf("recovery: %+v", rec)
		}
		j.checkResumed(t, rec, from, committed, j.lastSaveBefore(last, from[last], "event start"))
	})

	st := j.m.Orchestrations(0)
	if st.Current != nil {
		t.Fatalf("still running: %+v", st.Current)
	}
	for _, o := range st.History {
		t.Logf("#%d %s %s round %d strategy %s: detected %v stopped %v resumed %v", o.ID, o.Kind, o.State, o.Round, o.Strategy, o.Detected, o.Stopped, o.Resumed)
	}
}
