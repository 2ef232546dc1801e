package trace_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/faultline-ml/faultline/trace"
)

// A training loop dots its phases; an analysis reads them back as ranges.
func Example() {
	root, _ := os.MkdirTemp("", "profiling")
	defer os.RemoveAll(root)

	rec, err := trace.NewRecorder(trace.RecorderConfig{
		Root: root, Job: "job-1", Rank: 0, Switch: trace.AllOn(),
	})
	if err != nil {
		panic(err)
	}
	go rec.Run(context.Background())
	for step := uint64(1); step <= 2; step++ {
		s := rec.StartStep(step, 0, 0)
		rec.Start(trace.DataLoader, trace.MarkerDataLoader, 0, 0).End()
		rec.Start(trace.FP, trace.MarkerForward, 0, 0).End()
		rec.StartComm(&trace.CommOp{OpName: "HcclAllReduce", GroupName: "dp", Count: 1024, DataType: "bf16"}, 0, 1).End()
		s.End()
	}
	rec.Close()

	rr, _ := trace.OpenRankReader(filepath.Join(root, "job-1", "0"), trace.ReaderConfig{})
	defer rr.Close()
	var p trace.Pairer
	rr.Read(func(r *trace.Record) error {
		if rg, ok := p.Add(r); ok {
			k, _ := rg.Kind()
			fmt.Println(k, rg.End >= rg.Start)
		}
		return nil
	})
	// Output:
	// DataLoader true
	// FP true
	// CommunicationOperator true
	// Step true
	// DataLoader true
	// FP true
	// CommunicationOperator true
	// Step true
}

func ExampleParseSwitch() {
	s, err := trace.ParseSwitch([]byte(`{"CommunicationOperator":"off","Step":"on","SaveCheckpoint":"on","FP":"on","DataLoader":"on"}`))
	fmt.Println(s.Enabled(trace.FP), s.DomainEnabled(trace.DomainCommunication), err)

	_, err = trace.ParseSwitch([]byte(`{"Step":"yes"}`))
	fmt.Println(err)
	// Output:
	// true false <nil>
	// trace: profiling switch: field Step: value "yes": want "on" or "off"
}

// A SwitchWatcher applies a mounted switch file to a Recorder.
func ExampleSwitchWatcher() {
	dir, _ := os.MkdirTemp("", "datatrace-config")
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "profilingSwitch")
	os.WriteFile(path, []byte(`{"Step":"on","FP":"on"}`), 0o644)

	rec, _ := trace.NewRecorder(trace.RecorderConfig{Root: dir, Job: "j"})
	go rec.Run(context.Background())
	defer rec.Close()
	applied := make(chan struct{}, 1)
	w, _ := trace.NewSwitchWatcher(trace.SwitchWatcherConfig{Path: path, OnChange: func(s trace.Switch) {
		rec.SetSwitch(s)
		applied <- struct{}{}
	}})
	go w.Run(context.Background())
	defer w.Close()

	<-applied
	fmt.Println(rec.Enabled(trace.Step), rec.Enabled(trace.CommunicationOperator))
	// Output: true false
}

func ExampleRecord_AppendJSON() {
	r := trace.Record{Kind: trace.ActivityKindMarker, Flag: trace.FlagDeviceStart, Timestamp: 1731000000000000000,
		ID: 7, ProcessID: 42, ThreadID: 42, DeviceID: 3, StreamID: 1, Name: "step 12", Domain: trace.DomainDefault}
	fmt.Println(string(r.AppendJSON(nil)))
	// Output:
	// {"Kind":1,"Flag":16,"SourceKind":0,"Timestamp":1731000000000000000,"Id":7,"MsptiObjectId":{"Pt":{"ProcessId":42,"ThreadId":42},"Ds":{"DeviceId":3,"StreamId":1}},"Name":"step 12","Domain":"default"}
}

func ExamplePairer() {
	var p trace.Pairer
	p.Add(&trace.Record{Flag: trace.FlagHostStart, ID: 1, Timestamp: 100, Name: "dataloader", Domain: "default"})
	r, ok := p.Add(&trace.Record{Flag: trace.FlagHostEnd, ID: 1, Timestamp: 350})
	fmt.Println(r.Name, r.Duration(), ok)
	// Output: dataloader 250ns true
}

// An Ager keeps the root within its budget, oldest record files first.
func ExampleAger() {
	root, _ := os.MkdirTemp("", "profiling")
	defer os.RemoveAll(root)
	dir := filepath.Join(root, "job-1", "0")
	os.MkdirAll(dir, 0o750)
	for i := range 10 {
		os.WriteFile(filepath.Join(dir, fmt.Sprint(1731000000+i)), make([]byte, 1000), 0o640)
	}
	a, _ := trace.NewAger(trace.AgerConfig{Root: root, BudgetBytes: 8500})
	rep, _ := a.Check()
	fmt.Println(rep.DeletedFiles, rep.Files, rep.Bytes)
	// Output: 2 8 8000
}

func ExampleListRanks() {
	job, _ := os.MkdirTemp("", "job")
	defer os.RemoveAll(job)
	for _, r := range []string{"0", "1", "12", "parallel_group.json"} {
		os.Mkdir(filepath.Join(job, r), 0o750)
	}
	ranks, _ := trace.ListRanks(job)
	fmt.Println(ranks)
	// Output: [0 1 12]
}
