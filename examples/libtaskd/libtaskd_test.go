package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/trace"
)

const testJob = "libtaskd-test"

// startManager runs a real manager for testJob on loopback.
func startManager(t *testing.T, cfg taskd.ManagerConfig) *taskd.Manager {
	t.Helper()
	cfg.Job = testJob
	cfg.Listen = "127.0.0.1:0"
	cfg.Security = taskd.Security{Insecure: true}
	m, err := taskd.NewManager(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("manager: %v", err)
		}
		m.Close()
	})
	return m
}

// workerEnv is the environment of a trainer whose worker attaches to m
// directly and writes under root.
func workerEnv(t *testing.T, m *taskd.Manager, root string, rank int, extra map[string]any) []string {
	t.Helper()
	opts := map[string]any{
		"upstream": m.Addr().String(), "insecure": true, "root": root, "node": 0,
		"local_rank": 0, "device": 5, "marker_library": "off", "flush_interval": "200ms",
	}
	for k, v := range extra {
		opts[k] = v
	}
	b, err := json.Marshal(opts)
	if err != nil {
		t.Fatal(err)
	}
	return []string{"MINDX_TASK_ID=" + testJob, "TRAINER_RANK=" + strconv.Itoa(rank), "TRAINER_CONFIG=" + string(b)}
}

func registered(m *taskd.Manager, rank int) bool {
	for _, mi := range m.Members() {
		if mi.Role == taskd.RoleWorker && mi.Position.Rank == rank {
			return true
		}
	}
	return false
}

// setSwitch sets sw and waits until the worker of rank acknowledged it.
func setSwitch(t *testing.T, m *taskd.Manager, rank int, sw trace.Switch) {
	t.Helper()
	v, err := m.SetSwitch(sw)
	if err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, fmt.Sprintf("rank %d to apply %v", rank, sw), func() bool {
		st := m.SwitchStatus()
		if st.Version != v {
			return false
		}
		for _, w := range st.Workers {
			if w.Position.Rank != rank {
				continue
			}
			for d, s := range w.Domains {
				switch s {
				case taskd.DomainWaiting:
					return false
				case taskd.DomainFailed:
					t.Fatalf("rank %d failed to apply the switch (domain %s): %s", rank, d, w.Error)
				}
			}
			return len(w.Domains) > 0
		}
		return false
	})
}

