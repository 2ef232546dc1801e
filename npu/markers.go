package npu

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/faultline-ml/faultline/trace"
)

// Sink receives marker records, one call per record, in the order the
// profiling library wrote them. It runs on the goroutine that delivers (the
// one in MarkerSource.Run, or Close's for the last records) and never
// concurrently with itself. r and its strings are valid only during the
// call: a sink copies the record (*r) if it keeps it. A slow sink holds
// buffers back and so makes the library drop records (see MarkerConfig).
type Sink func(r *trace.Record)

// Defaults of MarkerConfig, as MindCluster's TaskD uses mspti.
const (
	DefaultMarkerLibrary       = "libmspti.so"
	DefaultMarkerBufferBytes   = 2 << 20
	DefaultMarkerMaxBuffers    = 100
	DefaultMarkerFlushInterval = time.Second
)

// MarkerConfig configures a MarkerSource. The zero value of every field but
// Sink is a documented default.
type MarkerConfig struct {
	// Library is the profiling library, a name dlopen searches for or a
	// path. Default DefaultMarkerLibrary.
	Library string

	// Sink receives every marker record. Required.
	Sink Sink

	// Switch is the profiling switch in force from the start; the zero
	// Switch (all off) collects nothing until ApplySwitch turns kinds on.
	Switch trace.Switch

	// BufferBytes is the size of each activity buffer handed to the
	// library. Default DefaultMarkerBufferBytes (2 MiB).
	BufferBytes int

	// MaxBuffers bounds the buffers in existence at once: held by the
	// library, waiting for delivery, or free. When all are taken, a request
	// for another is declined, the library drops the records it could not
	// store, and MarkerStats.Declined counts the refusal. Default
	// DefaultMarkerMaxBuffers (100).
	MaxBuffers int

	// FlushInterval is how often Run asks the library for partly filled
	// buffers. Default DefaultMarkerFlushInterval (1 s).
	FlushInterval time.Duration

	// Registerer receives the source's metrics (faultline_npu_marker_*);
	// nil means none. OpenMarkers fails, registering nothing, when one
	// cannot be registered (a collector of the same name is there); Close
	// unregisters them, so that a source can be opened again on the same
	// Registerer.
	Registerer prometheus.Registerer

	// Logger receives what goes wrong in the background; nil means none.
	Logger *slog.Logger
}

// Validate reports the first field that is out of range.
func (c MarkerConfig) Validate() error {
	const minBuffer = 4 << 10
	switch {
	case c.Sink == nil:
		return errors.New("npu: MarkerConfig.Sink: required")
	case c.BufferBytes != 0 && c.BufferBytes < minBuffer:
		return fmt.Errorf("npu: MarkerConfig.BufferBytes: %d is less than %d", c.BufferBytes, minBuffer)
	case c.BufferBytes > 1<<30:
		return fmt.Errorf("npu: MarkerConfig.BufferBytes: %d is more than 1 GiB", c.BufferBytes)
	case c.MaxBuffers < 0:
		return fmt.Errorf("npu: MarkerConfig.MaxBuffers: %d is negative", c.MaxBuffers)
	case c.MaxBuffers > 1<<16:
		return fmt.Errorf("npu: MarkerConfig.MaxBuffers: %d is more than %d", c.MaxBuffers, 1<<16)
	case c.FlushInterval < 0:
		return fmt.Errorf("npu: MarkerConfig.FlushInterval: %v is negative", c.FlushInterval)
	}
	return nil
}

func (c MarkerConfig) withDefaults() MarkerConfig {
	c.Library = cmp.Or(c.Library, DefaultMarkerLibrary)
	c.BufferBytes = cmp.Or(c.BufferBytes, DefaultMarkerBufferBytes)
	c.MaxBuffers = cmp.Or(c.MaxBuffers, DefaultMarkerMaxBuffers)
	c.FlushInterval = cmp.Or(c.FlushInterval, DefaultMarkerFlushInterval)
	c.Logger = cmp.Or(c.Logger, slog.New(slog.DiscardHandler))
	return c
}

// MarkerStats counts what a MarkerSource has seen since it was opened.
type MarkerStats struct {
	Records   uint64 // marker records delivered to the sink
	Buffers   uint64 // buffers the library completed and that were read
	Declined  uint64 // buffer requests refused because MaxBuffers were taken: the library dropped records
	Skipped   uint64 // records of other activity kinds, ignored
	Malformed uint64 // buffers cut short: a record outside the valid bytes, a size above the buffer's, a read error
	Foreign   uint64 // completed buffers this source never handed out, ignored
}
