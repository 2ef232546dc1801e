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

func (k findingKind) metricName() string {
	return [...]string{"compute", "dataloader", "send", "communication"}[k]
}

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
	val, ref  window // the subject's figure and its reference, recent steps
	hits      window // 1 for an anomalous step, 0 for a normal one
}

func (f *finding) observe(v, ref float64, hit bool) {
	f.val.push(v)
	f.ref.push(ref)
	h := 0.0
	if hit {
		h = 1
	}
	f.hits.push(h)
}

// evidence returns the recent figure, the reference and a confidence in
// [0, 1]: the share of recent steps that were anomalous, weighted by how
// far beyond the threshold the figure is.
func (f *finding) evidence(threshold float64, scratch []float64) (recent, ref, conf float64) {
	scratch = f.val.values(scratch[:0])
	recent = median(scratch)
	scratch = f.ref.values(scratch[:0])
	ref = median(scratch)
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
	return recent, ref, persistence * (0.5 + 0.5*margin)
}
