//go:build cgo

package npu

// The functions mspti's buffer callbacks reach through the C trampolines in
// markers.c. They may run on any thread, including ones Go did not
// create; h is the cgo.Handle of the MarkerSource, kept alive until no
// callback is in flight.

/*
#include <stddef.h>
#include <stdint.h>
*/
import "C"

import (
	"runtime/cgo"
	"unsafe"
)

//export flMarkerRequested
func flMarkerRequested(h C.uintptr_t, buf **C.uint8_t, size, maxRecords *C.size_t) {
	s := cgo.Handle(h).Value().(*MarkerSource)
	p := s.takeBuffer()
	*maxRecords = 0 // as many as fit
	if p == nil {
		// Declining makes the library drop records: the backpressure.
		*buf, *size = nil, 0
		s.declined.Add(1)
		s.metrics.declined.Inc()
		return
	}
	*buf = (*C.uint8_t)(p)
	*size = C.size_t(s.cfg.BufferBytes)
}

//export flMarkerCompleted
func flMarkerCompleted(h C.uintptr_t, buf *C.uint8_t, size, valid C.size_t) {
	s := cgo.Handle(h).Value().(*MarkerSource)
	s.complete(unsafe.Pointer(buf), int(size), int(valid))
}
