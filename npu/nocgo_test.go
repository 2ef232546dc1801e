//go:build !cgo

package npu_test

import (
	"context"
	"errors"
	"testing"

	"github.com/faultline-ml/faultline/npu"
	"github.com/faultline-ml/faultline/trace"
)

func TestUnsupportedWithoutCgo(t *testing.T) {
	if _, err := npu.OpenMarkers(npu.MarkerConfig{Sink: func(*trace.Record) {}}); !errors.Is(err, npu.ErrUnsupported) {
		t.Errorf("OpenMarkers: %v, want ErrUnsupported", err)
	}
	if _, err := npu.OpenMarkers(npu.MarkerConfig{}); err == nil || errors.Is(err, npu.ErrUnsupported) {
		t.Errorf("OpenMarkers without a sink: %v, want a validation error", err)
	}
	for _, b := range []string{"", npu.BackendNVML, npu.BackendDCMI} {
		if _, err := npu.OpenTelemetry(npu.TelemetryConfig{Backend: b}); !errors.Is(err, npu.ErrUnsupported) {
			t.Errorf("OpenTelemetry(%q): %v, want ErrUnsupported", b, err)
		}
	}
	if _, err := npu.OpenPairProbe(npu.PairProbeConfig{Library: "libx.so"}); !errors.Is(err, npu.ErrUnsupported) {
		t.Errorf("OpenPairProbe: %v, want ErrUnsupported", err)
	}
	var p *npu.PairProbe
	if _, err := p.Probe(context.Background(), 0, 1); !errors.Is(err, npu.ErrUnsupported) {
		t.Errorf("Probe: %v, want ErrUnsupported", err)
	}
}
