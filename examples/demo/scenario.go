package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/faultline-ml/faultline/ckpt/layout"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/trace/slownode"
)

// faultResult is what summary.json says of one injected fault.
type faultResult struct {
	Name         string    `json:"name"`
	Title        string    `json:"title"`
	Dir          string    `json:"dir"` // the fault's folder in the output, when it wrote files
	Rank         int       `json:"rank"`
	Node         int       `json:"node"`
	Injected     time.Time `json:"injected"`
	InjectedStep int64     `json:"injected_step"`
	// OnsetStep is the first step the fault slowed, as its rank says
	// (slow faults only).
	OnsetStep int64 `json:"onset_step,omitempty"`

	Detected         bool    `json:"detected"`
	DetectedBy       string  `json:"detected_by"`
	DetectionSeconds float64 `json:"detection_seconds"` // from the fault to its detection
	// DetectionStep is the step of the first verdict that named the
	// rank, and DetectionSteps how many steps after the onset that was
	// (slow faults only).
	DetectionStep  int64    `json:"detection_step,omitempty"`
	DetectionSteps int64    `json:"detection_steps,omitempty"`
	Explanation    string   `json:"explanation"`
	Culprit        []int    `json:"culprit,omitempty"` // the ranks the detection named
	Files          []string `json:"files,omitempty"`   // relative to the output folder

	Recovered       bool            `json:"recovered"`
	Recovery        *recoveryResult `json:"recovery,omitempty"`
	RecoverySeconds float64         `json:"recovery_seconds"` // from the manager taking the fault in to training resumed
	RestoredStep    int64           `json:"restored_step"`    // -1: the ranks went on from where they paused
	RestoredTiers   map[string]int  `json:"restored_tiers,omitempty"`
	Healthy         bool            `json:"healthy"` // training went on at full speed afterwards
	Error           string          `json:"error,omitempty"`
}

// recoveryResult is an orchestration, as summary.json says it.
type recoveryResult struct {
	ID               uint64             `json:"id"`
	Kind             string             `json:"kind"`
	State            string             `json:"state"`
	Strategy         string             `json:"strategy"`
	Rounds           int                `json:"rounds"`
	FaultyRanks      []int              `json:"faulty_ranks"`
	ResumedStep      int64              `json:"resumed_step"`
	DetectedSeconds  float64            `json:"detected_seconds"`
	StoppedSeconds   float64            `json:"stopped_seconds"`
	ResumedSeconds   float64            `json:"resumed_seconds"`
	Outcome          string             `json:"outcome"`
	HandedOverFrom   uint64             `json:"handed_over_from,omitempty"`
	Transitions      []transitionResult `json:"transitions"`
	HandedOverSwitch *recoveryResult    `json:"link_switch,omitempty"`
}

type transitionResult struct {
	From      string  `json:"from"`
	To        string  `json:"to"`
	AtSeconds float64 `json:"at_seconds"`
	Reason    string  `json:"reason"`
}

func recoveryOf(o taskd.Orchestration) *recoveryResult {
	r := &recoveryResult{ID: o.ID, Kind: string(o.Kind), State: string(o.State), Strategy: string(o.Strategy), Rounds: o.Round,
		FaultyRanks: o.FaultyRanks, ResumedStep: o.ResumedStep, DetectedSeconds: o.Detected.Seconds(),
		StoppedSeconds: o.Stopped.Seconds(), ResumedSeconds: o.Resumed.Seconds(), Outcome: o.Outcome, HandedOverFrom: o.HandedOverFrom}
	for _, t := range o.Transitions {
		r.Transitions = append(r.Transitions, transitionResult{From: string(t.From), To: string(t.To), AtSeconds: t.Time.Sub(o.Start).Seconds(), Reason: t.Reason})
	}
	return r
}

