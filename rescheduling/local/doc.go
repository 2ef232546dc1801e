// Package local is the rescheduling.Executor of one machine: a Supervisor
// runs child processes, reports each unexpected exit as a
// rescheduling.Fault (exit code and signal as a shell reports them, so
// that rescheduling.Classify applies DLRover's table), and restarts them
// when a decision asks.
//
// Each process runs in its own process group: a stop sends SIGTERM to the
// group, then SIGKILL after StopTimeout, so nothing the process started
// outlives it. Exits the supervisor causes are not reported. On one
// machine a pod is the whole set of processes, so RecreatePods and
// RestartJob restart every process; AvoidNode is unsupported. Nodes
// routes decisions to several supervisors, each standing for a node.
//
// A supervisor wired to a watchdog:
//
//	s, err := local.New(local.Config{Commands: []local.Command{
//		{Name: "rank-0", Path: "python", Args: []string{"train.py", "--rank=0"}},
//		{Name: "rank-1", Path: "python", Args: []string{"train.py", "--rank=1"}},
//	}})
//	...
//	policy, err := rescheduling.NewPolicy(rescheduling.Config{})
//	...
//	w, err := rescheduling.NewWatchdog(rescheduling.WatchdogConfig{
//		Policy: policy, Executor: s, Faults: s.Faults(),
//	})
//	...
//	go w.Run(ctx) // returns when s.Run closes Faults
//	err = s.Run(ctx)
package local
