package slownode

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// TestMedianMatchesSort checks the selecting median against the median
// of the sorted values, on sizes, ties and NaNs of every kind.
func TestMedianMatchesSort(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	sorted := func(xs []float64) float64 {
		s := slices.Clone(xs)
		slices.Sort(s)
		n := len(s)
		if n%2 == 1 {
			return s[n/2]
		}
		return (s[n/2-1] + s[n/2]) / 2
	}
	for trial := range 20000 {
		n := 1 + rng.IntN(300)
		xs := make([]float64, n)
		levels := 1 + rng.IntN(n+1) // few levels: many ties
		for i := range xs {
			switch rng.IntN(20) {
			case 0:
				xs[i] = math.NaN()
			default:
				xs[i] = float64(rng.IntN(levels)) * 0.5
			}
		}
		if trial%3 == 0 {
			slices.Sort(xs) // sorted and reversed inputs are a quickselect's worst pivots
			if trial%2 == 0 {
				slices.Reverse(xs)
			}
		}
		want := sorted(xs)
		got := median(slices.Clone(xs))
		if got != want && !(math.IsNaN(got) && math.IsNaN(want)) {
			t.Fatalf("trial %d: median %v, sorted median %v of %v", trial, got, want, xs)
		}
	}
}

// TestHealthyOfOneValue checks the shortcut for a repeated value against
// what the clustering finds for values a rounding error apart.
func TestHealthyOfOneValue(t *testing.T) {
	d, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int{3, 4, 5, 8, 1024} {
		for _, v := range []float64{0, 0.1, 7, 1e6} {
			pairs := make([]rankValue, n)
			for i := range pairs {
				pairs[i] = rankValue{v, int32(i)}
			}
			ref, _ := d.healthy(pairs, d.cfg.RelativeThreshold, 0.01, func(ri int32) { t.Errorf("n %d v %v: rank %d above", n, v, ri) })
			if ref != v {
				t.Errorf("n %d v %v: ref %v", n, v, ref)
			}
			pairs[n-1].v = math.Nextafter(v, math.Inf(1)) // one value a hair above: the long path
			ref, _ = d.healthy(pairs, d.cfg.RelativeThreshold, 0.01, func(ri int32) { t.Errorf("n %d v %v: rank %d above", n, v, ri) })
			if ref != v {
				t.Errorf("n %d v %v, one a hair above: ref %v", n, v, ref)
			}
		}
	}
}
