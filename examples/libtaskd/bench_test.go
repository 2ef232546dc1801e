package main

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/trace"
)

// BenchmarkTimeNow is the baseline of the Go benchmarks: one clock read.
func BenchmarkTimeNow(b *testing.B) {
	for b.Loop() {
		_ = time.Now()
	}
}

// BenchmarkRecorderSpan is the recorder's own cost of a range, the floor
// under BenchmarkRangeTable.
func BenchmarkRecorderSpan(b *testing.B) {
	rec, _ := newTestRecorder(b, trace.Switch{FP: true})
	for b.Loop() {
		rec.Start(trace.FP, trace.MarkerForward, 0, 0).End()
	}
}

// BenchmarkRangeTable is what taskd_range_start and taskd_range_end cost
// in Go, cgo's call overhead aside: the name parsed, the span kept by id.
func BenchmarkRangeTable(b *testing.B) {
	rec, _ := newTestRecorder(b, trace.Switch{FP: true, Step: true})
	rt := newRangeTable(rec, 0)
	b.Run("forward", func(b *testing.B) {
		for b.Loop() {
			id, _ := rt.start("forward", "")
			rt.end(id)
		}
	})
	b.Run("step", func(b *testing.B) {
		for b.Loop() {
			id, _ := rt.start("step 123456", "default")
			rt.end(id)
		}
	})
	b.Run("off", func(b *testing.B) {
		for b.Loop() {
			id, _ := rt.start("dataloader", "")
			rt.end(id)
		}
	})
	b.Run("parallel", func(b *testing.B) {
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				id, _ := rt.start("forward", "")
				rt.end(id)
			}
		})
	})
}

// BenchmarkPython times ranges from Python through faultline_taskd and the
// built library, beside a bare ctypes call and a ctypes call into the
// library that does nothing, all in one Python run of at least 200000
// iterations each; the figures are the ns/… metrics (ns/op is the whole
// run, Python's start-up included).
func BenchmarkPython(b *testing.B) {
	lib := library(b)
	env := []string{"MINDX_TASK_ID=bench", "BENCH_N=" + strconv.Itoa(max(b.N, 200000)),
		`TRAINER_CONFIG={"insecure":true,"root":"` + b.TempDir() + `","marker_library":"off",` +
			`"switch":{"Step":"on","FP":"on","DataLoader":"on","SaveCheckpoint":"off","CommunicationOperator":"off"}}`}
	py := startPython(b, lib, "bench", env...)
	line := py.expect("bench", 10*time.Minute)
	py.wait(time.Minute)
	var m map[string]float64
	if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "bench ")), &m); err != nil {
		b.Fatalf("%q: %v", line, err)
	}
	for k, v := range m {
		b.ReportMetric(v, "ns/"+k)
	}
}
