//go:build cgo

package npu

/*
#include <stdint.h>

// Shapes from nvml.h.
typedef struct { unsigned int gpu, memory; } fl_nvml_util;
typedef struct { unsigned long long total, free, used; } fl_nvml_memory;
typedef union {
	double dVal;
	unsigned int uiVal;
	unsigned long ulVal;
	unsigned long long ullVal;
	signed long long sllVal;
	signed int siVal;
} fl_nvml_value;
typedef struct {
	unsigned int fieldId;
	unsigned int scopeId;
	long long timestamp;
	long long latencyUsec;
	int valueType;
	int nvmlReturn;
	fl_nvml_value value;
} fl_nvml_field_value;

enum {
	FL_NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1,
	FL_NVML_VOLATILE_ECC = 0,
};

static int fl_nvml_void(void *fn) { return ((int (*)(void))fn)(); }
static int fl_nvml_count(void *fn, unsigned int *n) { return ((int (*)(unsigned int *))fn)(n); }
static int fl_nvml_handle(void *fn, unsigned int i, void **dev) {
	return ((int (*)(unsigned int, void **))fn)(i, dev);
}
static int fl_nvml_utilization(void *fn, void *dev, fl_nvml_util *u) {
	return ((int (*)(void *, fl_nvml_util *))fn)(dev, u);
}
static int fl_nvml_memory_info(void *fn, void *dev, fl_nvml_memory *m) {
	return ((int (*)(void *, fl_nvml_memory *))fn)(dev, m);
}
static int fl_nvml_ecc(void *fn, void *dev, unsigned long long *n) {
	return ((int (*)(void *, int, int, unsigned long long *))fn)(dev, FL_NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
	                                                            FL_NVML_VOLATILE_ECC, n);
}
static int fl_nvml_remapped(void *fn, void *dev, unsigned int *corr, unsigned int *unc, unsigned int *pending,
                            unsigned int *failure) {
	return ((int (*)(void *, unsigned int *, unsigned int *, unsigned int *, unsigned int *))fn)(dev, corr, unc,
	                                                                                            pending, failure);
}
static int fl_nvml_link_state(void *fn, void *dev, unsigned int link, int *active) {
	return ((int (*)(void *, unsigned int, int *))fn)(dev, link, active);
}
static int fl_nvml_link_errors(void *fn, void *dev, unsigned int link, int counter, unsigned long long *v) {
	return ((int (*)(void *, unsigned int, int, unsigned long long *))fn)(dev, link, counter, v);
}
static int fl_nvml_field_values(void *fn, void *dev, int n, fl_nvml_field_value *v) {
	return ((int (*)(void *, int, fl_nvml_field_value *))fn)(dev, n, v);
}
static const char *fl_nvml_error_string(void *fn, int rc) { return ((const char *(*)(int))fn)(rc); }

static unsigned long long fl_nvml_field_u64(fl_nvml_field_value *v) {
	switch (v->valueType) {
	case 0: return v->value.dVal < 0 ? 0 : (unsigned long long)v->value.dVal;
	case 1: return v->value.uiVal;
	case 2: return v->value.ulVal;
	case 3: return v->value.ullVal;
	case 4: return v->value.sllVal < 0 ? 0 : (unsigned long long)v->value.sllVal;
	case 5: return v->value.siVal < 0 ? 0 : (unsigned long long)v->value.siVal;
	}
	return 0;
}
*/
import "C"

import (
	"context"
	"fmt"
	"sync"
	"unsafe"
)

// NVML return codes and constants this backend acts on (nvml.h).
const (
	nvmlSuccess         = 0
	nvmlInvalidArgument = 2
	nvmlNotSupported    = 3
	nvmlNoPermission    = 4
	nvmlGPUIsLost       = 15
	nvmlMaxLinks        = 18 // NVML_NVLINK_MAX_LINKS

	nvmlLinkReplay    = 0 // NVML_NVLINK_ERROR_DL_REPLAY
	nvmlLinkRecovery  = 1
	nvmlLinkCRCFlit   = 2
	nvmlLinkCRCData   = 3
	nvmlFieldLinkTx   = 138 // NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, KiB
	nvmlFieldLinkRx   = 139
	nvmlFieldValueLen = 2
)

// nvmlTelemetry is the NVML backend (libnvidia-ml.so.1).
type nvmlTelemetry struct {
	lib *library
	fn  struct {
		init, shutdown, count, handle, utilization, memory unsafe.Pointer
		// optional
		errorString, ecc, remapped, linkState, linkErrors, fieldValues unsafe.Pointer
	}
	mu     sync.RWMutex // Devices read-locks; Close locks
	closed bool
}

