package hang

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// job64 is the stacks of a 64-rank PyTorch job where one rank (37) is
// still loading data while the other 63 wait for it in all_reduce.
func job64() []*Dump {
	const lib = "/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py"
	common := []Frame{{Func: "train_step", File: "/workspace/megatron/training.py", Line: 412},
		{Func: "train", File: "/workspace/megatron/training.py", Line: 781},
		{Func: "<module>", File: "/workspace/pretrain_gpt.py", Line: 230}}
	waiting := append([]Frame{{Func: "all_reduce", File: lib, Line: 2050},
		{Func: "wrapper", File: "/usr/lib/python3/dist-packages/torch/distributed/c10d_logger.py", Line: 75},
		{Func: "reduce_gradients", File: "/workspace/megatron/optimizer.py", Line: 98}}, common...)
	loading := append([]Frame{{Func: "read", File: "/usr/lib/python3.11/socket.py", Line: 720},
		{Func: "_recv", File: "/workspace/megatron/data/remote.py", Line: 51},
		{Func: "get_batch", File: "/workspace/megatron/data/loader.py", Line: 133}}, common...)
	dumps := make([]*Dump, 64)
	for r := range dumps {
		frames := waiting
		if r == 37 {
			frames = loading
		}
		dumps[r] = &Dump{Rank: r, World: 64, State: "S (sleeping)",
			Threads: []Thread{{Kind: KindPython, ID: 1, Name: "MainThread", Frames: frames}}}
	}
	return dumps
}

// TestSVGShowsTheRankThatParted: in a 64-rank job with one rank elsewhere,
// that rank's frames (1/64 of the width by weight) carry their label,
// ranks first, marked as the group that parted; every label is short
// (no package path, the file's base name) and the full one is in the
// tooltip.
func TestSVGShowsTheRankThatParted(t *testing.T) {
	m, err := Merge(job64(), MergeConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	if err := m.WriteSVG(&b, KindPython); err != nil {
		t.Fatal(err)
	}
	svg := b.String()
	checkSVG(t, b.Bytes())
	for _, want := range []string{
		`<g class="f odd" data-d="4" data-l="37 · get_batch loader.py:133">`,
		`>37 · get_batch loader.py:133</text>`,
		`>0-36/38-63 · reduce_gradients optimizer.py:98</text>`,
		`reduce_gradients@/workspace/megatron/optimizer.py:98@0-36/38-63|37`, // the tooltip
	} {
		if !strings.Contains(svg, want) {
			t.Errorf("SVG lacks %q", want)
		}
	}
	// The odd group is drawn wide enough for its label.
	m37 := regexp.MustCompile(`data-l="37 · get_batch[^"]*"><title>[^<]*</title><rect x="[0-9.]+" y="[0-9.]+" width="([0-9.]+)"`).FindStringSubmatch(svg)
	if m37 == nil || len(m37[1]) < 5 { // at least 100.00 px
		t.Errorf("get_batch frame width %v, want its label's", m37)
	}
}

func TestShortFunc(t *testing.T) {
	for in, want := range map[string]string{
		"github.com/faultline-ml/faultline/examples/demo.(*fabricClient).collective": "demo.(*fabricClient).collective",
		"main.(*trainer).Run": "main.(*trainer).Run",
		"runtime.gopark":      "runtime.gopark",
		"c10d::ProcessGroupNCCL::allreduce(std::vector<at::Tensor>&)": "c10d::ProcessGroupNCCL::allreduce",
		"all_reduce":                     "all_reduce",
		"[... 12 frames]":                "[... 12 frames]",
		"pthread_cond_wait@@GLIBC_2.3.2": "pthread_cond_wait@@GLIBC_2.3.2",
	} {
		if got := shortFunc(in); got != want {
			t.Errorf("shortFunc(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestSVGInChromium opens the flame graphs of the 64-rank job and of job8
// in headless Chromium: the script runs without an error (its Search
// button is there) and the frame of the rank that parted shows its label.
// FAULTLINE_SCREENSHOTS=dir also saves dir/hang-flamegraph-64ranks.png, the
// screenshot the README shows (docs/screenshots.sh).
func TestSVGInChromium(t *testing.T) {
	m64, err := Merge(job64(), MergeConfig{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		m     *Merged
		k     Kind
		shot  string
		parts string
	}{
		{"job64", m64, KindPython, "hang-flamegraph-64ranks.png", ">37 · get_batch loader.py:133</text>"},
		{"job8-python", mergeJob8(t), KindPython, "", ">6 · save_checkpoint train.py:88</text>"},
		{"job8-native", mergeJob8(t), KindNative, "", "<title>"},
	} {
		file := filepath.Join(t.TempDir(), tc.name+".svg")
		var b bytes.Buffer
		if err := tc.m.WriteSVG(&b, tc.k); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(file, b.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
		png := ""
		if dir := os.Getenv("FAULTLINE_SCREENSHOTS"); dir != "" && tc.shot != "" {
			png = filepath.Join(dir, tc.shot)
		}
		dom, console := testkit.Chromium(t, file, png, 220)
		if len(console) > 0 {
			t.Errorf("%s: console messages:\n%s", tc.name, strings.Join(console, "\n"))
		}
		if !strings.Contains(dom, `class="btn">Search</text>`) || !strings.Contains(dom, tc.parts) {
			t.Errorf("%s: the rendered document lacks the script's Search button or %q", tc.name, tc.parts)
		}
	}
}
