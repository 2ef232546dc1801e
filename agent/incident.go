package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/faultline-ml/faultline/hang"
	"github.com/faultline-ml/faultline/internal/atomicfile"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/trace/slownode"
)

// IncidentsFile is the file in Config.Out that gets one JSON line per
// incident as it ends.
const IncidentsFile = "incidents.jsonl"

// Incident is one fault and the job's recovery from it, as one node's
// agent saw it: each time is when this node got there.
type Incident struct {
	ID int `json:"id"`
	// Fault is the incident's root cause: of the faults that this node
	// saw (Faults, in the order it saw them), the one the others follow
	// from (see blame); Evidence says what chose it.
	Fault    IncidentFault   `json:"fault"`
	Evidence string          `json:"evidence,omitempty"`
	Faults   []IncidentFault `json:"faults"`
	// StepAtFault is the highest step the node's ranks had completed.
	StepAtFault int64 `json:"step_at_fault"`
	// The times: the fault, its detection, every local rank stopped
	// (paused, or dead), every local rank restarted, every local rank told
	// what to load, the first step completed after, and the job back at
	// the step where it was (StepAtFault completed again).
	FaultTime   time.Time `json:"fault_time"`
	Detected    time.Time `json:"detected"`
	Stopped     time.Time `json:"stopped,omitzero"`
	Restarted   time.Time `json:"restarted,omitzero"`
	Loaded      time.Time `json:"loaded,omitzero"`
	FirstStep   time.Time `json:"first_step,omitzero"`
	CaughtUp    time.Time `json:"caught_up,omitzero"`
	ResumedStep int64     `json:"resumed_step"`
	// Tier is where the node's ranks loaded ResumedStep from: memory,
	// disk or none, or several joined by "+" ("disk+memory": a rank whose
	// double buffer had moved past the step loaded it from disk).
	Tier string `json:"tier,omitempty"`
	// RecoverySeconds is CaughtUp - FaultTime: how long the fault cost.
	RecoverySeconds float64 `json:"recovery_seconds,omitempty"`
	// Orchestration is the manager's recovery (node 0 only) and the
	// strategy it took.
	Orchestration uint64 `json:"orchestration,omitempty"`
	Strategy      string `json:"strategy,omitempty"`
	// Dir holds the incident's stacks and, for a hang, the merged flame
	// graphs and the verdict.
	Dir     string `json:"dir,omitempty"`
	Verdict string `json:"verdict,omitempty"`
	Outcome string `json:"outcome"`
}

// IncidentFault is a fault as the incident records it.
type IncidentFault struct {
	Kind    string    `json:"kind"`
	Rank    int       `json:"rank"`
	Code    int       `json:"code,omitempty"`
	Message string    `json:"message"`
	Time    time.Time `json:"time"`
	// Peer is the address the fault's error names, as it names it (a
	// collective that failed on its connection to a peer); PeerRank is the
	// rank of this node it points at, absent when none: the one that held
	// the address, or, where none held it, the one whose end of a
	// connection with the fault's rank was the one found closed, at the
	// port PeerClosedPort (see closedPeer).
	Peer           string `json:"peer,omitempty"`
	PeerRank       *int   `json:"peer_rank,omitempty"`
	PeerClosedPort int    `json:"peer_closed_port,omitempty"`
}

// incidentFault is f as an incident records it.
func incidentFault(f taskd.Fault) IncidentFault {
	r := IncidentFault{Kind: string(f.Kind), Rank: f.Position.Rank, Code: f.Code, Message: f.Message, Time: f.Time, Peer: f.Attrs[attrPeer]}
	if n, err := strconv.Atoi(f.Attrs[attrPeerRank]); err == nil {
		r.PeerRank = &n
	}
	r.PeerClosedPort, _ = strconv.Atoi(f.Attrs[attrPeerClosedPort])
	return r
}

