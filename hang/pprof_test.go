package hang

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/google/pprof/profile"
)

func TestPprofParsesBack(t *testing.T) {
	m := mergeJob8(t)
	var buf bytes.Buffer
	if err := m.WritePprof(&buf); err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(buf.Bytes(), []byte{0x1f, 0x8b}) {
		t.Error("profile is not gzipped")
	}
	p, err := profile.Parse(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.CheckValid(); err != nil {
		t.Fatal(err)
	}
	if len(p.SampleType) != 1 || p.SampleType[0].Type != "ranks" {
		t.Errorf("sample types %v", p.SampleType)
	}
	// One sample per rank and distinct stack: the folded counts.
	want := m.Trees[KindPython].Weight() + m.Trees[KindNative].Weight()
	if len(p.Sample) != want {
		t.Errorf("%d samples, want %d", len(p.Sample), want)
	}
	ranks := map[int64]bool{}
	for _, s := range p.Sample {
		if len(s.NumLabel["rank"]) != 1 || len(s.Label["kind"]) != 1 || s.Label["state"][0] != "S (sleeping)" {
			t.Fatalf("sample labels %v %v", s.Label, s.NumLabel)
		}
		r := s.NumLabel["rank"][0]
		ranks[r] = true
		wantNode := "node-0"
		if r >= 4 {
			wantNode = "node-1"
		}
		if got := s.Label["node"]; len(got) != 1 || got[0] != wantNode {
			t.Errorf("rank %d node %v", r, got)
		}
		if s.Label["kind"][0] == "python" && r == 6 {
			if leaf := s.Location[0].Line[0]; leaf.Function.Name != "barrier" && leaf.Function.Name != "wait" {
				t.Errorf("rank 6 python leaf %s", leaf.Function.Name)
			}
		}
	}
	if len(ranks) != 7 || ranks[5] {
		t.Errorf("ranks in samples %v", ranks)
	}
}

// TestGoToolPprofOpensProfile runs `go tool pprof -top` on the profile, as
// an operator would.
func TestGoToolPprofOpensProfile(t *testing.T) {
	goTool := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := os.Stat(goTool); err != nil {
		var lerr error
		if goTool, lerr = exec.LookPath("go"); lerr != nil {
			t.Skip("the go tool is not installed")
		}
	}
	m := mergeJob8(t)
	path := filepath.Join(t.TempDir(), PprofFile)
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.WritePprof(f); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(goTool, "tool", "pprof", "-top", path)
	cmd.Env = append(os.Environ(), "PPROF_TMPDIR="+t.TempDir())
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("go tool pprof -top: %v\n%s", err, out)
	}
	text := string(out)
	for _, want := range []string{"Type: ranks", "barrier", "all_reduce", "__futex_abstimed_wait_common"} {
		if !strings.Contains(text, want) {
			t.Errorf("pprof -top output lacks %q:\n%s", want, text)
		}
	}
}
