package npu_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/faultline-ml/faultline/npu"
	"github.com/faultline-ml/faultline/trace"
)

// A health check reads every accelerator of the host. On a host without one
// (or a binary built without cgo) it turns itself off.
func ExampleOpenTelemetry() {
	tel, err := npu.OpenTelemetry(npu.TelemetryConfig{
		Backend: npu.BackendNVML,
		Library: "/nonexistent/libnvidia-ml.so.1", // "" loads the system's
	})
	if errors.Is(err, npu.ErrNoDevice) || errors.Is(err, npu.ErrUnsupported) {
		fmt.Println("no accelerator: device checks off")
		return
	}
	if err != nil {
		fmt.Println(err)
		return
	}
	defer tel.Close()
	devs, err := tel.Devices(context.Background())
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, d := range devs {
		fmt.Printf("%s %d: %d%% busy, %d/%d bytes, health %v, %d links\n",
			tel.Backend(), d.Index, d.Utilization, d.MemoryUsed, d.MemoryTotal, d.Health, len(d.Links))
	}
	// Output: no accelerator: device checks off
}

// A training process receives its marker records from the profiling
// library and passes them to the dotting recorder; the switch decides
// which domains the library collects.
func ExampleOpenMarkers() {
	var n int
	src, err := npu.OpenMarkers(npu.MarkerConfig{
		Library: "/nonexistent/libmspti.so", // "" loads libmspti.so
		Sink:    func(r *trace.Record) { n++ },
		Switch:  trace.AllOn(),
	})
	if errors.Is(err, npu.ErrNoDevice) || errors.Is(err, npu.ErrUnsupported) {
		fmt.Println("no profiling library: markers off")
		return
	}
	if err != nil {
		fmt.Println(err)
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- src.Run(ctx) }()
	// ... training; a switch change arrives:
	_ = src.ApplySwitch(trace.Switch{Step: true})
	cancel()
	<-done
	src.Close()
	fmt.Println(n, "records")
	// Output: no profiling library: markers off
}

// The switchbox check probes device pairs through a vendor's pair-probe
// library.
func ExampleOpenPairProbe() {
	pp, err := npu.OpenPairProbe(npu.PairProbeConfig{Library: "/nonexistent/libpairprobe.so"})
	if errors.Is(err, npu.ErrNoDevice) || errors.Is(err, npu.ErrUnsupported) {
		fmt.Println("no pair-probe library: switchbox check off")
		return
	}
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pp.Close()
	var prober npu.PairProber = pp
	bps, err := prober.Probe(context.Background(), 0, 1)
	fmt.Println(bps >= 10e9, err) // the switchbox check passes a pair above 10000 MB/s
	// Output: no pair-probe library: switchbox check off
}
