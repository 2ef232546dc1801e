package taskd

import (
	"bytes"
	"context"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/google/go-cmp/cmp"
)

// takeOver writes w's machine down and has a new machine take it over, as
// a manager that restarts does: the members register again (those of
// ranks in back, each as a process that was not evicted), and the new
// machine carries on. It returns the state file's bytes.
func (w *coreWorld) takeOver(back ...int) []byte {
	w.t.Helper()
	live := make(map[int]string, len(back))
	for _, r := range back {
		live[r] = "unevicted"
	}
	return w.takeOverLive(live)
}

// takeOverLive is takeOver with the members live after it, by rank, as
// those instances.
func (w *coreWorld) takeOverLive(live map[int]string) []byte {
	w.t.Helper()
	w.m.dirty, w.m.histNew = true, true
	state, hist, err := w.m.save()
	if err != nil {
		w.t.Fatal(err)
	}
	file, err := marshalStateFile("job", 7, state)
	if err != nil {
		w.t.Fatal(err)
	}
	token, raw, err := parseStateFile("orchestration.json", "job", file)
	if err != nil || token != 7 {
		w.t.Fatalf("parse: token %d, %v", token, err)
	}
	st, err := parseCoreState("orchestration.json", raw)
	if err != nil {
		w.t.Fatal(err)
	}
	h, err := parseHistory("orchestration-history.json", hist)
	if err != nil {
		w.t.Fatal(err)
	}
	m := newMachine(w.m.cfg)
	m.restore(st, h)
	w.m = m
	if r := m.run; r != nil {
		for _, rank := range coreRanks0() {
			if !m.holding(rank) {
				w.t.Fatalf("taken over in %s, rank %d is not held", r.o.State, rank)
			}
		}
	}
	w.step()
	for _, r := range slices.Sorted(maps.Keys(live)) {
		m.registered(w.now, r)
	}
	m.settled(w.now, "taken over", live)
	w.drain()
	return file
}

func coreRanks0() []int {
	out := make([]int, coreRanks)
	for i := range out {
		out[i] = i
	}
	return out
}

// evictedInPlace is a core restarting ranks in place whose repair has
// evicted instances (rank -> instance), the executor not yet called: a
// fault of kind[i] on each rank evicted, in rank order.
func evictedInPlace(t *testing.T, evicted map[int]string, kind ...FaultKind) *coreWorld {
	t.Helper()
	w := newCoreWorld(t, testCoreConfig())
	for i, rank := range slices.Sorted(maps.Keys(evicted)) {
		w.fault(rank, kind[i])
	}
	w.deliver(orchReply{})
	w.deliver(all())
	w.m.decided(w.now, w.last().id, levelInPlace, "x")
	w.drain()
	w.m.evicted(w.last().id, evicted)
	w.drain()
	return w
}

