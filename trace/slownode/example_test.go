package slownode_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/faultline-ml/faultline/trace"
	"github.com/faultline-ml/faultline/trace/slownode"
	"github.com/faultline-ml/faultline/trace/slownode/internal/gen"
)

// A detector fed per-step figures of eight ranks, one of which computes
// 40% slower from step 20 on, while its tensor-parallel peers wait for it.
func ExampleDetector() {
	d, err := slownode.New(slownode.Config{})
	if err != nil {
		panic(err)
	}
	d.AddGroups(trace.ParallelGroups{
		"tp0": {GroupName: "tp", GlobalRanks: []int{0, 1, 2, 3}},
		"tp1": {GroupName: "tp", GlobalRanks: []int{4, 5, 6, 7}},
	})
	for n := int64(0); n < 30; n++ {
		compute := [8]time.Duration{}
		for r := range compute {
			compute[r] = time.Duration(100+r%3) * time.Millisecond
		}
		if n >= 20 {
			compute[6] = 140 * time.Millisecond
		}
		for r := range 8 {
			group, slowest := "tp0", time.Duration(0)
			if r >= 4 {
				group = "tp1"
			}
			for p := r / 4 * 4; p < r/4*4+4; p++ {
				slowest = max(slowest, compute[p])
			}
			wait := slowest - compute[r] + 10*time.Millisecond
			d.AddStep(r, slownode.Step{Number: n, Time: slowest + 10*time.Millisecond, Compute: compute[r],
				Comm: []slownode.CommTime{{Group: group, Op: "HcclAllReduce", Time: wait}}, Have: slownode.FigComm})
		}
	}
	r := d.Result()
	fmt.Println("slow:", r.IsSlow, "ranks:", r.SlowCalculateRanks, "since step", r.OnsetStep)
	f := r.Findings[0]
	fmt.Printf("%s rank %v: %.0f ms against %.0f ms for its peers (%s)\n", f.Kind, f.Ranks, f.Recent, f.Baseline, f.Method)
	// Output:
	// slow: 1 ranks: [6] since step 20
	// compute rank [6]: 140 ms against 101 ms for its peers (relative+homogenisation)
}

// Analyze reads a job folder once and gives the verdict.
func ExampleAnalyze() {
	root, _ := os.MkdirTemp("", "profiling")
	defer os.RemoveAll(root)
	// A job's dotting files, here generated: 16 ranks for 60 steps, rank 6
	// computing half as slow again from step 40.
	gen.Generate(gen.Config{Root: root, Job: "my-job", TP: 4, DP: 4, PP: 1, Steps: 60, Seed: 11,
		Inject: []gen.Injection{{Kind: gen.SlowRank, Rank: 6, From: 40, Factor: 1.5}}})

	r, err := slownode.Analyze(context.Background(), filepath.Join(root, "my-job"), slownode.Config{RanksPerNode: 8})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return
	}
	fmt.Println("slow:", r.IsSlow, "compute:", r.SlowCalculateRanks, "hosts:", r.SlowHostNodes)
	// Output:
	// slow: 1 compute: [6] hosts: []
}

// Watch tails a running job and reports each change of verdict.
func ExampleWatch() {
	root, _ := os.MkdirTemp("", "profiling")
	defer os.RemoveAll(root)
	gen.Generate(gen.Config{Root: root, Job: "my-job", TP: 4, DP: 4, PP: 1, Steps: 60, Seed: 11,
		Inject: []gen.Injection{{Kind: gen.SlowRank, Rank: 6, From: 40, Factor: 1.5}}})

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := slownode.Watch(ctx, filepath.Join(root, "my-job"), slownode.Config{}, func(r *slownode.Result) {
		if r.IsSlow == 1 {
			fmt.Println("slow:", r.IsSlow, "compute:", r.SlowCalculateRanks, "hosts:", r.SlowHostNodes)
			cancel() // done watching
		}
	})
	if err != nil && !errors.Is(err, context.Canceled) {
		fmt.Fprintln(os.Stderr, err)
	}
	// Output:
	// slow: 1 compute: [6] hosts: []
}
