//go:build cgo

package npu

/*
// Shapes from dcmi_interface_api.h.
#define FL_DCMI_HCCS_MAX_PCS_NUM 16

struct fl_dcmi_hbm_info {
	unsigned long long memory_size;  // MB
	unsigned int freq;
	unsigned long long memory_usage; // MB
	int temp;
	unsigned int bandwith_util_rate;
};

struct fl_dcmi_memory_info {
	unsigned long long memory_size;      // MB
	unsigned long long memory_available; // MB
	unsigned int freq;
	unsigned long hugepagesize;
	unsigned long hugepages_total;
	unsigned long hugepages_free;
	unsigned int utiliza;
	unsigned char reserve[60];
};

struct fl_dcmi_hccs_lane_info {
	unsigned int hccs_port_pcs_bitmap;
	unsigned int pcs_lane_bitmap[FL_DCMI_HCCS_MAX_PCS_NUM];
	unsigned int reserve[16];
};

struct fl_dcmi_hccs_statistic_info {
	unsigned int tx_cnt[FL_DCMI_HCCS_MAX_PCS_NUM];
	unsigned int rx_cnt[FL_DCMI_HCCS_MAX_PCS_NUM];
	unsigned int crc_err_cnt[FL_DCMI_HCCS_MAX_PCS_NUM];
	unsigned int retry_cnt[FL_DCMI_HCCS_MAX_PCS_NUM];
	unsigned int reserved_field_cnt[64];
};

struct fl_dcmi_hccs_statistic_info_u64 {
	unsigned long long tx_cnt[FL_DCMI_HCCS_MAX_PCS_NUM];
	unsigned long long rx_cnt[FL_DCMI_HCCS_MAX_PCS_NUM];
	unsigned long long crc_err_cnt[FL_DCMI_HCCS_MAX_PCS_NUM];
	unsigned long long retry_cnt[FL_DCMI_HCCS_MAX_PCS_NUM];
	unsigned long long reserved[64];
};

static int fl_dcmi_void(void *fn) { return ((int (*)(void))fn)(); }
static int fl_dcmi_card_list(void *fn, int *num, int *list, int len) {
	return ((int (*)(int *, int *, int))fn)(num, list, len);
}
static int fl_dcmi_device_num(void *fn, int card, int *num) { return ((int (*)(int, int *))fn)(card, num); }
static int fl_dcmi_logic_id(void *fn, int *logic, int card, int dev) {
	return ((int (*)(int *, int, int))fn)(logic, card, dev);
}
static int fl_dcmi_utilization(void *fn, int card, int dev, int type, unsigned int *rate) {
	return ((int (*)(int, int, int, unsigned int *))fn)(card, dev, type, rate);
}
static int fl_dcmi_ptr(void *fn, int card, int dev, void *out) {
	return ((int (*)(int, int, void *))fn)(card, dev, out);
}
static int fl_dcmi_health(void *fn, int card, int dev, unsigned int *health) {
	return ((int (*)(int, int, unsigned int *))fn)(card, dev, health);
}
static int fl_dcmi_device_info(void *fn, int card, int dev, int main_cmd, unsigned int sub_cmd, void *buf,
                               unsigned int *size) {
	return ((int (*)(int, int, int, unsigned int, void *, unsigned int *))fn)(card, dev, main_cmd, sub_cmd, buf, size);
}
*/
import "C"

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"unsafe"
)

// DCMI return codes and commands this backend acts on
// (dcmi_interface_api.h).
const (
	dcmiOK                    = 0
	dcmiDeviceNotExist        = -8008
	dcmiNotReady              = -8012 // the card dropped off the bus
	dcmiNotSupportInContainer = -8013
	dcmiNotSupport            = -8255

	dcmiMaxCards              = 64 // MAX_CARD_NUM
	dcmiUtilizationAICore     = 2
	dcmiMainCmdHCCS           = 16
	dcmiHCCSLaneInfo          = 1
	dcmiHCCSStatistic         = 3
	dcmiHCCSStatisticU64      = 5
	dcmiHealthDeviceNotExists = 0xFFFFFFFF
)

// dcmiTelemetry is the DCMI backend (Ascend libdcmi.so).
type dcmiTelemetry struct {
	lib *library
	fn  struct {
		init, cardList, deviceNum, utilization, health unsafe.Pointer
		// optional
		logicID, hbm, memory, deviceInfo unsafe.Pointer
	}
	// mu serialises every call: DCMI guards against floods of concurrent
	// queries by failing them.
	mu     sync.Mutex
	closed bool
}

