package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/faultline-ml/faultline/hang"
	"github.com/faultline-ml/faultline/taskd"
)

// trainingLoop is the frame that marks a worker's training goroutine in
// its Go stacks: "main.(*trainer).Run", or under the package's import path
// in a test binary.
var trainingLoop = runtime.FuncForPC(reflect.ValueOf((*trainer).Run).Pointer()).Name()

// hangDiagnosis is the node agents' answer to a hang: when a rank's
// watchdog flags one, it gathers every rank's stack file (asking the ranks
// that did not flag it to dump), adds each process's native stacks, merges
// them into flame graphs and a verdict, and reports the rank the stacks
// single out to the manager as hung, which starts the recovery.
type hangDiagnosis struct {
	j       *job
	reports chan hangReport

	mu      sync.Mutex
	outDir  string // where the next diagnosis writes
	results []*hangResult
}

// hangResult is one diagnosis.
type hangResult struct {
	First    time.Time          // the first report reached the agent
	Flagged  time.Time          // the first watchdog flagged its op
	Reports  map[int]hangReport // by rank
	Asked    []int              // ranks asked to dump, not having flagged anything
	Native   string             // how native stacks were taken
	Dir      string
	Files    []string
	Verdict  string
	Split    string // where the culprit parts from the others
	Culprit  []int
	Fault    taskd.Fault // reported to the manager
	Done     time.Time
	Err      error
	Deferred string // why it was left to a recovery already running
}

func newHangDiagnosis(j *job) *hangDiagnosis {
	return &hangDiagnosis{j: j, reports: make(chan hangReport, 1024)}
}

// handle is the manager handler that takes the workers' hang reports in.
func (d *hangDiagnosis) handle(_ context.Context, _ *taskd.Manager, ev taskd.Event) error {
	if ev.Kind != taskd.EventMessage || ev.Message.Kind != msgHang {
		return nil
	}
	var r hangReport
	if err := json.Unmarshal(ev.Message.Payload, &r); err != nil {
		return fmt.Errorf("hang report from %s: %w", ev.Position, err)
	}
	select {
	case d.reports <- r:
	default:
		return errors.New("hang reports back up")
	}
	return nil
}

// setOutDir says where the next diagnosis writes its files.
func (d *hangDiagnosis) setOutDir(dir string) {
	d.mu.Lock()
	d.outDir = dir
	d.mu.Unlock()
}

// latest returns the diagnoses so far.
func (d *hangDiagnosis) all() []*hangResult {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.results)
}

// run diagnoses hangs until ctx ends.
func (d *hangDiagnosis) run(ctx context.Context) {
	for {
		var r hangReport
		select {
		case <-ctx.Done():
			return
		case r = <-d.reports:
		}
		res := &hangResult{First: time.Now(), Flagged: r.Time, Reports: map[int]hangReport{r.Rank: r}}
		if cur := d.j.m.Orchestrations(0).Current; cur != nil {
			// Ranks waiting on a dead peer while a recovery pauses them:
			// the recovery deals with it.
			res.Deferred = fmt.Sprintf("%s #%d is running", cur.Kind, cur.ID)
			d.j.log.Info("demo: hang report during an orchestration; left to it", "rank", r.Rank, "fault", r.Fault, "orchestration", cur.ID)
			d.drain(500 * time.Millisecond)
		} else {
			res.Err = d.diagnose(ctx, res)
			res.Done = time.Now()
			if res.Err != nil {
				d.j.log.Error("demo: hang diagnosis", "err", res.Err)
			}
		}
		d.mu.Lock()
		d.results = append(d.results, res)
		d.mu.Unlock()
		d.j.mu.Lock()
		d.j.notifyLocked()
		d.j.mu.Unlock()
	}
}

// drain drops the reports that arrive within d of each other.
func (d *hangDiagnosis) drain(quiet time.Duration) {
	for {
		select {
		case <-d.reports:
		case <-time.After(quiet):
			return
		}
	}
}