var faultTitles = map[string]string{
	faultSlowCompute: "slow compute",
	faultSlowIO:      "slow data loading",
	faultHang:        "hung collective",
	faultCrash:       "crashed worker",
	faultLink:        "failed link switch",
}

// target picks the rank (and its node) a fault hits.
func (j *job) target(name string) (rank, node int) {
	w, ppn := j.world, j.cfg.ProcsPerNode
	switch name {
	case faultSlowCompute:
		rank = max(1, min(ppn-1, w-1)) // node 0's last rank
	case faultSlowIO:
		rank = max(0, w-2)
	case faultHang:
		rank = min(w/2+1, w-1)
	case faultCrash:
		rank = min(2, w-1)
	case faultLink:
		rank = w - 1 // the rank whose switch fails, on the last node
	}
	return rank, j.nodeOf(rank)
}

// scenario injects each fault in turn and returns what came of each.
func (j *job) scenario(ctx context.Context) []*faultResult {
	var results []*faultResult
	if err := j.waitSteps(ctx, max(j.cfg.Steps, slownode.DefaultNormalSteps+5)); err != nil {
		return results
	}
	if err := j.waitMidInterval(ctx); err != nil {
		return results
	}
	j.progress()
	for i, name := range j.cfg.Faults {
		rank, node := j.target(name)
		res := &faultResult{Name: name, Title: faultTitles[name], Rank: rank, Node: node, RestoredStep: -1,
			Dir: fmt.Sprintf("%d-%s", i+1, name)}
		results = append(results, res)
		where := fmt.Sprintf("rank %d on node %d (%s)", rank, node, j.hosts[node])
		if name == faultLink {
			where = fmt.Sprintf("node %d (%s), failing on rank %d", node, j.hosts[node], rank)
		}
		head := fmt.Sprintf("── %d/%d  %s: %s ", i+1, len(j.cfg.Faults), res.Title, where)
		j.con.printf("\n%s%s", head, strings.Repeat("─", max(4, 78-len([]rune(head)))))
		j.setPhase(fmt.Sprintf("fault %d/%d: %s", i+1, len(j.cfg.Faults), res.Title))
		var err error
		switch name {
		case faultSlowCompute:
			err = j.slowFault(ctx, res, 3, "computes", func(r *slownode.Result) []int { return r.SlowCalculateRanks }, slownode.KindCompute)
		case faultSlowIO:
			err = j.slowFault(ctx, res, 10, "loads data", func(r *slownode.Result) []int { return r.SlowIORanks }, slownode.KindIO)
		case faultHang:
			err = j.hangFault(ctx, res)
		case faultCrash:
			err = j.crashFault(ctx, res)
		case faultLink:
			err = j.linkFault(ctx, res)
		}
		if err != nil {
			res.Error = err.Error()
			j.con.printf("  FAILED    %v", err)
			if ctx.Err() != nil {
				return results
			}
		}
		j.setPhase("training")
		err = j.waitSteps(ctx, j.cfg.Steps)
		if err == nil {
			err = j.waitMidInterval(ctx)
		}
		if err != nil {
			res.Error = strings.TrimPrefix(res.Error+"; ", "; ") + "training did not go on: " + err.Error()
			j.con.printf("  FAILED    training did not go on after the fault: %v", err)
			return results
		}
		res.Healthy = res.Error == ""
		j.progress()
	}
	return results
}

// waitMidInterval waits until the ranks are half way between two
// checkpoints, so that a fault costs the steps since the last one, as it
// does in real life.
func (j *job) waitMidInterval(ctx context.Context) error {
	every := j.cfg.SaveEvery
	return j.waitFor(ctx, time.Duration(every)*j.cfg.StepTime*4+30*time.Second, func() bool {
		lo, all := j.minStepLocked()
		return all && lo%every >= every/2
	})
}

