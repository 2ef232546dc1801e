package taskd

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// TestRunEndsWhenEvicted: a worker attached to the manager whose instance
// recovery evicts learns it when it registers again, and Run returns
// ErrEvicted, so that its host can build the successor, which takes the
// rank.
func TestRunEndsWhenEvicted(t *testing.T) {
	c := newCluster(t, insecureSec(), ManagerConfig{})
	w, err := NewWorker(WorkerConfig{Job: c.job, Rank: 3, Upstream: c.m.Addr().String(), Security: c.sec, AckTimeout: c.ack, ReconnectMax: 500e6})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	done := make(chan error, 1)
	go func() { done <- w.Run(context.Background()) }()
	testkit.WaitFor(t, "registration", w.Connected)
	c.m.evict([]int{3}, "restarted by the test")
	select {
	case err := <-done:
		if !errors.Is(err, ErrEvicted) {
			t.Fatalf("Run = %v, want ErrEvicted", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return after the eviction")
	}
	w2 := c.addWorker(0, 3)
	testkit.WaitFor(t, "the successor registered", w2.Connected)
}