// readRank returns every record of a rank folder.
func readRank(t *testing.T, dir string) []trace.Record {
	t.Helper()
	r, err := trace.OpenRankReader(dir, trace.ReaderConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	var recs []trace.Record
	if err := r.Read(func(rec *trace.Record) error {
		recs = append(recs, *rec)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if st := r.Stats(); st.GarbageLines != 0 {
		t.Errorf("%d garbage lines, last: %v", st.GarbageLines, st.LastGarbage)
	}
	return recs
}

// phase is a switch in force from set (when SetSwitch was called) and
// applied by the worker by acked.
type phase struct {
	sw         trace.Switch
	set, acked time.Time
}

// TestSwitchThroughManager flips the profiling switch through the manager
// while a Python trainer records step, dataloader and forward ranges, and
// checks from the files that each kind was recorded exactly while on.
func TestSwitchThroughManager(t *testing.T) {
	lib := library(t)
	root := t.TempDir()
	m := startManager(t, taskd.ManagerConfig{})
	const rank = 3
	py := startPython(t, lib, "loop", workerEnv(t, m, root, rank, nil)...)
	pid, _ := strconv.Atoi(strings.Fields(py.expect("started", 30*time.Second))[1])
	testkit.WaitFor(t, "the worker to register", func() bool { return registered(m, rank) })

	steps := func(n int) { // event-driven: wait for n more steps of the trainer
		for range n {
			py.expect("step", 30*time.Second)
		}
	}
	on := func(kinds ...trace.Kind) trace.Switch {
		var sw trace.Switch
		for _, k := range kinds {
			sw = sw.With(k, true)
		}
		return sw
	}
	phases := []phase{
		{sw: on()},
		{sw: on(trace.Step)},
		{sw: on(trace.Step, trace.FP, trace.DataLoader)},
		{sw: on(trace.DataLoader)},
		{sw: on()},
		{sw: on(trace.FP)},
	}
	steps(5)
	for i := range phases {
		phases[i].set = time.Now()
		setSwitch(t, m, rank, phases[i].sw)
		phases[i].acked = time.Now()
		// Steps the trainer printed while the switch was on its way are
		// not this phase's: count 15 from here.
		py.drain()
		steps(15)
	}
	py.send("stop")
	py.expect("done", 30*time.Second)
	py.wait(30 * time.Second)

	recs := readRank(t, filepath.Join(root, testJob, strconv.Itoa(rank)))
	if len(recs) == 0 {
		t.Fatal("no records")
	}
	// Timestamps are the trainer's wall clock advanced by its monotonic
	// clock; allow for the two processes reading the clock apart.
	const skew = 50 * time.Millisecond
	allowed := func(k trace.Kind, ts time.Time) bool {
		for i := len(phases) - 1; i >= 0; i-- {
			p := phases[i]
			if ts.Before(p.set.Add(-skew)) {
				continue
			}
			if p.sw.Enabled(k) {
				return true
			}
			// The switch before may still have been in force.
			return i > 0 && phases[i-1].sw.Enabled(k) && !ts.After(p.acked.Add(skew))
		}
		return false // before the first switch everything is off
	}
	type key struct {
		phase int
		kind  trace.Kind
	}
	seen := map[key]int{}
	var pairer trace.Pairer
	lastStep := int64(-1)
	for _, r := range recs {
		if r.ProcessID != uint32(pid) || r.DeviceID != 5 {
			t.Errorf("record %+v: want process %d, device 5", r, pid)
		}
		if rg, ok := pairer.Add(&r); ok {
			k, ok := rg.Kind()
			if !ok || rg.Start > rg.End || rg.Domain != trace.DomainDefault {
				t.Errorf("range %+v", rg)
			}
			if k == trace.Step {
				n, _ := rg.Step()
				if int64(n) <= lastStep {
					t.Errorf("step %d after step %d", n, lastStep)
				}
				lastStep = int64(n)
			}
		}
		if !r.Flag.IsStart() {
			continue
		}
		k, ok := trace.KindOf(r.Name, r.Domain)
		if !ok {
			t.Errorf("start record of no kind: %+v", r)
			continue
		}
		want := map[trace.Kind]trace.Flag{trace.Step: trace.FlagDeviceStart, trace.FP: trace.FlagDeviceStart, trace.DataLoader: trace.FlagHostStart}[k]
		if r.Flag != want {
			t.Errorf("%s start with flag %d, want %d", k, r.Flag, want)
		}
		ts := time.Unix(0, int64(r.Timestamp))
		if !allowed(k, ts) {
			t.Errorf("%s recorded at %v while off (phases %+v)", k, ts.Format(time.StampMicro), phases)
		}
		for i := range phases {
			end := time.Now()
			if i+1 < len(phases) {
				end = phases[i+1].set
			}
			if ts.After(phases[i].acked) && ts.Before(end) {
				seen[key{i, k}]++
			}
		}
	}
	if st := pairer.Stats(); st.Open != 0 || st.UnmatchedEnds != 0 || st.Evicted != 0 {
		t.Errorf("pairing: %+v", st)
	}
	t.Logf("%d records; starts per phase and kind after the switch was applied: %v", len(recs), seen)
	for i, p := range phases {
		for _, k := range []trace.Kind{trace.Step, trace.FP, trace.DataLoader} {
			if n := seen[key{i, k}]; p.sw.Enabled(k) && n < 5 {
				t.Errorf("phase %d (%v): %d %s ranges, want at least 5", i, p.sw, n, k)
			}
		}
	}
}

// TestPythonErrors checks that bad calls return errors naming what is
// wrong and never crash the process.
func TestPythonErrors(t *testing.T) {
	lib := library(t)
	env := []string{"MINDX_TASK_ID=" + testJob,
		`TRAINER_CONFIG={"insecure":true,"root":"` + t.TempDir() + `","upstream":"127.0.0.1:1","marker_library":"off"}`}
	py := startPython(t, lib, "errors", env...)
	py.expect("ok", 60*time.Second)
	py.wait(30 * time.Second)
}

// TestAllInOne runs a manager, a proxy and a worker in one Python process
// through the library, the switch set through it too.
func TestAllInOne(t *testing.T) {
	lib := library(t)
	root := t.TempDir()
	env := []string{"MINDX_TASK_ID=" + testJob,
		`TRAINER_CONFIG={"insecure":true,"root":"` + root + `","marker_library":"off","node":0}`}
	py := startPython(t, lib, "all_in_one", env...)
	line := py.expect("switches", 60*time.Second)
	py.expect("ok", 30*time.Second)
	py.wait(30 * time.Second)
	var sw map[string]string
	if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "switches ")), &sw); err != nil || sw["Step"] != "on" || sw["FP"] != "off" {
		t.Errorf("profiling switch callback saw %q (%v)", line, err)
	}
	recs := readRank(t, filepath.Join(root, testJob, "0"))
	var pairer trace.Pairer
	steps := 0
	for _, r := range recs {
		rg, ok := pairer.Add(&r)
		if !ok {
			continue
		}
		if k, _ := rg.Kind(); k != trace.Step {
			t.Errorf("range of kind %v recorded: %+v", k, rg)
		}
		steps++
	}
	if steps != 5 {
		t.Errorf("%d step ranges, want 5", steps)
	}
}