// Attributes of a reported fault whose error names a peer.
const (
	attrPeer     = "peer"      // the address, as the error names it
	attrPeerRank = "peer_rank" // the rank of the reporting node it points at
	// where no rank held the address: the port of that rank's end of a
	// connection with the fault's rank, found closed
	attrPeerClosedPort = "peer_closed_port"
)

// incidents keeps the node's open incident and writes each as it ends.
type incidents struct {
	a *Agent

	mu       sync.Mutex
	n        int
	cur      *Incident
	maxStep  int64 // highest step completed by any local rank
	isPaused map[int]bool
	started  map[int]bool
	isLoaded map[int]string // by rank: the tier it loaded from
	stepped  map[int]int64  // after the restart: each rank's last step
	hangSeen bool
	reported bool   // a fault of the open incident went to the manager
	verdict  string // the slow-node verdict written last
}

// newIncidents numbers the node's incidents on from those its Out holds.
func newIncidents(a *Agent) *incidents {
	return &incidents{a: a, maxStep: -1, n: lastIncident(a.cfg.Out)}
}

// openLocked opens an incident unless one is open.
func (in *incidents) openLocked(now time.Time) *Incident {
	if in.cur != nil {
		return in.cur
	}
	return in.newLocked(now)
}

// faultLocked returns the incident a fault of rank seen at now belongs
// to: the open one while its ranks are being stopped and restarted; once
// they run again, or once rank itself was restarted (its new process may
// fail before the node's other ranks are started), a fault is a new
// incident, and the open one ends without its ranks back where they were.
func (in *incidents) faultLocked(rank int, now time.Time) *Incident {
	if c := in.cur; c != nil && (!c.Restarted.IsZero() || in.started[rank]) {
		c.Outcome = "restarted " + resumedFrom(c) + ", then failed again before " + stepWord(c.StepAtFault)
		in.closeLocked()
	}
	return in.openLocked(now)
}

// newLocked opens a new incident.
func (in *incidents) newLocked(now time.Time) *Incident {
	in.n++
	in.cur = &Incident{ID: in.n, StepAtFault: in.maxStep, FaultTime: now, Detected: now, ResumedStep: -1,
		Dir: filepath.Join(in.a.cfg.Out, fmt.Sprintf("incident-%d", in.n))}
	in.isPaused, in.started, in.isLoaded, in.stepped, in.hangSeen, in.reported = map[int]bool{}, map[int]bool{}, map[int]string{}, map[int]int64{}, false, false
	return in.cur
}

// fault records a fault seen on this node. It returns true for the first
// fault of an incident: those after it (peers failing with it, or while
// the job is being restarted) are recorded but not reported, since every
// rank is restarted anyway.
func (in *incidents) fault(f taskd.Fault, detected time.Time) bool {
	in.mu.Lock()
	defer in.mu.Unlock()
	c := in.faultLocked(f.Position.Rank, detected)
	c.Faults = append(c.Faults, incidentFault(f))
	if c.Fault.Kind == "" || c.Fault.Kind == kindRemote {
		c.FaultTime, c.Detected = f.Time, detected
	}
	if c.Fault.Kind != string(taskd.FaultHang) {
		c.Fault, c.Evidence = blame(c.Faults)
	}
	if in.reported {
		return false
	}
	in.reported = true
	return true
}

// hang opens (or joins) the incident of a hung collective; first is true
// for the first hang of the incident, whose stacks are to be merged.
func (in *incidents) hang(f hang.Fault, now time.Time) (*Incident, bool) {
	in.mu.Lock()
	defer in.mu.Unlock()
	fresh := in.cur == nil || !in.cur.Restarted.IsZero() || in.started[f.Rank]
	c := in.faultLocked(f.Rank, now)
	r := IncidentFault{Kind: string(taskd.FaultHang), Rank: f.Rank, Message: f.String(), Time: f.Time}
	c.Faults = append(c.Faults, r)
	if fresh {
		c.FaultTime, c.Detected = f.Time.Add(-f.Elapsed).Add(f.Timeout), now
		c.Fault, c.Evidence = blame(c.Faults)
	}
	first := !in.hangSeen && !in.reported
	in.hangSeen, in.reported = true, true
	return c, first
}