// progress prints a line saying how training goes.
func (j *job) progress() {
	j.mu.Lock()
	lo, _ := j.minStepLocked()
	training := 0
	mem := int64(-1)
	for _, v := range j.ranks {
		if v.state == "training" {
			training++
		}
		if mem < 0 || v.lastSave < mem {
			mem = v.lastSave
		}
	}
	j.mu.Unlock()
	disk := "none yet"
	if b, err := os.ReadFile(j.path("ckpt", layout.DLRoverTrackerFile)); err == nil {
		if s, err := layout.ParseStepText(b); err == nil {
			disk = fmt.Sprintf("step %d", s)
		}
	}
	j.con.printf("[%5.1fs] training: step %d on %d/%d ranks; checkpoints: step %d in memory, %s on disk", j.since(), lo, training, j.world, mem, disk)
}

// inject sends an injection to a rank through the control plane.
func (j *job) inject(ctx context.Context, rank int, in injection) error {
	b, _ := json.Marshal(in)
	ds, err := j.m.Broadcast(ctx, taskd.RankList(rank), msgInject, b)
	if err != nil {
		return err
	}
	for _, d := range ds {
		if d.Err != nil {
			return fmt.Errorf("inject %s into rank %d: %w", in.Fault, rank, d.Err)
		}
	}
	return nil
}

// stepOf returns a rank's last step.
func (j *job) stepOf(rank int) int64 {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.ranks[rank].step
}

// slowFault injects a slowdown of factor into a rank's compute or data
// loading and follows slownode's verdict, the recovery it starts, and the
// verdict clearing.
func (j *job) slowFault(ctx context.Context, res *faultResult, factor float64, does string, list func(*slownode.Result) []int, kind string) error {
	rank := res.Rank
	sent := time.Now()
	if err := j.inject(ctx, rank, injection{Fault: res.Name, Factor: factor}); err != nil {
		return err
	}
	res.Injected, res.InjectedStep = time.Now(), j.stepOf(rank)
	// The rank says which step is the first it slows.
	err := j.waitFor(ctx, 10*time.Second, func() bool {
		v := j.ranks[rank]
		res.OnsetStep = v.injectedFrom
		return !v.injectedAt.Before(sent)
	})
	if err != nil {
		return fmt.Errorf("rank %d did not say it took the injection: %w", rank, err)
	}
	j.con.printf("  inject    rank %d %s %gx slower from step %d; its peers now wait for it in every collective", rank, does, factor, res.OnsetStep)

	// The first verdict that names the rank: the watch may pass on
	// another before this wakes.
	var v *slownode.Result
	var at time.Time
	err = j.waitFor(ctx, 90*time.Second, func() bool {
		for _, sv := range j.verdicts {
			if !sv.at.Before(sent) && slices.Contains(list(sv.r), rank) {
				v, at = sv.r, sv.at
				return true
			}
		}
		return false
	})
	if err != nil {
		j.inject(ctx, rank, injection{Fault: "heal"})
		return fmt.Errorf("slownode did not name rank %d: %w", rank, err)
	}
	res.Detected, res.DetectedBy = true, "trace/slownode.Watch over the live dotting files"
	res.DetectionSeconds = at.Sub(res.Injected).Seconds()
	res.DetectionStep, res.DetectionSteps = v.LastStep, v.LastStep-res.OnsetStep
	res.Culprit = list(v)
	field := "slowCalculateRanks"
	if kind == slownode.KindIO {
		field = "slowIORanks"
	}
	j.con.printf("  detect    %.1fs later, in the verdict of step %d, %d steps after the onset: slownode's verdict isSlow=%d, %s %v, degradation %s",
		res.DetectionSeconds, v.LastStep, res.DetectionSteps, v.IsSlow, field, list(v), v.DegradationLevel)
	for _, f := range v.Findings {
		if f.Kind != kind || !slices.Contains(f.Ranks, rank) {
			continue
		}
		res.Explanation = fmt.Sprintf("rank %d %s %.1f ms a step against %.1f ms on its peers (x%.1f, %s), onset step %d, confidence %.2f",
			rank, f.Metric, f.Recent, f.Baseline, f.Ratio, f.Method, f.OnsetStep, f.Confidence)
		j.con.printf("  explain   %s", res.Explanation)
	}
	if v.BaselineMs > 0 {
		j.con.printf("            job step time %.1f ms, baseline %.1f ms: every rank pays for one slow rank", v.StepMs, v.BaselineMs)
	}
	dir := j.path(res.Dir)
	files, err := writeVerdict(dir, v)
	if err != nil {
		return err
	}
	for _, f := range files {
		res.Files = append(res.Files, j.relOut(f))
	}
	j.con.printf("            report: %s (also slownode.json, slownode.txt)", j.rel(files[0]))

	msg := "slownode: " + field
	for _, f := range v.Findings {
		if f.Kind == kind && slices.Contains(f.Ranks, rank) {
			msg = fmt.Sprintf("slownode: %s %.1f ms, peers %.1f ms", f.Metric, f.Recent, f.Baseline)
		}
	}
	f, _, err := j.m.ReportFault(taskd.Fault{Kind: taskd.FaultSlowNode, Position: taskd.Position{Node: res.Node, Rank: rank},
		Message: msg, Attrs: map[string]string{"metric": kind}})
	if err != nil {
		return err
	}
	j.con.printf("  recover   the verdict goes to the manager as fault %s #%d; a slow node is one to replace:", f.Kind, f.Seq)
	o, err := j.followRecovery(ctx, res, func(o taskd.Orchestration) bool { return hasFault(o, f.ID) })
	if err != nil {
		return err
	}
	j.restored(o, res)

	// The replaced rank is healthy: the verdict clears once enough normal
	// steps have been evaluated.
	err = j.waitFor(ctx, 60*time.Second, func() bool {
		return j.verdictAt.After(o.End) && !slices.Contains(list(j.verdict), rank)
	})
	if err != nil {
		return fmt.Errorf("the slow-node verdict did not clear after the recovery: %w", err)
	}
	j.mu.Lock()
	last := j.verdict.LastStep
	j.mu.Unlock()
	j.con.printf("  healthy   slownode no longer names rank %d (verdict at step %d)", rank, last)
	return nil
}

