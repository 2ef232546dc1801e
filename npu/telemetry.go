package npu

import (
	"context"
	"errors"
	"fmt"
	"strconv"
)

// Telemetry reads the state of this host's accelerators from the vendor's
// management library. Implementations are safe for concurrent use.
//
// A driver call cannot be interrupted: Devices checks ctx between calls, so
// a driver that hangs inside one holds the caller until it returns. Callers
// that must not wait (a hang watchdog) call it from a goroutine of their own.
type Telemetry interface {
	// Backend names the library family: "nvml" or "dcmi".
	Backend() string

	// Devices reads every device, in index order. An error means the
	// devices could not be listed; a device that fails a query is still
	// listed, with DeviceStats.Err set and Health saying what is known.
	Devices(ctx context.Context) ([]DeviceStats, error)

	// Close releases the library. Further calls return ErrClosed.
	Close() error
}

// DeviceStats is one device at one moment.
type DeviceStats struct {
	// Index is the device's number: NVML's index (PCI bus order, CUDA's
	// with CUDA_DEVICE_ORDER=PCI_BUS_ID) or Ascend's logical id (the one
	// ASCEND_RT_VISIBLE_DEVICES names).
	Index int

	// Utilization is the percentage of time the compute engines were busy
	// (NVML: GPU utilisation; DCMI: AI Core), or -1 when not reported.
	Utilization int

	// MemoryUsed and MemoryTotal are device memory in bytes (HBM where the
	// device has it); MemoryTotal is 0 when not reported.
	MemoryUsed, MemoryTotal uint64

	// Health is the driver's verdict on the device.
	Health Health

	// Links are the device-to-device links (NvLink, HCCS), when the driver
	// reports any.
	Links []LinkStats

	// Err is the first query of this device that failed, nil when all
	// succeeded. A query the device does not support, or that this process
	// may not make, is not a failure; the fields it would fill keep their
	// "not reported" values.
	Err error
}

// LinkStats is one device-to-device link. Counters are cumulative since the
// driver loaded; rates come from differences between two reads.
type LinkStats struct {
	Index int // NvLink number, or HCCS PCS number
	State LinkState

	// Tx and Rx count traffic in the driver's unit: KiB of payload for
	// NVML (some drivers give the device's total for every link), packets
	// for DCMI. Zero when not reported.
	Tx, Rx uint64

	CRCErrors      uint64 // CRC errors (NVML: flit + data; DCMI: crc_err_cnt)
	ReplayErrors   uint64 // link-level retransmissions (NVML: replay; DCMI: retry_cnt)
	RecoveryErrors uint64 // link recoveries (NVML only)
}

// Health is a device's health as the driver reports it, worst last.
type Health uint8

// Health values. DCMI reports them as they are (0 normal, 1 minor, 2 major,
// 3 critical alarm); for NVML a pending row remap or uncorrectable volatile
// ECC errors are Major, a failed row remap or a lost GPU is Critical.
const (
	HealthUnknown Health = iota
	HealthOK
	HealthMinor
	HealthMajor
	HealthCritical
)

var healthNames = [...]string{"unknown", "ok", "minor", "major", "critical"}

func (h Health) String() string {
	if int(h) < len(healthNames) {
		return healthNames[h]
	}
	return "Health(" + strconv.Itoa(int(h)) + ")"
}

// LinkState says whether a link is up.
type LinkState uint8

// Link states.
const (
	LinkUnknown LinkState = iota
	LinkUp
	LinkDown
)

var linkStateNames = [...]string{"unknown", "up", "down"}

func (s LinkState) String() string {
	if int(s) < len(linkStateNames) {
		return linkStateNames[s]
	}
	return "LinkState(" + strconv.Itoa(int(s)) + ")"
}

// Telemetry backends and their default libraries.
const (
	BackendNVML = "nvml"
	BackendDCMI = "dcmi"

	DefaultNVMLLibrary = "libnvidia-ml.so.1"
	DefaultDCMILibrary = "libdcmi.so"
)

// TelemetryConfig chooses and loads a telemetry backend. The zero value tries
// NVML, then DCMI, each from its default library.
type TelemetryConfig struct {
	// Backend is BackendNVML, BackendDCMI, or "" to try both in that order.
	Backend string

	// Library is the name or path to dlopen instead of the backend's
	// default. It needs Backend.
	Library string
}

// Validate reports the first field that is out of range.
func (c TelemetryConfig) Validate() error {
	switch c.Backend {
	case "", BackendNVML, BackendDCMI:
	default:
		return fmt.Errorf("npu: TelemetryConfig.Backend: %q is not %q, %q or empty", c.Backend, BackendNVML, BackendDCMI)
	}
	if c.Library != "" && c.Backend == "" {
		return fmt.Errorf("npu: TelemetryConfig.Library: %q needs Backend to say which library family it is", c.Library)
	}
	return nil
}

// OpenTelemetry loads the backend cfg names, or the first of NVML and DCMI
// that finds a device. Without one the error wraps ErrNoDevice; without cgo
// it is ErrUnsupported.
func OpenTelemetry(cfg TelemetryConfig) (Telemetry, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	switch cfg.Backend {
	case BackendNVML:
		return openNVML(libraryOr(cfg.Library, DefaultNVMLLibrary))
	case BackendDCMI:
		return openDCMI(libraryOr(cfg.Library, DefaultDCMILibrary))
	}
	t, errN := openNVML(DefaultNVMLLibrary)
	if errN == nil {
		return t, nil
	}
	t, errD := openDCMI(DefaultDCMILibrary)
	if errD == nil {
		return t, nil
	}
	if errors.Is(errN, ErrUnsupported) {
		return nil, ErrUnsupported
	}
	return nil, errors.Join(errN, errD)
}

func libraryOr(lib, def string) string {
	if lib == "" {
		return def
	}
	return lib
}
