package trace

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// envChild selects a child mode when the test binary is re-executed.
const envChild = "FAULTLINE_TRACE_TEST_CHILD"

func TestMain(m *testing.M) {
	if mode := os.Getenv(envChild); mode != "" {
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

// child returns a command that re-executes the test binary in mode.
func child(t *testing.T, mode string, env ...string) *exec.Cmd {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), append([]string{envChild + "=" + mode}, env...)...)
	cmd.Stderr = os.Stderr
	return cmd
}

// waitFor polls cond until it holds or the generous deadline passes; it is
// for conditions produced by other processes or by the file system, where
// there is no event to wait on.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
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