// relOut returns path relative to the output folder.
func (j *job) relOut(path string) string {
	if r, err := filepath.Rel(j.out, path); err == nil {
		return r
	}
	return path
}

// writeVerdict writes a verdict as HTML, JSON and text; the HTML first.
func writeVerdict(dir string, r *slownode.Result) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var paths []string
	for _, f := range []struct {
		name  string
		write func(*os.File) error
	}{
		{"slownode.html", func(w *os.File) error { return slownode.WriteHTML(w, r) }},
		{"slownode.json", func(w *os.File) error { return slownode.WriteJSON(w, r) }},
		{"slownode.txt", func(w *os.File) error { return slownode.WriteText(w, r) }},
	} {
		path := filepath.Join(dir, f.name)
		w, err := os.Create(path)
		if err != nil {
			return paths, err
		}
		err = f.write(w)
		if cerr := w.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return paths, fmt.Errorf("%s: %w", path, err)
		}
		paths = append(paths, path)
	}
	return paths, nil
}

func hasFault(o taskd.Orchestration, id string) bool {
	return slices.ContainsFunc(o.Faults, func(f taskd.Fault) bool { return f.ID == id })
}

// followRecovery waits for the recovery match picks, printing its
// transitions as they happen, and records it in res.
func (j *job) followRecovery(ctx context.Context, res *faultResult, match func(taskd.Orchestration) bool) (taskd.Orchestration, error) {
	var id uint64
	printed := 0
	var o taskd.Orchestration
	for {
		err := j.waitFor(ctx, 3*time.Minute, func() bool {
			if id == 0 {
				ids := make([]uint64, 0, len(j.orchs))
				for k := range j.orchs {
					ids = append(ids, k)
				}
				slices.Sort(ids)
				for _, k := range ids {
					if o := j.orchs[k]; o.Kind == taskd.KindRecovery && match(o) {
						id = k
						break
					}
				}
			}
			if id == 0 {
				return false
			}
			o = j.orchs[id]
			return len(o.Transitions) > printed || o.Done
		})
		if err != nil {
			return o, fmt.Errorf("waiting for the recovery: %w", err)
		}
		if printed == 0 {
			j.con.printf("            recovery #%d (taskd orchestration; times from its start):", o.ID)
		}
		j.printTransitions(o, printed)
		printed = len(o.Transitions)
		if o.Done {
			break
		}
	}
	res.Recovery = recoveryOf(o)
	res.Recovered = o.State == taskd.StateRecovered
	res.RecoverySeconds = (o.Resumed - o.Detected).Seconds()
	if !res.Recovered {
		return o, fmt.Errorf("recovery #%d ended %s: %s", o.ID, o.State, o.Outcome)
	}
	j.con.printf("            from the fault: taken in by the manager after %s, training paused after %s, resumed after %s",
		secs(o.Detected), secs(o.Stopped), secs(o.Resumed))
	return o, nil
}

