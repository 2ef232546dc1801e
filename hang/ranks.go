package hang

import (
	"errors"
	"fmt"
	"iter"
	"slices"
	"strconv"
	"strings"
)

// Ranks is a set of ranks kept as sorted, disjoint runs, so that the
// contiguous sets typical of a job (all 10,000 ranks but one) take a few
// words whatever their size. Adding ranks in increasing order costs O(1).
// The zero value is the empty set; negative ranks are never members.
//
// Its text form folds runs as xpu_timer's viewer does: "0-3/9/11-15".
type Ranks struct {
	runs []rankRun // sorted, disjoint, not adjacent
}

type rankRun struct{ lo, hi int } // inclusive

// ranksOf returns the set of the given ranks.
func ranksOf(ranks ...int) Ranks {
	var r Ranks
	for _, x := range ranks {
		r.add(x)
	}
	return r
}

// rankRange returns the set {lo, ..., hi}; it is empty when hi < lo.
func rankRange(lo, hi int) Ranks {
	lo = max(lo, 0)
	if hi < lo {
		return Ranks{}
	}
	return Ranks{runs: []rankRun{{lo, hi}}}
}

// add puts rank into the set. Negative ranks are ignored.
func (r *Ranks) add(rank int) {
	if rank < 0 {
		return
	}
	n := len(r.runs)
	if n == 0 || rank > r.runs[n-1].hi+1 {
		r.runs = append(r.runs, rankRun{rank, rank})
		return
	}
	if rank == r.runs[n-1].hi+1 {
		r.runs[n-1].hi = rank
		return
	}
	if rank >= r.runs[n-1].lo {
		return // already the last run's member: the common case of a rank's second thread
	}
	// Out of order: find the first run that ends at or after rank-1.
	i, _ := slices.BinarySearchFunc(r.runs, rank, func(x rankRun, t int) int {
		if x.hi+1 < t {
			return -1
		}
		return 1
	})
	run := &r.runs[i]
	switch {
	case rank >= run.lo && rank <= run.hi:
		return
	case rank == run.hi+1:
		run.hi = rank
		if i+1 < len(r.runs) && r.runs[i+1].lo == rank+1 {
			run.hi = r.runs[i+1].hi
			r.runs = slices.Delete(r.runs, i+1, i+2)
		}
	case rank == run.lo-1:
		run.lo = rank
	default:
		r.runs = slices.Insert(r.runs, i, rankRun{rank, rank})
	}
}

// addSet puts every member of o into r.
func (r *Ranks) addSet(o Ranks) {
	if len(o.runs) == 0 {
		return
	}
	if len(r.runs) == 0 {
		r.runs = slices.Clone(o.runs)
		return
	}
	merged := make([]rankRun, 0, len(r.runs)+len(o.runs))
	a, b := r.runs, o.runs
	for len(a) > 0 || len(b) > 0 {
		var next rankRun
		if len(b) == 0 || (len(a) > 0 && a[0].lo <= b[0].lo) {
			next, a = a[0], a[1:]
		} else {
			next, b = b[0], b[1:]
		}
		if k := len(merged); k > 0 && next.lo <= merged[k-1].hi+1 {
			merged[k-1].hi = max(merged[k-1].hi, next.hi)
			continue
		}
		merged = append(merged, next)
	}
	r.runs = merged
}

// Has reports whether rank is in the set.
func (r Ranks) Has(rank int) bool {
	_, found := slices.BinarySearchFunc(r.runs, rank, func(x rankRun, t int) int {
		switch {
		case x.hi < t:
			return -1
		case x.lo > t:
			return 1
		}
		return 0
	})
	return found
}

// Len returns the number of ranks in the set.
func (r Ranks) Len() int {
	n := 0
	for _, x := range r.runs {
		n += x.hi - x.lo + 1
	}
	return n
}

// isEmpty reports whether the set has no member.
func (r Ranks) isEmpty() bool { return len(r.runs) == 0 }

