package hang

import (
	"math/rand/v2"
	"slices"
	"testing"
)

func TestRanksString(t *testing.T) {
	for _, tc := range []struct {
		ranks []int
		want  string
	}{
		{nil, ""},
		{[]int{0}, "0"},
		{[]int{0, 1, 2, 3, 9, 11, 12, 13, 14, 15}, "0-3/9/11-15"},
		{[]int{15, 14, 13, 12, 11, 9, 3, 2, 1, 0}, "0-3/9/11-15"},
		{[]int{5, 3, 4, 4, 5, -1}, "3-5"},
		{[]int{1, 3, 2}, "1-3"},
		{[]int{10, 0, 5}, "0/5/10"},
	} {
		r := ranksOf(tc.ranks...)
		if got := r.String(); got != tc.want {
			t.Errorf("ranksOf(%v) = %q, want %q", tc.ranks, got, tc.want)
		}
		back, err := ParseRanks(tc.want)
		if err != nil || !back.Equal(r) {
			t.Errorf("ParseRanks(%q) = %v, %v; want %v", tc.want, back, err, r)
		}
	}
}

func TestParseRanksErrors(t *testing.T) {
	for _, s := range []string{"/", "1/", "a", "1-", "-1", "3-1", "1--2", "99999999999", " 1", "1-2-3", "+1"} {
		if _, err := ParseRanks(s); err == nil {
			t.Errorf("ParseRanks(%q): no error", s)
		}
	}
	r, err := ParseRanks("5-7/0/6/1-2")
	if err != nil || r.String() != "0-2/5-7" {
		t.Errorf("overlapping runs: %v, %v", r, err)
	}
}

// TestRanksModel checks Ranks against a map under random operations.
func TestRanksModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for iter := range 300 {
		world := 1 + rng.IntN(200)
		var r, other Ranks
		model, otherModel := map[int]bool{}, map[int]bool{}
		for range rng.IntN(300) {
			x := rng.IntN(world)
			if rng.IntN(3) == 0 {
				other.add(x)
				otherModel[x] = true
			} else {
				r.add(x)
				model[x] = true
			}
		}
		check := func(what string, got Ranks, want map[int]bool) {
			t.Helper()
			members := slices.Collect(got.All())
			var wantMembers []int
			for x := range world {
				if want[x] {
					wantMembers = append(wantMembers, x)
				}
				if got.Has(x) != want[x] {
					t.Fatalf("iter %d %s: Has(%d) = %v", iter, what, x, got.Has(x))
				}
			}
			if !slices.Equal(members, wantMembers) || got.Len() != len(wantMembers) {
				t.Fatalf("iter %d %s: members %v (len %d), want %v", iter, what, members, got.Len(), wantMembers)
			}
			for i := 1; i < len(got.runs); i++ {
				if got.runs[i].lo <= got.runs[i-1].hi+1 {
					t.Fatalf("iter %d %s: runs not disjoint and apart: %v", iter, what, got.runs)
				}
			}
		}
		check("r", r, model)
		comp := map[int]bool{}
		for x := range world {
			comp[x] = !model[x]
		}
		check("complement", r.complement(world), comp)
		union := r.clone()
		union.addSet(other)
		for x := range otherModel {
			model[x] = true
		}
		check("union", union, model)
		back, err := ParseRanks(union.String())
		if err != nil || !back.Equal(union) {
			t.Fatalf("iter %d: round trip of %q: %v, %v", iter, union.String(), back, err)
		}
	}
}

func TestRanksCompare(t *testing.T) {
	small, big := ranksOf(6), rankRange(0, 5)
	if small.compare(big) >= 0 || big.compare(small) <= 0 || small.compare(ranksOf(6)) != 0 {
		t.Error("Compare does not order by size first")
	}
	if ranksOf(1).compare(ranksOf(2)) >= 0 {
		t.Error("Compare does not order equal sizes by members")
	}
}

func FuzzParseRanks(f *testing.F) {
	for _, s := range []string{"", "0", "0-3/9/11-15", "5-7/0/6", "1-", "4294967296"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParseRanks(s)
		if err != nil {
			return
		}
		back, err := ParseRanks(r.String())
		if err != nil || !back.Equal(r) {
			t.Fatalf("%q: round trip of %q: %v, %v", s, r.String(), back, err)
		}
	})
}
