package taskd

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/faultline-ml/faultline/internal/atomicfile"
)

// The orchestration state is kept in StateDir so that a manager that
// restarts, or a standby that takes over, finishes the orchestration in
// progress: orchestration.json holds the core's state (its counters, the
// links off their primary and the orchestration in progress), written
// before the manager acts on a change; orchestration-history.json holds
// the finished orchestrations, written when one ends.
//
// Each file is one JSON object:
//
//	{"version":1,"job":"llm","token":3,"state":{...},"crc32c":"1c291ca3"}
//
// version is stateVersion; job is the manager's job; token is the fencing
// token of the lease term that wrote it (0 without a lease); state is the
// content, and crc32c the CRC-32C (Castagnoli) of its bytes as they stand
// in the file, as 8 hexadecimal digits.
const (
	orchStateFile   = "orchestration.json"
	orchHistoryFile = "orchestration-history.json"
)

// stateVersion is the version of the orchestration state files that this
// package writes and reads.
const stateVersion = 1

// maxStateBytes bounds a state file: the history of MaxHistory
// orchestrations of a large job fits.
const maxStateBytes = 256 << 20

// ErrStateFile is wrapped by *StateFileError.
var ErrStateFile = errors.New("taskd: state file refused")

// StateFileError refuses a state file that a manager cannot take over:
// unreadable or damaged, of an unknown version, of another job, or written
// by a newer lease term than the manager's. The file is left as it is.
type StateFileError struct {
	File  string
	Field string // the member at fault; "" for the whole file
	Value string // the value at fault, when there is one
	Msg   string
}

func (e *StateFileError) Error() string {
	var b strings.Builder
	b.WriteString("taskd: state file " + e.File + ": ")
	if e.Field != "" {
		b.WriteString(e.Field + " ")
		if e.Value != "" {
			b.WriteString(e.Value + " ")
		}
	}
	b.WriteString(e.Msg)
	return b.String()
}

// Unwrap lets errors.Is(err, ErrStateFile) hold.
func (e *StateFileError) Unwrap() error { return ErrStateFile }

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// stateEnvelope is a state file on disk.
type stateEnvelope struct {
	Version int             `json:"version"`
	Job     string          `json:"job"`
	Token   uint64          `json:"token"`
	State   json.RawMessage `json:"state"`
	CRC     string          `json:"crc32c"`
}

