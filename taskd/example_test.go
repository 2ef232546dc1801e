package taskd_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/faultline-ml/faultline/internal/freeport"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/taskd/lease"
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

// Two managers of one job share a lease file: the first leads and serves,
// the second stands by without listening. When the leader stops, it
// resigns, and the standby leads with the next fencing token. A worker
// given both addresses follows the leader.
func ExampleLead() {
	dir, _ := os.MkdirTemp("", "taskd-example-")
	defer os.RemoveAll(dir)
	sec := taskd.Security{Insecure: true}
	addrs := []string{freeAddr(), freeAddr()}
	leading := make(chan *taskd.Manager, 2)
	manager := func(i int) (context.CancelFunc, <-chan error) {
		l, err := lease.NewFile(lease.FileConfig{Path: filepath.Join(dir, "manager.lease"),
			Candidate: lease.Candidate{Job: "job-1", Config: lease.ConfigHash([]byte("nodes=1")), Name: fmt.Sprintf("mgr-%d", i)}})
		if err != nil {
			panic(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() {
			done <- taskd.Lead(ctx, l, taskd.ManagerConfig{Job: "job-1", Listen: addrs[i], Security: sec}, func(m *taskd.Manager) { leading <- m })
		}()
		return cancel, done
	}
	stopFirst, firstDone := manager(0)
	fmt.Println("leading at", (<-leading).Addr().String() == addrs[0])
	stopSecond, secondDone := manager(1)

	w, err := taskd.NewWorker(taskd.WorkerConfig{Job: "job-1", Node: 0, Rank: 0, Upstream: strings.Join(addrs, ","), Security: sec})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go w.Run(ctx)
	for !w.Connected() {
		time.Sleep(time.Millisecond)
	}

	stopFirst()
	fmt.Println("first manager:", <-firstDone)
	fmt.Println("leading at", (<-leading).Addr().String() == addrs[1])
	cancel()
	w.Close()
	stopSecond()
	fmt.Println("second manager:", <-secondDone)
	// Output:
	// leading at true
	// first manager: <nil>
	// leading at true
	// second manager: <nil>
}

func freeAddr() string {
	p, err := freeport.Find(1)
	if err != nil {
		panic(err)
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(p))
}
