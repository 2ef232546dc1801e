package taskd

import (
	"time"

	"github.com/cenkalti/backoff/v4"
)

type ackBackoff = backoff.ExponentialBackOff

// newAckBackoff returns an exponential backoff from initial to max with
// jitter that never gives up: callers bound it by a context.
func newAckBackoff(initial, max time.Duration) *ackBackoff {
	bo := backoff.NewExponentialBackOff()
	bo.InitialInterval = initial
	bo.MaxInterval = max
	bo.Multiplier = 2
	bo.RandomizationFactor = 0.2
	bo.MaxElapsedTime = 0
	bo.Reset()
	return bo
}
