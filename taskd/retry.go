package taskd

import (
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
// refused for serving another job: it is up, and the job's own (an
// elastic job's next shape) takes its place soon, which a backoff grown
// meanwhile would leave waiting past the job's --join-timeout.
const otherJobRetry = 200 * time.Millisecond

// retryWait returns the wait before registering again after err, from
// bo: otherJobRetry after a refusal for another job, which starts bo over.
func retryWait(bo *backoff.ExponentialBackOff, err error) time.Duration {
	if _, ok := servedJob(err); ok {
		bo.Reset()
		return otherJobRetry
	}
	return bo.NextBackOff()
}
