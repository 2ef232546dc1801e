package npu

import (
	"errors"
	"fmt"
)

// Sentinel errors that callers branch on.
var (
	// ErrNoDevice is wrapped by every error that means "there is no
	// accelerator to talk to here": the library is missing or lacks a
	// function, the driver is not loaded, or it reports no device. A caller
	// turns the feature off and carries on.
	ErrNoDevice = errors.New("npu: no accelerator device or driver")

	// ErrUnsupported is returned by every constructor when the package was
	// built without cgo (CGO_ENABLED=0): nothing can be loaded then.
	ErrUnsupported = errors.New("npu: unsupported: built without cgo")

	// ErrClosed is returned by methods called after Close.
	ErrClosed = errors.New("npu: closed")

	// ErrBusy is returned by OpenMarkers while another MarkerSource of this
	// process is open, or when the profiling library already has a
	// subscriber: mspti allows one per process.
	ErrBusy = errors.New("npu: marker activity already subscribed in this process")
)

// LoadError says which library or function could not be loaded. It wraps
// ErrNoDevice.
type LoadError struct {
	Library string // the name or path given to dlopen
	Symbol  string // the missing function; "" when the library itself failed to load
	Msg     string // dlerror's text
}

func (e *LoadError) Error() string {
	if e.Symbol == "" {
		return fmt.Sprintf("npu: load %s: %s", e.Library, e.Msg)
	}
	return fmt.Sprintf("npu: load %s: function %s: %s", e.Library, e.Symbol, e.Msg)
}

// Unwrap lets errors.Is(err, ErrNoDevice) hold.
func (e *LoadError) Unwrap() error { return ErrNoDevice }

// DriverError is a failing return code of a driver library function.
type DriverError struct {
	Library string // the name or path the library was loaded from
	Func    string // the C function, e.g. "nvmlDeviceGetMemoryInfo"
	Code    int    // its return code
	Msg     string // the library's text for Code, if it has one
	err     error  // a sentinel this code means (ErrNoDevice, ErrBusy), or nil
}

func (e *DriverError) Error() string {
	s := fmt.Sprintf("npu: %s: %s returned %d", e.Library, e.Func, e.Code)
	if e.Msg != "" {
		s += " (" + e.Msg + ")"
	}
	return s
}

// Unwrap returns the sentinel the code means, if any.
func (e *DriverError) Unwrap() error { return e.err }
