package main

import (
	"bytes"
	"encoding/xml"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/pprof/profile"
	"go.uber.org/goleak"

	"github.com/faultline-ml/faultline/hang"
)

const job8 = "../../hang/testdata/job8"

func TestMain(m *testing.M) {
	// The end-to-end test runs this binary as the command itself.
	if os.Getenv("HANG_VIEWER_MAIN") == "1" {
		main()
	}
	goleak.VerifyTestMain(m)
}

func TestViewerWritesEverything(t *testing.T) {
	out := t.TempDir()
	var stdout, stderr bytes.Buffer
	if code := run([]string{"--path", job8, "--out", out}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	verdict := stdout.String()
	for _, want := range []string{
		"world 8: stacks from 7 ranks (0-4/6-7); 1 missing (5)",
		"1 rank  6                -> save_checkpoint@train.py:88",
		"00005-00008.stacktrace:24: last line cut short",
	} {
		if !strings.Contains(verdict, want) {
			t.Errorf("verdict lacks %q:\n%s", want, verdict)
		}
	}
	for _, name := range []string{"py_stack.svg", "cpp_stack.svg", "py_stack.folded", "cpp_stack.folded", "stacks.pb.gz"} {
		data, err := os.ReadFile(filepath.Join(out, name))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(verdict, filepath.Join(out, name)) {
			t.Errorf("verdict does not list %s", name)
		}
		switch filepath.Ext(name) {
		case ".svg":
			dec := xml.NewDecoder(bytes.NewReader(data))
			for {
				_, err := dec.Token()
				if err == io.EOF {
					break
				}
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
			}
		case ".folded":
			if !strings.Contains(string(data), "State@S (sleeping);") {
				t.Errorf("%s:\n%s", name, data)
			}
		case ".gz":
			p, err := profile.Parse(bytes.NewReader(data))
			if err != nil || len(p.Sample) == 0 {
				t.Errorf("%s: %v", name, err)
			}
		}
	}
	if matches, _ := filepath.Glob(filepath.Join(out, "go_stack.*")); len(matches) != 0 {
		t.Errorf("go files for a job without Go stacks: %v", matches)
	}
}

// TestViewerWritesOnlyWhatHasContent merges ranks that gave Python stacks
// only: no native file is written (one an earlier merge left is removed),
// and the listing says why.
func TestViewerWritesOnlyWhatHasContent(t *testing.T) {
	in, out := t.TempDir(), t.TempDir()
	for r := range 4 {
		d := &hang.Dump{Rank: r, World: 4, State: "S (sleeping)", Threads: []hang.Thread{{Kind: hang.KindPython, ID: 1,
			Frames: []hang.Frame{{Func: "all_reduce", File: "c10d.py", Line: 9}, {Func: "<module>", File: "train.py", Line: 3}}}}}
		if _, err := hang.WriteStackFile(in, d); err != nil {
			t.Fatal(err)
		}
	}
	stale := filepath.Join(out, hang.NativeSVGFile)
	if err := os.WriteFile(stale, []byte("<svg/>"), 0o644); err != nil {
		t.Fatal(err)
	}
	var stdout, stderr bytes.Buffer
	if code := run([]string{"--path", in, "--out", out}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if !strings.Contains(stdout.String(), "no native stacks from any rank: cpp_stack.svg and cpp_stack.folded not written") ||
		strings.Contains(stdout.String(), "Python stacks from any rank") {
		t.Errorf("listing:\n%s", stdout.String())
	}
	ents, _ := os.ReadDir(out)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if want := []string{"py_stack.folded", "py_stack.svg", "stacks.pb.gz"}; !slices.Equal(names, want) {
		t.Errorf("wrote %v, want %v", names, want)
	}
}

func TestViewerUsage(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := run(nil, &stdout, &stderr); code != 2 || !strings.Contains(stderr.String(), "usage") {
		t.Errorf("no args: exit %d, %q", code, stderr.String())
	}
	if code := run([]string{"--path", t.TempDir()}, &stdout, &stderr); code != 1 || !strings.Contains(stderr.String(), "no stack files") {
		t.Errorf("empty folder: exit %d, %q", code, stderr.String())
	}
}

// TestViewerProcess runs the command as its own process, default --out.
func TestViewerProcess(t *testing.T) {
	dir := t.TempDir()
	entries, err := os.ReadDir(job8)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		data, err := os.ReadFile(filepath.Join(job8, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, e.Name()), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(os.Args[0], "--path", dir)
	cmd.Env = append(os.Environ(), "HANG_VIEWER_MAIN=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if !strings.Contains(string(out), "python stacks from 7 ranks: 1 split") {
		t.Errorf("output:\n%s", out)
	}
	if _, err := os.Stat(filepath.Join(dir, "cpp_stack.svg")); err != nil {
		t.Error(err)
	}
}
