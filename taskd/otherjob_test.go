package taskd

import (
	"testing"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// TestOtherJob: a worker of a job its manager does not serve (the job
// went on under another name, as an elastic job's new shape) learns the
// job the manager serves from the refusal, through the manager and
// through a proxy, and keeps registering; a worker of the right job sees
// none.
func TestOtherJob(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{})
	c.addProxy(1)
	right := c.addWorker(0, 0)
	c.job = "job-1-g1" // what the next workers are built with
	direct := c.addWorker(0, 1)
	viaProxy := c.addWorker(1, 2)
	testkit.WaitFor(t, "the workers of another job told what the manager serves, the job's own connected", func() bool {
		return direct.OtherJob() == "job-1" && viaProxy.OtherJob() == "job-1" && right.Connected()
	})
	if got := right.OtherJob(); got != "" {
		t.Errorf("the job's own worker: OtherJob %q", got)
	}
	if direct.Connected() || viaProxy.Connected() {
		t.Error("a worker of another job is connected")
	}
}
