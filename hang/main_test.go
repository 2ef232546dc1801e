package hang

import (
	"os"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/faultline-ml/faultline/internal/testkit"
)

func TestMain(m *testing.M) {
	// The process tests re-execute this binary as the program that hangs.
	if role := testkit.Role(); role != "" {
		os.Exit(runChild(role))
	}
	goleak.VerifyTestMain(m)
}

// fakeClock is a clock that moves only when told; its Now is a
// Config.Now.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}
