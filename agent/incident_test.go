package agent

import (
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
