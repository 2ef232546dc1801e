package netcheck

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"time"
)

// Node is a host to check: the name that reports use, and the address
// (host:port) of the agent that runs on it.
type Node struct {
	Name string `json:"name"`
	// Addr is the agent's address. It is empty for the checker itself when
	// it takes part as the reference.
	Addr string `json:"addr,omitempty"`
}

// Pair is one probe to run: From measures its link to To. Either may be
// the reference, which is always From.
type Pair struct {
	From string `json:"from"`
	To   string `json:"to"`
}

// String returns "from→to".
func (p Pair) String() string { return p.From + "→" + p.To }

// Measurement is what one probe saw.
type Measurement struct {
	From string `json:"from"`
	To   string `json:"to"`
	// Elapsed is how long the probe's work took: for TCPProber, the
	// fastest of its transfers (Bytes up and Bytes down), without the
	// connection and the pings; for a failed probe, the time until it
	// failed; for a partial one, the time its transfer ran.
	Elapsed time.Duration `json:"elapsed_ns"`
	// RTT is the median round trip of small messages; 0 if not measured.
	RTT time.Duration `json:"rtt_ns,omitempty"`
	// Bandwidth is in bytes per second, the slower of the two directions;
	// 0 if not measured.
	Bandwidth float64 `json:"bandwidth_bytes_per_second,omitempty"`
	// Bytes is how much one transfer of the probe sends each way.
	Bytes int64 `json:"bytes,omitempty"`
	// Partial is set when the deadline cut the probe's first transfer
	// short: Bandwidth is then the rate of the Moved bytes that arrived
	// (both ways together) in Elapsed, and the probe is judged as if the
	// whole transfer had taken 2 × Bytes at that rate. A link too slow to
	// finish is slow, not failed; one that moved nothing fails.
	Partial bool  `json:"partial,omitempty"`
	Moved   int64 `json:"moved_bytes,omitempty"`
	// Error says why the probe failed; "" if it did not.
	Error string `json:"error,omitempty"`
}

// Failed reports whether the probe failed.
func (m Measurement) Failed() bool { return m.Error != "" }

// Policy is how probe results are judged. The zero value holds the
// defaults documented on each field.
type Policy struct {
	// StragglerRatio: a probe is slow when it took longer than this many
	// times the median of the nodes' best probe times. Default 2.
	StragglerRatio float64 `json:"straggler_ratio"`
	// MinBandwidth: a probe that measured fewer bytes per second is slow.
	// Default 0, no floor. A floor is a baseline of its own: with one, a
	// node whose probes pass it is healthy even where no probe shows what
	// a healthy link does (see Planner). ParseBandwidth reads "400Mbit"
	// or "50MB".
	MinBandwidth float64 `json:"min_bandwidth_bytes_per_second,omitempty"`
	// MaxRTT: a probe whose round trip was longer is slow. Default 0, no
	// ceiling.
	MaxRTT time.Duration `json:"max_rtt_ns,omitempty"`
	// ProbeTimeout is the deadline of one probe, and the time a failed
	// probe counts as when medians are taken. Default 10 s.
	ProbeTimeout time.Duration `json:"probe_timeout_ns"`
	// ConfirmPeers is how many distinct healthy peers a node must fail or
	// be slow against before it is blamed (fewer when fewer exist).
	// Default 2.
	ConfirmPeers int `json:"confirm_peers"`
	// MaxRounds bounds the rounds of probes. Default 8.
	MaxRounds int `json:"max_rounds"`
}

// withDefaults returns p with zero fields set to their defaults.
func (p Policy) withDefaults() Policy {
	p.StragglerRatio = cmp.Or(p.StragglerRatio, 2)
	p.ProbeTimeout = cmp.Or(p.ProbeTimeout, 10*time.Second)
	p.ConfirmPeers = cmp.Or(p.ConfirmPeers, 2)
	p.MaxRounds = cmp.Or(p.MaxRounds, 8)
	return p
}

// Validate reports a field that cannot work.
func (p Policy) Validate() error {
	var errs []error
	if p.StragglerRatio != 0 && (p.StragglerRatio < 1 || math.IsNaN(p.StragglerRatio) || math.IsInf(p.StragglerRatio, 0)) {
		errs = append(errs, fmt.Errorf("Policy.StragglerRatio = %v: want at least 1", p.StragglerRatio))
	}
	if p.MinBandwidth < 0 || math.IsNaN(p.MinBandwidth) || math.IsInf(p.MinBandwidth, 0) {
		errs = append(errs, fmt.Errorf("Policy.MinBandwidth = %v: want a finite value ≥ 0", p.MinBandwidth))
	}
	if p.MaxRTT < 0 {
		errs = append(errs, fmt.Errorf("Policy.MaxRTT = %v: must not be negative", p.MaxRTT))
	}
	if p.ProbeTimeout < 0 {
		errs = append(errs, fmt.Errorf("Policy.ProbeTimeout = %v: must not be negative", p.ProbeTimeout))
	}
	if p.ConfirmPeers < 0 {
		errs = append(errs, fmt.Errorf("Policy.ConfirmPeers = %d: must not be negative", p.ConfirmPeers))
	}
	if p.MaxRounds < 0 {
		errs = append(errs, fmt.Errorf("Policy.MaxRounds = %d: must not be negative", p.MaxRounds))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("netcheck: %w", err)
	}
	return nil
}
