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
// backoff started over once, for otherJobWindow after the first since the
// last registration; other errors, and those refusals after the window,
// wait longer each time.
func TestRetryWait(t *testing.T) {
	r := newRetry(50*time.Millisecond, 5*time.Second)
	other := errors.New("connection refused")
	refused := unknownJob("job-1-g2", "manager", "job-1-g1")
	var last time.Duration
	for range 8 {
		last = r.wait(other, t0)
	}
	if last < time.Second {
		t.Fatalf("after 8 failures the wait is %v; want the backoff grown past 1s", last)
	}
	fast := func(d time.Duration) bool { return d >= otherJobRetry*8/10 && d <= otherJobRetry*12/10 }
	if got := r.wait(refused, t0); !fast(got) {
		t.Errorf("wait after a refusal for another job = %v, want %v ± 20%%", got, otherJobRetry)
	}
	if got := r.wait(other, t0); got > 60*time.Millisecond {
		t.Errorf("wait after the next failure = %v; want the backoff started over (50ms ± 20%%)", got)
	}
	// Refusals mixed with other failures start the backoff over only once.
	for i := range 8 {
		if got := r.wait(refused, t0.Add(time.Duration(i)*time.Second)); !fast(got) {
			t.Fatalf("wait after refusal %d within the window = %v, want %v ± 20%%", i+2, got, otherJobRetry)
		}
		last = r.wait(other, t0.Add(time.Duration(i)*time.Second))
	}
	if last < time.Second {
		t.Fatalf("after 9 failures between the refusals the wait is %v; want the backoff grown past 1s", last)
	}
	// A server that still serves another job after the window is asked
	// as after any failure.
	for i := range 8 {
		last = r.wait(refused, t0.Add(otherJobWindow+time.Duration(i)*time.Second))
	}
	if last < 4*time.Second {
		t.Fatalf("wait after refusals past the window = %v; want the backoff at its bound, 5s ± 20%%", last)
	}
	// Only a session that registered ends the run of refusals.
	r.ended(false, true)
	if got := r.wait(refused, t0.Add(time.Hour)); fast(got) {
		t.Errorf("wait after a refusal, after a long session that did not register = %v, want the backoff's", got)
	}
	r.ended(true, false)
	if got := r.wait(refused, t0.Add(time.Hour)); !fast(got) {
		t.Errorf("wait after a refusal, after a session that registered = %v, want %v ± 20%%", got, otherJobRetry)
	}
	// One that lasted too starts the backoff over.
	for range 8 {
		r.wait(other, t0)
	}
	r.ended(true, true)
	if got := r.wait(other, t0); got > 60*time.Millisecond {
		t.Errorf("wait after a session that lasted = %v; want the backoff started over (50ms ± 20%%)", got)
	}
}
