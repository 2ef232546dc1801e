package slownode

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/trace/slownode/internal/gen"
)

// TestHTMLInChromium opens the report of a generated job (a slow rank and
// a slow data loader among 16 ranks) in headless Chromium: its script
// runs without an error, and the charts and tables are there.
// FAULTLINE_SCREENSHOTS=dir also saves dir/slownode-report.png, the
// screenshot the README shows (docs/screenshots.sh).
func TestHTMLInChromium(t *testing.T) {
	root := t.TempDir()
	_, err := gen.Generate(gen.Config{Root: root, Job: "train-16", TP: 4, DP: 4, PP: 1, Steps: 60, Seed: 42,
		CheckpointEach: 20, Inject: []gen.Injection{
			{Kind: gen.SlowRank, Rank: 9, From: 30, Factor: 1.4},
			{Kind: gen.SlowIO, Rank: 2, From: 35, Factor: 6},
		}})
	if err != nil {
		t.Fatal(err)
	}
	r, err := Analyze(t.Context(), filepath.Join(root, "train-16"), Config{})
	if err != nil {
		t.Fatal(err)
	}
	page := filepath.Join(root, "report.html")
	f, err := os.Create(page)
	if err != nil {
		t.Fatal(err)
	}
	if err := WriteHTML(f, r); err != nil {
		t.Fatal(err)
	}
	f.Close()
	png := ""
	if dir := os.Getenv("FAULTLINE_SCREENSHOTS"); dir != "" {
		png = filepath.Join(dir, "slownode-report.png")
	}
	dom, console := testkit.Chromium(t, page, png, 1900)
	if len(console) > 0 {
		t.Errorf("console messages:\n%s", strings.Join(console, "\n"))
	}
	for _, want := range []string{`title="click to sort"`, "Compute time per rank", "Dataloader time per rank",
		"onset, step 30", "<polyline class=\"slow\""} {
		if !strings.Contains(dom, want) {
			t.Errorf("page as rendered lacks %q", want)
		}
	}
}