func openNVML(name string) (Telemetry, error) {
	lib, err := openLibrary(name, false)
	if err != nil {
		return nil, err
	}
	t := &nvmlTelemetry{lib: lib}
	err = lib.resolve([]symbol{
		{"nvmlInit_v2", &t.fn.init},
		{"nvmlShutdown", &t.fn.shutdown},
		{"nvmlDeviceGetCount_v2", &t.fn.count},
		{"nvmlDeviceGetHandleByIndex_v2", &t.fn.handle},
		{"nvmlDeviceGetUtilizationRates", &t.fn.utilization},
		{"nvmlDeviceGetMemoryInfo", &t.fn.memory},
	})
	if err != nil {
		lib.close()
		return nil, err
	}
	t.fn.errorString = lib.optional("nvmlErrorString")
	t.fn.ecc = lib.optional("nvmlDeviceGetTotalEccErrors")
	t.fn.remapped = lib.optional("nvmlDeviceGetRemappedRows")
	t.fn.linkState = lib.optional("nvmlDeviceGetNvLinkState")
	t.fn.linkErrors = lib.optional("nvmlDeviceGetNvLinkErrorCounter")
	t.fn.fieldValues = lib.optional("nvmlDeviceGetFieldValues")

	if rc := C.fl_nvml_void(t.fn.init); rc != nvmlSuccess {
		err := t.err("nvmlInit_v2", rc)
		err.err = ErrNoDevice // driver not loaded, no permission, ...: nothing to read
		lib.close()
		return nil, err
	}
	var n C.uint
	if rc := C.fl_nvml_count(t.fn.count, &n); rc != nvmlSuccess || n == 0 {
		var err error = fmt.Errorf("%w: %s: the driver reports none", ErrNoDevice, name)
		if rc != nvmlSuccess {
			de := t.err("nvmlDeviceGetCount_v2", rc)
			de.err = ErrNoDevice
			err = de
		}
		C.fl_nvml_void(t.fn.shutdown)
		lib.close()
		return nil, err
	}
	return t, nil
}

func (t *nvmlTelemetry) Backend() string { return BackendNVML }

func (t *nvmlTelemetry) err(fn string, rc C.int) *DriverError {
	e := &DriverError{Library: t.lib.name, Func: fn, Code: int(rc)}
	if t.fn.errorString != nil {
		if s := C.fl_nvml_error_string(t.fn.errorString, rc); s != nil {
			e.Msg = C.GoString(s)
		}
	}
	return e
}

func (t *nvmlTelemetry) Devices(ctx context.Context) ([]DeviceStats, error) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if t.closed {
		return nil, ErrClosed
	}
	var n C.uint
	if rc := C.fl_nvml_count(t.fn.count, &n); rc != nvmlSuccess {
		return nil, t.err("nvmlDeviceGetCount_v2", rc)
	}
	out := make([]DeviceStats, 0, int(n))
	for i := 0; i < int(n); i++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		out = append(out, t.device(i))
	}
	return out, nil
}

// nvmlDevice collects one device's answers: the first failure and what
// they say about its health.
type nvmlDevice struct {
	t      *nvmlTelemetry
	d      DeviceStats
	lost   bool
	worst  Health // worst health signal seen
	unsure bool   // a health query failed
}

// ok reports whether rc is success; a failure other than "not supported"
// or "no permission" (an unprivileged container) is kept as the device's
// error.
func (q *nvmlDevice) ok(fn string, rc C.int) bool {
	switch rc {
	case nvmlSuccess:
		return true
	case nvmlNotSupported, nvmlNoPermission:
		return false
	case nvmlGPUIsLost:
		q.lost = true
	}
	if q.d.Err == nil {
		q.d.Err = q.t.err(fn, rc)
	}
	return false
}

func (q *nvmlDevice) signal(h Health) {
	if h > q.worst {
		q.worst = h
	}
}

func (t *nvmlTelemetry) device(i int) DeviceStats {
	q := &nvmlDevice{t: t, d: DeviceStats{Index: i, Utilization: -1}, worst: HealthOK}
	var dev unsafe.Pointer
	if !q.ok("nvmlDeviceGetHandleByIndex_v2", C.fl_nvml_handle(t.fn.handle, C.uint(i), &dev)) {
		q.d.Health = HealthUnknown
		if q.lost {
			q.d.Health = HealthCritical
		}
		return q.d
	}
	var u C.fl_nvml_util
	if q.ok("nvmlDeviceGetUtilizationRates", C.fl_nvml_utilization(t.fn.utilization, dev, &u)) {
		q.d.Utilization = int(u.gpu)
	}
	var m C.fl_nvml_memory
	if q.ok("nvmlDeviceGetMemoryInfo", C.fl_nvml_memory_info(t.fn.memory, dev, &m)) {
		q.d.MemoryUsed, q.d.MemoryTotal = uint64(m.used), uint64(m.total)
	}
	t.health(q, dev)
	if !q.lost {
		t.links(q, dev)
	}
	switch {
	case q.lost:
		q.d.Health = HealthCritical
	case q.unsure && q.worst == HealthOK:
		q.d.Health = HealthUnknown
	default:
		q.d.Health = q.worst
	}
	return q.d
}

