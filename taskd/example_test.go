package taskd_test

import (
	"context"
	"fmt"

	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/trace"
)

// A manager and one worker on loopback: the manager's profiling switch
// reaches the worker's OnSwitch hook.
func Example() {
	sec := taskd.Security{Insecure: true} // use SecurityFromDir(dir) for mutual TLS
	m, err := taskd.NewManager(taskd.ManagerConfig{Job: "job-1", Listen: "127.0.0.1:0", Security: sec})
	if err != nil {
		panic(err)
	}
	applied := make(chan trace.Switch, 1)
	w, err := taskd.NewWorker(taskd.WorkerConfig{
		Job: "job-1", Node: 0, Rank: 0, Upstream: m.Addr().String(), Security: sec,
		OnSwitch: func(sw trace.Switch) error { applied <- sw; return nil },
	})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go m.Run(ctx)
	go w.Run(ctx)

	m.SetSwitch(trace.Switch{Step: true, FP: true})
	fmt.Println(<-applied)

	w.Close()
	m.Close()
	// Output: {"CommunicationOperator":"off","Step":"on","SaveCheckpoint":"off","FP":"on","DataLoader":"off"}
}

// A handler plugged into the manager sees every fault a worker reports.
func ExampleHandler() {
	faults := make(chan taskd.Fault, 1)
	recovery := taskd.Handler{Name: "recovery", Priority: 10, Handle: func(ctx context.Context, m *taskd.Manager, ev taskd.Event) error {
		if ev.Kind == taskd.EventFault {
			faults <- ev.Fault
		}
		return nil
	}}
	sec := taskd.Security{Insecure: true}
	m, err := taskd.NewManager(taskd.ManagerConfig{Job: "job-1", Listen: "127.0.0.1:0", Security: sec, Handlers: []taskd.Handler{recovery}})
	if err != nil {
		panic(err)
	}
	w, err := taskd.NewWorker(taskd.WorkerConfig{Job: "job-1", Node: 1, Rank: 9, Upstream: m.Addr().String(), Security: sec})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go m.Run(ctx)
	go w.Run(ctx)

	w.ReportFault(taskd.Fault{Kind: taskd.FaultProcessExit, Code: 137, Message: "trainer killed"})
	f := <-faults
	fmt.Println(f.Seq, f.Kind, f.Position, f.Code, f.Message)

	w.Close()
	m.Close()
	// Output: 1 process_exit node 1 rank 9 137 trainer killed
}
