package main

import (
	"context"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if rank := os.Getenv(envWorker); rank != "" {
		os.Exit(worker(rank)) // the demo re-executes this test binary as its workers
	}
	goleak.VerifyTestMain(m)
}

// TestDemo runs the demo in a short configuration and checks its report.
func TestDemo(t *testing.T) {
	var out strings.Builder
	cfg := config{Workers: 2, Phase: 1200 * time.Millisecond, Out: t.TempDir()}
	if err := run(context.Background(), cfg, &out); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	report := out.String()
	t.Log("\n" + report)
	for _, want := range []string{
		"/profiling/default_task_id_",
		"rank 0: ", "rank 1: ",
		"parallel groups: dp-0=dp[0] tp-0=tp[0 1]",
		"ranges of a kind switched off, started more than 1 s after the switch: 0",
	} {
		if !strings.Contains(report, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	if !regexp.MustCompile(`(?m)^3 +[0-9.]+s +\(all off\)$`).MatchString(report) {
		t.Error("report lacks phase 3, all off")
	}
	if n := strings.Count(report, " 0 damaged lines, 0 unmatched ends"); n != 2 {
		t.Errorf("%d ranks read cleanly, want 2", n)
	}
	// Phase 1 has every kind on: each rank recorded steps and collectives.
	phase1 := regexp.MustCompile(`phase 1 +([0-9]+) +([0-9]+) +([0-9]+) +([0-9]+) +([0-9]+)`)
	for _, m := range phase1.FindAllStringSubmatch(report, -1) {
		if m[1] == "0" || m[5] == "0" {
			t.Errorf("phase 1 row %q: no steps or no collectives", m[0])
		}
	}
}