// marshalStateFile encodes state, a JSON document, as a state file of job
// written under token.
func marshalStateFile(job string, token uint64, state []byte) ([]byte, error) {
	b, err := json.Marshal(stateEnvelope{Version: stateVersion, Job: job, Token: token, State: state,
		CRC: fmt.Sprintf("%08x", crc32.Checksum(state, castagnoli))})
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// parseStateFile decodes a state file named file and returns its token and
// state. It refuses anything but one envelope of this version and job
// whose checksum matches.
func parseStateFile(file, job string, data []byte) (token uint64, state []byte, err error) {
	bad := func(field, value, msg string) error {
		return &StateFileError{File: file, Field: field, Value: value, Msg: msg}
	}
	if len(data) > maxStateBytes {
		return 0, nil, bad("", "", fmt.Sprintf("is %d bytes, more than %d", len(data), maxStateBytes))
	}
	// The version first: another version may differ in every other member.
	var v struct {
		Version *json.RawMessage `json:"version"`
	}
	if err := json.Unmarshal(data, &v); err != nil {
		return 0, nil, bad("", "", "is not a JSON object: "+err.Error())
	}
	if v.Version == nil {
		return 0, nil, bad("version", "", "is missing")
	}
	if n, err := strconv.Atoi(string(*v.Version)); err != nil || n != stateVersion {
		return 0, nil, bad("version", string(*v.Version), fmt.Sprintf("is unknown: this manager reads version %d; the file was written by another release", stateVersion))
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var env stateEnvelope
	if err := dec.Decode(&env); err != nil {
		return 0, nil, bad("", "", err.Error())
	}
	if dec.More() {
		return 0, nil, bad("", "", "holds more than one JSON value")
	}
	switch {
	case env.Job != job:
		return 0, nil, bad("job", strconv.Quote(env.Job), fmt.Sprintf("is another job's, not %q's: give each job its own StateDir", job))
	case len(env.State) == 0:
		return 0, nil, bad("state", "", "is missing")
	}
	if want := fmt.Sprintf("%08x", crc32.Checksum(env.State, castagnoli)); env.CRC != want {
		return 0, nil, bad("crc32c", strconv.Quote(env.CRC), fmt.Sprintf("does not match the content (%s): the file was damaged or edited", want))
	}
	return env.Token, env.State, nil
}

// readStateFile reads the state file at path; fs.ErrNotExist (wrapped)
// when there is none.
func readStateFile(path, job string) (uint64, []byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, nil, fmt.Errorf("taskd: state file: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxStateBytes+1))
	if err != nil {
		return 0, nil, fmt.Errorf("taskd: state file %s: %w", path, err)
	}
	return parseStateFile(path, job, data)
}

// writeStateFile writes state to path atomically, unless the file there
// was written by a newer lease term than token: a deposed manager must not
// overwrite its successor's state. A file that cannot be read is refused
// too: it is left for an operator to look at.
func writeStateFile(path, job string, token uint64, state []byte) error {
	unlock, err := lockStateDir(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer unlock()
	prev, _, err := readStateFile(path, job)
	switch {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return err
	case prev > token:
		return &StateFileError{File: path, Field: "token", Value: strconv.FormatUint(prev, 10),
			Msg: fmt.Sprintf("is newer than this manager's term (%d): it was deposed, and leaves the state to the leader", token)}
	}
	data, err := marshalStateFile(job, token, state)
	if err != nil {
		return err
	}
	return atomicfile.WriteFile(path, data, 0o644)
}

// jobMarkFile, in StateDir, is a state file with an empty state: it names
// the job (and the format's version) the folder belongs to, so that a
// manager of another job is refused before it reads the fault log.
const jobMarkFile = "manager.json"

// stateLockFile, in StateDir, is locked by each writer of the state files
// from its check of the token there to its rename: a deposed manager that
// read the state before the leader wrote it must not rename over it.
const stateLockFile = "orchestration.lock"

// lockStateDir takes the lock of the state files in dir, waiting for a
// writer that holds it, and returns what releases it.
func lockStateDir(dir string) (unlock func(), err error) {
	unlock, err = atomicfile.Lock(filepath.Join(dir, stateLockFile), 0o644)
	if err != nil {
		return nil, fmt.Errorf("taskd: lock the state files: %w", err)
	}
	return unlock, nil
}

// faultMark says which faults of the log, by Seq, the core took in: all
// up to Below, and those in Above (sorted). Faults can reach the core out
// of order; a manager that takes over gives it those it had not taken.
type faultMark struct {
	Below uint64   `json:"below"`
	Above []uint64 `json:"above,omitempty"`
}

// maxMarkGaps bounds the faults above the first not taken in that a mark
// lists; past it, the oldest gap is taken for taken in (its event was
// dropped: the manager's queue was full).
const maxMarkGaps = 4096

// has reports whether the fault of seq was taken in.
func (k *faultMark) has(seq uint64) bool {
	if seq <= k.Below {
		return true
	}
	_, found := slices.BinarySearch(k.Above, seq)
	return found
}

// add marks seq taken in and reports whether it was not already.
func (k *faultMark) add(seq uint64) bool {
	if seq == 0 || k.has(seq) {
		return false
	}
	i, _ := slices.BinarySearch(k.Above, seq)
	k.Above = slices.Insert(k.Above, i, seq)
	if len(k.Above) > maxMarkGaps {
		k.Below = k.Above[0]
		k.Above = k.Above[1:]
	}
	n := 0
	for n < len(k.Above) && k.Above[n] == k.Below+1 {
		k.Below++
		n++
	}
	k.Above = slices.Delete(k.Above, 0, n)
	return true
}

// coreState is the core's state as it is written down.
type coreState struct {
	Epoch       string            `json:"epoch"`
	NextRun     uint64            `json:"next_run"`
	NextAction  uint64            `json:"next_action"`
	Seen        faultMark         `json:"seen"`
	RestartedAt map[int]time.Time `json:"restarted_at,omitempty"`
	Links       []LinkState       `json:"links,omitempty"`
	Run         *runState         `json:"run,omitempty"`
}

// runState is the orchestration in progress as it is written down. What
// its actions were is not: a manager that takes it over asks again for
// what its state needs.
type runState struct {
	Orchestration Orchestration   `json:"orchestration"`
	Origin        time.Time       `json:"origin"`
	Faults        map[int][]Fault `json:"faults,omitempty"`
	IDs           []string        `json:"ids,omitempty"`
	Pending       bool            `json:"pending,omitempty"`
	Handover      []Fault         `json:"handover,omitempty"`
	Failed        []Strategy      `json:"failed,omitempty"`
	// Supported is null when no rank answered the notice.
	Supported   []Strategy     `json:"supported"`
	Level       level          `json:"level,omitempty"`
	RepairStart time.Time      `json:"repair_start"`
	Repairing   map[int]Fault  `json:"repairing,omitempty"`
	RepairDone  bool           `json:"repair_done,omitempty"`
	Awaited     []int          `json:"awaited,omitempty"`
	Registered  []int          `json:"registered,omitempty"`
	Evicted     map[int]string `json:"evicted,omitempty"`
	Restarted   []int          `json:"restarted,omitempty"`
	ResumeStep  int64          `json:"resume_step"`
	Deferred    []Fault        `json:"deferred,omitempty"`
}

// save returns the state to write down, and the history when an
// orchestration ended since the last call; nil for either when it did
// not change.
func (m *machine) save() (state, history []byte, err error) {
	if m.histNew {
		if history, err = json.Marshal(m.history); err != nil {
			return nil, nil, err
		}
	}
	if m.dirty {
		st := coreState{Epoch: m.epoch, NextRun: m.nextRun, NextAction: m.nextAction, Seen: m.seen,
			RestartedAt: m.restartedAt, Links: m.linkStates()}
		if r := m.run; r != nil {
			st.Run = &runState{
				Orchestration: r.o, Origin: r.origin, Faults: r.faults, IDs: slices.Sorted(maps.Keys(r.ids)), Pending: r.pending,
				Handover: r.handover, Failed: setList(r.failed), Level: r.level, RepairStart: r.repairStart,
				Repairing: r.repairing, RepairDone: r.repairDone, Awaited: r.awaited, Registered: setList(r.registered),
				Restarted: r.restarted, ResumeStep: r.resumeStep, Deferred: r.deferred, Evicted: r.evictedInst,
			}
			if r.supported != nil {
				st.Run.Supported = setList(r.supported)
				if st.Run.Supported == nil {
					st.Run.Supported = []Strategy{}
				}
			}
		}
		if state, err = json.Marshal(st); err != nil {
			return nil, nil, err
		}
	}
	m.dirty, m.histNew = false, false
	return state, history, nil
}

// unsaved says that what save returned last was not written down: the
// next save returns the state again, and the history too if hist.
func (m *machine) unsaved(hist bool) {
	m.dirty = true
	m.histNew = m.histNew || hist
}

// setList returns the keys of a set whose values say whether a key is in
// it, sorted.
func setList[K interface{ ~int | ~string }](set map[K]bool) []K {
	var out []K
	for k, in := range set {
		if in {
			out = append(out, k)
		}
	}
	slices.Sort(out)
	return out
}

func listSet[K comparable](list []K) map[K]bool {
	out := make(map[K]bool, len(list))
	for _, k := range list {
		out[k] = true
	}
	return out
}

// parseCoreState decodes and checks a core's state read from file.
func parseCoreState(file string, data []byte) (coreState, error) {
	var st coreState
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&st); err != nil {
		return coreState{}, &StateFileError{File: file, Field: "state", Msg: err.Error()}
	}
	if err := st.check(); err != nil {
		err.File = file
		return coreState{}, err
	}
	return st, nil
}

// check reports the first member of st that a core cannot take over.
func (st *coreState) check() *StateFileError {
	bad := func(field, value, msg string) *StateFileError {
		return &StateFileError{Field: "state." + field, Value: value, Msg: msg}
	}
	if len(st.Epoch) != 16 || strings.Trim(st.Epoch, "0123456789abcdef") != "" {
		return bad("epoch", strconv.Quote(st.Epoch), "want 16 hexadecimal digits")
	}
	if len(st.Seen.Above) > maxMarkGaps || !slices.IsSorted(st.Seen.Above) || (len(st.Seen.Above) > 0 && st.Seen.Above[0] <= st.Seen.Below+1) {
		return bad("seen.above", "", fmt.Sprintf("want at most %d sorted numbers above below+1", maxMarkGaps))
	}
	for i, l := range st.Links {
		if l.Target != LinkStandby {
			return bad(fmt.Sprintf("links[%d].Target", i), strconv.Quote(string(l.Target)), "want "+string(LinkStandby))
		}
	}
	r := st.Run
	if r == nil {
		return nil
	}
	o := &r.Orchestration
	if o.ID == 0 || o.ID > st.NextRun {
		return bad("run.orchestration.ID", fmt.Sprint(o.ID), fmt.Sprintf("want 1 to next_run (%d)", st.NextRun))
	}
	if !runStates[o.Kind][o.State] {
		return bad("run.orchestration.State", strconv.Quote(string(o.State)), fmt.Sprintf("is no state that a %q orchestration runs in", o.Kind))
	}
	switch {
	case o.Round < 1:
		return bad("run.orchestration.Round", fmt.Sprint(o.Round), "want 1 or more")
	case o.Done:
		return bad("run.orchestration.Done", "true", "the orchestration in progress is not done")
	case r.Level < 0 || r.Level > levelGiveUp:
		return bad("run.level", fmt.Sprint(int(r.Level)), "out of range")
	case (o.Kind == KindLinkSwitch || o.Kind == KindSwitchback) && o.Link == nil:
		return bad("run.orchestration.Link", "", "is missing from a link switch")
	case o.Kind == KindStressTest && o.Stress == nil:
		return bad("run.orchestration.Stress", "", "is missing from a stress test")
	}
	if o.Link != nil {
		if err := o.Link.Validate(); err != nil {
			return bad("run.orchestration.Link", "", err.Error())
		}
	}
	if o.Stress != nil {
		if err := o.Stress.Validate(); err != nil {
			return bad("run.orchestration.Stress", "", err.Error())
		}
	}
	for _, list := range [][]Strategy{r.Failed, r.Supported} {
		for _, s := range list {
			if !s.valid() {
				return bad("run", strconv.Quote(string(s)), "is no strategy")
			}
		}
	}
	if o.Strategy != "" && !o.Strategy.valid() {
		return bad("run.orchestration.Strategy", strconv.Quote(string(o.Strategy)), "is no strategy")
	}
	for rank, fs := range r.Faults {
		if rank < 0 || len(fs) == 0 {
			return bad("run.faults", fmt.Sprint(rank), "want a rank of 0 or more with its faults")
		}
	}
	for rank := range r.Repairing {
		if rank < 0 {
			return bad("run.repairing", fmt.Sprint(rank), "want a rank of 0 or more")
		}
	}
	return nil
}

// runStates are the states an orchestration of each kind runs in.
var runStates = map[OrchestrationKind]map[State]bool{
	KindRecovery: {StateStopping: true, StateNotifying: true, StateDeciding: true, StateRetrying: true, StateRestarting: true,
		StateReplacing: true, StateLoading: true, StateResuming: true, StateDumping: true, StateExiting: true},
	KindLinkSwitch: {StatePausing: true, StateSwitching: true, StateContinuing: true},
	KindSwitchback: {StatePausing: true, StateSwitching: true, StateContinuing: true},
	KindStressTest: {StatePausing: true, StateTesting: true, StateContinuing: true},
}

// parseHistory decodes and checks the finished orchestrations read from
// file.
func parseHistory(file string, data []byte) ([]Orchestration, error) {
	var h []Orchestration
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&h); err != nil {
		return nil, &StateFileError{File: file, Field: "state", Msg: err.Error()}
	}
	for i, o := range h {
		switch {
		case !o.Done || !o.State.Terminal():
			return nil, &StateFileError{File: file, Field: fmt.Sprintf("state[%d].State", i), Value: strconv.Quote(string(o.State)), Msg: "a finished orchestration ends in a terminal state"}
		case i > 0 && o.ID <= h[i-1].ID:
			return nil, &StateFileError{File: file, Field: fmt.Sprintf("state[%d].ID", i), Value: fmt.Sprint(o.ID), Msg: "want IDs increasing"}
		}
	}
	return h, nil
}

// restore makes st and history the machine's state. An orchestration in
// progress settles: it takes faults and registrations in, and acts once
// settled is called.
func (m *machine) restore(st coreState, history []Orchestration) {
	m.epoch, m.nextRun, m.nextAction, m.seen = st.Epoch, st.NextRun, st.NextAction, st.Seen
	m.restartedAt = maps.Clone(st.RestartedAt)
	if m.restartedAt == nil {
		m.restartedAt = make(map[int]time.Time)
	}
	m.links = make(map[[2]int]LinkTarget)
	for _, l := range st.Links {
		m.links[[2]int{l.Node, l.Device}] = l.Target
	}
	m.history = history
	if over := len(m.history) - m.cfg.maxHistory; over > 0 {
		m.history = slices.Delete(m.history, 0, over)
	}
	m.run = nil
	if s := st.Run; s != nil && !slices.ContainsFunc(history, func(o Orchestration) bool { return o.ID == s.Orchestration.ID }) {
		r := &coreRun{
			o: s.Orchestration, origin: s.Origin, faults: s.Faults, ids: listSet(s.IDs), pending: s.Pending,
			handover: s.Handover, failed: listSet(s.Failed), level: s.Level, repairStart: s.RepairStart,
			repairing: s.Repairing, repairDone: s.RepairDone, awaited: s.Awaited, registered: listSet(s.Registered),
			restarted: s.Restarted, resumeStep: s.ResumeStep, deferred: s.Deferred, evictedInst: s.Evicted, restored: true, settling: true,
		}
		if s.Supported != nil {
			r.supported = listSet(s.Supported)
		}
		if r.faults == nil {
			r.faults = make(map[int][]Fault)
		}
		if r.repairing == nil {
			r.repairing = make(map[int]Fault)
		}
		m.run = r
	}
	m.dirty, m.histNew = false, false
}

// settled carries on the orchestration taken over, once the members have
// registered again with the instances live (rank -> instance): it asks
// again for what its state needs, and reacts to the faults that came
// meanwhile. A repair that the executor finished is not made again: the
// state waits for the ranks it restarted. Nor is one whose executor call
// was cut short once its evictions were written, unless a rank it was to
// restart still runs as the instance it evicted: the repair is taken for
// done, a rank live as another instance as restarted by it, the others
// waited for as for those of any repair (and lost if they never come).
func (m *machine) settled(now time.Time, why string, live map[int]string) {
	r := m.run
	if r == nil || !r.settling {
		return
	}
	r.settling = false
	r.o.Restored++
	m.record(now, r.o.State, why)
	repairing := r.o.State == StateRestarting || r.o.State == StateReplacing
	var restarted, untouched []int // untouched: still running as the instance evicted
	if repairing && !r.repairDone {
		for rank, inst := range r.evictedInst {
			switch l := live[rank]; {
			case l != "" && l != inst:
				restarted = append(restarted, rank)
			case l != "" && l == inst:
				untouched = append(untouched, rank)
			}
		}
	}
	// A rank evicted and not live yet may be on its way back from the
	// dead manager's call: making the repair again would kill what that
	// call started and count its registration for the new one. It is
	// waited for as the ranks of any repair are. In place, only the ranks
	// the call evidently did not reach are restarted again; a pod's
	// recreation, which may be under way for any of its ranks, is made
	// again whole.
	if len(untouched) > 0 && len(untouched) < len(r.evictedInst) && r.o.State == StateRestarting {
		for _, rank := range restarted {
			r.registered[rank] = true
		}
		for rank := range r.repairing {
			if !slices.Contains(untouched, rank) {
				delete(r.repairing, rank)
			}
		}
		m.issue(now)
		m.settledFaults(now)
		return
	}
	switch {
	case repairing && (r.repairDone || (len(r.evictedInst) > 0 && len(untouched) == 0)):
		timeout := m.repairTimeout()
		m.nextAction++
		r.action, r.deadline = m.nextAction, now.Add(timeout+grace(timeout))
		if r.repairDone {
			m.checkRepaired(now)
			break
		}
		for _, rank := range restarted {
			r.registered[rank] = true
		}
		m.repaired(now, r.action, slices.Collect(maps.Keys(r.evictedInst)), nil)
	default:
		m.issue(now)
	}
	m.settledFaults(now)
}

// settledFaults reacts to the faults deferred while the orchestration
// taken over settled.
func (m *machine) settledFaults(now time.Time) {
	r := m.run
	deferred := r.deferred
	r.deferred = nil
	for _, f := range deferred {
		if m.run != r {
			break // it ended, or handed over to a recovery that holds these faults
		}
		m.react(now, f)
	}
}

// persisted is what a manager read of the orchestration state in its
// StateDir.
type persisted struct {
	state   *coreState // nil when there is none
	history []Orchestration
}

// readOrchestration reads the orchestration state kept in dir for job,
// refusing files that a manager whose term's token is token cannot take
// over: of another job or version, damaged, or written by a newer term.
func readOrchestration(dir, job string, token uint64) (persisted, error) {
	var p persisted
	for _, name := range []string{orchHistoryFile, orchStateFile} {
		path := filepath.Join(dir, name)
		tok, raw, err := readStateFile(path, job)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			continue
		case err != nil:
			return p, err
		case tok > token:
			return p, &StateFileError{File: path, Field: "token", Value: strconv.FormatUint(tok, 10),
				Msg: fmt.Sprintf("is newer than this manager's term (%d): a newer leader wrote it", token)}
		}
		if name == orchHistoryFile {
			if p.history, err = parseHistory(path, raw); err != nil {
				return p, err
			}
			continue
		}
		st, err := parseCoreState(path, raw)
		if err != nil {
			return p, err
		}
		p.state = &st
	}
	return p, nil
}
