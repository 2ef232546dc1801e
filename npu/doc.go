// Package npu talks to accelerator drivers: it is the only package of the
// module that uses cgo. Every vendor library is loaded at run time with
// dlopen and dlsym, never linked, so one binary runs on hosts with NVIDIA
// GPUs, Ascend NPUs, both or neither. Without a driver a constructor returns
// an error wrapping ErrNoDevice; built with CGO_ENABLED=0 it returns
// ErrUnsupported. Nothing here crashes for want of hardware.
//
// Three things are loaded:
//
//   - Marker activity (MarkerSource): an mspti-style profiling library
//     (libmspti.so) records the markers a training process writes (step,
//     forward, dataloader, communication ops) into activity buffers that
//     this package hands it, then returns them through a callback. The
//     records go to a Sink as trace.Record values, ready for the dotting
//     recorder. Buffers are C memory, at most MaxBuffers of BufferBytes
//     (MindCluster's 100 of 2 MiB); when the sink falls behind, requests
//     for more are declined, the library drops records, and the refusals
//     are counted. ApplySwitch maps the profiling switch onto the library's
//     marker activity and "communication" domain.
//
//   - Device telemetry (Telemetry, from OpenTelemetry): per device
//     utilisation, memory, health and device-to-device link counters, from
//     NVML (libnvidia-ml.so.1) or DCMI (Ascend libdcmi.so), for hang and
//     health checks.
//
//   - Device pair probe (PairProbe): the switchbox check's link bandwidth
//     between two devices, from a library implementing the small C
//     interface in include/faultline_pairprobe.h. PairProbe satisfies
//     PairProber; netcheck adapts it to its own interface.
//
// mspti's buffer callbacks carry no user data, so one MarkerSource may be
// open per process at a time (mspti allows one subscriber anyway). The
// callbacks may arrive on threads the library creates; they reach Go through
// exported functions and a cgo.Handle, and no Go pointer is kept in C
// memory.
//
// # Tests
//
// The tests build fake driver libraries from the C sources in testdata (a
// libmspti that emits marker records when the test asks, an NVML, a DCMI and
// a pair-probe library, each with the real function names, types and
// layouts) with the system C compiler, and load them through the same
// dlopen path; they skip when no C compiler is found. Tests against a
// host's real libraries are opt-in:
//
//	FAULTLINE_NVML_REAL=1 go test -run TestNVMLRealLibrary -v ./npu/
//	FAULTLINE_DCMI_REAL=1 go test -run TestDCMIRealLibrary -v ./npu/
//	FAULTLINE_MSPTI_REAL=1 go test -run TestMarkersRealLibrary -v ./npu/
//
// # Example
//
//	src, err := npu.OpenMarkers(npu.MarkerConfig{
//		Sink:   func(r *trace.Record) { recorder.Record(r) },
//		Switch: sw,
//	})
//	if errors.Is(err, npu.ErrNoDevice) || errors.Is(err, npu.ErrUnsupported) {
//		return nil // no profiling library here: dot from Python instead
//	}
//	if err != nil {
//		return err
//	}
//	defer src.Close()
//	go src.Run(ctx)
//	// on every switch change:
//	err = src.ApplySwitch(newSwitch)
package npu