func openDCMI(name string) (Telemetry, error) {
	lib, err := openLibrary(name, false)
	if err != nil {
		return nil, err
	}
	t := &dcmiTelemetry{lib: lib}
	err = lib.resolve([]symbol{
		{"dcmi_init", &t.fn.init},
		{"dcmi_get_card_num_list", &t.fn.cardList},
		{"dcmi_get_device_num_in_card", &t.fn.deviceNum},
		{"dcmi_get_device_utilization_rate", &t.fn.utilization},
		{"dcmi_get_device_health", &t.fn.health},
	})
	if err != nil {
		lib.close()
		return nil, err
	}
	t.fn.logicID = lib.optional("dcmi_get_device_logic_id")
	t.fn.hbm = lib.optional("dcmi_get_device_hbm_info")
	t.fn.memory = lib.optional("dcmi_get_device_memory_info_v3")
	t.fn.deviceInfo = lib.optional("dcmi_get_device_info")

	if rc := C.fl_dcmi_void(t.fn.init); rc != dcmiOK {
		err := t.err("dcmi_init", rc)
		err.err = ErrNoDevice
		lib.close()
		return nil, err
	}
	cards, err := t.cards()
	if err == nil && len(cards) == 0 {
		err = fmt.Errorf("%w: %s: the driver reports none", ErrNoDevice, name)
	}
	if err != nil {
		if de, ok := err.(*DriverError); ok {
			de.err = ErrNoDevice
		}
		lib.close()
		return nil, err
	}
	return t, nil
}

func (t *dcmiTelemetry) Backend() string { return BackendDCMI }

func (t *dcmiTelemetry) err(fn string, rc C.int) *DriverError {
	return &DriverError{Library: t.lib.name, Func: fn, Code: int(rc)}
}

func (t *dcmiTelemetry) cards() ([]C.int, error) {
	var list [dcmiMaxCards]C.int
	var n C.int
	if rc := C.fl_dcmi_card_list(t.fn.cardList, &n, &list[0], dcmiMaxCards); rc != dcmiOK {
		return nil, t.err("dcmi_get_card_num_list", rc)
	}
	n = max(0, min(n, dcmiMaxCards))
	return list[:n], nil
}

func (t *dcmiTelemetry) Devices(ctx context.Context) ([]DeviceStats, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil, ErrClosed
	}
	cards, err := t.cards()
	if err != nil {
		return nil, err
	}
	var out []DeviceStats
	for _, card := range cards {
		var n C.int
		if rc := C.fl_dcmi_device_num(t.fn.deviceNum, card, &n); rc != dcmiOK {
			return nil, t.err("dcmi_get_device_num_in_card", rc)
		}
		for dev := C.int(0); dev < n; dev++ {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			out = append(out, t.device(card, dev, len(out)))
		}
	}
	slices.SortStableFunc(out, func(a, b DeviceStats) int { return a.Index - b.Index })
	return out, nil
}

// dcmiDevice collects one chip's answers.
type dcmiDevice struct {
	t    *dcmiTelemetry
	d    DeviceStats
	gone bool // the chip dropped off or vanished
}

func (q *dcmiDevice) ok(fn string, rc C.int) bool {
	switch rc {
	case dcmiOK:
		return true
	case dcmiNotSupport, dcmiNotSupportInContainer:
		return false
	case dcmiDeviceNotExist, dcmiNotReady:
		q.gone = true
	}
	if q.d.Err == nil {
		q.d.Err = q.t.err(fn, rc)
	}
	return false
}

func (t *dcmiTelemetry) device(card, dev C.int, seq int) DeviceStats {
	q := &dcmiDevice{t: t, d: DeviceStats{Index: seq, Utilization: -1}}
	if t.fn.logicID != nil {
		var id C.int
		if C.fl_dcmi_logic_id(t.fn.logicID, &id, card, dev) == dcmiOK && id >= 0 {
			q.d.Index = int(id)
		}
	}
	var rate C.uint
	if q.ok("dcmi_get_device_utilization_rate", C.fl_dcmi_utilization(t.fn.utilization, card, dev, dcmiUtilizationAICore, &rate)) {
		q.d.Utilization = int(rate)
	}
	t.memory(q, card, dev)
	var h C.uint
	if q.ok("dcmi_get_device_health", C.fl_dcmi_health(t.fn.health, card, dev, &h)) {
		switch h {
		case 0:
			q.d.Health = HealthOK
		case 1:
			q.d.Health = HealthMinor
		case 2:
			q.d.Health = HealthMajor
		case 3, dcmiHealthDeviceNotExists:
			q.d.Health = HealthCritical
		}
	}
	if !q.gone {
		t.links(q, card, dev)
	}
	if q.gone {
		q.d.Health = HealthCritical
	}
	return q.d
}

