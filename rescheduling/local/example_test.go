package local_test

import (
	"context"
	"fmt"

	"github.com/faultline-ml/faultline/rescheduling"
	"github.com/faultline-ml/faultline/rescheduling/local"
)

// A process that exits with code 3 is reported as a fault, which the
// policy classifies and decides on; the supervisor carries the decision
// out.
func ExampleSupervisor() {
	s, err := local.New(local.Config{
		Node:     "n1",
		Commands: []local.Command{{Name: "worker", Path: "/bin/sh", Args: []string{"-c", "exit 3"}}},
	})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()

	f := <-s.Faults()
	fmt.Println(f.Process, f.ExitCode, rescheduling.Classify(f))

	policy, err := rescheduling.NewPolicy(rescheduling.Config{})
	if err != nil {
		panic(err)
	}
	d := policy.Decide(ctx, f)
	fmt.Println(d.Action)
	if err := s.RestartProcesses(ctx, d); err != nil {
		panic(err)
	}
	f = <-s.Faults() // it fails again
	fmt.Println(f.Process, f.ExitCode, s.State()[0].Restarts)

	cancel()
	<-done
	// Output:
	// worker 3 unknown
	// restart_processes
	// worker 3 1
}
