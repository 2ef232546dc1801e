package slownode

import (
	"context"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/trace/slownode/internal/gen"
)

func TestDbgTime(t *testing.T) {
	root := t.TempDir()
	t0 := time.Now()
	_, err := gen.Generate(gen.Config{Root: root, Job: "j", TP: 8, PP: 2, DP: 4, Steps: 60, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	t1 := time.Now()
	_, err = Analyze(context.Background(), root+"/j", Config{})
	t.Log(t1.Sub(t0), time.Since(t1))
}