// current returns the open incident, nil when none is.
func (in *incidents) current() *Incident {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.cur
}

// setVerdict records c's job-wide hang verdict: the rank it names, on
// whatever node, is the incident's root cause.
func (in *incidents) setVerdict(c *Incident, verdict string, culprits []int) {
	in.mu.Lock()
	defer in.mu.Unlock()
	c.Verdict = verdict
	if len(culprits) > 0 {
		c.Fault = IncidentFault{Kind: string(taskd.FaultHang), Rank: culprits[0], Message: strings.TrimPrefix(verdict, "Culprit: "), Time: c.Fault.Time}
		c.Evidence = "the job-wide merge of every rank's stacks"
	}
}

// stackDir is where the open incident keeps the ranks' stacks.
func (in *incidents) stackDir() string {
	in.mu.Lock()
	defer in.mu.Unlock()
	return filepath.Join(in.openLocked(time.Now()).Dir, "stacks")
}

// pausing: recovery pauses this node's ranks (the fault may be another
// node's).
func (in *incidents) pausing(now time.Time) {
	in.mu.Lock()
	defer in.mu.Unlock()
	c := in.openLocked(now)
	if c.Fault.Kind == "" {
		c.Fault = IncidentFault{Kind: kindRemote, Rank: -1, Message: "the manager paused this node's ranks for a fault elsewhere", Time: now}
	}
}

// paused notes a local rank paused; every local rank paused or dead is
// the node stopped.
func (in *incidents) paused(rank int, now time.Time) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.cur == nil {
		return
	}
	in.isPaused[rank] = true
	if in.cur.Stopped.IsZero() && in.allLocked(func(s *slot) bool { return in.isPaused[s.rank] || s.stateIs(slotFailed) }) {
		in.cur.Stopped = now
	}
}

// restarted notes a local rank restarted to load step.
func (in *incidents) restarted(rank int, step int64, now time.Time) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.cur == nil {
		return
	}
	in.started[rank] = true
	in.cur.ResumedStep = step
	if in.cur.Stopped.IsZero() {
		in.cur.Stopped = now
	}
	if in.cur.Restarted.IsZero() && in.allLocked(func(s *slot) bool { return in.started[s.rank] }) {
		in.cur.Restarted = now
	}
}

// loaded notes what a local rank was told to load.
func (in *incidents) loaded(rank int, step int64, tier string) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.cur == nil || in.cur.Restarted.IsZero() && !in.started[rank] {
		return
	}
	in.isLoaded[rank] = tier
	tiers := map[string]bool{}
	for _, t := range in.isLoaded {
		tiers[t] = true
	}
	in.cur.ResumedStep, in.cur.Tier = step, strings.Join(slices.Sorted(maps.Keys(tiers)), "+")
	if in.cur.Loaded.IsZero() && in.allLocked(func(s *slot) bool { return in.isLoaded[s.rank] != "" }) {
		in.cur.Loaded = time.Now()
	}
}

// saved: a rank saved step; nothing to record yet.
func (in *incidents) saved(int, int64) {}

// step notes that a local rank completed step n at t: the first after a
// restart, and the job back where it was, end the incident.
func (in *incidents) step(rank int, n int64, t time.Time) {
	in.mu.Lock()
	defer in.mu.Unlock()
	c := in.cur
	if c == nil {
		in.maxStep = max(in.maxStep, n)
		return
	}
	if !in.started[rank] {
		return // a step finishing as the job stops
	}
	if c.FirstStep.IsZero() {
		c.FirstStep = t
	}
	in.stepped[rank] = n
	if in.allLocked(func(s *slot) bool { st, ok := in.stepped[s.rank]; return ok && st >= c.StepAtFault }) {
		c.CaughtUp = t
		c.RecoverySeconds = t.Sub(c.FaultTime).Seconds()
		c.Outcome = fmt.Sprintf("recovered: resumed %s, back at %s in %.2fs", resumedFrom(c), stepWord(c.StepAtFault), c.RecoverySeconds)
		in.closeLocked()
		in.maxStep = max(in.maxStep, n)
	}
}

