//go:build cgo

package npu_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"

	"github.com/faultline-ml/faultline/npu"
	"github.com/faultline-ml/faultline/npu/internal/fakedriver"
)

const gib = 1 << 30

func openTelemetry(t *testing.T, backend, path string) npu.Telemetry {
	t.Helper()
	tel, err := npu.OpenTelemetry(npu.TelemetryConfig{Backend: backend, Library: path})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tel.Close() })
	return tel
}

func devices(t *testing.T, tel npu.Telemetry) []npu.DeviceStats {
	t.Helper()
	devs, err := tel.Devices(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return devs
}

func TestNVML(t *testing.T) {
	path := fakedriver.Build(t, "testdata/fake_nvml.c")
	fake := fakedriver.Open(t, path)
	fake.Get("links", 2, 0)
	fake.Get("link_down", 1, 1)
	fake.Get("link_errors", 1, 10)
	fake.Get("remap", 1, 1) // a row remap pending
	tel := openTelemetry(t, npu.BackendNVML, path)
	if tel.Backend() != npu.BackendNVML {
		t.Errorf("Backend() = %q", tel.Backend())
	}

	want := []npu.DeviceStats{{
		Index: 0, Utilization: 10, MemoryUsed: 1 * gib, MemoryTotal: 80 * gib, Health: npu.HealthOK,
		Links: []npu.LinkStats{
			{Index: 0, State: npu.LinkUp, Tx: 1000, Rx: 2000},
			{Index: 1, State: npu.LinkUp, Tx: 2000, Rx: 4000, ReplayErrors: 1, RecoveryErrors: 1, CRCErrors: 2},
		},
	}, {
		Index: 1, Utilization: 20, MemoryUsed: 2 * gib, MemoryTotal: 80 * gib, Health: npu.HealthMajor,
		Links: []npu.LinkStats{
			// The fake's counter n reads base*(n+1) + link: replay 0, recovery 1, CRC flit 2 and data 3.
			{Index: 0, State: npu.LinkUp, Tx: 2000, Rx: 4000, ReplayErrors: 10, RecoveryErrors: 20, CRCErrors: 30 + 40},
			{Index: 1, State: npu.LinkDown, Tx: 4000, Rx: 8000, ReplayErrors: 11, RecoveryErrors: 21, CRCErrors: 31 + 41},
		},
	}}
	if d := cmp.Diff(want, devices(t, tel)); d != "" {
		t.Errorf("devices (-want +got):\n%s", d)
	}

	fake.Get("ecc", 0, 3)
	fake.Get("remap", 1, 2) // the remap failed
	devs := devices(t, tel)
	if devs[0].Health != npu.HealthMajor || devs[1].Health != npu.HealthCritical {
		t.Errorf("health %v, %v; want major (uncorrected ECC), critical (remap failure)", devs[0].Health, devs[1].Health)
	}

	if n := fake.Get("inits", 0, 0); n != 1 {
		t.Errorf("%d NVML inits outstanding, want 1", n)
	}
	if err := tel.Close(); err != nil {
		t.Fatal(err)
	}
	if n := fake.Get("inits", 0, 0); n != 0 {
		t.Errorf("Close left %d NVML inits", n)
	}
	if _, err := tel.Devices(context.Background()); !errors.Is(err, npu.ErrClosed) {
		t.Errorf("Devices after Close: %v", err)
	}
	if err := tel.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func TestNVMLLostGPU(t *testing.T) {
	path := fakedriver.Build(t, "testdata/fake_nvml.c")
	fake := fakedriver.Open(t, path)
	fake.Get("lost", 1, 0)
	tel := openTelemetry(t, npu.BackendNVML, path)
	devs := devices(t, tel)
	if len(devs) != 2 {
		t.Fatalf("%d devices, want 2 (a lost one is still listed)", len(devs))
	}
	if devs[0].Err != nil || devs[0].Health != npu.HealthOK {
		t.Errorf("device 0: %+v", devs[0])
	}
	lost := devs[1]
	var de *npu.DriverError
	if !errors.As(lost.Err, &de) || de.Code != 15 || de.Msg != "GPU is lost" || de.Func != "nvmlDeviceGetUtilizationRates" {
		t.Errorf("lost device error: %v, want nvmlDeviceGetUtilizationRates returning 15 (GPU is lost)", lost.Err)
	}
	if lost.Health != npu.HealthCritical || lost.Utilization != -1 || lost.MemoryTotal != 0 || lost.Links != nil {
		t.Errorf("lost device: %+v", lost)
	}
}

func TestNVMLNoDevice(t *testing.T) {
	path := fakedriver.Build(t, "testdata/fake_nvml.c")
	fake := fakedriver.Open(t, path)

	fake.Get("no_driver", 1, 0)
	_, err := npu.OpenTelemetry(npu.TelemetryConfig{Backend: npu.BackendNVML, Library: path})
	var de *npu.DriverError
	if !errors.Is(err, npu.ErrNoDevice) || !errors.As(err, &de) || de.Func != "nvmlInit_v2" || de.Code != 9 {
		t.Errorf("driver not loaded: %v, want ErrNoDevice from nvmlInit_v2 (9)", err)
	}

	fake.Get("no_driver", 0, 0)
	fake.Get("devices", 0, 0)
	_, err = npu.OpenTelemetry(npu.TelemetryConfig{Backend: npu.BackendNVML, Library: path})
	if !errors.Is(err, npu.ErrNoDevice) {
		t.Errorf("no device: %v, want ErrNoDevice", err)
	}
	if n := fake.Get("inits", 0, 0); n != 0 {
		t.Errorf("failed opens left %d NVML inits", n)
	}

	_, err = npu.OpenTelemetry(npu.TelemetryConfig{Backend: npu.BackendNVML, Library: "/nonexistent/libnvidia-ml.so.1"})
	var le *npu.LoadError
	if !errors.Is(err, npu.ErrNoDevice) || !errors.As(err, &le) {
		t.Errorf("no library: %v, want a LoadError wrapping ErrNoDevice", err)
	}
	dcmi := fakedriver.Build(t, "testdata/fake_dcmi.c")
	_, err = npu.OpenTelemetry(npu.TelemetryConfig{Backend: npu.BackendNVML, Library: dcmi})
	if !errors.Is(err, npu.ErrNoDevice) || !errors.As(err, &le) || le.Symbol != "nvmlInit_v2" {
		t.Errorf("not NVML: %v, want a LoadError naming nvmlInit_v2", err)
	}
}

func TestDCMI(t *testing.T) {
	path := fakedriver.Build(t, "testdata/fake_dcmi.c")
	fake := fakedriver.Open(t, path)
	fake.Get("health", 1, 2) // major alarm
	fake.Get("lane_down", 1, 3)
	tel := openTelemetry(t, npu.BackendDCMI, path)
	if tel.Backend() != npu.BackendDCMI {
		t.Errorf("Backend() = %q", tel.Backend())
	}
	hccs := func(down int) []npu.LinkStats {
		var ls []npu.LinkStats
		for i := 1; i <= 7; i++ {
			l := npu.LinkStats{Index: i, State: npu.LinkUp, Tx: 100 * uint64(i), Rx: 200 * uint64(i)}
			if i == down {
				l.State, l.CRCErrors = npu.LinkDown, 1
			}
			ls = append(ls, l)
		}
		return ls
	}
	const mib = 1 << 20
	want := []npu.DeviceStats{
		{Index: 0, Utilization: 40, MemoryUsed: 2048 * mib, MemoryTotal: 65536 * mib, Health: npu.HealthOK, Links: hccs(-1)},
		{Index: 1, Utilization: 41, MemoryUsed: 3072 * mib, MemoryTotal: 65536 * mib, Health: npu.HealthMajor, Links: hccs(3)},
	}
	if d := cmp.Diff(want, devices(t, tel)); d != "" {
		t.Errorf("devices (-want +got):\n%s", d)
	}

	// Older parts: no HBM query (DDR memory instead), no HCCS; a chip gone.
	fake.Get("no_hbm", 1, 0)
	fake.Get("no_hccs", 1, 0)
	fake.Get("missing", 0, 0)
	devs := devices(t, tel)
	want = []npu.DeviceStats{
		{Index: 0, Utilization: -1, Health: npu.HealthCritical},
		{Index: 1, Utilization: 41, MemoryUsed: 3072 * mib, MemoryTotal: 32768 * mib, Health: npu.HealthMajor},
	}
	if d := cmp.Diff(want, devs, cmpopts.IgnoreFields(npu.DeviceStats{}, "Err")); d != "" {
		t.Errorf("devices (-want +got):\n%s", d)
	}
	var de *npu.DriverError
	if !errors.As(devs[0].Err, &de) || de.Code != -8008 || devs[1].Err != nil {
		t.Errorf("errors %v, %v; want DCMI_ERR_CODE_DEVICE_NOT_EXIST (-8008) for the missing chip only", devs[0].Err, devs[1].Err)
	}
	if err := tel.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := tel.Devices(context.Background()); !errors.Is(err, npu.ErrClosed) {
		t.Errorf("Devices after Close: %v", err)
	}
}

func TestDCMINoDevice(t *testing.T) {
	path := fakedriver.Build(t, "testdata/fake_dcmi.c")
	fake := fakedriver.Open(t, path)
	fake.Get("no_driver", 1, 0)
	_, err := npu.OpenTelemetry(npu.TelemetryConfig{Backend: npu.BackendDCMI, Library: path})
	var de *npu.DriverError
	if !errors.Is(err, npu.ErrNoDevice) || !errors.As(err, &de) || de.Func != "dcmi_init" {
		t.Errorf("no driver: %v, want ErrNoDevice from dcmi_init", err)
	}
	_, err = npu.OpenTelemetry(npu.TelemetryConfig{Backend: npu.BackendDCMI, Library: "/nonexistent/libdcmi.so"})
	if !errors.Is(err, npu.ErrNoDevice) {
		t.Errorf("no library: %v, want ErrNoDevice", err)
	}
}

func TestTelemetryContext(t *testing.T) {
	path := fakedriver.Build(t, "testdata/fake_nvml.c")
	tel := openTelemetry(t, npu.BackendNVML, path)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := tel.Devices(ctx); !errors.Is(err, context.Canceled) {
		t.Errorf("Devices with a cancelled context: %v", err)
	}
}

// Concurrent readers and a Close: race-clean, and no read after the unload.
func TestTelemetryConcurrent(t *testing.T) {
	for _, b := range []struct{ backend, src string }{
		{npu.BackendNVML, "testdata/fake_nvml.c"},
		{npu.BackendDCMI, "testdata/fake_dcmi.c"},
	} {
		t.Run(b.backend, func(t *testing.T) {
			tel := openTelemetry(t, b.backend, fakedriver.Build(t, b.src))
			done := make(chan struct{})
			for range 4 {
				go func() {
					defer func() { done <- struct{}{} }()
					for range 50 {
						if _, err := tel.Devices(context.Background()); err != nil {
							if !errors.Is(err, npu.ErrClosed) {
								t.Error(err)
							}
							return
						}
					}
				}()
			}
			tel.Close()
			for range 4 {
				<-done
			}
		})
	}
}

// The zero config tries the system's libraries: on this host either one
// loads or the error says there is no device.
func TestTelemetryAuto(t *testing.T) {
	tel, err := npu.OpenTelemetry(npu.TelemetryConfig{})
	if err != nil {
		if !errors.Is(err, npu.ErrNoDevice) {
			t.Fatalf("OpenTelemetry: %v, want ErrNoDevice on a host without accelerators", err)
		}
		return
	}
	t.Logf("found %s", tel.Backend())
	tel.Close()
}

func TestTelemetryConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		cfg   npu.TelemetryConfig
		field string
	}{
		{npu.TelemetryConfig{Backend: "rocm"}, "Backend"},
		{npu.TelemetryConfig{Library: "libx.so"}, "Library"},
	} {
		err := tc.cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), "TelemetryConfig."+tc.field) {
			t.Errorf("Validate(%+v) = %v, want an error naming %s", tc.cfg, err, tc.field)
		}
		if _, err := npu.OpenTelemetry(tc.cfg); err == nil || errors.Is(err, npu.ErrNoDevice) {
			t.Errorf("OpenTelemetry(%+v) = %v, want the validation error", tc.cfg, err)
		}
	}
}

