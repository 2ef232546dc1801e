package hang

import (
	"io"
	"strconv"
	"strings"

	"github.com/google/pprof/profile"
)

// Profile returns the merged stacks as a pprof profile: one sample per
// rank and distinct stack, of value 1 in the sample type "ranks", with
// the labels "kind" (python, native, go), "state" (the process state)
// and "node" (the rank's host, when known), and the numeric label "rank".
// `go tool pprof -top` then counts ranks per frame, and
// `-tagfocus rank=3` or `-tagfocus kind=python` narrows it.
func (m *Merged) Profile() *profile.Profile {
	p := &profile.Profile{
		SampleType:        []*profile.ValueType{{Type: "ranks", Unit: "count"}},
		DefaultSampleType: "ranks",
		PeriodType:        &profile.ValueType{Type: "stacks", Unit: "count"},
		Period:            1,
		Comments:          []string{"faultline hang: stacks of " + rankText(m.Ranks) + " merged; world " + strconv.Itoa(m.World) + "; missing " + rankText(m.Missing)},
	}
	type funcKey struct{ name, file string }
	funcs := map[funcKey]*profile.Function{}
	locs := map[*Node]*profile.Location{}
	function := func(f Frame) *profile.Function {
		key := funcKey{f.Func, f.File}
		fn := funcs[key]
		if fn == nil {
			fn = &profile.Function{ID: uint64(len(p.Function) + 1), Name: f.Func, SystemName: f.Func, Filename: f.File}
			funcs[key] = fn
			p.Function = append(p.Function, fn)
		}
		return fn
	}
	for _, k := range m.Kinds() {
		walk(m.Trees[k], func(path []*Node) {
			n := path[len(path)-1]
			if !n.isState {
				loc := &profile.Location{ID: uint64(len(p.Location) + 1), Line: []profile.Line{{Function: function(n.Frame), Line: int64(n.Frame.Line)}}}
				locs[n] = loc
				p.Location = append(p.Location, loc)
			}
			if n.Ends.isEmpty() {
				return
			}
			stack := make([]*profile.Location, 0, len(path)-1)
			for i := len(path) - 1; i >= 1; i-- { // leaf first; path[0] is the state
				stack = append(stack, locs[path[i]])
			}
			state := strings.TrimPrefix(path[0].Frame.Func, "State@")
			for rank := range n.Ends.All() {
				s := &profile.Sample{
					Location: stack,
					Value:    []int64{1},
					Label:    map[string][]string{"kind": {string(k)}, "state": {state}},
					NumLabel: map[string][]int64{"rank": {int64(rank)}},
					NumUnit:  map[string][]string{"rank": {"count"}},
				}
				if h := m.hosts[rank]; h != "" {
					s.Label["node"] = []string{h}
				}
				p.Sample = append(p.Sample, s)
			}
		})
	}
	return p
}

// WritePprof writes Profile() in pprof's format (gzipped protocol buffer).
func (m *Merged) WritePprof(w io.Writer) error { return m.Profile().Write(w) }
