package hang_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"strings"

	"github.com/faultline-ml/faultline/hang"
)

// A trainer times its collectives; the watchdog reports a hang after the
// learned timeout and writes this process's stacks to DumpDir.
func Example() {
	var faults []hang.Fault // written by Run's goroutine, read once it returned
	w, err := hang.New(hang.Config{Rank: 3, World: 8, DumpDir: os.TempDir(), LearnTimeouts: true,
		OnFault: func(f hang.Fault) { faults = append(faults, f) }})
	if err != nil {
		log.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()

	allreduce := w.Op("HcclAllReduce", "dp") // once
	for step := 0; step < 3; step++ {
		t := allreduce.Start(0) // per call: no allocation
		// ... the all-reduce runs ...
		t.End()
	}
	cancel()
	fmt.Println(<-done, len(faults), "faults")
	// Output:
	// context canceled 0 faults
}

func ExampleWatchdog_Check() {
	w, err := hang.New(hang.Config{Rank: 3, World: 8})
	if err != nil {
		log.Fatal(err)
	}
	send := w.Op("HcclSend", "pp")
	t := send.Start(1)
	t.Fail(errors.New("HCCL error 7: remote rank gone"))
	for _, f := range w.Check() {
		fmt.Println(f.Kind, f.Rank, f.Op, f.Group, f.Stream, f.Err)
	}
	// Output: op_error 3 HcclSend pp 1 HCCL error 7: remote rank gone
}

func ExampleMergeDir() {
	m, err := hang.MergeDir("testdata/job8", hang.MergeConfig{})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("missing:", m.Missing)
	s := m.Splits()[0]
	fmt.Printf("%s: ranks %s split below %s\n", s.Kind, s.Ranks, s.Path[len(s.Path)-1].Func)
	for _, g := range s.Groups {
		fmt.Printf("  %s -> %s\n", g.Ranks, g.Frame.Func)
	}
	// Output:
	// missing: 5
	// python: ranks 0-4/6-7 split below train
	//   6 -> save_checkpoint
	//   0-4/7 -> train_step
}

func ExampleMerged_WriteFolded() {
	var dumps []*hang.Dump
	for rank := range 4 {
		fn := "allreduce"
		if rank == 2 {
			fn = "dataloader"
		}
		dumps = append(dumps, &hang.Dump{Rank: rank, World: 4, State: "S (sleeping)", Threads: []hang.Thread{{
			Kind:   hang.KindPython,
			Frames: []hang.Frame{{Func: fn, File: "train.py", Line: 10}, {Func: "main", File: "train.py", Line: 3}},
		}}})
	}
	m, err := hang.Merge(dumps, hang.MergeConfig{})
	if err != nil {
		log.Fatal(err)
	}
	m.WriteFolded(os.Stdout, hang.KindPython)
	// Output:
	// State@S (sleeping);main@train.py:3@0-3|;allreduce@train.py:10@0-1/3|2 3
	// State@S (sleeping);main@train.py:3@0-3|;dataloader@train.py:10@2|0-1/3 1
}

func ExampleRanks() {
	r, err := hang.ParseRanks("11-15/9/0-3/2")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(r, r.Len(), r.Has(2), r.Has(5))
	// Output:
	// 0-3/9/11-15 10 true false
}

func ExampleDump_Marshal() {
	d := &hang.Dump{Rank: 1, World: 2, State: "S (sleeping)", Threads: []hang.Thread{{
		Kind: hang.KindGo, ID: 7, Name: "goroutine 7", State: "chan receive",
		Frames: []hang.Frame{{Func: "main.wait", File: "/app/main.go", Line: 12}},
	}}}
	b, err := d.Marshal()
	if err != nil {
		log.Fatal(err)
	}
	fmt.Print(string(b))
	// Output:
	// faultline-stacktrace 1
	// rank 1
	// world 2
	// state "S (sleeping)"
	// thread go 7 "goroutine 7" "chan receive"
	// frame "main.wait" "/app/main.go" 12
	// end 1 1
}

func ExampleCapture() {
	d, err := hang.Capture(context.Background(), 0) // this process
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(d.Threads[0].Kind, strings.HasPrefix(d.State, "R") || strings.HasPrefix(d.State, "S"))
	// Output: go true
}