func (t *nvmlTelemetry) health(q *nvmlDevice, dev unsafe.Pointer) {
	if t.fn.ecc != nil {
		var n C.ulonglong
		rc := C.fl_nvml_ecc(t.fn.ecc, dev, &n)
		if q.ok("nvmlDeviceGetTotalEccErrors", rc) {
			if n > 0 {
				q.signal(HealthMajor)
			}
		} else if rc != nvmlNotSupported && rc != nvmlNoPermission {
			q.unsure = true
		}
	}
	if t.fn.remapped != nil {
		var corr, unc, pending, failure C.uint
		rc := C.fl_nvml_remapped(t.fn.remapped, dev, &corr, &unc, &pending, &failure)
		if q.ok("nvmlDeviceGetRemappedRows", rc) {
			if failure != 0 {
				q.signal(HealthCritical)
			} else if pending != 0 {
				q.signal(HealthMajor)
			}
		} else if rc != nvmlNotSupported && rc != nvmlNoPermission {
			q.unsure = true
		}
	}
}

func (t *nvmlTelemetry) links(q *nvmlDevice, dev unsafe.Pointer) {
	if t.fn.linkState == nil {
		return
	}
	for l := 0; l < nvmlMaxLinks; l++ {
		var active C.int
		rc := C.fl_nvml_link_state(t.fn.linkState, dev, C.uint(l), &active)
		if rc == nvmlInvalidArgument {
			break // past the device's last link
		}
		if !q.ok("nvmlDeviceGetNvLinkState", rc) {
			if rc == nvmlNotSupported {
				continue
			}
			break
		}
		ls := LinkStats{Index: l, State: LinkDown}
		if active != 0 {
			ls.State = LinkUp
		}
		if t.fn.linkErrors != nil {
			ls.ReplayErrors = t.linkCounter(q, dev, l, nvmlLinkReplay)
			ls.RecoveryErrors = t.linkCounter(q, dev, l, nvmlLinkRecovery)
			ls.CRCErrors = t.linkCounter(q, dev, l, nvmlLinkCRCFlit) + t.linkCounter(q, dev, l, nvmlLinkCRCData)
		}
		q.d.Links = append(q.d.Links, ls)
	}
	if t.fn.fieldValues == nil || len(q.d.Links) == 0 {
		return
	}
	vals := make([]C.fl_nvml_field_value, nvmlFieldValueLen*len(q.d.Links))
	for i, ls := range q.d.Links {
		vals[2*i].fieldId, vals[2*i].scopeId = nvmlFieldLinkTx, C.uint(ls.Index)
		vals[2*i+1].fieldId, vals[2*i+1].scopeId = nvmlFieldLinkRx, C.uint(ls.Index)
	}
	if !q.ok("nvmlDeviceGetFieldValues", C.fl_nvml_field_values(t.fn.fieldValues, dev, C.int(len(vals)), &vals[0])) {
		return
	}
	for i := range q.d.Links {
		if vals[2*i].nvmlReturn == nvmlSuccess {
			q.d.Links[i].Tx = uint64(C.fl_nvml_field_u64(&vals[2*i]))
		}
		if vals[2*i+1].nvmlReturn == nvmlSuccess {
			q.d.Links[i].Rx = uint64(C.fl_nvml_field_u64(&vals[2*i+1]))
		}
	}
}

func (t *nvmlTelemetry) linkCounter(q *nvmlDevice, dev unsafe.Pointer, link, counter int) uint64 {
	var v C.ulonglong
	if q.ok("nvmlDeviceGetNvLinkErrorCounter", C.fl_nvml_link_errors(t.fn.linkErrors, dev, C.uint(link), C.int(counter), &v)) {
		return uint64(v)
	}
	return 0
}

func (t *nvmlTelemetry) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil
	}
	t.closed = true
	rc := C.fl_nvml_void(t.fn.shutdown)
	var err error
	if rc != nvmlSuccess {
		err = t.err("nvmlShutdown", rc)
	}
	t.lib.close()
	return err
}
