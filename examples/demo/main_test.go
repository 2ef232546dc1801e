package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/faultline-ml/faultline/trace/slownode"
)

func TestMain(m *testing.M) {
	if role := os.Getenv(envRole); role != "" {
		os.Exit(runChild(role)) // the demo re-executes this test binary as its proxies and workers
	}
	goleak.VerifyTestMain(m)
}

// TestDemo runs the whole demo on a small job and checks that every fault
// was detected, blamed on the rank it was injected into, recovered from,
// and that the outputs the README points at were written.
func TestDemo(t *testing.T) {
	out := filepath.Join(t.TempDir(), "out")
	var story strings.Builder
	cfg := config{Nodes: 2, ProcsPerNode: 2, Steps: 25, Faults: allFaults, Out: out}
	err := run(context.Background(), cfg, &story)
	t.Log("\n" + story.String())
	if err != nil {
		t.Fatal(err)
	}

	b, err := os.ReadFile(filepath.Join(out, "summary.json"))
	if err != nil {
		t.Fatal(err)
	}
	var sum summary
	if err := json.Unmarshal(b, &sum); err != nil {
		t.Fatalf("summary.json: %v", err)
	}
	if !sum.OK || len(sum.Faults) != len(allFaults) {
		t.Fatalf("summary.json: ok %v, %d faults, want %d", sum.OK, len(sum.Faults), len(allFaults))
	}
	for i, f := range sum.Faults {
		if f.Name != allFaults[i] {
			t.Errorf("fault %d is %q, want %q", i, f.Name, allFaults[i])
		}
		if !f.Detected || !f.Recovered || !f.Healthy || f.Error != "" {
			t.Errorf("%s: detected %v, recovered %v, healthy after %v, error %q", f.Name, f.Detected, f.Recovered, f.Healthy, f.Error)
		}
		// The detections that name ranks must name the one at fault.
		if len(f.Culprit) > 0 && !slices.Contains(f.Culprit, f.Rank) {
			t.Errorf("%s: injected on rank %d, detection named %v", f.Name, f.Rank, f.Culprit)
		}
		// A slow rank is named in the verdict of a step soon after the
		// first it slowed: steps, not seconds, which a loaded machine
		// stretches.
		if slow := f.Name == faultSlowCompute || f.Name == faultSlowIO; slow &&
			(f.OnsetStep <= 0 || f.DetectionSteps < 0 || f.DetectionSteps > slownode.DefaultConsecutive+3) {
			t.Errorf("%s: onset step %d, named in the verdict of step %d, %d steps later; want at most %d",
				f.Name, f.OnsetStep, f.DetectionStep, f.DetectionSteps, slownode.DefaultConsecutive+3)
		}
		if f.Recovery == nil || f.Recovery.State != "recovered" {
			t.Errorf("%s: recovery %+v, want one that ended recovered", f.Name, f.Recovery)
		}
	}
	for _, name := range []string{
		"1-slow-compute/slownode.html",
		"2-slow-io/slownode.html",
		"3-hang/go_stack.svg",
		"3-hang/stacks.pb.gz",
		"3-hang/verdict.txt",
		"ckpt-inspect.txt",
		"orchestrations.json",
		"manager/faults.jsonl",
		"hccl.json",
	} {
		if fi, err := os.Stat(filepath.Join(out, name)); err != nil || fi.Size() == 0 {
			t.Errorf("output %s: missing or empty (%v)", name, err)
		}
	}
	if ms, _ := filepath.Glob(filepath.Join(out, "metrics", "*")); len(ms) == 0 {
		t.Error("no metrics scraped")
	}
}

// TestFlags checks that bad flags get an error naming them.
func TestFlags(t *testing.T) {
	if _, err := parseFaults("hang,nope"); err == nil || !strings.Contains(err.Error(), `"nope"`) {
		t.Errorf("parseFaults: %v", err)
	}
	got, err := parseFaults("link, crash,hang")
	if err != nil || !slices.Equal(got, []string{faultHang, faultCrash, faultLink}) {
		t.Errorf("parseFaults: %v %v", got, err)
	}
	for _, c := range []struct {
		cfg  config
		want string
	}{
		{config{Nodes: 0, ProcsPerNode: 4, Steps: 40}, "--nodes 0"},
		{config{Nodes: 1, ProcsPerNode: 1, Steps: 40}, "at least 2 ranks"},
		{config{Nodes: 2, ProcsPerNode: 4, Steps: 0}, "--steps 0"},
	} {
		c.cfg.setDefaults()
		if err := c.cfg.validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("validate %+v: %v, want %q", c.cfg, err, c.want)
		}
	}
}