func (d *hangDiagnosis) diagnose(ctx context.Context, res *hangResult) error {
	j := d.j
	d.mu.Lock()
	dir := d.outDir
	d.mu.Unlock()
	if dir == "" {
		dir = j.path(faultHang)
	}
	res.Dir = dir

	// The other ranks' watchdogs flag within a step or two of the first.
	window := time.NewTimer(2 * time.Second)
collect:
	for len(res.Reports) < j.world {
		select {
		case r := <-d.reports:
			res.Reports[r.Rank] = r
			if r.Time.Before(res.Flagged) {
				res.Flagged = r.Time
			}
		case <-window.C:
			break collect
		case <-ctx.Done():
			window.Stop()
			return ctx.Err()
		}
	}
	window.Stop()

	// Every rank's stacks: those that flagged a hang wrote them; the
	// others are asked to.
	stackDir := j.path("stacks", jobID)
	for r := range j.world {
		if _, ok := res.Reports[r]; !ok {
			res.Asked = append(res.Asked, r)
		}
	}
	if len(res.Asked) > 0 {
		bctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		j.m.Broadcast(bctx, taskd.RankList(res.Asked...), msgDump, []byte("a peer's collective hung"))
		cancel()
	}
	var dumps []*hang.Dump
	for r := range j.world {
		since := res.First.Add(-j.cfg.HangTimeout - 5*time.Second)
		if rep, ok := res.Reports[r]; ok {
			since = rep.Time.Add(-time.Second)
		}
		if d := waitStackFile(ctx, filepath.Join(stackDir, hang.FileName(r, j.world)), since, 5*time.Second); d != nil {
			dumps = append(dumps, d)
		}
	}
	if len(dumps) == 0 {
		return errors.New("no rank wrote its stacks")
	}

	// Native stacks, as a node agent takes them from its trainers, and
	// each Go dump narrowed to the training goroutine: the others (gRPC,
	// the dotting writer, ...) are alike on every rank.
	res.Native = nativeTool()
	if err := os.MkdirAll(filepath.Join(dir, "stacks"), 0o755); err != nil {
		return err
	}
	for _, dm := range dumps {
		if res.Native != "" && dm.Pid > 0 {
			cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			nd, err := hang.Capture(cctx, dm.Pid)
			cancel()
			if nd != nil {
				for _, t := range nd.Threads {
					if t.Kind != hang.KindGo {
						dm.Threads = append(dm.Threads, t)
					}
				}
				dm.Notes = append(dm.Notes, nd.Notes...)
			}
			if err != nil {
				dm.Notes = append(dm.Notes, "native capture: "+err.Error())
			}
		}
		dm.Threads = slices.DeleteFunc(dm.Threads, func(t hang.Thread) bool {
			return t.Kind == hang.KindGo && !slices.ContainsFunc(t.Frames, func(f hang.Frame) bool { return f.Func == trainingLoop })
		})
		dm.Notes = append(dm.Notes, "go: narrowed to the training goroutine ("+trainingLoop+")")
		if _, err := hang.WriteStackFile(filepath.Join(dir, "stacks"), dm); err != nil {
			return err
		}
	}

	merged, err := hang.Merge(dumps, hang.MergeConfig{World: j.world})
	if err != nil {
		return err
	}
	if res.Files, err = merged.WriteFiles(dir); err != nil {
		return err
	}
	res.Verdict = merged.Verdict()
	note := fmt.Sprintf("Merged stacks of %d ranks. Go stacks are each rank's training goroutine (frames through %s); native stacks are every thread (%s).\n\n",
		len(dumps), trainingLoop, orNone(res.Native))
	verdictPath := filepath.Join(dir, "verdict.txt")
	if err := os.WriteFile(verdictPath, []byte(note+res.Verdict), 0o644); err != nil {
		return err
	}
	res.Files = append(res.Files, verdictPath)

	// The culprit: the ranks stuck in a function of the training code
	// that no other rank is in.
	pkg := trainingLoop[:strings.Index(trainingLoop, ".(")+1] // "main."
	res.Culprit, res.Split = hang.Culprit(dumps, func(k hang.Kind, f hang.Frame) bool {
		return k == hang.KindGo && strings.HasPrefix(f.Func, pkg)
	})
	if len(res.Culprit) == 0 {
		return errors.New("the stacks single out no rank: " + res.Verdict)
	}
	for _, r := range res.Culprit {
		rep := res.Reports[r]
		msg := fmt.Sprintf("merged stacks: %s", res.Split)
		if rep.Fault != "" {
			msg = rep.Fault + "; " + msg
		}
		f, _, err := j.m.ReportFault(taskd.Fault{Kind: taskd.FaultHang, Position: taskd.Position{Node: j.nodeOf(r), Rank: r},
			Message: msg, Time: rep.Time, Attrs: map[string]string{"op": rep.Op, "group": rep.Group, "stacks": dir}})
		if err != nil {
			return err
		}
		if res.Fault.Seq == 0 {
			res.Fault = f
		}
	}
	return nil
}

func rankWord(ranks string, n int) string {
	if n == 1 {
		return "rank " + ranks
	}
	return "ranks " + ranks
}

func orNone(s string) string {
	if s == "" {
		return "none: neither eu-stack nor gdb is installed"
	}
	return s
}

// nativeTool names the tool hang.Capture takes native stacks with, ""
// when none is installed.
func nativeTool() string {
	for _, t := range []string{"eu-stack", "gdb"} {
		if _, err := exec.LookPath(t); err == nil {
			return t
		}
	}
	return ""
}

// waitStackFile waits up to timeout for path to hold stacks taken since
// since, and returns them; nil when it does not.
func waitStackFile(ctx context.Context, path string, since time.Time, timeout time.Duration) *hang.Dump {
	deadline := time.Now().Add(timeout)
	for {
		if d, err := hang.ReadStackFile(path); err == nil && !d.Time.Before(since) {
			return d
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// reportedRanks groups the ranks of reports by the op they flagged.
func (res *hangResult) byOp() []string {
	ops := map[string][]int{}
	var elapsed = map[string]time.Duration{}
	for r, rep := range res.Reports {
		k := fmt.Sprintf("%s (%s)", rep.Op, rep.Group)
		if strings.HasPrefix(rep.Group, "tp-") {
			k = rep.Op + " (tp)"
		}
		ops[k] = append(ops[k], r)
		elapsed[k] = max(elapsed[k], rep.Elapsed)
	}
	var out []string
	for k, rs := range ops {
		sort.Ints(rs)
		out = append(out, fmt.Sprintf("%s %s", rankWord(joinInts(rs), len(rs)), k))
	}
	sort.Strings(out)
	return out
}

func joinInts(xs []int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = fmt.Sprint(x)
	}
	return strings.Join(s, ",")
}
