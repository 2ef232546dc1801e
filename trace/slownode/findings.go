package slownode

import "math"

// findingKind says what a finding blames.
type findingKind uint8

const (
	kindCompute findingKind = iota // a rank slow to compute
	kindIO                         // a rank slow to load data
	kindLink                       // a rank whose sends are slow
	kindDomain                     // a communicator slow as a whole
)

// Finding kinds as they appear in Finding.Kind.
const (
	KindCompute             = "compute"
	KindIO                  = "io"
	KindLink                = "link"
	KindCommunicationDomain = "communicationDomain"
	KindHost                = "host"
)

func (k findingKind) String() string {
	return [...]string{KindCompute, KindIO, KindLink, KindCommunicationDomain}[k]
}

func (k findingKind) metric() metric {
	switch k {
	case kindIO:
		return mDataLoader
	case kindLink:
		return mSend
	}
	return mCompute
}

// metricNames name the figures a finding's evidence may be.
var metricNames = map[metric]string{mCompute: "compute", mForward: "forward", mDataLoader: "dataloader",
	mSend: "send", mComm: "communication"}

type findingKey struct {
	kind findingKind
	id   int32 // dense rank index, or group index for kindDomain
}

// finding is the state of one subject that has been anomalous lately.
type finding struct {
	key       findingKey
	run       int   // consecutive anomalous steps
	calm      int   // consecutive normal steps while active
	active    bool  // run reached Consecutive; stays until calm does
	onset     int64 // first step of the run that made it active
	detected  int64 // step at which it became active
	flaggedAt int64
	method    string
	metric    metric // the figure val and ref hold, as of the latest anomalous step
	group     int32  // the communicator of the latest waited, -1 for none
	val, ref  window // the subject's figure and its reference, recent steps; NaN where not computed
	waited    window // how long its peers waited for it (homogenisation), 0 where they did not
	hits      window // 1 for an anomalous step, 0 for a normal one
}

func (f *finding) observe(v, ref, waited float64, hit bool) {
	f.val.push(v)
	f.ref.push(ref)
	f.waited.push(waited)
	h := 0.0
	if hit {
		h = 1
	}
	f.hits.push(h)
}

// evidence returns the recent figure, the reference (NaN where neither
// was computed), how long the peers waited for the subject, and a
// confidence in [0, 1]: the share of recent steps that were anomalous,
// weighted by how far beyond the threshold the figure is.
func (f *finding) evidence(threshold float64, scratch []float64) (recent, ref, waited, conf float64) {
	recent = medianComputed(f.val.values(scratch[:0]))
	ref = medianComputed(f.ref.values(scratch[:0]))
	waited = median(f.waited.values(scratch[:0]))
	scratch = f.hits.values(scratch[:0])
	var hits float64
	for _, h := range scratch {
		hits += h
	}
	persistence := hits / float64(len(scratch))
	margin := 1.0
	if ref > 0 && threshold > 0 {
		margin = math.Min(1, math.Max(0, (recent/ref-1)/(2*threshold)))
	}
	return recent, ref, waited, persistence * (0.5 + 0.5*margin)
}

// medianComputed returns the median of the values of xs that are not
// NaN, NaN if none; it reorders xs.
func medianComputed(xs []float64) float64 {
	n := 0
	for _, x := range xs {
		if !math.IsNaN(x) {
			xs[n] = x
			n++
		}
	}
	return median(xs[:n])
}
