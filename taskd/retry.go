package taskd

import (
	"math/rand/v2"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// newBackoff returns an exponential backoff from initial to max with
// jitter that never gives up: callers bound it by a context.
func newBackoff(initial, max time.Duration) *backoff.ExponentialBackOff {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = initial
	bo.MaxInterval = max
	bo.Multiplier = 2
	bo.RandomizationFactor = 0.2
	bo.MaxElapsedTime = 0
	bo.Reset()
	return bo
}

// otherJobRetry is the wait before registering again with a server that
// refused for serving another job, for otherJobWindow after the first
// such refusal: the server is up, and the job's own (an elastic job's
// next shape) takes its place soon, which a backoff grown meanwhile
// would leave waiting past the job's --join-timeout. After the window,
// a server that still serves another job is asked as after any failure.
const (
	otherJobRetry  = 200 * time.Millisecond
	otherJobWindow = 30 * time.Second
)

// retry paces registrations after failures.
type retry struct {
	bo    *backoff.ExponentialBackOff
	since time.Time // the first refusal for another job since the last registration
}

// newRetry returns a retry whose backoff runs from initial to max.
func newRetry(initial, max time.Duration) *retry {
	return &retry{bo: newBackoff(initial, max)}
}

// ended takes in a session that ended: one that registered ends a run of
// refusals for another job, and one that lasted too starts the backoff
// over.
func (r *retry) ended(registered, lasted bool) {
	if registered {
		r.since = time.Time{}
		if lasted {
			r.bo.Reset()
		}
	}
}

// wait returns the wait before registering again after err, at now: about
// otherJobRetry after a refusal for another job within otherJobWindow of
// the first (which starts the backoff over), the backoff's next else.
func (r *retry) wait(err error, now time.Time) time.Duration {
	if _, ok := servedJob(err); ok {
		if r.since.IsZero() {
			r.since = now
			r.bo.Reset()
		}
		if now.Sub(r.since) < otherJobWindow {
			// Jittered as the backoff is, so that the nodes a new shape
			// refused together do not ask again together.
			return time.Duration(float64(otherJobRetry) * (0.8 + 0.4*rand.Float64()))
		}
	}
	return r.bo.NextBackOff()
}