func secs(d time.Duration) string { return fmt.Sprintf("%.2fs", d.Seconds()) }

// printTransitions prints o's transitions from index from.
func (j *job) printTransitions(o taskd.Orchestration, from int) {
	for _, t := range o.Transitions[from:] {
		reason := t.Reason
		if len(reason) > 160 {
			reason = reason[:157] + "..."
		}
		j.con.printf("              %+6.2fs  %-11s %s", t.Time.Sub(o.Start).Seconds(), t.To, reason)
	}
}

// restored prints and records the checkpoint a recovery resumed from.
func (j *job) restored(o taskd.Orchestration, res *faultResult) {
	res.RestoredStep = o.ResumedStep
	if o.ResumedStep < 0 {
		j.con.printf("  restored  nothing: the ranks went on from where they paused")
		return
	}
	ld := j.ckpts.lastLoad()
	res.RestoredTiers = map[string]int{}
	var sample string
	for _, rep := range ld.Reports {
		res.RestoredTiers[string(rep.Tier)]++
		if rep.Shard == res.Rank {
			sample = rep.String()
		}
	}
	j.mu.Lock()
	loaded := map[string]int{}
	reached := int64(-1)
	for _, v := range j.ranks {
		if !v.lastLoad.time.Before(o.Start) && v.lastLoad.step == o.ResumedStep {
			loaded[v.lastLoad.tier]++
		}
		for _, e := range v.events {
			if e.kind == "pause" && !e.time.Before(o.Start) && !e.time.After(o.End) {
				reached = max(reached, e.step)
			}
		}
	}
	j.mu.Unlock()
	j.con.printf("  restored  step %d (the ranks had reached step %d): the node agents readied it (%s), then every rank loaded it (%s)",
		o.ResumedStep, reached, tierCounts(res.RestoredTiers, "shard"), tierCounts(loaded, "rank"))
	if sample != "" {
		j.con.printf("            ckpt LoadReport: %s", sample)
	}
}

func tierCounts(m map[string]int, what string) string {
	var parts []string
	for t, n := range m {
		w := what
		if n != 1 {
			w += "s"
		}
		parts = append(parts, fmt.Sprintf("%d %s from %s", n, w, t))
	}
	sort.Strings(parts)
	return strings.Join(parts, ", ")
}

