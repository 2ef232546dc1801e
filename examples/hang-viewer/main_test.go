package main

import (
	"bytes"
	"encoding/xml"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/pprof/profile"
	"go.uber.org/goleak"
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
