package slownode

import (
	"math"
	"math/bits"
	"slices"
)

// madScale turns a median absolute deviation into an estimate of the
// standard deviation of normally distributed data.
const madScale = 1.4826

// median returns the median of xs, reordering xs. It returns NaN for
// none. NaNs count as the smallest values, as slices.Sort orders them.
// It selects the middle values instead of sorting: the detector takes a
// median over every rank several times a step.
func median(xs []float64) float64 {
	n := len(xs)
	if n == 0 {
		return math.NaN()
	}
	nan := 0
	for i, x := range xs {
		if math.IsNaN(x) {
			xs[i], xs[nan] = xs[nan], x
			nan++
		}
	}
	k := n / 2
	if k < nan || (n%2 == 0 && k-1 < nan) {
		return math.NaN()
	}
	rest, j := xs[nan:], k-nan
	hi := nth(rest, j)
	if n%2 == 1 {
		return hi
	}
	return (slices.Max(rest[:j]) + hi) / 2
}

// nth reorders xs, which holds no NaN, so that xs[k] is the value sorting
// would put there, those before it no greater and those after no smaller,
// and returns it: quickselect, which sorts what is left once it has
// partitioned more times than a well-chosen pivot would need.
func nth(xs []float64, k int) float64 {
	lo, hi := 0, len(xs)-1
	for budget := 2 * bits.Len(uint(len(xs))); hi-lo >= 16; budget-- {
		if budget == 0 {
			break
		}
		m := lo + (hi-lo)/2
		if xs[m] < xs[lo] {
			xs[m], xs[lo] = xs[lo], xs[m]
		}
		if xs[hi] < xs[lo] {
			xs[hi], xs[lo] = xs[lo], xs[hi]
		}
		if xs[hi] < xs[m] {
			xs[hi], xs[m] = xs[m], xs[hi]
		}
		p := xs[m]
		i, j := lo, hi
		for i <= j {
			for xs[i] < p {
				i++
			}
			for xs[j] > p {
				j--
			}
			if i <= j {
				xs[i], xs[j] = xs[j], xs[i]
				i++
				j--
			}
		}
		switch {
		case k <= j:
			hi = j
		case k >= i:
			lo = i
		default:
			return xs[k] // between the two parts, equal to the pivot
		}
	}
	slices.Sort(xs[lo : hi+1])
	return xs[k]
}

// radixMin is the length from which sortFloats sorts by radix; shorter
// slices sort as fast with pdqsort.
const radixMin = 64

// sortFloats sorts xs, which holds no NaN, in increasing order, using buf
// for work, and returns buf, grown if it was short.
//
// The detector sorts the figures of a thousand peers several times a
// step, in an order that differs every time: pdqsort then mispredicts a
// branch at every other comparison and costs five times what this LSD
// radix sort does. The radix sort orders the floats' bits, made to
// compare as unsigned integers, a byte at a time, and skips the bytes
// that every value shares (the sign, the exponent and the top of the
// mantissa of figures of one kind).
func sortFloats(xs []float64, buf []uint64) []uint64 {
	n := len(xs)
	if n < radixMin {
		slices.Sort(xs)
		return buf
	}
	buf = slices.Grow(buf[:0], 2*n)[:2*n]
	keys, tmp := buf[:n], buf[n:]
	var counts [8][256]uint32
	for i, x := range xs {
		k := floatKey(x)
		keys[i] = k
		// Unrolled: a loop over the bytes costs half as much again.
		counts[0][byte(k)]++
		counts[1][byte(k>>8)]++
		counts[2][byte(k>>16)]++
		counts[3][byte(k>>24)]++
		counts[4][byte(k>>32)]++
		counts[5][byte(k>>40)]++
		counts[6][byte(k>>48)]++
		counts[7][byte(k>>56)]++
	}
	for b := range counts {
		c := &counts[b]
		shift := 8 * uint(b)
		if c[byte(keys[0]>>shift)] == uint32(n) {
			continue // every key has this byte
		}
		var sum uint32
		for i, k := range c {
			c[i], sum = sum, sum+k
		}
		for _, k := range keys {
			p := &c[byte(k>>shift)]
			tmp[*p] = k
			*p++
		}
		keys, tmp = tmp, keys
	}
	for i, k := range keys {
		xs[i] = keyFloat(k)
	}
	return buf
}

// floatKey maps x to an integer with the order of the floats: negative
// values have their bits flipped, the others their sign bit set.
func floatKey(x float64) uint64 {
	b := math.Float64bits(x)
	if b>>63 != 0 {
		return ^b
	}
	return b | 1<<63
}

// keyFloat is the inverse of floatKey.
func keyFloat(k uint64) float64 {
	if k>>63 != 0 {
		return math.Float64frombits(k &^ (1 << 63))
	}
	return math.Float64frombits(^k)
}

// medianMAD returns the median and the scaled median absolute deviation
// (a robust σ) of xs, using scratch for work; xs is left untouched.
func medianMAD(xs, scratch []float64) (med, sigma float64, _ []float64) {
	scratch = append(scratch[:0], xs...)
	med = median(scratch)
	for i, x := range xs {
		scratch[i] = math.Abs(x - med)
	}
	return med, madScale * median(scratch), scratch
}

