package agent

import (
	"strings"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/taskd"
)

// TestFaultOfARestartedRank: a rank whose new process fails before the
// node's other ranks are restarted has a fault of its own, reported,
// not one taken for its peers' stopping.
func TestFaultOfARestartedRank(t *testing.T) {
	a, _, _ := shellAgent(t, 2, 3, `exit 0`)
	in := a.incident
	now := time.Now()
	exit := func(rank int) taskd.Fault {
		return taskd.Fault{Kind: taskd.FaultProcessExit, Position: taskd.Position{Rank: rank}, Code: 3, Time: now}
	}
	if !in.fault(exit(1), now) {
		t.Fatal("the first fault is not reported")
	}
	if in.fault(exit(0), now) {
		t.Fatal("a peer stopping with the first fault is reported")
	}
	in.restarted(1, -1, now)
	if !in.fault(exit(1), now) {
		t.Fatal("the restarted rank's new fault, before rank 0 restarted, is not reported")
	}
	if in.n != 2 {
		t.Fatalf("incidents opened: %d, want 2", in.n)
	}
}

// TestIncidentOfAStartOver: a rank told to load a step from disk that
// then starts over, its peers holding no such step, makes the incident
// say the job resumed from the start, not from the step first loaded.
func TestIncidentOfAStartOver(t *testing.T) {
	a, _, _ := shellAgent(t, 1, 3, `exit 0`)
	in := a.incident
	now := time.Now()
	in.step(0, 39, now)
	in.fault(taskd.Fault{Kind: taskd.FaultProcessExit, Position: taskd.Position{Rank: 0}, Code: 3, Time: now}, now)
	in.restarted(0, -1, now)
	in.loaded(0, 29, "disk")
	in.loaded(0, -1, "none")
	c := in.current()
	in.step(0, 39, now.Add(time.Second))
	if want := "recovered: resumed from the start (no step held by every rank), back at step 39"; !strings.HasPrefix(c.Outcome, want) {
		t.Fatalf("outcome %q, want it to begin %q", c.Outcome, want)
	}
}
