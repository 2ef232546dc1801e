package hang

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestParsePySpyJSON(t *testing.T) {
	data, err := os.ReadFile(filepath.Join("testdata", "job8", "rank-6.json"))
	if err != nil {
		t.Fatal(err)
	}
	threads, pid, err := ParsePySpyJSON(data)
	if err != nil {
		t.Fatal(err)
	}
	if pid != 1600 || len(threads) != 2 {
		t.Fatalf("pid %d, %d threads", pid, len(threads))
	}
	main := threads[0]
	want := Thread{Kind: KindPython, ID: 1600, Name: "MainThread", State: "active", Frames: []Frame{
		{Func: "barrier", File: "torch/distributed/distributed_c10d.py", Line: 3696},
		{Func: "wrapper", File: "torch/distributed/c10d_logger.py", Line: 75},
		{Func: "save_checkpoint", File: "train.py", Line: 88},
		{Func: "train", File: "train.py", Line: 120},
		{Func: "<module>", File: "train.py", Line: 140},
	}}
	if diff := cmp.Diff(want, main); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
	if threads[1].State != "idle" || threads[1].ID != 1607 {
		t.Errorf("second thread %+v", threads[1])
	}

	// Without os_thread_id or short_filename, as older py-spy writes.
	threads, _, err = ParsePySpyJSON([]byte(`[{"pid":5,"thread_id":77,"thread_name":null,"active":true,"owns_gil":true,
		"frames":[{"name":"f","filename":"/abs/f.py","module":null,"short_filename":null,"line":0,"locals":null}]}]`))
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]Thread{{Kind: KindPython, ID: 77, State: "active+gil", Frames: []Frame{{Func: "f", File: "/abs/f.py"}}}}, threads); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
}

func TestParsePySpyJSONErrors(t *testing.T) {
	for _, s := range []string{"", "{}", "[", `[{"frames":[{"line":-3}]}]`, `[{"thread_id":"x"}]`, "Process 12: python x.py"} {
		if _, _, err := ParsePySpyJSON([]byte(s)); !errors.Is(err, ErrFormat) {
			t.Errorf("%q: %v, want ErrFormat", s, err)
		}
	}
}

func TestParsePySpyFileName(t *testing.T) {
	for _, tc := range []struct {
		name        string
		rank, world int
		ok          bool
	}{
		{"3.json", 3, 0, true},
		{"rank3.json", 3, 0, true},
		{"rank-3.json", 3, 0, true},
		{"py-spy_00003.json", 3, 0, true},
		{"00003-00008.json", 3, 8, true},
		{"00003-00008.pyspy.json", 3, 8, true},
		{"/d/rank_12.pyspy.json", 12, 0, true},
		{"rank.json", 0, 0, false},
		{"rank 3.json", 0, 0, false},
		{"3.txt", 0, 0, false},
		{"config.json", 0, 0, false},
	} {
		r, w, ok := ParsePySpyFileName(tc.name)
		if r != tc.rank || w != tc.world || ok != tc.ok {
			t.Errorf("ParsePySpyFileName(%q) = %d, %d, %v", tc.name, r, w, ok)
		}
	}
}

func FuzzParsePySpyJSON(f *testing.F) {
	data, err := os.ReadFile(filepath.Join("testdata", "job8", "rank-6.json"))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(data)
	f.Add([]byte(`[]`))
	f.Fuzz(func(t *testing.T, data []byte) {
		threads, _, err := ParsePySpyJSON(data)
		if err != nil {
			return
		}
		if _, err := (&Dump{World: 1, Threads: threads}).Marshal(); err != nil {
			t.Fatalf("parsed threads do not marshal: %v", err)
		}
	})
}