// hangFault breaks a rank's link in the middle of an all-reduce and
// follows the watchdogs, the stack merge and the recovery.
func (j *job) hangFault(ctx context.Context, res *faultResult) error {
	rank := res.Rank
	dir := j.path(res.Dir)
	j.diag.setOutDir(dir)
	before := len(j.diag.all())
	if err := j.inject(ctx, rank, injection{Fault: faultHang}); err != nil {
		return err
	}
	res.Injected = time.Now()
	var hungAt time.Time
	if err := j.waitFor(ctx, time.Minute, func() bool {
		v := j.ranks[rank]
		hungAt, res.InjectedStep = v.hungAt, v.step
		return v.hungAt.After(res.Injected)
	}); err != nil {
		return fmt.Errorf("rank %d did not hang: %w", rank, err)
	}
	j.con.printf("  inject    rank %d's all-reduce of step %d never completes: its link drops the chunk it sends", rank, res.InjectedStep+1)
	j.con.printf("            its peers wait in their collectives; nothing fails, nothing exits")

	var d *hangResult
	if err := j.waitFor(ctx, j.cfg.HangTimeout+2*time.Minute, func() bool {
		all := j.diag.all()
		if len(all) > before {
			d = all[before]
			return d.Deferred == ""
		}
		return false
	}); err != nil {
		return fmt.Errorf("no hang diagnosis: %w", err)
	}
	if d.Err != nil && len(d.Culprit) == 0 {
		return fmt.Errorf("hang diagnosis: %w", d.Err)
	}
	res.Detected, res.DetectedBy = true, "hang.Watchdog on every rank, then the node agents' stack merge"
	res.DetectionSeconds = d.Flagged.Sub(hungAt).Seconds()
	res.Culprit = d.Culprit
	res.Explanation = d.Split
	j.con.printf("  detect    %.1fs after the all-reduce stuck (timeout %v), the hang watchdogs flagged: %s",
		res.DetectionSeconds, j.cfg.HangTimeout, strings.Join(d.byOp(), "; "))
	asked := ""
	if len(d.Asked) > 0 {
		asked = fmt.Sprintf("; ranks %s were asked for theirs", joinInts(d.Asked))
	}
	j.con.printf("  explain   every rank's stacks (hang.Watchdog.Dump%s) and their native threads (%s) merged in %.1fs:",
		asked, orNone(d.Native), d.Done.Sub(d.First).Seconds())
	j.con.printf("            %s", d.Split)
	for _, f := range d.Files {
		res.Files = append(res.Files, j.relOut(f))
	}
	j.con.printf("            flame graphs %s/go_stack.svg, cpp_stack.svg; pprof stacks.pb.gz; folded stacks; verdict.txt", j.rel(dir))
	if d.Fault.Seq == 0 {
		return fmt.Errorf("the culprit was not reported: %v", d.Err)
	}
	j.con.printf("  recover   rank %s goes to the manager as fault %s #%d:", joinInts(d.Culprit), d.Fault.Kind, d.Fault.Seq)
	o, err := j.followRecovery(ctx, res, func(o taskd.Orchestration) bool { return hasFault(o, d.Fault.ID) })
	if err != nil {
		return err
	}
	j.restored(o, res)
	return nil
}