// split2 divides values into a low and a high cluster with the boundary
// that minimises the within-cluster sum of squares (1-D 2-means, exact).
// It returns the index in sorted order of the first high value and the
// two cluster means; sorted must be in increasing order.
func split2(sorted []float64) (cut int, lowMean, highMean float64) {
	n := len(sorted)
	if n < 2 {
		return n, math.NaN(), math.NaN()
	}
	var total, totalSq float64
	for _, x := range sorted {
		total += x
		totalSq += x * x
	}
	best := math.Inf(1)
	var sum, sumSq float64
	for i := 1; i < n; i++ {
		x := sorted[i-1]
		sum += x
		sumSq += x * x
		l, h := float64(i), float64(n-i)
		sse := (sumSq - sum*sum/l) + ((totalSq - sumSq) - (total-sum)*(total-sum)/h)
		if sse < best {
			best, cut, lowMean, highMean = sse, i, sum/l, (total-sum)/h
		}
	}
	return cut, lowMean, highMean
}

// window keeps the last len(buf) values of a series.
type window struct {
	buf  []float64
	next int
	full bool
}

func newWindow(n int) window { return window{buf: make([]float64, n)} }

func (w *window) push(x float64) {
	w.buf[w.next] = x
	w.next++
	if w.next == len(w.buf) {
		w.next, w.full = 0, true
	}
}

func (w *window) len() int {
	if w.full {
		return len(w.buf)
	}
	return w.next
}

// values appends the kept values, oldest first, to dst.
func (w *window) values(dst []float64) []float64 {
	if w.full {
		dst = append(dst, w.buf[w.next:]...)
	}
	return append(dst, w.buf[:w.next]...)
}

// prev returns the value pushed before the newest one.
func (w *window) prev() (float64, bool) {
	n := len(w.buf)
	if w.len() < 2 {
		return 0, false
	}
	return w.buf[(w.next-2+n)%n], true
}

// Series names a figure a History keeps.
type Series int

// The series of a History.
const (
	SeriesStep       Series = iota // step time
	SeriesCompute                  // compute time
	SeriesDataLoader               // dataloader time
	SeriesComm                     // communication time, all communicators
	SeriesSend                     // send time
	numHist          = iota
)

// histMetrics are the detector's metrics of the history's series.
var histMetrics = [numHist]metric{mStep, mCompute, mDataLoader, mComm, mSend}

// history is a bounded, evenly decimated history of a few figures for
// charts: when full, adjacent points are merged (averaged) and the stride
// doubles, so memory stays fixed however long a job runs. The figures
// share their steps, and keep float32 values: 32 bytes a point for five
// figures, where a Point a figure would take 80.
type history struct {
	max    int // points kept; the slice is allocated at the first point
	pts    []histPoint
	stride int64 // steps per point
	acc    histPoint
	sum    [numHist]float64 // NaN once a step of the point lacked the figure
	accN   int64
}

type histPoint struct {
	step int64
	v    [numHist]float32 // NaN where the figure was not computed
}

// Point is one point of a chart series: a step and a value in
// milliseconds (a mean over the steps it stands for when the series is
// decimated; a figure one of them lacked is left out of that point).
type Point struct {
	Step  int64   `json:"step"`
	Value float64 `json:"ms"`
}

func newHistory(capacity int) history { return history{max: capacity, stride: 1} }

// add adds a step's figures, m being the detector's metrics of a rank or
// of the job; a NaN one is left out of its series. It is small enough to
// be inlined: the detector calls it for every rank at every step.
func (h *history) add(step int64, m *[numMetrics]float64) {
	if h.accN == 0 {
		h.acc.step = step
	}
	// A NaN stays in a sum, and leaves the figure out of the point.
	h.sum[SeriesStep] += m[mStep]
	h.sum[SeriesCompute] += m[mCompute]
	h.sum[SeriesDataLoader] += m[mDataLoader]
	h.sum[SeriesComm] += m[mComm]
	h.sum[SeriesSend] += m[mSend]
	h.accN++
	if h.accN >= h.stride {
		h.flush()
	}
}

// flush ends the point being accumulated, merging the points pairwise
// and doubling the stride when they fill the history.
func (h *history) flush() {
	if h.max == 0 {
		h.sum, h.accN = [numHist]float64{}, 0
		return
	}
	if h.pts == nil {
		h.pts = make([]histPoint, 0, h.max)
	}
	if len(h.pts) == cap(h.pts) {
		half := len(h.pts) / 2
		for i := 0; i < half; i++ {
			h.pts[i] = mergePoints(h.pts[2*i], h.pts[2*i+1])
		}
		if len(h.pts)%2 == 1 {
			h.pts[half] = h.pts[len(h.pts)-1]
			half++
		}
		h.pts = h.pts[:half]
		h.stride *= 2
	}
	h.pts = append(h.pts, h.point())
	h.sum, h.accN = [numHist]float64{}, 0
}

// point returns the point being accumulated.
func (h *history) point() histPoint {
	p := histPoint{step: h.acc.step}
	for i, sum := range h.sum {
		p.v[i] = float32(sum / float64(h.accN))
	}
	return p
}

// mergePoints averages two points, each figure over those that have it.
func mergePoints(a, b histPoint) histPoint {
	for i, x := range b.v {
		switch y := a.v[i]; {
		case math.IsNaN(float64(y)):
			a.v[i] = x
		case !math.IsNaN(float64(x)):
			a.v[i] = (x + y) / 2
		}
	}
	return a
}

// snapshot returns a copy of the points, the partial one included.
func (h *history) snapshot() []histPoint {
	out := make([]histPoint, len(h.pts), len(h.pts)+1)
	copy(out, h.pts)
	if h.accN > 0 {
		out = append(out, h.point())
	}
	return out
}

// seriesOf returns series s of pts, the points that have it.
func seriesOf(pts []histPoint, s Series) []Point {
	var out []Point
	for _, p := range pts {
		if v := p.v[s]; !math.IsNaN(float64(v)) {
			out = append(out, Point{Step: p.step, Value: round3(float64(v))})
		}
	}
	return out
}