// TestMarkersFromProfilingLibrary loads the npu package's fake libmspti as
// the worker's profiling library: the markers it emits reach the record
// files while their domain is on, and the communication domain stays off.
func TestMarkersFromProfilingLibrary(t *testing.T) {
	lib := library(t)
	cc, ok := cCompiler()
	if !ok {
		t.Skip("no C compiler (Debian package gcc) to build the fake profiling library")
	}
	fake := filepath.Join(t.TempDir(), "libmspti.so")
	src := filepath.Join("..", "..", "npu", "testdata", "fake_mspti.c")
	if out, err := exec.Command(cc, "-shared", "-fPIC", "-O1", "-o", fake, src, "-lpthread").CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", cc, src, err, out)
	}
	root := t.TempDir()
	m := startManager(t, taskd.ManagerConfig{})
	env := append(workerEnv(t, m, root, 0, map[string]any{"marker_library": fake}), "FAKE_MSPTI="+fake)
	py := startPython(t, lib, "mspti", env...)
	py.expect("started", 30*time.Second)
	testkit.WaitFor(t, "the worker to register", func() bool { return registered(m, 0) })
	setSwitch(t, m, 0, trace.Switch{Step: true})
	py.send("emit 4 900 mspti-step")
	py.expect("emitted", 30*time.Second)
	py.send("emit 3 950 commop communication")
	if got := py.expect("emitted", 30*time.Second); got != "emitted 8 filtered 6" {
		t.Errorf("fake library: %q, want 8 emitted and the communication domain's 6 filtered", got)
	}
	py.send("stop")
	py.expect("done", 30*time.Second)
	py.wait(30 * time.Second)

	var starts, ends int
	for _, r := range readRank(t, filepath.Join(root, testJob, "0")) {
		switch {
		case r.Domain == trace.DomainCommunication:
			t.Errorf("communication record while its domain is off: %+v", r)
		case r.Flag == trace.FlagHostStart && r.Name == "mspti-step" && r.ID >= 900 && r.ID < 904:
			starts++
		case r.Flag == trace.FlagHostEnd && r.ID >= 900 && r.ID < 904:
			ends++
		default:
			t.Errorf("unexpected record %+v", r)
		}
	}
	if starts != 4 || ends != 4 {
		t.Errorf("%d starts and %d ends from the profiling library, want 4 and 4", starts, ends)
	}
}

// Orchestration messages as the manager's recovery and link failover send
// them (kinds and payload of taskd's wire protocol).
const (
	kindPause      = "taskd/pause"
	kindNotice     = "taskd/notice"
	kindRetry      = "taskd/retry"
	kindResume     = "taskd/resume"
	kindSwitchLink = "taskd/switch-link"
	kindStress     = "taskd/stress-test"
	kindStop       = "taskd/stop"
)

