// Command demo runs a small training job on this machine, breaks it five
// ways, and shows each fault detected, explained and recovered.
//
//	go run ./examples/demo [--nodes 2] [--procs-per-node 4] [--steps 40]
//	    [--fault slow-compute,slow-io,hang,crash,link] [--keep] [--out demo-out]
//
// The program is the job's launcher and operator. It runs the taskd
// manager with orchestration on (a rescheduling policy, a local
// supervisor per node as the executor, the nodes' checkpoint owners as
// the checkpoint store), one proxy process per simulated node, and one
// worker process per rank (this program again). Nodes are loopback
// addresses (127.0.1.1, 127.0.1.2, ...) under two access switches, and
// their ranks follow the switch-aware order of package topology.
//
// Each worker trains a synthetic model: every step loads data, runs
// forward with a tensor-parallel all-gather inside, backward, and a
// data-parallel all-reduce over a simulated fabric (a collective waits
// for every member of its group), dotting every phase with package trace.
// It saves a flash checkpoint to memory every few steps (a ckpt.Writer
// into a segment its node's ckpt.Owner holds) and to disk less often, and
// a hang.Watchdog times its collectives.
//
// The faults, one after the other:
//
//	slow-compute  a rank computes 3x slower: trace/slownode finds it in the
//	              live dotting files; the manager replaces its node
//	slow-io       a rank loads data 10x slower: slownode's slowIORanks
//	hang          a rank's all-reduce never completes: every rank's watchdog
//	              fires, the node agent merges their stacks into flame graphs
//	              and names the culprit, the manager restarts it
//	crash         a rank is SIGKILLed: its supervisor reports the exit, the
//	              manager restarts it and every rank resumes from memory
//	link          a link switch fails on one rank: the switch hands over to
//	              a recovery that replaces the node
//
// --steps is the number of healthy steps trained before the first fault,
// between faults and after the last. --fault picks faults by name.
// --keep leaves the job training at the end and prints the /metrics
// addresses of the manager, the proxies and the workers, until Ctrl-C.
//
// Everything lands in --out (default demo-out): the slow-node reports
// (HTML, JSON, text), the merged hang flame graphs (go_stack.svg,
// cpp_stack.svg, py_stack.svg), folded stacks and pprof profile with the
// split verdict, every rank's stack file, the dotting files, the disk
// checkpoints and an inspection of both tiers, the manager's fault log and
// orchestration history, the metrics scraped at the end, the logs of
// every process, and summary.json with each fault's detection and
// recovery. A folder the demo made is replaced on the next run; any other
// non-empty folder is refused.
//
// Every process the demo starts runs in its own process group and dies
// with the demo (Pdeathsig); the shared memory of the checkpoints lives
// under /dev/shm/faultline-demo-<pid>/ and is removed at the end (and,
// after a demo that was killed, by the next run).
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"
)

// The faults, in the order they run.
const (
	faultSlowCompute = "slow-compute"
	faultSlowIO      = "slow-io"
	faultHang        = "hang"
	faultCrash       = "crash"
	faultLink        = "link"
)

var allFaults = []string{faultSlowCompute, faultSlowIO, faultHang, faultCrash, faultLink}

// config is a run of the demo.
type config struct {
	Nodes, ProcsPerNode int
	// Steps of healthy training before the first fault, between faults
	// and after the last.
	Steps  int
	Faults []string // names from allFaults, run in allFaults' order
	Keep   bool
	Out    string

	// Pace and patience; zero means the default beside each.
	StepTime    time.Duration // a healthy step (60 ms)
	HangTimeout time.Duration // a collective running longer is hung (2 s)
	SaveEvery   int64         // flash checkpoint every so many steps (10)
	// PersistEvery is every how many saves one goes to disk too (5).
	PersistEvery int64
}

func (c *config) setDefaults() {
	c.StepTime = cmp.Or(c.StepTime, 60*time.Millisecond)
	c.HangTimeout = cmp.Or(c.HangTimeout, 2*time.Second)
	c.SaveEvery = cmp.Or(c.SaveEvery, 10)
	c.PersistEvery = cmp.Or(c.PersistEvery, 5)
	c.Out = cmp.Or(c.Out, "demo-out")
}

// validate reports the first field that cannot be used.
func (c config) validate() error {
	switch {
	case c.Nodes < 1 || c.Nodes > 200:
		return fmt.Errorf("--nodes %d: want 1 to 200", c.Nodes)
	case c.ProcsPerNode < 1 || c.ProcsPerNode > 64:
		return fmt.Errorf("--procs-per-node %d: want 1 to 64", c.ProcsPerNode)
	case c.Nodes*c.ProcsPerNode < 2:
		return errors.New("--nodes × --procs-per-node: want at least 2 ranks")
	case c.Steps < 1:
		return fmt.Errorf("--steps %d: want at least 1", c.Steps)
	case c.StepTime < 10*time.Millisecond:
		return fmt.Errorf("step time %v: want at least 10ms", c.StepTime)
	case c.HangTimeout < 10*c.StepTime:
		return fmt.Errorf("hang timeout %v: want at least 10 steps (%v)", c.HangTimeout, 10*c.StepTime)
	case c.SaveEvery < 1 || c.PersistEvery < 1:
		return errors.New("checkpoint intervals: want at least 1")
	}
	return nil
}

// parseFaults reads --fault: names separated by commas, "all" for every
// fault. The faults run in allFaults' order whatever the order given.
func parseFaults(s string) ([]string, error) {
	want := map[string]bool{}
	for name := range strings.SplitSeq(s, ",") {
		name = strings.TrimSpace(name)
		switch {
		case name == "":
		case name == "all":
			for _, f := range allFaults {
				want[f] = true
			}
		case slices.Contains(allFaults, name):
			want[name] = true
		default:
			return nil, fmt.Errorf("--fault: unknown fault %q (want %s or all)", name, strings.Join(allFaults, ", "))
		}
	}
	var out []string
	for _, f := range allFaults {
		if want[f] {
			out = append(out, f)
		}
	}
	return out, nil
}

func main() {
	if role := os.Getenv(envRole); role != "" {
		os.Exit(runChild(role))
	}
	var cfg config
	flag.IntVar(&cfg.Nodes, "nodes", 2, "simulated nodes, each with a proxy and a checkpoint owner")
	flag.IntVar(&cfg.ProcsPerNode, "procs-per-node", 4, "worker processes (ranks) per node")
	flag.IntVar(&cfg.Steps, "steps", 40, "healthy steps before the first fault, between faults and after the last")
	faults := flag.String("fault", "all", "faults to inject, comma-separated: "+strings.Join(allFaults, ", "))
	flag.BoolVar(&cfg.Keep, "keep", false, "keep the job running at the end, printing its /metrics addresses, until Ctrl-C")
	flag.StringVar(&cfg.Out, "out", "demo-out", "output folder; one the demo made is replaced, any other must be empty")
	flag.DurationVar(&cfg.StepTime, "step-time", 60*time.Millisecond, "time of a healthy training step")
	flag.DurationVar(&cfg.HangTimeout, "hang-timeout", 2*time.Second, "a collective running longer is hung")
	flag.Parse()
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "demo: unexpected arguments %q\n", flag.Args())
		flag.Usage()
		os.Exit(2)
	}
	var err error
	if cfg.Faults, err = parseFaults(*faults); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		stop()
		os.Exit(1)
	}
}
