package taskd

import (
	"context"
	"sort"
	"time"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
)

// Departure is a worker that is no longer live: it left (it said so as it
// stopped), or it was lost or evicted.
type Departure struct {
	Position Position
	// Left is set when the worker said it was going; unset when it was
	// declared lost, or evicted by a recovery that restarts it.
	Left bool
	// Finished is set when it left after its last step (Worker.Finish).
	Finished bool
	// Time is when it left, or when it was last heard from.
	Time time.Time
}

// JobStatus says where the job's workers are.
type JobStatus struct {
	// Complete is set once every rank of the job left finished: every
	// rank of Nodes×ProcsPerNode when the job's shape is set, else every
	// rank that registered. CompletedAt is when the last one left. A rank
	// that registers again makes the job incomplete.
	Complete    bool
	CompletedAt time.Time
	// Live are the live ranks, sorted.
	Live []int
	// Departed are the ranks that are gone, by rank.
	Departed []Departure
}

// departures holds the workers that are gone, by rank, and counts those
// that left finished, so that completion is known in O(1). It is pure:
// the caller serialises access.
type departures struct {
	byRank   map[int]Departure
	finished int
	// expected is the job's ranks when its shape is set, 0 when unknown.
	expected int
}

func newDepartures(expected int) *departures {
	return &departures{byRank: make(map[int]Departure), expected: expected}
}

// add records d, replacing what its rank held.
func (g *departures) add(d Departure) {
	g.back(d.Position.Rank)
	g.byRank[d.Position.Rank] = d
	if d.Finished {
		g.finished++
	}
}

// back forgets rank, which is live again.
func (g *departures) back(rank int) {
	if old, ok := g.byRank[rank]; ok {
		delete(g.byRank, rank)
		if old.Finished {
			g.finished--
		}
	}
}

// complete reports whether every rank of the job left finished, given how
// many workers are live.
func (g *departures) complete(live int) bool {
	if live > 0 || g.finished == 0 {
		return false
	}
	if g.expected > 0 {
		return g.finished == g.expected
	}
	return g.finished == len(g.byRank)
}

// list returns the departures of ranks from on, in rank order.
func (g *departures) list(from int) []Departure {
	out := make([]Departure, 0, len(g.byRank))
	for r, d := range g.byRank {
		if r >= from {
			out = append(out, d)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Position.Rank < out[j].Position.Rank })
	return out
}

// leave takes in the leave of the member at key, if instance holds it: the
// member is dropped as a lost one would be, but its silence is no fault.
// A leave of an instance that no longer holds its place (lost, evicted,
// left already) changes nothing.
func (m *Manager) leave(key memberKey, instance string, finished bool, now time.Time) {
	m.mu.Lock()
	mm := m.reg.get(key)
	if mm == nil || mm.instance != instance {
		m.mu.Unlock()
		return
	}
	m.reg.remove(key, instance)
	m.ids.revoke(key, instance)
	if dl := m.downlinks[key]; dl != nil && dl.instance == instance {
		dl.detach()
		delete(m.downlinks, key)
	}
	dep := Departure{Position: mm.pos, Left: true, Finished: finished && key.role == RoleWorker, Time: now}
	evs := []Event{{Kind: EventLeft, Time: now, Role: key.role, Position: mm.pos, Departure: dep}}
	complete := false
	switch {
	case key.role == RoleWorker && m.spare(mm.pos):
		m.sw.gone(key.id) // no rank of the job: not among its departures
	case key.role == RoleWorker:
		m.sw.gone(key.id)
		m.gone.add(dep)
		if m.completedAt.IsZero() && m.gone.complete(m.jobWorkersLocked()) {
			complete = true
			m.completedAt = now
			m.met.complete.Set(1)
			evs = append(evs, Event{Kind: EventJobComplete, Time: now})
		}
		m.checkFanoutLocked(now)
	}
	m.met.left.WithLabelValues(key.role.String()).Inc()
	m.updateMemberGaugesLocked()
	ranks := len(m.gone.byRank)
	m.mu.Unlock()
	m.log.Info("taskd: member left", "member", key.String(), "finished", dep.Finished)
	if complete {
		m.log.Info("taskd: job complete: every rank left after its last step", "ranks", ranks)
	}
	m.events.push(evs...)
}

// departedLocked records a worker that is gone without leaving: lost, or
// evicted by recovery.
func (m *Manager) departedLocked(pos Position, at time.Time) {
	m.gone.add(Departure{Position: pos, Time: at})
}

// returnedLocked notes that a worker of rank registered as a new
// instance: it is no longer gone, and the job no longer complete.
func (m *Manager) returnedLocked(rank int) {
	m.gone.back(rank)
	if !m.completedAt.IsZero() {
		m.completedAt = time.Time{}
		m.met.complete.Set(0)
	}
}

// JobStatus returns where the job's workers are and whether the job is
// complete.
func (m *Manager) JobStatus() JobStatus {
	m.mu.Lock()
	defer m.mu.Unlock()
	st := JobStatus{Complete: !m.completedAt.IsZero(), CompletedAt: m.completedAt, Departed: m.gone.list(0)}
	for _, mm := range m.reg.list() {
		if mm.key.role == RoleWorker {
			st.Live = append(st.Live, mm.key.id)
		}
	}
	return st
}

// maxDeparturesPerList bounds the departures one GetJob answer holds.
const maxDeparturesPerList = 10000

func (s *managerAdmin) GetJob(_ context.Context, req *pb.GetJobReq) (*pb.GetJobRes, error) {
	if req.GetJobNsName() != s.m.cfg.Job {
		return &pb.GetJobRes{Code: pb.Code_CODE_UNKNOWN_JOB, Message: "unknown job " + quote(req.GetJobNsName())}, nil
	}
	m := s.m
	m.mu.Lock()
	res := &pb.GetJobRes{Code: pb.Code_CODE_OK, Message: "ok", Complete: !m.completedAt.IsZero(), CompleteUnixNano: unixNano(m.completedAt),
		LiveWorkers: int32(m.jobWorkersLocked()), DepartedWorkers: int32(len(m.gone.byRank))}
	deps := m.gone.list(int(req.GetFromRank()))
	m.mu.Unlock()
	if len(deps) > maxDeparturesPerList {
		deps = deps[:maxDeparturesPerList]
	}
	for _, d := range deps {
		res.Departed = append(res.Departed, &pb.Departure{Position: &pb.Position{Node: int32(d.Position.Node), Rank: int32(d.Position.Rank)},
			Left: d.Left, Finished: d.Finished, TimeUnixNano: unixNano(d.Time)})
	}
	return res, nil
}
