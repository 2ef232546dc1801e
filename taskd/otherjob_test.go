package taskd

import (
	"errors"
	"testing"
	"time"

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

// TestRetryWait: a refusal for another job is asked again soon, with the
// backoff started over; other errors wait longer each time.
func TestRetryWait(t *testing.T) {
	bo := newBackoff(50*time.Millisecond, 5*time.Second)
	other := errors.New("connection refused")
	var last time.Duration
	for range 8 {
		last = retryWait(bo, other)
	}
	if last < time.Second {
		t.Fatalf("after 8 failures the wait is %v; want the backoff grown past 1s", last)
	}
	if got := retryWait(bo, unknownJob("job-1-g2", "manager", "job-1-g1")); got != otherJobRetry {
		t.Errorf("wait after a refusal for another job = %v, want %v", got, otherJobRetry)
	}
	if got := retryWait(bo, other); got > 60*time.Millisecond {
		t.Errorf("wait after the next failure = %v; want the backoff started over (50ms ± 20%%)", got)
	}
}
