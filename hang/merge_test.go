package hang

import (
	"bytes"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/google/go-cmp/cmp"

	"github.com/faultline-ml/faultline/internal/testkit"
)

func mergeJob8(t *testing.T) *Merged {
	t.Helper()
	m, err := MergeDir(filepath.Join("testdata", "job8"), MergeConfig{})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// find returns the node reached from kind k's root through the frames
// whose functions are funcs, the first being a state.
func find(t *testing.T, m *Merged, k Kind, funcs ...string) *Node {
	t.Helper()
	n := m.Trees[k]
	for _, fn := range funcs {
		var next *Node
		for _, c := range n.Children {
			if c.Frame.Func == fn {
				next = c
			}
		}
		if next == nil {
			t.Fatalf("%s: no frame %q below %q", k, fn, n.Frame.Func)
		}
		n = next
	}
	return n
}

func TestMergeDirJob8(t *testing.T) {
	m := mergeJob8(t)
	if m.World != 8 || m.Ranks.String() != "0-4/6-7" || m.Missing.String() != "5" {
		t.Errorf("world %d ranks %s missing %s", m.World, m.Ranks, m.Missing)
	}
	if len(m.Problems) != 1 || !errors.Is(m.Problems[0], ErrTruncated) || !strings.Contains(m.Problems[0].Error(), "00005-00008.stacktrace") {
		t.Errorf("problems %v, want the truncated file of rank 5", m.Problems)
	}
	if got := m.Kinds(); !slices.Equal(got, []Kind{KindPython, KindNative}) {
		t.Errorf("kinds %v", got)
	}
	if m.Host(6) != "node-1" || m.Host(0) != "node-0" || m.Host(5) != "" {
		t.Errorf("hosts %q %q %q", m.Host(6), m.Host(0), m.Host(5))
	}

	state := "State@S (sleeping)"
	train := find(t, m, KindPython, state, "<module>", "train")
	if got := m.Label(train); got != "train@train.py:120@0-4/6-7|5" {
		t.Errorf("label %q", got)
	}
	// Rank 6's Python stack comes from py-spy's own file.
	ckpt := find(t, m, KindPython, state, "<module>", "train", "save_checkpoint", "wrapper", "barrier")
	if got := m.Label(ckpt); got != "barrier@torch/distributed/distributed_c10d.py:3696@6|0-5/7" {
		t.Errorf("label %q", got)
	}
	ar := find(t, m, KindPython, state, "<module>", "train", "train_step", "wrapper", "all_reduce")
	if ar.Ends.String() != "0-4/7" || ar.Weight() != 6 {
		t.Errorf("all_reduce ends %s weight %d", ar.Ends, ar.Weight())
	}
	// Two Python threads per rank: the root weighs 7 ranks twice.
	if w := m.Trees[KindPython].Weight(); w != 14 {
		t.Errorf("python root weight %d, want 14", w)
	}
	if got := m.Label(find(t, m, KindNative, state)); got != state {
		t.Errorf("state label %q", got)
	}

	splits := m.Splits()
	if len(splits) == 0 {
		t.Fatal("no split")
	}
	first := splits[0]
	if first.Groups[0].Ranks.String() != "6" || first.Ranks.String() != "0-4/6-7" {
		t.Errorf("first split %+v, want rank 6 alone", first)
	}
	for _, s := range splits {
		if s.Kind == KindPython {
			if at := s.Path[len(s.Path)-1]; at.Func != "train" || len(s.Groups) != 2 || s.Groups[1].Frame.Func != "train_step" {
				t.Errorf("python split at %v groups %+v", at, s.Groups)
			}
		}
	}
	testkit.Golden(t, filepath.Join("testdata", "golden", "job8.verdict"), []byte(m.Verdict()))
}

func TestMergeOutputsGolden(t *testing.T) {
	m := mergeJob8(t)
	for _, k := range []Kind{KindPython, KindNative} {
		var folded, svg bytes.Buffer
		if err := m.WriteFolded(&folded, k); err != nil {
			t.Fatal(err)
		}
		if err := m.WriteSVG(&svg, k); err != nil {
			t.Fatal(err)
		}
		testkit.Golden(t, filepath.Join("testdata", "golden", "job8_"+string(k)+".folded"), folded.Bytes())
		testkit.Golden(t, filepath.Join("testdata", "golden", "job8_"+string(k)+".svg"), svg.Bytes())
		checkSVG(t, svg.Bytes())
		checkFolded(t, folded.Bytes(), m.Trees[k].Weight())
	}
}

// checkSVG checks that an SVG is well-formed XML that refers to nothing
// outside itself.
func checkSVG(t *testing.T, svg []byte) {
	t.Helper()
	dec := xml.NewDecoder(bytes.NewReader(svg))
	titles := 0
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("SVG is not well-formed XML: %v", err)
		}
		if se, ok := tok.(xml.StartElement); ok {
			switch se.Name.Local {
			case "image", "use", "a", "foreignObject":
				t.Errorf("SVG has a <%s> element", se.Name.Local)
			case "script":
				if len(se.Attr) != 1 || se.Attr[0].Name.Local != "type" {
					t.Errorf("SVG script with attributes %v: only an inline one, with its type, is allowed", se.Attr)
				}
			case "title":
				titles++
			}
			for _, a := range se.Attr {
				if strings.Contains(a.Value, "http") && a.Name.Local != "xmlns" || strings.Contains(a.Value, "url(") {
					t.Errorf("SVG refers outside: %s=%q", a.Name.Local, a.Value)
				}
			}
		}
	}
	if titles == 0 && bytes.Contains(svg, []byte("<rect x=\"10.00\"")) {
		t.Error("SVG frames have no <title> tooltips")
	}
}

