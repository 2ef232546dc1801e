package taskd

import (
	"context"
	"fmt"
	"time"
)

// ReportFault takes f into the job's fault log as the manager's own report,
// for a detector embedded beside the manager (a launcher that saw a
// process exit, a hang detector). An empty ID is filled in, a zero Time
// means now, and an empty ReporterRole means the manager. It returns the
// fault as logged, and false when a fault with its ID was logged already.
func (m *Manager) ReportFault(f Fault) (Fault, bool, error) {
	if err := checkKind(f.Kind); err != nil {
		return Fault{}, false, fmt.Errorf("taskd: Fault.Kind: %w", err)
	}
	now := time.Now()
	if f.ID == "" {
		f.ID = fmt.Sprintf("manager/%s/%d", m.instance, m.nextID.Add(1))
	}
	if f.Time.IsZero() {
		f.Time = now
	}
	if f.ReporterRole == 0 {
		f.ReporterRole, f.Reporter = RoleManager, Position{Node: -1, Rank: -1}
	}
	stored, fresh := m.faults.add(f, now)
	if err := m.faults.wait(context.Background(), stored.Seq); err != nil {
		return stored, fresh, err
	}
	if !fresh {
		m.met.faultDups.Inc()
		return stored, false, nil
	}
	m.met.faults.WithLabelValues(kindLabel(stored.Kind)).Inc()
	m.log.Warn("taskd: fault", "seq", stored.Seq, "kind", stored.Kind, "position", stored.Position.String(), "code", stored.Code, "message", stored.Message)
	m.events.push(Event{Kind: EventFault, Time: now, Role: stored.ReporterRole, Position: stored.Reporter, Fault: stored})
	return stored, true, nil
}

// liveWorkers returns the ranks of the live workers, sorted.

// Faults returns the job's faults with Seq above after, oldest first.
func (m *Manager) Faults(after uint64) []Fault { return m.faults.after(after) }
