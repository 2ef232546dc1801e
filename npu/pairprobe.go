package npu

import (
	"context"
	"fmt"
)

// PairProber measures the link between two accelerators of this host: the
// switchbox check's device-pair probe. *PairProbe implements it over a
// loaded library; a caller (netcheck) adapts it to its own interface.
type PairProber interface {
	// Probe moves data from device a to device b and returns the rate.
	Probe(ctx context.Context, a, b int) (bytesPerSec float64, err error)
}

// DefaultPairProbeBytes is how much one probe moves unless configured.
const DefaultPairProbeBytes = 256 << 20

// PairProbeConfig configures OpenPairProbe.
type PairProbeConfig struct {
	// Library is the name or path of a library implementing
	// include/faultline_pairprobe.h. Required: there is no vendor default.
	Library string

	// Bytes is how much one probe moves. Default DefaultPairProbeBytes
	// (256 MiB).
	Bytes uint64
}

// Validate reports the first field that is out of range.
func (c PairProbeConfig) Validate() error {
	if c.Library == "" {
		return fmt.Errorf("npu: PairProbeConfig.Library: required")
	}
	return nil
}

// PairProbeError is a failed probe of one pair. It wraps ErrNoDevice when
// the library says a device does not exist.
type PairProbeError struct {
	A, B int
	Code int    // the library's return code
	Msg  string // the library's text for it, if any
	err  error
}

func (e *PairProbeError) Error() string {
	s := fmt.Sprintf("npu: pair probe %d->%d: code %d", e.A, e.B, e.Code)
	if e.Msg != "" {
		s += " (" + e.Msg + ")"
	}
	return s
}

// Unwrap returns ErrNoDevice for FAULTLINE_PAIRPROBE_ENODEV, else nil.
func (e *PairProbeError) Unwrap() error { return e.err }
