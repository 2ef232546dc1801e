package taskd

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/internal/testkit"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if role := testkit.Role(); role != "" {
		os.Exit(runChild(role))
	}
	goleak.VerifyTestMain(m)
}

// fast returns timings short enough for tests and long enough for a loaded
// two-core machine running the race detector.
type fastTimings struct {
	interval, deadline, ack time.Duration
}

var testTimings = fastTimings{interval: 200 * time.Millisecond, deadline: 3 * time.Second, ack: 1 * time.Second}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	return ctx
}
