package hang

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestCulprit(t *testing.T) {
	py := func(rank int, funcs ...string) *Dump {
		var frames []Frame
		for _, f := range funcs {
			file := "/job/train.py"
			if strings.Contains(f, ".") {
				file = "torch/distributed/distributed_c10d.py"
			}
			frames = append(frames, Frame{Func: f, File: file})
		}
		return &Dump{Rank: rank, World: 4, Threads: []Thread{{Kind: KindPython, Frames: frames}}}
	}
	own := func(k Kind, f Frame) bool { return k == KindPython && f.File == "/job/train.py" }
	for _, tc := range []struct {
		name  string
		dumps []*Dump
		ranks []int
		where string
	}{
		{"one rank before the all-reduce", []*Dump{
			py(0, "c10d.all_reduce", "step", "<module>"),
			py(1, "get_batch", "step", "<module>"),
			py(2, "c10d.all_reduce", "step", "<module>"),
			py(3, "c10d.all_reduce", "step", "<module>"),
		}, []int{1}, "rank 1 in get_batch, where no other rank is; ranks 0,2,3 in step"},
		{"a group of two", []*Dump{
			py(0, "get_batch", "step"),
			py(1, "c10d.all_reduce", "step"),
		}, []int{0}, "rank 0 in get_batch, where no other rank is; rank 1 in step"},
		{"every rank in one place", []*Dump{py(0, "step"), py(1, "step")}, nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ranks, where := Culprit(tc.dumps, own)
			if diff := cmp.Diff(tc.ranks, ranks); diff != "" || where != tc.where {
				t.Errorf("Culprit = %v, %q; want %v, %q", ranks, where, tc.ranks, tc.where)
			}
		})
	}
}
