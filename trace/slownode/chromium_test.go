package slownode

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/faultline-ml/faultline/trace/slownode/internal/gen"
)

// chromium opens file in headless Chromium and returns the document as
// its scripts left it and the console's messages (an uncaught error among
// them), skipping the test where Chromium is not installed. With png set
// it also saves a screenshot of the first height pixels at 1,400 wide.
func chromium(t *testing.T, file, png string, height int) (dom string, console []string) {
	t.Helper()
	bin, err := exec.LookPath("chromium")
	if err != nil {
		t.Skip("chromium not installed (Debian package chromium): the pages are checked in a real browser")
	}
	run := func(args ...string) (stdout, stderr []byte) {
		args = append([]string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
			"--disable-background-networking", "--disable-component-update", "--disable-sync",
			"--user-data-dir=" + t.TempDir(), "--enable-logging=stderr", "--v=0", "--hide-scrollbars"}, args...)
		cmd := exec.Command(bin, append(args, "file://"+file)...)
		var out, errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Run(); err != nil {
			t.Fatalf("chromium %v: %v\n%s", args, err, errb.Bytes())
		}
		return out.Bytes(), errb.Bytes()
	}
	out, errb := run("--dump-dom")
	for line := range strings.Lines(string(errb)) {
		if strings.Contains(line, ":CONSOLE") {
			console = append(console, strings.TrimSpace(line))
		}
	}
	if png != "" {
		run("--window-size=1400,"+strconv.Itoa(height), "--screenshot="+png)
	}
	return string(out), console
}

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
	dom, console := chromium(t, page, png, 1900)
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
