package trace

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"

	"go.uber.org/goleak"

	"github.com/faultline-ml/faultline/internal/testkit"
)

func TestMain(m *testing.M) {
	if mode := testkit.Role(); mode != "" {
		os.Exit(runChild(mode))
	}
	goleak.VerifyTestMain(m)
}

// runChild is the body of a re-executed test binary.
func runChild(mode string) int {
	root := os.Getenv("TRACE_ROOT")
	switch mode {
	case "resolve-job":
		job, err := ResolveJob(root)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Println(job)
		return 0
	case "write-forever":
		// Writes records, flushing each batch, and says how many are on disk
		// after each flush until it is killed.
		rank, _ := strconv.Atoi(os.Getenv("TRACE_RANK"))
		rec, err := NewRecorder(RecorderConfig{
			Root: root, Job: "killed", Rank: rank, Switch: AllOn(), MaxFileBytes: 64 << 10,
		})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		go rec.Run(context.Background())
		flushed := 0
		for step := uint64(0); ; step++ {
			for i := 0; i < 50; i++ {
				s := rec.StartStep(step, 0, 0)
				f := rec.Start(FP, MarkerForward, 0, 1)
				f.End()
				s.End()
			}
			if err := rec.Flush(); err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
			flushed += 200
			fmt.Println(flushed) // blocks once the parent stops reading: the writes stay few
		}
	}
	fmt.Fprintln(os.Stderr, "unknown child mode", mode)
	return 2
}

// readAll reads every record of a rank folder.
func readAll(t *testing.T, dir string) ([]Record, ReaderStats) {
	t.Helper()
	rr, err := OpenRankReader(dir, ReaderConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer rr.Close()
	var recs []Record
	if err := rr.Read(func(r *Record) error { recs = append(recs, *r); return nil }); err != nil {
		t.Fatal(err)
	}
	return recs, rr.Stats()
}