// TestCoreTakeOver: a manager that takes a recovery over in each state
// asks again for what that state needs, with the keys that make a
// worker carry a retry or resume out once, and finishes it.
func TestCoreTakeOver(t *testing.T) {
	t.Run("resuming: the same resume again, then recovered", func(t *testing.T) {
		w := newCoreWorld(t, testCoreConfig())
		w.fault(3, FaultProcessExit)
		w.deliver(orchReply{})
		w.deliver(all())
		w.m.decided(w.now, w.last().id, levelInPlace, "x")
		w.drain()
		w.m.repaired(w.now, w.last().id, []int{3}, nil)
		w.m.registered(w.now, 3)
		w.drain()
		w.m.loaded(w.now, w.last().id, 20, nil)
		w.drain()
		first := w.last()
		if first.msg != kindResume || first.payload.Once == "" {
			t.Fatalf("resume: %+v", first)
		}
		w.takeOver(0, 1, 2, 3)
		again := w.last()
		if again.msg != kindResume || again.payload.Once != first.payload.Once || again.payload.Resume.Step != 20 || again.id == first.id {
			t.Fatalf("taken over: %+v, first %+v", again, first)
		}
		// A rank that registers late gets the resume again.
		w.m.registered(w.now, 2)
		w.drain()
		if late := w.last(); late.msg != kindResume || late.id == again.id || late.payload.Once != first.payload.Once {
			t.Fatalf("late registration: %+v", late)
		}
		w.deliver(orchReply{})
		w.wantStates(StateStopping, StateNotifying, StateDeciding, StateRestarting, StateLoading, StateResuming, StateResuming, StateRecovered)
		if o := w.m.history[0]; o.Restored != 1 || o.ResumedStep != 20 {
			t.Fatalf("record: %+v", o)
		}
	})

	t.Run("restarting after the executor returned: no second repair", func(t *testing.T) {
		w := newCoreWorld(t, testCoreConfig())
		w.fault(3, FaultProcessExit)
		w.deliver(orchReply{})
		w.deliver(all())
		w.m.decided(w.now, w.last().id, levelInPlace, "x")
		w.drain()
		w.m.repaired(w.now, w.last().id, []int{3}, nil)
		w.drain()
		n := len(w.actions)
		w.takeOver(0, 1, 2, 3) // rank 3's new process registers with the new manager
		if a := w.actions[n:]; len(a) != 1 || a[0].kind != actLoad {
			t.Fatalf("after the takeover: %+v", a)
		}
	})

	t.Run("restarting with the executor's call cut short: the repair again", func(t *testing.T) {
		w := newCoreWorld(t, testCoreConfig())
		w.fault(3, FaultProcessExit)
		w.deliver(orchReply{})
		w.deliver(all())
		w.m.decided(w.now, w.last().id, levelInPlace, "x")
		w.drain()
		w.takeOver(0, 1, 2, 3) // rank 3 registering before the repair does not count
		a := w.last()
		if a.kind != actRepair || len(a.faults) != 1 || a.faults[0].Position.Rank != 3 {
			t.Fatalf("after the takeover: %+v", a)
		}
		w.m.repaired(w.now, a.id, []int{3}, nil)
		w.drain()
		if w.m.run.o.State != StateRestarting {
			t.Fatalf("moved on before rank 3 registered: %s", w.m.run.o.State)
		}
	})

	t.Run("restarting with the executor's call cut short after it restarted the rank: no second repair", func(t *testing.T) {
		w := evictedInPlace(t, map[int]string{3: "before"}, FaultProcessExit)
		n := len(w.actions)
		// Rank 3's new process registers with the new manager.
		w.takeOverLive(map[int]string{0: "a", 1: "b", 2: "c", 3: "after"})
		if a := w.actions[n:]; len(a) != 1 || a[0].kind != actLoad {
			t.Fatalf("after the takeover: %+v", a)
		}
		if r := w.m.run.restarted; !slices.Equal(r, []int{3}) {
			t.Fatalf("restarted %v, want [3]", r)
		}
	})

	t.Run("restarting with the executor's call cut short before it restarted the rank: the repair again", func(t *testing.T) {
		w := evictedInPlace(t, map[int]string{3: "before"}, FaultProcessExit)
		// Rank 3's old process, which the executor did not reach,
		// registers with the new manager.
		w.takeOverLive(map[int]string{0: "a", 1: "b", 2: "c", 3: "before"})
		if a := w.last(); a.kind != actRepair || len(a.faults) != 1 || a.faults[0].Position.Rank != 3 {
			t.Fatalf("after the takeover: %+v", a)
		}
	})

	t.Run("restarting with the executor's call cut short, the rank not back yet: waited for, not restarted again", func(t *testing.T) {
		w := evictedInPlace(t, map[int]string{3: "before"}, FaultProcessExit)
		n := len(w.actions)
		// The dead manager's call killed rank 3's old process; the new
		// one registers only after the takeover settled.
		w.takeOverLive(map[int]string{0: "a", 1: "b", 2: "c"})
		if a := w.actions[n:]; len(a) != 0 {
			t.Fatalf("after the takeover: %+v, want the rank waited for", a)
		}
		w.m.registered(w.now, 3)
		w.drain()
		if a := w.actions[n:]; len(a) != 1 || a[0].kind != actLoad {
			t.Fatalf("once rank 3 registered: %+v", a)
		}
	})

	t.Run("restarting with the executor's call cut short, the rank never back: lost at the repair's deadline", func(t *testing.T) {
		w := evictedInPlace(t, map[int]string{3: "before"}, FaultProcessExit)
		w.takeOverLive(map[int]string{0: "a", 1: "b", 2: "c"})
		w.now = w.m.deadline().Add(time.Millisecond)
		w.m.tick(w.now)
		w.drain()
		if fs := w.m.run.faults[3]; len(fs) == 0 || fs[len(fs)-1].Kind != FaultLost {
			t.Fatalf("after the deadline: state %s, faults %+v", w.m.run.o.State, w.m.run.faults)
		}
	})

	// A call cut short part way: the ranks it evidently did not reach are
	// restarted again, alone; those it restarted, back or on their way,
	// are waited for.
	for _, tc := range []struct {
		name string
		live map[int]string
	}{
		{"one rank untouched, the other back", map[int]string{0: "a", 1: "b", 2: "h2", 3: "new3"}},
		{"one rank untouched, the other on its way back", map[int]string{0: "a", 1: "b", 2: "h2"}},
	} {
		t.Run("restarting with the executor's call cut short part way: "+tc.name, func(t *testing.T) {
			w := evictedInPlace(t, map[int]string{2: "h2", 3: ""}, FaultHang, FaultProcessExit)
			w.takeOverLive(tc.live)
			a := w.last()
			if a.kind != actRepair || len(a.faults) != 1 || a.faults[0].Position.Rank != 2 {
				t.Fatalf("after the takeover: %+v, want rank 2 alone restarted again", a)
			}
			w.m.evicted(a.id, map[int]string{2: "h2"})
			w.m.registered(w.now, 3) // the dead call's rank 3, now or again: it counts
			w.m.repaired(w.now, a.id, []int{2}, nil)
			w.drain()
			if w.m.run.o.State != StateRestarting {
				t.Fatalf("moved on to %s before rank 2's successor registered", w.m.run.o.State)
			}
			w.m.registered(w.now, 2)
			w.drain()
			if w.m.run.o.State != StateLoading || !slices.Equal(w.m.run.awaited, []int{2, 3}) {
				t.Fatalf("once rank 2 registered: %s, awaited %v\n%s", w.m.run.o.State, w.m.run.awaited, w.reasons())
			}
		})
	}

	t.Run("a fault while the members register again", func(t *testing.T) {
		w := newCoreWorld(t, testCoreConfig())
		w.fault(3, FaultProcessExit)
		w.deliver(orchReply{})
		w.deliver(all())
		w.m.decided(w.now, w.last().id, levelInPlace, "x")
		w.drain()
		w.m.repaired(w.now, w.last().id, []int{3}, nil)
		w.m.registered(w.now, 3)
		w.drain()
		w.m.loaded(w.now, w.last().id, 20, nil)
		w.drain()
		w.m.dirty = true
		state, _, _ := w.m.save()
		st, err := parseCoreState("f", state)
		if err != nil {
			t.Fatal(err)
		}
		m := newMachine(w.m.cfg)
		m.restore(st, nil)
		w.m = m
		w.step()
		m.fault(w.now, Fault{ID: "late", Kind: FaultHang, Position: Position{Node: 0, Rank: 1}, Time: w.now, Received: w.now})
		w.drain()
		if len(w.actions) != 0 && w.last().id > st.NextAction {
			t.Fatalf("acted while settling: %+v", w.last())
		}
		m.settled(w.now, "taken over", nil)
		w.drain()
		if r := m.run; r.o.State != StateStopping || r.o.Round != 2 {
			t.Fatalf("after the takeover: %s round %d", r.o.State, r.o.Round)
		}
	})

	t.Run("a link switch in switching", func(t *testing.T) {
		w := newCoreWorld(t, testCoreConfig())
		if _, err := w.m.request(w.now, KindLinkSwitch, &LinkRequest{Node: 1, Devices: []int{0}, Target: LinkStandby}, nil); err != nil {
			t.Fatal(err)
		}
		w.drain()
		w.deliver(orchReply{})
		w.takeOver(0, 1, 2, 3)
		if a := w.last(); a.msg != kindSwitch {
			t.Fatalf("after the takeover: %+v", a)
		}
		w.deliver(orchReply{})
		w.deliver(orchReply{})
		w.wantStates(StatePausing, StateSwitching, StateSwitching, StateContinuing, StateSwitched)
		if st := w.m.status(0); len(st.Links) != 1 {
			t.Fatalf("links: %+v", st.Links)
		}
		w.takeOver()
		if st := w.m.status(0); len(st.Links) != 1 || len(st.History) != 1 || st.Current != nil {
			t.Fatalf("after a takeover while idle: %+v", st)
		}
	})
}

