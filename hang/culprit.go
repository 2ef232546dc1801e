package hang

import (
	"fmt"
	"maps"
	"slices"
	"strings"
)

// Culprit names the ranks to blame for a hang: those in a function of the
// job's own code (own says which frames of which kinds of stack are) that the fewest ranks are in,
// and not all of them. It also says, in a sentence, where they and the
// others are; it returns no ranks when the stacks single none out.
//
// Ranks waiting in a collective share its frames with every other waiting
// rank; the rank stuck somewhere of its own is the one to blame, even in a
// group of two where the size of a split of the merged tree cannot tell,
// and whatever the process state or the line each rank happened to be on
// at the moment of the dump.
func Culprit(dumps []*Dump, own func(Kind, Frame) bool) (ranks []int, where string) {
	funcs := map[int][]string{}   // rank: its own functions, innermost first
	holders := map[string][]int{} // function: the ranks in it
	for _, d := range dumps {
		for _, t := range d.Threads {
			for _, f := range t.Frames {
				if own(t.Kind, f) && !slices.Contains(funcs[d.Rank], f.Func) {
					funcs[d.Rank] = append(funcs[d.Rank], f.Func)
					holders[f.Func] = append(holders[f.Func], d.Rank)
				}
			}
		}
	}
	var fn string
	for f, rs := range holders {
		if len(rs) == len(dumps) {
			continue
		}
		if fn == "" || len(rs) < len(holders[fn]) || len(rs) == len(holders[fn]) && f < fn {
			fn = f
		}
	}
	if fn == "" {
		return nil, ""
	}
	ranks = slices.Sorted(slices.Values(holders[fn]))
	// The others, by the outermost function that not every rank is in:
	// the collective each waits in.
	others := map[string][]int{}
	for r, fs := range funcs {
		if slices.Contains(ranks, r) {
			continue
		}
		at := fs[0]
		for _, f := range fs {
			if len(holders[f]) < len(dumps) {
				at = f
			}
		}
		others[at] = append(others[at], r)
	}
	var rest []string
	for _, f := range slices.Sorted(maps.Keys(others)) {
		rest = append(rest, fmt.Sprintf("%s in %s", rankWords(slices.Sorted(slices.Values(others[f]))), f))
	}
	where = fmt.Sprintf("%s in %s, where no other rank is", rankWords(ranks), fn)
	if len(rest) > 0 {
		where += "; " + strings.Join(rest, ", ")
	}
	return ranks, where
}

// rankWords writes "rank 3" or "ranks 0,1,5".
func rankWords(ranks []int) string {
	s := make([]string, len(ranks))
	for i, r := range ranks {
		s[i] = fmt.Sprint(r)
	}
	if len(s) == 1 {
		return "rank " + s[0]
	}
	return "ranks " + strings.Join(s, ",")
}
