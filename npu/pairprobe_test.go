//go:build cgo

package npu_test

import (
	"context"
	"errors"
	"sync"
	"testing"

	"github.com/faultline-ml/faultline/npu"
	"github.com/faultline-ml/faultline/npu/internal/fakedriver"
)

var _ npu.PairProber = (*npu.PairProbe)(nil)

func TestPairProbe(t *testing.T) {
	path := fakedriver.Build(t, "testdata/fake_pairprobe.c")
	fake := fakedriver.Open(t, path)
	fake.Control("rate", 0, 1, 5e9, "", "")
	fake.Control("fail", 2, 3, 0, "", "")
	pp, err := npu.OpenPairProbe(npu.PairProbeConfig{Library: path, Bytes: 64 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if pp.Devices() != 8 || fake.Get("inits", 0, 0) != 1 {
		t.Errorf("%d devices, %d inits; want 8, 1", pp.Devices(), fake.Get("inits", 0, 0))
	}
	ctx := context.Background()
	for _, tc := range []struct {
		a, b int
		want float64
	}{{0, 1, 5e9}, {1, 0, 20e9}, {6, 7, 20e9}} {
		got, err := pp.Probe(ctx, tc.a, tc.b)
		if err != nil || got != tc.want {
			t.Errorf("Probe(%d, %d) = %v, %v; want %v", tc.a, tc.b, got, err, tc.want)
		}
	}
	if n := fake.Get("last_bytes", 0, 0); n != 64<<20 {
		t.Errorf("library moved %d bytes, want the configured 64 MiB", n)
	}

	_, err = pp.Probe(ctx, 2, 3)
	var pe *npu.PairProbeError
	if !errors.As(err, &pe) || pe.A != 2 || pe.B != 3 || pe.Code != 7 || pe.Msg != "peer copy timed out" || errors.Is(err, npu.ErrNoDevice) {
		t.Errorf("failing pair: %v, want a PairProbeError 2->3 code 7 with the library's text", err)
	}
	if _, err := pp.Probe(ctx, 0, 8); !errors.Is(err, npu.ErrNoDevice) {
		t.Errorf("device out of range: %v, want ErrNoDevice", err)
	}
	fake.Get("devices", 4, 0) // the library loses devices under us
	if _, err := pp.Probe(ctx, 0, 5); !errors.Is(err, npu.ErrNoDevice) || !errors.As(err, &pe) || pe.Code != 1 {
		t.Errorf("device the library no longer has: %v, want ErrNoDevice with code 1", err)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	runs := fake.Get("runs", 0, 0)
	if _, err := pp.Probe(cancelled, 0, 1); !errors.Is(err, context.Canceled) || fake.Get("runs", 0, 0) != runs {
		t.Errorf("cancelled probe: %v, want context.Canceled before any transfer", err)
	}

	if err := pp.Close(); err != nil {
		t.Fatal(err)
	}
	if fake.Get("finis", 0, 0) != 1 {
		t.Error("Close did not call faultline_pairprobe_fini")
	}
	if _, err := pp.Probe(ctx, 0, 1); !errors.Is(err, npu.ErrClosed) {
		t.Errorf("Probe after Close: %v", err)
	}
	if err := pp.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func TestPairProbeConcurrent(t *testing.T) {
	path := fakedriver.Build(t, "testdata/fake_pairprobe.c")
	pp, err := npu.OpenPairProbe(npu.PairProbeConfig{Library: path})
	if err != nil {
		t.Fatal(err)
	}
	defer pp.Close()
	var wg sync.WaitGroup
	for a := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 100 {
				if _, err := pp.Probe(context.Background(), a, a+4); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if n := fakedriver.Open(t, path).Get("runs", 0, 0); n != 400 {
		t.Errorf("%d runs, want 400", n)
	}
}

func TestPairProbeNoDevice(t *testing.T) {
	path := fakedriver.Build(t, "testdata/fake_pairprobe.c")
	fake := fakedriver.Open(t, path)
	fake.Get("init_fails", 1, 0) // FAULTLINE_PAIRPROBE_ENODEV
	_, err := npu.OpenPairProbe(npu.PairProbeConfig{Library: path})
	var de *npu.DriverError
	if !errors.Is(err, npu.ErrNoDevice) || !errors.As(err, &de) || de.Func != "faultline_pairprobe_init" || de.Msg != "no such device" {
		t.Errorf("init failing: %v, want ErrNoDevice from faultline_pairprobe_init", err)
	}
	fake.Get("init_fails", 0, 0)
	fake.Get("devices", 0, 0)
	if _, err := npu.OpenPairProbe(npu.PairProbeConfig{Library: path}); !errors.Is(err, npu.ErrNoDevice) {
		t.Errorf("no devices: %v, want ErrNoDevice", err)
	}
	if _, err := npu.OpenPairProbe(npu.PairProbeConfig{Library: "/nonexistent/libpairprobe.so"}); !errors.Is(err, npu.ErrNoDevice) {
		t.Errorf("no library: %v, want ErrNoDevice", err)
	}
	mspti := fakedriver.Build(t, "testdata/fake_mspti.c")
	var le *npu.LoadError
	if _, err := npu.OpenPairProbe(npu.PairProbeConfig{Library: mspti}); !errors.As(err, &le) || le.Symbol != "faultline_pairprobe_version" {
		t.Errorf("not a pair-probe library: %v", err)
	}
	if _, err := npu.OpenPairProbe(npu.PairProbeConfig{}); err == nil || errors.Is(err, npu.ErrNoDevice) {
		t.Errorf("no Library: %v, want a validation error", err)
	}
}