type orchestration struct {
	TimeoutMS int64                `json:"timeout_ms,omitempty"`
	Resume    *taskd.ResumeRequest `json:"resume,omitempty"`
	Notice    *taskd.FaultNotice   `json:"notice,omitempty"`
	Link      *taskd.LinkRequest   `json:"link,omitempty"`
	Stress    *taskd.StressRequest `json:"stress,omitempty"`
	Reason    string               `json:"reason,omitempty"`
}

// TestRecoveryCallbacks drives a Python trainer's StepGate and callbacks
// from the manager: it starts paused and is resumed on registration,
// pauses for real (no step is recorded while paused), refuses what it
// cannot do, resumes from a checkpoint step, switches a link through the
// manager's link failover, and is stopped by the recovery that a failed
// switchback hands over to.
func TestRecoveryCallbacks(t *testing.T) {
	lib := library(t)
	root := t.TempDir()
	m := startManager(t, taskd.ManagerConfig{Orchestration: &taskd.OrchestrationConfig{}})
	const rank = 2
	py := startPython(t, lib, "recovery", workerEnv(t, m, root, rank, nil)...)
	// The worker resumes the trainer once registered, on its own thread:
	// its line may come before or after the main thread's "started".
	if got := py.expectAll(30*time.Second, "started", "resumed")["resumed"]; got != "resumed -1 - []" {
		t.Errorf("start: %q, want the worker's resume with step -1", got)
	}
	testkit.WaitFor(t, "the worker to register", func() bool { return registered(m, rank) })
	setSwitch(t, m, rank, trace.Switch{Step: true})
	for range 10 {
		py.expect("step", 30*time.Second)
	}

	send := func(kind string, o orchestration) error {
		t.Helper()
		b, err := json.Marshal(o)
		if err != nil {
			t.Fatal(err)
		}
		ds, err := m.Broadcast(context.Background(), taskd.RankList(rank), kind, b)
		if err != nil || len(ds) != 1 {
			t.Fatalf("%s: %+v, %v", kind, ds, err)
		}
		return ds[0].Err
	}
	refused := func(kind string, err error, want string) {
		t.Helper()
		var de *taskd.DeliveryError
		if !errors.As(err, &de) || !strings.Contains(de.Msg, want) {
			t.Errorf("%s: %v, want a refusal with %q", kind, err, want)
		}
	}
	if err := send(kindPause, orchestration{TimeoutMS: 20000}); err != nil {
		t.Fatalf("pause: %v", err)
	}
	pausedAt := time.Now()
	notice := &taskd.FaultNotice{Faults: []taskd.Fault{{Kind: taskd.FaultOpError, Position: taskd.Position{Node: 0, Rank: 1}}}}
	if err := send(kindNotice, orchestration{Notice: notice}); err != nil {
		t.Errorf("fault notice: %v", err)
	}
	link := taskd.LinkRequest{Node: 0, Devices: []int{0, 1}, Target: taskd.LinkStandby}
	if err := send(kindSwitchLink, orchestration{Link: &link}); err != nil {
		t.Errorf("switch link: %v", err)
	}
	if got := py.expect("switch_link", 30*time.Second); got != "switch_link 0 [0, 1] standby" {
		t.Errorf("switch link callback: %q", got)
	}
	link.Target = taskd.LinkPrimary
	refused("switch back", send(kindSwitchLink, orchestration{Link: &link}), "RuntimeError: primary link still down")
	refused("stress test", send(kindStress, orchestration{Stress: &taskd.StressRequest{Ranks: []int{rank}, Test: "hbm"}}), "Unsupported: no stress test hbm")
	refused("retry", send(kindRetry, orchestration{}), "no retry_step callback")
	// Stay paused long enough that a loop that kept stepping would have
	// recorded dozens of steps.
	time.Sleep(500 * time.Millisecond)
	resumedAt := time.Now()
	resume := &taskd.ResumeRequest{Step: 7, Strategy: taskd.StrategyRecoverInPlace, Restarted: []int{1}}
	if err := send(kindResume, orchestration{Resume: resume}); err != nil {
		t.Fatalf("resume: %v", err)
	}
	if got := py.expect("resumed", 30*time.Second); got != "resumed 7 recover-in-place [1]" {
		t.Errorf("resume callback: %q", got)
	}
	for range 10 {
		py.expect("step", 30*time.Second)
	}
	// The manager's link failover, through its Go API: a switch to the
	// standby link pauses the job, runs the callback and continues.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	link.Target = taskd.LinkStandby
	o, err := m.SwitchLink(ctx, link)
	if err != nil || o.State != taskd.StateSwitched {
		t.Fatalf("link switch: %v, %s (%s)", err, o.State, o.Outcome)
	}
	if got := py.expect("switch_link", 30*time.Second); got != "switch_link 0 [0, 1] standby" {
		t.Errorf("switch link callback: %q", got)
	}
	py.expect("step", 30*time.Second)
	// Switching back fails on the trainer's side: the switchback hands over
	// to a recovery which, with no executor and no checkpoints to offer
	// another strategy, ends the job by stopping every rank.
	link.Target = taskd.LinkPrimary
	o, err = m.SwitchLink(ctx, link)
	if !errors.Is(err, taskd.ErrOrchestrationFailed) || o.HandedOverTo == 0 {
		t.Fatalf("failing switchback: %v, %+v", err, o)
	}
	py.expect("stopped", 30*time.Second)
	py.expect("done", 30*time.Second)
	py.wait(30 * time.Second)
	var rec taskd.Orchestration
	testkit.WaitFor(t, "the recovery to end", func() bool {
		for _, h := range m.Orchestrations(0).History {
			if h.ID == o.HandedOverTo {
				rec = h
				return true
			}
		}
		return false
	})
	t.Logf("recovery %d: %v, %s; stopped after %v", rec.ID, rec.States(), rec.Outcome, rec.Stopped)
	if d := rec.End.Sub(rec.Start); d > 10*time.Second {
		t.Errorf("the recovery took %v: the stop's acknowledgement was lost when the trainer exited", d)
	}
	if rec.State != taskd.StateExited || rec.Strategy != taskd.StrategyExit {
		t.Errorf("recovery ended %s by %q (%s), states %v", rec.State, rec.Strategy, rec.Outcome, rec.States())
	}

	const skew = 50 * time.Millisecond
	var before, during, after int
	for _, r := range readRank(t, filepath.Join(root, testJob, strconv.Itoa(rank))) {
		if !r.Flag.IsStart() {
			continue
		}
		switch ts := time.Unix(0, int64(r.Timestamp)); {
		case ts.Before(pausedAt):
			before++
		case ts.After(resumedAt):
			after++
		case ts.After(pausedAt.Add(skew)) && ts.Before(resumedAt.Add(-skew)):
			during++
		}
	}
	if before < 5 || after < 5 || during != 0 {
		t.Errorf("step starts: %d before the pause, %d while paused, %d after the resume", before, during, after)
	}
}