// TestStateFileRoundTrip: what a machine writes down reads back into a
// machine that writes the same.
func TestStateFileRoundTrip(t *testing.T) {
	w := newCoreWorld(t, testCoreConfig())
	w.fault(1, FaultOpError)
	w.fault(3, FaultHang)
	w.deliver(orchReply{})
	w.deliver(orchReply{Strategies: []Strategy{StrategyRecover}})
	w.m.seen.add(1)
	w.m.seen.add(3)
	w.m.restartedAt[2] = w.now
	w.m.dirty = true
	first, _, err := w.m.save()
	if err != nil {
		t.Fatal(err)
	}
	st, err := parseCoreState("f", first)
	if err != nil {
		t.Fatal(err)
	}
	m := newMachine(w.m.cfg)
	m.restore(st, nil)
	m.run.restored, m.run.settling = false, false
	m.dirty = true
	again, _, err := m.save()
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(string(first), string(again)); diff != "" {
		t.Fatalf("state changed on the way (-first +again):\n%s", diff)
	}
}

// TestStateFileRefused: a state file of another job, of another version,
// damaged, or naming a state its kind has not is refused with the file
// and the member named; a manager whose term is older than the file's
// does not overwrite it.
func TestStateFileRefused(t *testing.T) {
	good, err := marshalStateFile("llm", 3, []byte(`{"epoch":"0123456789abcdef","next_run":0,"next_action":0,"seen":{"below":0}}`))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, data, want string
	}{
		{"another job", strings.Replace(string(good), `"llm"`, `"other"`, 1), `job "other" is another job's`},
		{"another version", strings.Replace(string(good), `"version":1`, `"version":2`, 1), "version 2 is unknown"},
		{"no version", strings.Replace(string(good), `"version":1,`, ``, 1), "version is missing"},
		{"flipped byte", strings.Replace(string(good), `0123`, `0124`, 1), "crc32c"},
		{"not JSON", "{", "is not a JSON object"},
		{"unknown member", strings.Replace(string(good), `"token"`, `"extra":1,"token"`, 1), "unknown field"},
	} {
		_, _, err := parseStateFile("/state/orchestration.json", "llm", []byte(tc.data))
		if !errors.Is(err, ErrStateFile) || !strings.Contains(err.Error(), "/state/orchestration.json") || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
	for _, tc := range []struct{ name, state, want string }{
		{"terminal state", `{"epoch":"0123456789abcdef","next_run":1,"next_action":1,"seen":{"below":0},"run":{"orchestration":{"ID":1,"Kind":"recovery","State":"recovered","Round":1},"supported":null,"resume_step":-1,"origin":"2026-01-01T00:00:00Z","repair_start":"0001-01-01T00:00:00Z"}}`, "run.orchestration.State"},
		{"switch without link", `{"epoch":"0123456789abcdef","next_run":1,"next_action":1,"seen":{"below":0},"run":{"orchestration":{"ID":1,"Kind":"link-switch","State":"switching","Round":1},"supported":null,"resume_step":-1,"origin":"2026-01-01T00:00:00Z","repair_start":"0001-01-01T00:00:00Z"}}`, "run.orchestration.Link"},
		{"bad epoch", `{"epoch":"x","next_run":0,"next_action":0,"seen":{"below":0}}`, "state.epoch"},
	} {
		_, err := parseCoreState("/state/orchestration.json", []byte(tc.state))
		if !errors.Is(err, ErrStateFile) || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "/state/orchestration.json") {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}

	path := filepath.Join(t.TempDir(), orchStateFile)
	if err := writeStateFile(path, "llm", 5, []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	err = writeStateFile(path, "llm", 4, []byte(`{"x":1}`))
	if !errors.Is(err, ErrStateFile) || !strings.Contains(err.Error(), "deposed") {
		t.Fatalf("an older term's write: %v", err)
	}
	if _, state, err := readStateFile(path, "llm"); err != nil || string(state) != "{}" {
		t.Fatalf("after a refused write: %q %v", state, err)
	}
	if err := os.WriteFile(path, []byte("garbage"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := writeStateFile(path, "llm", 6, []byte(`{}`)); !errors.Is(err, ErrStateFile) {
		t.Fatalf("writing over an unreadable file: %v", err)
	}
	if b, _ := os.ReadFile(path); string(b) != "garbage" {
		t.Fatalf("an unreadable file was overwritten: %q", b)
	}
}

func TestFaultMark(t *testing.T) {
	var k faultMark
	for _, seq := range []uint64{1, 3, 2, 6, 5} {
		if !k.add(seq) {
			t.Fatalf("add %d: already there", seq)
		}
	}
	if k.add(3) || k.Below != 3 || !slices.Equal(k.Above, []uint64{5, 6}) || k.has(4) || !k.has(5) {
		t.Fatalf("mark %+v", k)
	}
	k.add(4)
	if k.Below != 6 || len(k.Above) != 0 {
		t.Fatalf("mark %+v", k)
	}
	for seq := uint64(8); seq < 8+maxMarkGaps+1; seq++ {
		k.add(seq)
	}
	if k.Below != 8+maxMarkGaps || len(k.Above) != 0 {
		t.Fatalf("after too many gaps: below %d, %d above", k.Below, len(k.Above))
	}
}

// FuzzStateFile reads random state files: a file is refused or taken
// over, and a machine that takes one over does not panic and ends what
// it holds.
func FuzzStateFile(f *testing.F) {
	w := newCoreWorld(f, testCoreConfig())
	w.fault(3, FaultProcessExit)
	w.deliver(orchReply{})
	w.m.dirty = true
	state, _, _ := w.m.save()
	good, _ := marshalStateFile("job", 1, state)
	f.Add(good)
	f.Add([]byte(`{"version":1,"job":"job","token":0,"state":{"epoch":"0123456789abcdef","next_run":0,"next_action":0,"seen":{"below":0}},"crc32c":"00000000"}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		_, raw, err := parseStateFile("f", "job", data)
		if err != nil {
			return
		}
		st, err := parseCoreState("f", raw)
		if err != nil {
			return
		}
		w := newCoreWorld(t, testCoreConfig())
		w.m.restore(st, nil)
		w.m.registered(w.now, 0)
		w.m.fault(w.now, Fault{ID: "x", Kind: FaultHang, Position: Position{Node: 0, Rank: 1}, Time: w.now})
		w.m.settled(w.now, "taken over", map[int]string{0: "a", 2: "b"})
		w.drain()
		for n := 0; w.m.run != nil && n < 100; n++ {
			w.now = w.m.deadline().Add(time.Millisecond)
			w.m.tick(w.now)
			w.drain()
		}
		if w.m.run != nil {
			t.Fatalf("still in %s", w.m.run.o.State)
		}
	})
}

// TestManagerRefusesState: a manager whose StateDir holds the
// orchestration state of another job, of another version, or of a newer
// lease term does not start, names the file, and changes nothing there.
func TestManagerRefusesState(t *testing.T) {
	state := []byte(`{"epoch":"0123456789abcdef","next_run":0,"next_action":0,"seen":{"below":0}}`)
	for _, tc := range []struct {
		name, job string
		token     uint64
		edit      func([]byte) []byte
		want      string
	}{
		{"another job", "other", 0, nil, "another job's"},
		{"another version", "job-1", 0, func(b []byte) []byte { return bytes.Replace(b, []byte(`"version":1`), []byte(`"version":9`), 1) }, "version 9 is unknown"},
		{"a newer term", "job-1", 8, nil, "newer than this manager's term (0)"},
	} {
		dir := t.TempDir()
		file, err := marshalStateFile(tc.job, tc.token, state)
		if err != nil {
			t.Fatal(err)
		}
		if tc.edit != nil {
			file = tc.edit(file)
		}
		path := filepath.Join(dir, orchStateFile)
		if err := os.WriteFile(path, file, 0o644); err != nil {
			t.Fatal(err)
		}
		for _, oc := range []*OrchestrationConfig{{}, nil} {
			_, err = NewManager(ManagerConfig{Job: "job-1", Listen: "127.0.0.1:0", Security: insecureSec(), StateDir: dir, Orchestration: oc})
			if !errors.Is(err, ErrStateFile) || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s (orchestration %v): %v, want %q", tc.name, oc != nil, err, tc.want)
			}
		}
		entries, _ := os.ReadDir(dir)
		if b, _ := os.ReadFile(path); len(entries) != 1 || !bytes.Equal(b, file) {
			t.Errorf("%s: the state dir changed: %v, %q", tc.name, entries, b)
		}
	}
}

// logOneFault runs a manager of job-1 without orchestration on dir until
// it has logged the fault "exit-3" of rank 3, and closes it.
func logOneFault(t *testing.T, dir string) {
	t.Helper()
	m, err := NewManager(ManagerConfig{Job: "job-1", Listen: "127.0.0.1:0", Security: insecureSec(), StateDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- m.Run(context.Background()) }()
	if _, _, err := m.ReportFault(Fault{ID: "exit-3", Kind: FaultProcessExit, Position: Position{Node: 1, Rank: 3}}); err != nil {
		t.Fatal(err)
	}
	m.Close()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestStateDirOfAnotherJob: a StateDir that a manager without
// orchestration kept (a fault log, no orchestration state) is refused to
// a manager of another job, with the file named and the log untouched.
func TestStateDirOfAnotherJob(t *testing.T) {
	dir := t.TempDir()
	logOneFault(t, dir)
	log, err := os.ReadFile(filepath.Join(dir, "faults.jsonl"))
	if err != nil || len(log) == 0 {
		t.Fatalf("fault log: %q, %v", log, err)
	}
	_, err = NewManager(ManagerConfig{Job: "job-2", Listen: "127.0.0.1:0", Security: insecureSec(), StateDir: dir})
	if !errors.Is(err, ErrStateFile) || !strings.Contains(err.Error(), filepath.Join(dir, jobMarkFile)) || !strings.Contains(err.Error(), "another job's") {
		t.Fatalf("a manager of another job: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "faults.jsonl")); !bytes.Equal(b, log) {
		t.Errorf("the fault log changed: %q, was %q", b, log)
	}
	// The job's own manager starts on it again.
	m, err := NewManager(ManagerConfig{Job: "job-1", Listen: "127.0.0.1:0", Security: insecureSec(), StateDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	m.Close()
}

// TestManagerTakesUnseenFaults: a fault the manager logged and acknowledged
// but died before its orchestration took in is taken in by the manager
// that comes back: the recovery it starts waits for the members, then
// pauses them.
func TestManagerTakesUnseenFaults(t *testing.T) {
	dir := t.TempDir()
	// The manager before: it logged the fault, and its orchestration state
	// says it took none in.
	logOneFault(t, dir)
	if err := writeStateFile(filepath.Join(dir, orchStateFile), "job-1", 0, []byte(`{"epoch":"0123456789abcdef","next_run":0,"next_action":0,"seen":{"below":0}}`)); err != nil {
		t.Fatal(err)
	}

	c := newCluster(t, insecureSec(), ManagerConfig{StateDir: dir, Nodes: 2, ProcsPerNode: 2, Orchestration: &OrchestrationConfig{Timeouts: Timeouts{Pause: 5 * time.Second}}})
	st := c.m.Orchestrations(0)
	if st.Current == nil || st.Current.State != StateStopping || len(st.Current.Faults) != 1 || st.Current.Faults[0].ID != "exit-3" {
		t.Fatalf("after the restart: %+v", st.Current)
	}
	for r := range 3 {
		c.addWorker(r/2, r)
	}
	// Their workers have no trainer: the pause reaches all three, and
	// fails; so does the recovery.
	testkit.WaitFor(t, "the recovery ended", func() bool { return len(c.m.Orchestrations(0).History) == 1 })
	o := c.m.Orchestrations(0).History[0]
	if o.Restored != 1 || len(o.Transitions) < 3 || o.Transitions[1].To != StateStopping || !strings.HasSuffix(o.Transitions[2].Reason, "of 3 ranks paused") {
		t.Fatalf("the recovery did not wait for the ranks: %+v", o.Transitions)
	}
}

// TestStateFileWritersRace: a deposed manager that keeps writing its state
// while the leader writes never replaces the leader's: its check of the
// token there and its rename are one step against the leader's write.
func TestStateFileWritersRace(t *testing.T) {
	path := filepath.Join(t.TempDir(), orchStateFile)
	leaderDone := make(chan struct{})
	var deposedErr error
	var g sync.WaitGroup
	g.Go(func() {
		// It tries again after each refusal: a stronger adversary than a
		// manager, which stops at the first.
		for {
			if err := writeStateFile(path, "llm", 4, []byte(`{"term":4}`)); err != nil {
				deposedErr = err
			}
			select {
			case <-leaderDone:
				return
			default:
			}
		}
	})
	for range 50 {
		if err := writeStateFile(path, "llm", 5, []byte(`{"term":5}`)); err != nil {
			t.Fatal(err)
		}
		if tok, _, err := readStateFile(path, "llm"); err != nil || tok != 5 {
			close(leaderDone)
			g.Wait()
			t.Fatalf("after the leader's write the file holds term %d's state (%v)", tok, err)
		}
	}
	close(leaderDone)
	g.Wait()
	if !errors.Is(deposedErr, ErrStateFile) {
		t.Fatalf("the deposed writer: %v, want ErrStateFile", deposedErr)
	}
}