// checkFolded checks the folded-stack grammar and that the counts add up
// to the tree's weight.
func checkFolded(t *testing.T, folded []byte, weight int) {
	t.Helper()
	if !utf8.Valid(folded) {
		t.Error("folded stacks are not UTF-8")
	}
	total := 0
	for line := range strings.SplitSeq(strings.TrimSuffix(string(folded), "\n"), "\n") {
		if line == "" {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		n, err := strconv.Atoi(line[i+1:])
		if i < 0 || err != nil || n < 1 {
			t.Fatalf("bad folded line %q", line)
		}
		if strings.ContainsAny(line[:i], "\n\r\t") || strings.Contains(line, ";;") {
			t.Fatalf("bad frames in %q", line)
		}
		total += n
	}
	if total != weight {
		t.Errorf("folded counts add to %d, tree weighs %d", total, weight)
	}
}

// genStacks makes a job of world ranks whose threads take one of a few
// distinct stacks of depth frames that share prefixes.
func genStacks(rng *rand.Rand, world, distinct, depth, threads int) []*Dump {
	stacks := make([][]Frame, distinct)
	for i := range stacks {
		shared := rng.IntN(depth)
		s := make([]Frame, depth) // outermost first here; reversed below
		for j := range s {
			if j < shared {
				s[j] = Frame{Func: fmt.Sprintf("shared_%d", j), File: "common.py", Line: j + 1}
			} else {
				s[j] = Frame{Func: fmt.Sprintf("f%d_%d", i, j), File: fmt.Sprintf("mod%d.py", i%3), Line: j}
			}
		}
		slices.Reverse(s)
		stacks[i] = s
	}
	dumps := make([]*Dump, world)
	for r := range dumps {
		d := &Dump{Rank: r, World: world, State: "S (sleeping)"}
		for th := range threads {
			d.Threads = append(d.Threads, Thread{Kind: KindPython, ID: uint64(th), Frames: stacks[rng.IntN(distinct)]})
		}
		dumps[r] = d
	}
	return dumps
}

// TestMergeGeneratedMatchesBruteForce checks every node's rank sets and
// weight against a direct count over the generated stacks.
func TestMergeGeneratedMatchesBruteForce(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	for iter := range 40 {
		world := 1 + rng.IntN(300)
		dumps := genStacks(rng, world, 1+rng.IntN(6), 1+rng.IntN(12), 1+rng.IntN(3))
		// Leave some ranks out.
		for range rng.IntN(5) {
			dumps[rng.IntN(world)] = nil
		}
		rng.Shuffle(len(dumps), func(i, j int) { dumps[i], dumps[j] = dumps[j], dumps[i] })
		m, err := Merge(dumps, MergeConfig{})
		if err != nil {
			t.Fatal(err)
		}
		stuck := map[string]*Ranks{}
		ends := map[string]*Ranks{}
		add := func(mp map[string]*Ranks, key string, r int) {
			if mp[key] == nil {
				mp[key] = &Ranks{}
			}
			mp[key].add(r)
		}
		var present Ranks
		for _, d := range dumps {
			if d == nil {
				continue
			}
			present.add(d.Rank)
			for _, th := range d.Threads {
				key := "State@" + d.State
				for i := len(th.Frames) - 1; i >= 0; i-- {
					f := th.Frames[i]
					key += fmt.Sprintf(";%s@%s:%d", f.Func, f.File, f.Line)
					add(stuck, key, d.Rank)
				}
				add(ends, key, d.Rank)
			}
		}
		if !m.Ranks.Equal(present) || !m.Missing.Equal(present.complement(m.World)) {
			t.Fatalf("iter %d: ranks %s missing %s", iter, m.Ranks, m.Missing)
		}
		nodes := 0
		walk(m.Trees[KindPython], func(path []*Node) {
			nodes++
			key := path[0].Frame.Func
			for _, p := range path[1:] {
				key += fmt.Sprintf(";%s@%s:%d", p.Frame.Func, p.Frame.File, p.Frame.Line)
			}
			n := path[len(path)-1]
			if len(path) > 1 && !n.Stuck.Equal(*stuck[key]) {
				t.Fatalf("iter %d: %s stuck %s, want %s", iter, key, n.Stuck, stuck[key])
			}
			wantEnds := Ranks{}
			if ends[key] != nil {
				wantEnds = *ends[key]
			}
			if !n.Ends.Equal(wantEnds) {
				t.Fatalf("iter %d: %s ends %s, want %s", iter, key, n.Ends, wantEnds)
			}
			w := 0
			for k, e := range ends {
				if k == key || strings.HasPrefix(k, key+";") {
					w += e.Len()
				}
			}
			if n.Weight() != w {
				t.Fatalf("iter %d: %s weight %d, want %d", iter, key, n.Weight(), w)
			}
		})
		if nodes != len(stuck)+1 { // +1: the state node
			t.Fatalf("iter %d: %d nodes, want %d", iter, nodes, len(stuck)+1)
		}
		var folded bytes.Buffer
		if err := m.WriteFolded(&folded, KindPython); err != nil {
			t.Fatal(err)
		}
		checkFolded(t, folded.Bytes(), m.Trees[KindPython].Weight())
	}
}

func TestMergeSplitsSmallestGroupFirst(t *testing.T) {
	stack := func(fns ...string) []Frame {
		var fs []Frame
		for _, fn := range slices.Backward(fns) {
			fs = append(fs, Frame{Func: fn, File: "x.py", Line: 1})
		}
		return fs
	}
	var dumps []*Dump
	for r := range 16 {
		fns := []string{"main", "loop", "allreduce"}
		switch {
		case r == 9:
			fns = []string{"main", "loop", "dataloader", "read"}
		case r >= 12:
			fns = []string{"main", "loop", "allgather"}
		}
		dumps = append(dumps, &Dump{Rank: r, World: 16, State: "S (sleeping)", Threads: []Thread{{Kind: KindPython, Frames: stack(fns...)}}})
	}
	dumps[3].State = "D (disk sleep)"
	m, err := Merge(dumps, MergeConfig{})
	if err != nil {
		t.Fatal(err)
	}
	splits := m.Splits()
	var got []string
	for _, s := range splits {
		var groups []string
		for _, g := range s.Groups {
			groups = append(groups, g.Ranks.String()+">"+g.Frame.Func)
		}
		at := "(state)"
		if len(s.Path) > 0 {
			at = s.Path[len(s.Path)-1].Func
		}
		got = append(got, at+": "+strings.Join(groups, " "))
	}
	want := []string{
		"(state): 3>State@D (disk sleep) 0-2/4-15>State@S (sleeping)",
		"loop: 9>dataloader 12-15>allgather 0-2/4-8/10-11>allreduce",
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("splits (-want +got):\n%s", diff)
	}
	v := m.Verdict()
	if !strings.Contains(v, "1 rank  9") || strings.Index(v, "-> dataloader@x.py:1") > strings.Index(v, "-> allgather@x.py:1") {
		t.Errorf("verdict does not put rank 9 first:\n%s", v)
	}
}

func TestMergeBadInput(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, data []byte) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	good := func(rank, world int, fns ...string) []byte {
		t.Helper()
		th := Thread{Kind: KindNative, ID: 1}
		for _, fn := range fns {
			th.Frames = append(th.Frames, Frame{Func: fn, File: "lib.so"})
		}
		b, err := (&Dump{Rank: rank, World: world, State: "S (sleeping)", Threads: []Thread{th}}).Marshal()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	write(FileName(0, 6), good(0, 6, "wait", "main"))
	write(FileName(1, 6), good(1, 6, "wait\xff\xfe;bad\nname", "main"))
	write(FileName(2, 6), []byte("\x00\x01garbage that is no stack file"))
	write(FileName(3, 6), good(3, 6, "wait", "main")[:40])
	write(FileName(4, 8), good(4, 8, "wait", "main")) // a world that disagrees
	deep := make([]string, 100_000)
	for i := range deep {
		deep[i] = "recurse"
	}
	deep[0], deep[len(deep)-1] = "innermost", "main"
	write(FileName(5, 6), good(5, 6, deep...))
	write("9.json", []byte(`[{"thread_id":1,"frames":[]}]`)) // rank 9 >= world
	write("rank-1.json", []byte(`{"not":"a list"}`))
	write("README", []byte("not a stack file at all"))

	m, err := MergeDir(dir, MergeConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if m.World != 6 || m.Ranks.String() != "0-1/4-5" || m.Missing.String() != "2-3" {
		t.Errorf("world %d ranks %s missing %s", m.World, m.Ranks, m.Missing)
	}
	var problems []string
	for _, p := range m.Problems {
		problems = append(problems, p.Error())
	}
	for _, want := range []string{
		"00002-00006.stacktrace:1: not a stack file",
		"00003-00006.stacktrace:",
		"00004-00008.stacktrace: world 8 disagrees with the job's 6",
		"100000 frames; 98976 in the middle elided",
		"9.json: rank 9 outside the job's world of 6",
		"rank-1.json: hang: malformed stack file: py-spy json",
	} {
		if !slices.ContainsFunc(problems, func(p string) bool { return strings.Contains(p, want) }) {
			t.Errorf("no problem saying %q in:\n%s", want, strings.Join(problems, "\n"))
		}
	}
	root := m.Trees[KindNative]
	depth := 0
	walk(root, func(path []*Node) { depth = max(depth, len(path)) })
	if depth != 1+1024+1 {
		t.Errorf("depth %d, want the state, 1024 frames and the elision", depth)
	}
	var folded, svg bytes.Buffer
	m.WriteFolded(&folded, KindNative)
	m.WriteSVG(&svg, KindNative)
	checkFolded(t, folded.Bytes(), root.Weight())
	checkSVG(t, svg.Bytes())
	if !strings.Contains(folded.String(), `wait\xff\xfe:bad name@lib.so@1|0/2-5 1`) {
		t.Errorf("non-UTF-8 name not escaped in folded stacks:\n%.2000s", folded.String())
	}
	if err := m.Profile().Write(io.Discard); err != nil {
		t.Error(err)
	}
	t.Log(m.Verdict())
}

func TestMergeDirEmpty(t *testing.T) {
	if _, err := MergeDir(t.TempDir(), MergeConfig{}); !errors.Is(err, ErrNoStacks) {
		t.Errorf("empty dir: %v, want ErrNoStacks", err)
	}
	if _, err := MergeDir(filepath.Join(t.TempDir(), "nope"), MergeConfig{}); err == nil {
		t.Error("missing dir: no error")
	}
	if _, err := Merge(nil, MergeConfig{MaxDepth: 1}); err == nil {
		t.Error("MaxDepth 1: no error")
	}
}

func TestMergeDuplicateRank(t *testing.T) {
	th := []Thread{{Kind: KindGo, Frames: []Frame{{Func: "a"}}}, {Kind: KindGo, Frames: []Frame{{Func: "b"}}}}
	m, err := Merge([]*Dump{
		{Rank: 0, World: 2, Threads: th},
		{Rank: 0, World: 2, Threads: []Thread{{Kind: KindGo, Frames: []Frame{{Func: "c"}}}}},
		{Rank: 1, World: 2, Threads: []Thread{{Kind: "BAD", Frames: []Frame{{Func: "c"}}}}},
	}, MergeConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Problems) != 2 || m.Ranks.String() != "0" {
		t.Errorf("ranks %s problems %v", m.Ranks, m.Problems)
	}
	if got := len(m.Trees[KindGo].Children[0].Children); got != 2 {
		t.Errorf("%d frames under the state, want a and b", got)
	}
}

// FuzzMergeOutputs merges any stack file that parses and checks that every
// output stays well-formed, whatever bytes the names hold.
func FuzzMergeOutputs(f *testing.F) {
	f.Add([]byte(docText))
	f.Add([]byte("faultline-stacktrace 1\nrank 1\nworld 3\nstate \"<&>\"\nthread go 1 \"\" \"\"\nframe \"a;b\\n]]>\" \"\\xff\" 3\nend 1 1\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		d, err := ParseDump(data)
		if err != nil {
			return
		}
		other := &Dump{Rank: 0, World: d.World, Threads: []Thread{{Kind: KindNative, Frames: []Frame{{Func: "main"}}}}}
		m, err := Merge([]*Dump{d, other}, MergeConfig{MaxDepth: 64})
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range m.Kinds() {
			var folded, svg bytes.Buffer
			if err := m.WriteFolded(&folded, k); err != nil {
				t.Fatal(err)
			}
			if err := m.WriteSVG(&svg, k); err != nil {
				t.Fatal(err)
			}
			checkFolded(t, folded.Bytes(), m.Trees[k].Weight())
			checkSVG(t, svg.Bytes())
		}
		if err := m.WritePprof(io.Discard); err != nil {
			t.Fatal(err)
		}
		_ = m.Verdict()
	})
}
