package trainertest_test

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/taskd/trainertest"
)

// A fake trainer behind a worker: an op error it reports makes the
// manager pause it, have it retry the step and resume it.
func Example() {
	sec := taskd.Security{Insecure: true}
	done := make(chan taskd.Orchestration, 1)
	m, err := taskd.NewManager(taskd.ManagerConfig{Job: "job-1", Listen: "127.0.0.1:0", Security: sec,
		Orchestration: &taskd.OrchestrationConfig{OnTransition: func(o taskd.Orchestration, t taskd.Transition) {
			if t.To.Terminal() {
				done <- o
			}
		}}})
	if err != nil {
		panic(err)
	}
	tr := trainertest.New(trainertest.Config{StepTime: time.Millisecond})
	w, err := taskd.NewWorker(taskd.WorkerConfig{Job: "job-1", Upstream: m.Addr().String(), Security: sec, Trainer: tr})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for _, run := range []func(context.Context) error{m.Run, w.Run, tr.Run} {
		wg.Add(1)
		go func() { defer wg.Done(); run(ctx) }()
	}
	for tr.Step() < 3 { // the worker started the trainer once registered
		time.Sleep(time.Millisecond)
	}

	w.ReportFault(taskd.Fault{Kind: taskd.FaultOpError, Message: "allreduce failed"})
	o := <-done
	fmt.Println(o.State, o.Strategy, o.States())

	cancel()
	wg.Wait()
	// Output: recovered retry [stopping notifying retrying resuming recovered]
}
