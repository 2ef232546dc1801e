package taskd

import (
	"context"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if role := os.Getenv(childRoleEnv); role != "" {
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

// waitFor polls cond until it holds or the deadline passes. The tests use
// it only around real processes and sockets, whose progress no event
// exposes.
func waitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	return ctx
}
