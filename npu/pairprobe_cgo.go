//go:build cgo

package npu

/*
#include <stdint.h>

static int fl_pp_void(void *fn) { return ((int (*)(void))fn)(); }
static void fl_pp_fini(void *fn) { ((void (*)(void))fn)(); }
static int fl_pp_run(void *fn, int a, int b, uint64_t bytes, double *bps) {
	return ((int (*)(int, int, uint64_t, double *))fn)(a, b, bytes, bps);
}
static const char *fl_pp_strerror(void *fn, int code) { return ((const char *(*)(int))fn)(code); }
*/
import "C"

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"sync"
	"unsafe"
)

// Return codes of include/faultline_pairprobe.h.
const (
	pairProbeVersion = 1
	pairProbeOK      = 0
	pairProbeENODEV  = 1
)

// PairProbe measures device pairs through a library implementing
// include/faultline_pairprobe.h. Probes are serialised: two transfers at once
// would share the links they measure.
type PairProbe struct {
	lib *library
	cfg PairProbeConfig
	fn  struct {
		version, count, run  unsafe.Pointer
		init, strerror, fini unsafe.Pointer // optional
	}
	mu      sync.Mutex
	devices int
	closed  bool
}

// OpenPairProbe loads cfg.Library and initialises it. Without the library,
// or when it finds no device, the error wraps ErrNoDevice.
func OpenPairProbe(cfg PairProbeConfig) (*PairProbe, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Bytes = cmp.Or(cfg.Bytes, DefaultPairProbeBytes)
	lib, err := openLibrary(cfg.Library, false)
	if err != nil {
		return nil, err
	}
	p := &PairProbe{lib: lib, cfg: cfg}
	err = lib.resolve([]symbol{
		{"faultline_pairprobe_version", &p.fn.version},
		{"faultline_pairprobe_device_count", &p.fn.count},
		{"faultline_pairprobe_run", &p.fn.run},
	})
	if err != nil {
		lib.close()
		return nil, err
	}
	p.fn.init = lib.optional("faultline_pairprobe_init")
	p.fn.strerror = lib.optional("faultline_pairprobe_strerror")
	p.fn.fini = lib.optional("faultline_pairprobe_fini")
	if v := C.fl_pp_void(p.fn.version); v != pairProbeVersion {
		lib.close()
		return nil, fmt.Errorf("npu: %s: faultline_pairprobe_version is %d, want %d", cfg.Library, v, pairProbeVersion)
	}
	if p.fn.init != nil {
		if rc := C.fl_pp_void(p.fn.init); rc != pairProbeOK {
			err := p.err("faultline_pairprobe_init", rc)
			lib.close()
			return nil, err
		}
	}
	p.devices = int(C.fl_pp_void(p.fn.count))
	if p.devices <= 0 {
		p.close()
		return nil, fmt.Errorf("%w: %s: the library reports none", ErrNoDevice, cfg.Library)
	}
	return p, nil
}

func (p *PairProbe) err(fn string, rc C.int) error {
	e := &DriverError{Library: p.cfg.Library, Func: fn, Code: int(rc), Msg: p.strerror(rc)}
	if rc == pairProbeENODEV {
		e.err = ErrNoDevice
	}
	return e
}

func (p *PairProbe) strerror(rc C.int) string {
	if p.fn.strerror == nil {
		return ""
	}
	if s := C.fl_pp_strerror(p.fn.strerror, rc); s != nil {
		return C.GoString(s)
	}
	return ""
}

// Devices returns how many devices the library can probe.
func (p *PairProbe) Devices() int { return p.devices }

// Probe moves PairProbeConfig.Bytes from device a to device b and returns
// the rate the library measured. The transfer cannot be interrupted: ctx is
// checked before it starts.
func (p *PairProbe) Probe(ctx context.Context, a, b int) (float64, error) {
	if a < 0 || b < 0 || a >= p.devices || b >= p.devices {
		return 0, fmt.Errorf("%w: pair probe %d->%d: devices are 0..%d", ErrNoDevice, a, b, p.devices-1)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	var bps C.double
	if rc := C.fl_pp_run(p.fn.run, C.int(a), C.int(b), C.uint64_t(p.cfg.Bytes), &bps); rc != pairProbeOK {
		e := &PairProbeError{A: a, B: b, Code: int(rc), Msg: p.strerror(rc)}
		if rc == pairProbeENODEV {
			e.err = ErrNoDevice
		}
		return 0, e
	}
	v := float64(bps)
	if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
		return 0, &PairProbeError{A: a, B: b, Msg: fmt.Sprintf("library reported rate %v", v)}
	}
	return v, nil
}

// Close finalises and unloads the library. It is idempotent.
func (p *PairProbe) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	p.close()
	return nil
}

func (p *PairProbe) close() {
	if p.fn.fini != nil {
		C.fl_pp_fini(p.fn.fini)
	}
	p.lib.close()
}