// TestCHeader compiles a C caller against the generated libtaskd.h and
// runs it: the header is valid C, and codes, handles and errors behave as
// documented.
func TestCHeader(t *testing.T) {
	lib := library(t)
	header := strings.TrimSuffix(lib, ".so") + ".h"
	if _, err := os.Stat(header); err != nil {
		t.Skipf("no header beside %s: %v", lib, err)
	}
	cc, ok := cCompiler()
	if !ok {
		t.Skip("no C compiler (Debian package gcc) to build the C ABI test program")
	}
	bin := filepath.Join(t.TempDir(), "abi")
	out, err := exec.Command(cc, "-std=c11", "-Wall", "-Werror", "-o", bin, filepath.Join("testdata", "abi.c"),
		"-I", filepath.Dir(header), lib, "-Wl,-rpath,"+filepath.Dir(lib)).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", cc, err, out)
	}
	root := t.TempDir()
	if out, err := exec.Command(bin, root).CombinedOutput(); err != nil || string(out) != "ok\n" {
		t.Fatalf("abi: %v\n%s", err, out)
	}
	var n int
	for _, r := range readRank(t, filepath.Join(root, "c-abi", "0")) {
		if r.Name == trace.MarkerForward || r.Flag.IsEnd() {
			n++
		}
	}
	if n != 3 { // the range's start and end, and the mark
		t.Errorf("%d records, want 3", n)
	}
}