// transition follows node 0's manager through its orchestrations.
func (in *incidents) transition(o taskd.Orchestration, t taskd.Transition) {
	if o.Kind != taskd.KindRecovery {
		return
	}
	if !t.To.Terminal() {
		go in.a.refuseIncompleteRestart(t.Reason)
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.cur == nil {
		if t.To == taskd.StateExited {
			go in.a.stopJob(o.Outcome)
		}
		return
	}
	in.cur.Orchestration, in.cur.Strategy = o.ID, string(o.Strategy)
	if t.To == taskd.StateExited {
		in.cur.Outcome = "exited: " + o.Outcome
		if r := in.a.resizedTo(); r != nil && in.a.terminating() == 0 {
			in.cur.Outcome = "resized: " + r.Why
		}
		in.closeLocked()
		go in.a.stopJob(o.Outcome)
	}
}

// finish ends the open incident, if any, as the job ends.
func (in *incidents) finish(why string) {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.cur != nil {
		if in.cur.Outcome == "" {
			in.cur.Outcome = why
		}
		in.closeLocked()
	}
}

// allLocked reports whether f holds for every local slot.
func (in *incidents) allLocked(f func(*slot) bool) bool {
	for _, s := range in.a.slots {
		if !f(s) {
			return false
		}
	}
	return true
}

// closeLocked writes the open incident and closes it.
func (in *incidents) closeLocked() {
	c := in.cur
	in.cur = nil
	b, err := json.Marshal(c)
	if err == nil {
		var f *os.File
		if f, err = os.OpenFile(filepath.Join(in.a.cfg.Out, IncidentsFile), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644); err == nil {
			_, err = f.Write(append(b, '\n'))
			if cerr := f.Close(); err == nil {
				err = cerr
			}
		}
	}
	if err != nil {
		in.a.log.Error("agent: incident not written", "err", err)
	}
	cause := ""
	if c.Evidence != "" {
		cause = " (the root cause: " + c.Evidence + ")"
	}
	fmt.Fprintf(in.a.cfg.Stderr, "faultline-run: incident %d: %s%s: %s\n", c.ID, c.Fault.Message, cause, c.Outcome)
}

// resumedFrom says where an incident's ranks resumed from.
func resumedFrom(c *Incident) string {
	if c.ResumedStep < 0 {
		return "from the start (no step held by every rank)"
	}
	return fmt.Sprintf("from step %d (%s)", c.ResumedStep, orNone(c.Tier))
}

// stepWord names the step a job was back at.
func stepWord(n int64) string {
	if n < 0 {
		return "its first step"
	}
	return fmt.Sprintf("step %d", n)
}

// last returns the headline fault of the open incident, "" when none.
func (in *incidents) last() string {
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.cur == nil {
		return ""
	}
	return in.cur.Fault.Message
}

func orNone(s string) string {
	if s == "" {
		return "none"
	}
	return s
}

// diagnoseHang takes every local rank's stacks at once into the
// incident's folder, merges them into flame graphs, a pprof profile and a
// verdict, and returns the ranks the stacks single out and where every
// rank is.
func (a *Agent) diagnoseHang(c *Incident) ([]int, string) {
	dir := filepath.Join(c.Dir, "stacks")
	dumps := make([]*hang.Dump, len(a.slots))
	var wg sync.WaitGroup
	for i, s := range a.slots {
		s.mu.Lock()
		p := s.proc
		s.mu.Unlock()
		if p == nil {
			continue
		}
		wg.Go(func() { dumps[i] = s.dumpStacks(context.Background(), p, "hang: "+c.Fault.Message, dir) })
	}
	wg.Wait()
	var got []*hang.Dump
	for _, d := range dumps {
		if d != nil {
			got = append(got, d)
		}
	}
	if len(got) == 0 {
		return nil, ""
	}
	merged, err := hang.Merge(got, hang.MergeConfig{World: a.world})
	if err != nil {
		a.log.Warn("agent: stacks not merged", "err", err)
		return nil, ""
	}
	if _, err := merged.WriteFiles(c.Dir); err != nil {
		a.log.Warn("agent: merged stacks not written", "err", err)
	}
	culprits, where := hang.Culprit(got, ownFrame(a.cfg.PythonPath))
	var b bytes.Buffer
	fmt.Fprintf(&b, "Hang: %s\n", c.Fault.Message)
	switch {
	case a.cfg.Nodes > 1:
		// A rank alone in its code here may be where every rank of the
		// other nodes is: the job-wide merge (takeVerdict) names the culprit.
		culprits, where = nil, ""
		fmt.Fprintf(&b, "Culprit: partial, the stacks of node %d's ranks alone, which name no culprit; the job-wide verdict replaces this one.\n", a.cfg.NodeRank)
	case len(culprits) > 0:
		fmt.Fprintf(&b, "Culprit: %s.\n", where)
	default:
		b.WriteString("Culprit: the stacks single out no rank: every rank is in the same code.\n")
	}
	fmt.Fprintf(&b, "Stacks of %d ranks, taken by faulthandler on each at %s.\n\n", len(got), time.Now().Format(time.RFC3339Nano))
	b.WriteString(merged.Verdict())
	if err := atomicfile.WriteFile(filepath.Join(c.Dir, "verdict.txt"), b.Bytes(), 0o644); err != nil {
		a.log.Warn("agent: verdict not written", "err", err)
	}
	a.incident.mu.Lock()
	c.Verdict = strings.TrimSuffix(strings.SplitN(b.String(), "\n", 3)[1], ".")
	a.incident.mu.Unlock()
	fmt.Fprintf(a.cfg.Stderr, "faultline-run: hang: %s (stacks and flame graphs in %s)\n", c.Verdict, c.Dir)
	return culprits, where
}

// writeVerdict writes a slow-node verdict to Out as slownode.json (the
// shape of MindCluster's ClusterJobResult, with the evidence), .txt and
// .html, and says on the output when the job turns slow or healthy.
func (a *Agent) writeVerdict(r *slownode.Result) {
	for _, f := range []struct{ name, format string }{{"slownode.json", "json"}, {"slownode.txt", "text"}, {"slownode.html", "html"}} {
		var b bytes.Buffer
		if err := slownode.Write(&b, r, f.format); err != nil {
			a.log.Warn("agent: slow-node verdict not written", "format", f.format, "err", err)
			continue
		}
		if err := atomicfile.WriteFile(filepath.Join(a.cfg.Out, f.name), b.Bytes(), 0o644); err != nil {
			a.log.Warn("agent: slow-node verdict not written", "file", f.name, "err", err)
		}
	}
	summary := "healthy"
	if r.IsSlow == 1 {
		var parts []string
		for _, f := range r.Findings {
			parts = append(parts, fmt.Sprintf("%s ranks %v (%s %.1fms against %.1fms, %.2fx)", f.Kind, f.Ranks, f.Metric, f.Recent, f.Baseline, f.Ratio))
		}
		summary = "slow: " + strings.Join(parts, "; ")
	}
	a.incident.mu.Lock()
	prev := a.incident.verdict
	a.incident.verdict = summary
	a.incident.mu.Unlock()
	if summary != prev && (r.IsSlow == 1 || strings.HasPrefix(prev, "slow")) {
		fmt.Fprintf(a.cfg.Stderr, "faultline-run: slow-node verdict at step %d: %s (%s)\n", r.LastStep, summary, filepath.Join(a.cfg.Out, "slownode.txt"))
	}
}
