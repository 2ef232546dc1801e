//go:build !cgo

package npu

import (
	"context"

	"github.com/faultline-ml/faultline/trace"
)

// Without cgo nothing can be loaded: every constructor returns
// ErrUnsupported, so that the rest of the module builds and runs with
// accelerator features off.

// MarkerSource is unavailable without cgo.
type MarkerSource struct{}

// OpenMarkers returns ErrUnsupported.
func OpenMarkers(cfg MarkerConfig) (*MarkerSource, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return nil, ErrUnsupported
}

// ApplySwitch returns ErrUnsupported.
func (s *MarkerSource) ApplySwitch(trace.Switch) error { return ErrUnsupported }

// Switch returns the zero Switch.
func (s *MarkerSource) Switch() trace.Switch { return trace.Switch{} }

// Run returns ErrUnsupported.
func (s *MarkerSource) Run(context.Context) error { return ErrUnsupported }

// Flush returns ErrUnsupported.
func (s *MarkerSource) Flush(context.Context) error { return ErrUnsupported }

// Stats returns zero counts.
func (s *MarkerSource) Stats() MarkerStats { return MarkerStats{} }

// Close does nothing.
func (s *MarkerSource) Close() error { return nil }

func openNVML(string) (Telemetry, error) { return nil, ErrUnsupported }
func openDCMI(string) (Telemetry, error) { return nil, ErrUnsupported }

// PairProbe is unavailable without cgo.
type PairProbe struct{}

// OpenPairProbe returns ErrUnsupported.
func OpenPairProbe(cfg PairProbeConfig) (*PairProbe, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return nil, ErrUnsupported
}

// Devices returns 0.
func (p *PairProbe) Devices() int { return 0 }

// Probe returns ErrUnsupported.
func (p *PairProbe) Probe(context.Context, int, int) (float64, error) { return 0, ErrUnsupported }

// Close does nothing.
func (p *PairProbe) Close() error { return nil }
