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
			ref, _, _ := d.healthy(pairs, d.cfg.RelativeThreshold, 0.01, 0, minHealthyRanks, func(ri int32) { t.Errorf("n %d v %v: rank %d above", n, v, ri) })
			if ref != v {
				t.Errorf("n %d v %v: ref %v", n, v, ref)
			}
			pairs[n-1].v = math.Nextafter(v, math.Inf(1)) // one value a hair above: the long path
			ref, _, _ = d.healthy(pairs, d.cfg.RelativeThreshold, 0.01, 0, minHealthyRanks, func(ri int32) { t.Errorf("n %d v %v: rank %d above", n, v, ri) })
			if ref != v {
				t.Errorf("n %d v %v, one a hair above: ref %v", n, v, ref)
			}
		}
	}
}

// TestSortFloatsMatchesSort checks the radix sort against slices.Sort on
// sizes either side of radixMin, ties, negative values, zeros of both
// signs, infinities and figures that share their leading bytes.
func TestSortFloatsMatchesSort(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	var buf []uint64
	for trial := range 3000 {
		n := rng.IntN(3 * radixMin)
		if trial%100 == 0 {
			n = 1024 + rng.IntN(1024)
		}
		xs := make([]float64, n)
		levels := 1 + rng.IntN(n+1)
		for i := range xs {
			switch trial % 4 {
			case 0: // a peer set: milliseconds from nanoseconds
				xs[i] = float64(30_000_000+rng.IntN(1_000_000)) / 1e6
			case 1:
				xs[i] = float64(rng.IntN(levels)-levels/2) * 0.25
			case 2:
				xs[i] = rng.NormFloat64() * math.Pow(10, float64(rng.IntN(40)-20))
			default:
				xs[i] = []float64{0, math.Copysign(0, -1), math.Inf(1), math.Inf(-1), math.MaxFloat64,
					-math.SmallestNonzeroFloat64, 1, -1}[rng.IntN(8)]
			}
		}
		want := slices.Clone(xs)
		slices.Sort(want)
		got := slices.Clone(xs)
		buf = sortFloats(got, buf)
		if !slices.Equal(got, want) {
			t.Fatalf("trial %d (n %d): sortFloats gives %v, slices.Sort %v", trial, n, got, want)
		}
	}
}

// peerSets returns sets of n step figures in milliseconds, as the
// detector sorts them: one rank's in each set a little higher.
func peerSets(n int) [][]float64 {
	rng := rand.New(rand.NewPCG(13, 14))
	sets := make([][]float64, 256)
	for k := range sets {
		sets[k] = make([]float64, n)
		for i := range sets[k] {
			sets[k][i] = float64(int64((30+rng.NormFloat64()*0.5)*1e6)&^255) / 1e6
		}
		sets[k][rng.IntN(n)] *= 1.4
	}
	return sets
}

// BenchmarkSortFloats sorts peer sets of a thousand figures, a different
// set each time (the branch predictor would learn one set by heart), beside
// BenchmarkPdqsort, slices.Sort of the same sets in the same run.
func BenchmarkSortFloats(b *testing.B) {
	sets, xs := peerSets(1024), make([]float64, 1024)
	var buf []uint64
	for i := 0; b.Loop(); i++ {
		copy(xs, sets[i%len(sets)])
		buf = sortFloats(xs, buf)
	}
}

// BenchmarkPdqsort is the baseline of BenchmarkSortFloats.
func BenchmarkPdqsort(b *testing.B) {
	sets, xs := peerSets(1024), make([]float64, 1024)
	for i := 0; b.Loop(); i++ {
		copy(xs, sets[i%len(sets)])
		slices.Sort(xs)
	}
}