// Equal reports whether r and o have the same members.
func (r Ranks) Equal(o Ranks) bool { return slices.Equal(r.runs, o.runs) }

// compare orders sets by size, then by their members, so that sorting
// groups of ranks with it puts the smallest groups first.
func (r Ranks) compare(o Ranks) int {
	if c := r.Len() - o.Len(); c != 0 {
		return c
	}
	return slices.CompareFunc(r.runs, o.runs, func(a, b rankRun) int {
		if a.lo != b.lo {
			return a.lo - b.lo
		}
		return a.hi - b.hi
	})
}

// complement returns the ranks in [0, world) that are not in r.
func (r Ranks) complement(world int) Ranks {
	var out Ranks
	next := 0
	for _, x := range r.runs {
		if x.lo >= world {
			break
		}
		if x.lo > next {
			out.runs = append(out.runs, rankRun{next, x.lo - 1})
		}
		next = x.hi + 1
	}
	if next < world {
		out.runs = append(out.runs, rankRun{next, world - 1})
	}
	return out
}

// clone returns a copy of r that shares no memory with it.
func (r Ranks) clone() Ranks { return Ranks{runs: slices.Clone(r.runs)} }

// All yields the members in increasing order.
func (r Ranks) All() iter.Seq[int] {
	return func(yield func(int) bool) {
		for _, x := range r.runs {
			for i := x.lo; i <= x.hi; i++ {
				if !yield(i) {
					return
				}
			}
		}
	}
}

// String returns the folded form: runs joined by "/", a run of two or
// more ranks written "lo-hi", e.g. "0-3/9/11-15". The empty set is "".
func (r Ranks) String() string { return string(r.appendText(nil)) }

// appendText appends the folded form to b.
func (r Ranks) appendText(b []byte) []byte {
	for i, x := range r.runs {
		if i > 0 {
			b = append(b, '/')
		}
		b = strconv.AppendInt(b, int64(x.lo), 10)
		if x.hi > x.lo {
			b = append(b, '-')
			b = strconv.AppendInt(b, int64(x.hi), 10)
		}
	}
	return b
}

// MarshalText returns the folded form.
func (r Ranks) MarshalText() ([]byte, error) { return r.appendText(nil), nil }

// UnmarshalText parses the folded form as ParseRanks does.
func (r *Ranks) UnmarshalText(b []byte) error {
	v, err := ParseRanks(string(b))
	if err != nil {
		return err
	}
	*r = v
	return nil
}

// ErrRanks is wrapped by every error ParseRanks returns.
var ErrRanks = errors.New("hang: invalid rank set")

// maxRank bounds a rank in text so that a hostile "0-999999999999" cannot
// overflow or make All loop for ever.
const maxRank = 1<<31 - 1

// ParseRanks parses the folded form ("0-3/9/11-15"). Runs may come in any
// order and may overlap; the empty string is the empty set.
func ParseRanks(s string) (Ranks, error) {
	var r Ranks
	if s == "" {
		return r, nil
	}
	for part := range strings.SplitSeq(s, "/") {
		lo, hi, isRun := strings.Cut(part, "-")
		a, err := parseRank(lo)
		if err != nil {
			return Ranks{}, fmt.Errorf("%w %q: %q: %v", ErrRanks, s, part, err)
		}
		b := a
		if isRun {
			if b, err = parseRank(hi); err != nil {
				return Ranks{}, fmt.Errorf("%w %q: %q: %v", ErrRanks, s, part, err)
			}
			if b < a {
				return Ranks{}, fmt.Errorf("%w %q: run %q ends before it starts", ErrRanks, s, part)
			}
		}
		r.addSet(Ranks{runs: []rankRun{{a, b}}})
	}
	return r, nil
}

func parseRank(s string) (int, error) {
	if s == "" || len(s) > 10 || strings.TrimLeft(s, "0123456789") != "" {
		return 0, errors.New("not a rank number")
	}
	v, err := strconv.Atoi(s)
	if err != nil || v > maxRank {
		return 0, errors.New("rank out of range")
	}
	return v, nil
}
