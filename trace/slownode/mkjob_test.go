package slownode

import (
	"os"
	"testing"

	"github.com/faultline-ml/faultline/trace/slownode/internal/gen"
)

func TestMakeJob(t *testing.T) {
	dir := os.Getenv("MKJOB")
	if dir == "" {
		t.Skip()
	}
	_, err := gen.Generate(gen.Config{Root: dir, Job: "job", TP: 4, PP: 2, DP: 4, Steps: 80, Seed: 3, Garbage: true, CheckpointEach: 25,
		Inject: []gen.Injection{{Kind: gen.SlowRank, Rank: 13, From: 40, Factor: 1.4}, {Kind: gen.SlowIO, Rank: 2, From: 50, Factor: 6}}})
	if err != nil {
		t.Fatal(err)
	}
}
