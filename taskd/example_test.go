package taskd_test

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/taskd/trainertest"
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

// With orchestration on, a link switch pauses the job, moves the links of
// a node's devices to the standby and continues; the switchback takes the
// same path to the primary. Each worker's Trainer (here a fake one) does
// the pausing and switching.
func ExampleManager_SwitchLink() {
	sec := taskd.Security{Insecure: true}
	m, err := taskd.NewManager(taskd.ManagerConfig{Job: "job-1", Listen: "127.0.0.1:0", Security: sec, Orchestration: &taskd.OrchestrationConfig{}})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	start := func(run func(context.Context) error) {
		wg.Add(1)
		go func() { defer wg.Done(); run(ctx) }()
	}
	start(m.Run)
	var trainers []*trainertest.Trainer
	for rank := range 2 {
		tr := trainertest.New(trainertest.Config{StepTime: time.Millisecond})
		w, err := taskd.NewWorker(taskd.WorkerConfig{Job: "job-1", Node: 0, Rank: rank, Upstream: m.Addr().String(), Security: sec, Trainer: tr})
		if err != nil {
			panic(err)
		}
		start(w.Run)
		start(tr.Run)
		trainers = append(trainers, tr)
	}
	for _, tr := range trainers {
		for !tr.Running() { // started by its worker once registered
			time.Sleep(time.Millisecond)
		}
	}

	o, err := m.SwitchLink(ctx, taskd.LinkRequest{Node: 0, Devices: []int{0, 1}, Target: taskd.LinkStandby})
	fmt.Println(o.States(), err, trainers[1].Links())
	o, err = m.SwitchLink(ctx, taskd.LinkRequest{Node: 0, Devices: []int{0, 1}, Target: taskd.LinkPrimary})
	fmt.Println(o.Kind, o.State, err, len(m.Orchestrations(0).Links))

	cancel()
	wg.Wait()
	// Output:
	// [pausing switching continuing switched] <nil> map[0:standby 1:standby]
	// switchback switched <nil> 0
}