func (t *dcmiTelemetry) memory(q *dcmiDevice, card, dev C.int) {
	const mb = 1 << 20
	if t.fn.hbm != nil {
		var h C.struct_fl_dcmi_hbm_info
		rc := C.fl_dcmi_ptr(t.fn.hbm, card, dev, unsafe.Pointer(&h))
		if q.ok("dcmi_get_device_hbm_info", rc) && h.memory_size > 0 {
			q.d.MemoryTotal = uint64(h.memory_size) * mb
			q.d.MemoryUsed = uint64(h.memory_usage) * mb
			return
		}
	}
	if t.fn.memory != nil {
		var m C.struct_fl_dcmi_memory_info
		if q.ok("dcmi_get_device_memory_info_v3", C.fl_dcmi_ptr(t.fn.memory, card, dev, unsafe.Pointer(&m))) {
			total, avail := uint64(m.memory_size), uint64(m.memory_available)
			q.d.MemoryTotal = total * mb
			if avail <= total {
				q.d.MemoryUsed = (total - avail) * mb
			}
		}
	}
}

// links reads the HCCS ports: which PCS are ports and whether their lanes
// are up, then their counters.
func (t *dcmiTelemetry) links(q *dcmiDevice, card, dev C.int) {
	if t.fn.deviceInfo == nil {
		return
	}
	var lanes C.struct_fl_dcmi_hccs_lane_info
	size := C.uint(unsafe.Sizeof(lanes))
	haveLanes := q.ok("dcmi_get_device_info(HCCS lane info)",
		C.fl_dcmi_device_info(t.fn.deviceInfo, card, dev, dcmiMainCmdHCCS, dcmiHCCSLaneInfo, unsafe.Pointer(&lanes), &size))

	var tx, rx, crc, retry [C.FL_DCMI_HCCS_MAX_PCS_NUM]uint64
	var s64 C.struct_fl_dcmi_hccs_statistic_info_u64
	size = C.uint(unsafe.Sizeof(s64))
	rc := C.fl_dcmi_device_info(t.fn.deviceInfo, card, dev, dcmiMainCmdHCCS, dcmiHCCSStatisticU64, unsafe.Pointer(&s64), &size)
	haveStats := rc == dcmiOK
	if haveStats {
		for i := range tx {
			tx[i], rx[i] = uint64(s64.tx_cnt[i]), uint64(s64.rx_cnt[i])
			crc[i], retry[i] = uint64(s64.crc_err_cnt[i]), uint64(s64.retry_cnt[i])
		}
	} else if rc == dcmiNotSupport || rc == dcmiNotSupportInContainer {
		// Older drivers have only the 32-bit counters.
		var s32 C.struct_fl_dcmi_hccs_statistic_info
		size = C.uint(unsafe.Sizeof(s32))
		haveStats = q.ok("dcmi_get_device_info(HCCS statistics)",
			C.fl_dcmi_device_info(t.fn.deviceInfo, card, dev, dcmiMainCmdHCCS, dcmiHCCSStatistic, unsafe.Pointer(&s32), &size))
		if haveStats {
			for i := range tx {
				tx[i], rx[i] = uint64(s32.tx_cnt[i]), uint64(s32.rx_cnt[i])
				crc[i], retry[i] = uint64(s32.crc_err_cnt[i]), uint64(s32.retry_cnt[i])
			}
		}
	} else {
		q.ok("dcmi_get_device_info(HCCS statistics, 64-bit)", rc)
	}
	if !haveLanes && !haveStats {
		return
	}
	for i := range tx {
		if haveLanes && lanes.hccs_port_pcs_bitmap&(1<<i) == 0 {
			continue
		}
		ls := LinkStats{Index: i, Tx: tx[i], Rx: rx[i], CRCErrors: crc[i], ReplayErrors: retry[i]}
		if haveLanes {
			ls.State = LinkDown
			if lanes.pcs_lane_bitmap[i] != 0 {
				ls.State = LinkUp
			}
		}
		q.d.Links = append(q.d.Links, ls)
	}
}

func (t *dcmiTelemetry) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil
	}
	t.closed = true
	// DCMI has no shutdown call.
	t.lib.close()
	return nil
}
