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