func TestHealthAndLinkStateStrings(t *testing.T) {
	for h, want := range map[npu.Health]string{
		npu.HealthUnknown: "unknown", npu.HealthOK: "ok", npu.HealthMinor: "minor",
		npu.HealthMajor: "major", npu.HealthCritical: "critical", 9: "Health(9)",
	} {
		if got := h.String(); got != want {
			t.Errorf("Health(%d).String() = %q, want %q", h, got, want)
		}
	}
	for s, want := range map[npu.LinkState]string{npu.LinkUnknown: "unknown", npu.LinkUp: "up", npu.LinkDown: "down", 7: "LinkState(7)"} {
		if got := s.String(); got != want {
			t.Errorf("LinkState(%d).String() = %q, want %q", s, got, want)
		}
	}
}

// FAULTLINE_NVML_REAL=1 reads the host's GPUs through the system's
// libnvidia-ml.so.1 (FAULTLINE_NVML_LIBRARY overrides the library) and
// prints them: go test -run TestNVMLRealLibrary -v ./npu/
func TestNVMLRealLibrary(t *testing.T) {
	realLibrary(t, "FAULTLINE_NVML_REAL", "FAULTLINE_NVML_LIBRARY", npu.BackendNVML)
}

// FAULTLINE_DCMI_REAL=1 does the same for Ascend NPUs through libdcmi.so
// (FAULTLINE_DCMI_LIBRARY overrides the library).
func TestDCMIRealLibrary(t *testing.T) {
	realLibrary(t, "FAULTLINE_DCMI_REAL", "FAULTLINE_DCMI_LIBRARY", npu.BackendDCMI)
}

func realLibrary(t *testing.T, gate, libEnv, backend string) {
	if os.Getenv(gate) != "1" {
		t.Skipf("set %s=1 to read this host's devices through the system's library", gate)
	}
	tel := openTelemetry(t, backend, os.Getenv(libEnv))
	start := time.Now()
	devs := devices(t, tel)
	t.Logf("%s: %d devices read in %v", backend, len(devs), time.Since(start))
	if len(devs) == 0 {
		t.Fatal("no devices")
	}
	for _, d := range devs {
		t.Logf("device %d: utilization %d%%, memory %d/%d MiB, health %v, err %v",
			d.Index, d.Utilization, d.MemoryUsed>>20, d.MemoryTotal>>20, d.Health, d.Err)
		for _, l := range d.Links {
			t.Logf("  link %d: %v tx %d rx %d crc %d replay %d recovery %d",
				l.Index, l.State, l.Tx, l.Rx, l.CRCErrors, l.ReplayErrors, l.RecoveryErrors)
		}
		if d.MemoryTotal == 0 || d.MemoryUsed > d.MemoryTotal || d.Utilization < -1 || d.Utilization > 100 {
			t.Errorf("device %d: implausible %+v", d.Index, d)
		}
	}
}