// crashFault kills a rank with SIGKILL and follows its supervisor's
// report and the recovery.
func (j *job) crashFault(ctx context.Context, res *faultResult) error {
	rank := res.Rank
	pid := 0
	for _, st := range j.sups[res.Node].State() {
		if st.Name == fmt.Sprintf("rank-%d", rank) {
			pid = st.PID
		}
	}
	if pid == 0 {
		return fmt.Errorf("rank %d has no process", rank)
	}
	before := func() int { j.mu.Lock(); defer j.mu.Unlock(); return len(j.exits) }()
	res.InjectedStep = j.stepOf(rank)
	res.Injected = time.Now()
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		return err
	}
	j.con.printf("  inject    kill -KILL %d: rank %d dies at step %d, in the middle of whatever it was doing", pid, rank, res.InjectedStep)
	var e exitSeen
	if err := j.waitFor(ctx, time.Minute, func() bool {
		for _, x := range j.exits[before:] {
			if x.rank == rank {
				e = x
				return true
			}
		}
		return false
	}); err != nil {
		return fmt.Errorf("no supervisor saw rank %d exit: %w", rank, err)
	}
	res.Detected, res.DetectedBy = true, "rescheduling/local.Supervisor (process exit), reported to the manager"
	res.DetectionSeconds = e.fault.Received.Sub(res.Injected).Seconds()
	res.Culprit = []int{rank}
	res.Explanation = fmt.Sprintf("pid %s exited with code %d (%s)", e.pid, e.code, orDash(e.signal))
	j.con.printf("  detect    node %d's supervisor saw pid %s exit with code %d (%s) %s after the kill;", res.Node, e.pid, e.code, orDash(e.signal), ms(e.time.Sub(res.Injected)))
	j.con.printf("            the manager took fault %s #%d in %s after the kill (heartbeats would have said so within 3s)", e.fault.Kind, e.fault.Seq, ms(e.fault.Received.Sub(res.Injected)))
	j.con.printf("  recover   a killed process is restarted in place, and every rank resumes from the newest checkpoint:")
	o, err := j.followRecovery(ctx, res, func(o taskd.Orchestration) bool { return hasFault(o, e.fault.ID) })
	if err != nil {
		return err
	}
	j.restored(o, res)
	return nil
}

func ms(d time.Duration) string {
	if d < 10*time.Millisecond {
		return fmt.Sprintf("%.1fms", float64(d)/1e6)
	}
	return d.Round(time.Millisecond).String()
}

// linkFault asks the manager to move a node's links to their standby
// while one of its ranks cannot, and follows the switch and the recovery
// it hands over to.
func (j *job) linkFault(ctx context.Context, res *faultResult) error {
	rank, node := res.Rank, res.Node
	why := fmt.Sprintf("NIC of device %d: no carrier on the standby link", rank%j.cfg.ProcsPerNode)
	if err := j.inject(ctx, rank, injection{Fault: "fail-switch", Reason: why}); err != nil {
		return err
	}
	devices := make([]int, j.cfg.ProcsPerNode)
	for d := range devices {
		devices[d] = d
	}
	res.Injected, res.InjectedStep = time.Now(), j.stepOf(rank)
	j.con.printf("  inject    rank %d's standby link is down; the operator moves node %d's links (devices %s) to standby:", rank, node, joinInts(devices))
	sw, err := j.m.SwitchLink(ctx, taskd.LinkRequest{Node: node, Devices: devices, Target: taskd.LinkStandby})
	if !errors.Is(err, taskd.ErrOrchestrationFailed) {
		return fmt.Errorf("the link switch did not fail as injected: %v (%s)", err, sw.State)
	}
	j.con.printf("            link switch #%d (taskd.Manager.SwitchLink):", sw.ID)
	j.printTransitions(sw, 0)
	var switching time.Time
	for _, t := range sw.Transitions {
		if t.To == taskd.StateSwitching {
			switching = t.Time
		}
	}
	res.Detected, res.DetectedBy = true, "taskd link switch: a rank's SwitchLink failed"
	res.DetectionSeconds = sw.End.Sub(switching).Seconds()
	res.Culprit = sw.FaultyRanks
	res.Explanation = sw.Outcome
	j.con.printf("  detect    rank %d failed to switch %.2fs into the switch: %s", rank, res.DetectionSeconds, why)
	j.con.printf("  recover   the switch hands the job over to recovery #%d; a bad link is a node to replace:", sw.HandedOverTo)
	o, err := j.followRecovery(ctx, res, func(o taskd.Orchestration) bool { return o.ID == sw.HandedOverTo })
	if err != nil {
		return err
	}
	res.Recovery.HandedOverSwitch = recoveryOf(sw)
	j.restored(o, res)
	if links := j.m.Orchestrations(0).Links; len(links) == 0 {
		j.con.printf("            links on standby now: none (node %d's processes were replaced, on their primary links)", node)
	}
	return nil
}
