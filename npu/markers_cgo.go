//go:build cgo

package npu

/*
#include <stdlib.h>

#include "markers.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"runtime/cgo"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/faultline-ml/faultline/internal/promreg"
	"github.com/faultline-ml/faultline/trace"
)

const (
	msptiKindMarker = 1
	// msptiFlushForced is the flag MindCluster passes to
	// msptiActivityFlushAll: hand back partly filled buffers too.
	msptiFlushForced = 1
	// maxInterned bounds the strings a source keeps to avoid copying the
	// same marker name for every record.
	maxInterned = 4096
)

// MarkerSource receives marker records from an mspti-style profiling
// library and delivers them to a Sink. It hands the library activity
// buffers of C memory (at most MaxBuffers, each BufferBytes), takes them
// back through the library's buffer-completed callback, reads the records
// out on the goroutine of Run and recycles the buffer.
//
// Which markers the library collects follows the profiling switch (see
// ApplySwitch). One MarkerSource may be open per process at a time.
type MarkerSource struct {
	cfg MarkerConfig
	lib *library
	fn  struct {
		subscribe, unsubscribe, register             unsafe.Pointer
		enable, disable, enableDomain, disableDomain unsafe.Pointer
		getNext, flushAll                            unsafe.Pointer
	}
	handle     cgo.Handle
	subscriber unsafe.Pointer

	// bufMu guards the buffer bookkeeping. It is never held across a call
	// into the library, whose callbacks take it.
	bufMu       sync.Mutex
	free        []unsafe.Pointer
	outstanding map[unsafe.Pointer]struct{} // handed to the library
	allocated   int

	completed chan completedBuffer // cap MaxBuffers: a send never waits
	barriers  chan chan struct{}
	closing   chan struct{}
	runDone   chan struct{}
	running   atomic.Bool
	closeOnce sync.Once
	closeErr  error

	// swMu serialises switch changes, which call into the library.
	swMu     sync.Mutex
	sw       trace.Switch
	markerOn bool
	commOn   bool

	// deliverMu is held by whoever reads buffers: Run, or Close after it.
	deliverMu sync.Mutex
	reader    *C.fl_reader
	rec       trace.Record
	interned  map[string]string

	records, buffers, declined, skipped, malformed, foreign atomic.Uint64

	metrics markerMetrics
}

type completedBuffer struct {
	buf   unsafe.Pointer
	valid int
}

type markerMetrics struct {
	reg         *promreg.Registrar
	records     prometheus.Counter
	buffers     prometheus.Counter
	declined    prometheus.Counter
	skipped     prometheus.Counter
	malformed   prometheus.Counter
	outstanding prometheus.Gauge
}

// OpenMarkers loads cfg.Library, subscribes to it, registers the buffer
// callbacks and applies cfg.Switch. Records flow once Run is running.
// Without the library the error wraps ErrNoDevice; while another source is
// open in this process it wraps ErrBusy.
func OpenMarkers(cfg MarkerConfig) (*MarkerSource, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	// RTLD_GLOBAL, as MindCluster loads it: the runtime's marker hooks
	// look the profiling library's symbols up globally.
	lib, err := openLibrary(cfg.Library, true)
	if err != nil {
		return nil, err
	}
	s := &MarkerSource{
		cfg:         cfg,
		lib:         lib,
		outstanding: make(map[unsafe.Pointer]struct{}),
		completed:   make(chan completedBuffer, cfg.MaxBuffers),
		barriers:    make(chan chan struct{}),
		closing:     make(chan struct{}),
		runDone:     make(chan struct{}),
		interned: map[string]string{
			trace.DomainDefault:       trace.DomainDefault,
			trace.DomainCommunication: trace.DomainCommunication,
		},
	}
	// The library stays loaded after a failure or Close: its threads may
	// still be running code from it.
	err = lib.resolve([]symbol{
		{"msptiSubscribe", &s.fn.subscribe},
		{"msptiUnsubscribe", &s.fn.unsubscribe},
		{"msptiActivityRegisterCallbacks", &s.fn.register},
		{"msptiActivityEnable", &s.fn.enable},
		{"msptiActivityDisable", &s.fn.disable},
		{"msptiActivityEnableMarkerDomain", &s.fn.enableDomain},
		{"msptiActivityDisableMarkerDomain", &s.fn.disableDomain},
		{"msptiActivityGetNextRecord", &s.fn.getNext},
		{"msptiActivityFlushAll", &s.fn.flushAll},
	})
	if err != nil {
		return nil, err
	}
	s.handle = cgo.NewHandle(s)
	if C.fl_marker_claim(C.uintptr_t(s.handle)) == 0 {
		s.handle.Delete()
		return nil, fmt.Errorf("%w: open markers from %s", ErrBusy, cfg.Library)
	}
	s.reader = (*C.fl_reader)(C.calloc(1, C.sizeof_fl_reader))
	s.reader.getnext = s.fn.getNext
	subscribed := false
	fail := func(err error) (*MarkerSource, error) {
		if subscribed {
			C.fl_call_u32(s.fn.disable, msptiKindMarker)
			C.fl_call_ptr(s.fn.unsubscribe, s.subscriber)
		}
		s.release()
		s.discard()
		C.free(unsafe.Pointer(s.reader))
		s.metrics.unregister()
		return nil, err
	}
	if s.metrics, err = newMarkerMetrics(cfg.Registerer); err != nil {
		return fail(err)
	}
	if rc := C.fl_mspti_subscribe(s.fn.subscribe, &s.subscriber); rc != 0 {
		var sentinel error
		if rc == C.FL_MSPTI_ERROR_MULTIPLE_SUBSCRIBERS {
			sentinel = ErrBusy
		}
		return fail(s.driverError("msptiSubscribe", rc, sentinel))
	}
	subscribed = true
	if rc := C.fl_mspti_register(s.fn.register); rc != 0 {
		return fail(s.driverError("msptiActivityRegisterCallbacks", rc, nil))
	}
	s.swMu.Lock()
	err = s.applyLocked(cfg.Switch, true)
	s.swMu.Unlock()
	if err != nil {
		return fail(err)
	}
	return s, nil
}

// newMarkerMetrics builds the source's collectors and registers them on
// reg; it returns the error of a registration that failed, having
// registered nothing.
func newMarkerMetrics(reg prometheus.Registerer) (markerMetrics, error) {
	r := promreg.New(reg, "npu: MarkerConfig.Registerer")
	f := promauto.With(r)
	m := markerMetrics{
		reg: r,
		records: f.NewCounter(prometheus.CounterOpts{
			Name: "faultline_npu_marker_records_total",
			Help: "Marker records delivered to the sink.",
		}),
		buffers: f.NewCounter(prometheus.CounterOpts{
			Name: "faultline_npu_marker_buffers_total",
			Help: "Activity buffers completed by the profiling library and read.",
		}),
		declined: f.NewCounter(prometheus.CounterOpts{
			Name: "faultline_npu_marker_buffers_declined_total",
			Help: "Buffer requests refused because every buffer was taken; the library dropped records.",
		}),
		skipped: f.NewCounter(prometheus.CounterOpts{
			Name: "faultline_npu_marker_records_skipped_total",
			Help: "Records of other activity kinds, ignored.",
		}),
		malformed: f.NewCounter(prometheus.CounterOpts{
			Name: "faultline_npu_marker_buffers_malformed_total",
			Help: "Buffers whose walk ended early on a malformed record or a read error.",
		}),
		outstanding: f.NewGauge(prometheus.GaugeOpts{
			Name: "faultline_npu_marker_buffers",
			Help: "Activity buffers in existence: held by the library, waiting for delivery, or free.",
		}),
	}
	if err := r.Err(); err != nil {
		return markerMetrics{}, err
	}
	return m, nil
}

// unregister unregisters what newMarkerMetrics registered; it does
// nothing for the zero markerMetrics.
func (m markerMetrics) unregister() {
	if m.reg != nil {
		m.reg.UnregisterAll()
	}
}

func (s *MarkerSource) driverError(fn string, rc C.int, sentinel error) error {
	return &DriverError{Library: s.cfg.Library, Func: fn, Code: int(rc), err: sentinel}
}

// release frees the process-wide slot, waits for callbacks in flight, and
// deletes the handle they resolve.
func (s *MarkerSource) release() {
	C.fl_marker_release()
	s.handle.Delete()
}

// ApplySwitch makes the library collect what sw turns on, as MindCluster
// does: marker activity is enabled while any kind is on (the "default"
// domain has no name in mspti to enable by), and the "communication" domain
// is enabled only while CommunicationOperator is on. A kind that is off in
// a domain that is on is still collected; the recorder filters it. On error
// the parts that were applied stay applied, and a later call retries the
// rest.
func (s *MarkerSource) ApplySwitch(sw trace.Switch) error {
	s.swMu.Lock()
	defer s.swMu.Unlock()
	select {
	case <-s.closing:
		return ErrClosed
	default:
	}
	return s.applyLocked(sw, false)
}

// Switch returns the switch last applied in full.
func (s *MarkerSource) Switch() trace.Switch {
	s.swMu.Lock()
	defer s.swMu.Unlock()
	return s.sw
}

func (s *MarkerSource) applyLocked(sw trace.Switch, force bool) error {
	comm := sw.DomainEnabled(trace.DomainCommunication)
	on := sw.DomainEnabled(trace.DomainDefault)
	if force || comm != s.commOn {
		if err := s.setDomain(trace.DomainCommunication, comm); err != nil {
			return err
		}
		s.commOn = comm
	}
	if force || on != s.markerOn {
		fn, name := s.fn.disable, "msptiActivityDisable"
		if on {
			fn, name = s.fn.enable, "msptiActivityEnable"
		}
		if rc := C.fl_call_u32(fn, msptiKindMarker); rc != 0 {
			return s.driverError(name, rc, nil)
		}
		s.markerOn = on
	}
	s.sw = sw
	return nil
}

func (s *MarkerSource) setDomain(domain string, on bool) error {
	fn, name := s.fn.disableDomain, "msptiActivityDisableMarkerDomain"
	if on {
		fn, name = s.fn.enableDomain, "msptiActivityEnableMarkerDomain"
	}
	cd := C.CString(domain)
	defer C.free(unsafe.Pointer(cd))
	if rc := C.fl_call_str(fn, cd); rc != 0 {
		return fmt.Errorf("%w (domain %q)", s.driverError(name, rc, nil), domain)
	}
	return nil
}

// Run delivers completed buffers to the sink and asks the library for
// partly filled ones every FlushInterval, until ctx is done or Close is
// called; then it delivers what it holds and returns nil. It returns
// ErrClosed if Close came first. Run may be called once.
func (s *MarkerSource) Run(ctx context.Context) error {
	if !s.running.CompareAndSwap(false, true) {
		return errors.New("npu: MarkerSource.Run called twice")
	}
	defer close(s.runDone)
	select {
	case <-s.closing:
		return ErrClosed
	default:
	}
	s.deliverMu.Lock()
	defer s.deliverMu.Unlock()
	tick := time.NewTicker(s.cfg.FlushInterval)
	defer tick.Stop()
	for {
		select {
		case b := <-s.completed:
			s.deliver(b)
		case ack := <-s.barriers:
			s.drain()
			close(ack)
		case <-tick.C:
			if err := s.flushAll(); err != nil {
				s.cfg.Logger.Warn("npu: flush marker buffers", "err", err)
			}
		case <-ctx.Done():
			if err := s.flushAll(); err != nil {
				s.cfg.Logger.Warn("npu: flush marker buffers", "err", err)
			}
			s.drain()
			return nil
		case <-s.closing:
			s.drain()
			return nil
		}
	}
}

// Flush asks the library for every buffer holding records, partly filled
// ones included, and waits until Run has delivered them to the sink. It
// returns ctx's error if Run is not running to do so.
func (s *MarkerSource) Flush(ctx context.Context) error {
	select {
	case <-s.closing:
		return ErrClosed
	default:
	}
	if err := s.flushAll(); err != nil {
		return err
	}
	ack := make(chan struct{})
	select {
	case s.barriers <- ack:
	case <-s.closing:
		return ErrClosed
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case <-ack:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (s *MarkerSource) flushAll() error {
	if rc := C.fl_call_u32(s.fn.flushAll, msptiFlushForced); rc != 0 {
		return s.driverError("msptiActivityFlushAll", rc, nil)
	}
	return nil
}

// Stats returns the counts so far.
func (s *MarkerSource) Stats() MarkerStats {
	return MarkerStats{
		Records:   s.records.Load(),
		Buffers:   s.buffers.Load(),
		Declined:  s.declined.Load(),
		Skipped:   s.skipped.Load(),
		Malformed: s.malformed.Load(),
		Foreign:   s.foreign.Load(),
	}
}

// Close stops collection: it disables marker activity, takes back the
// buffers the library holds, unsubscribes, waits for Run to return and
// delivers the last records to the sink. It must not be called from the
// sink. Buffers the library never hands back are leaked rather than freed
// under it. Close is idempotent.
func (s *MarkerSource) Close() error {
	s.closeOnce.Do(func() {
		close(s.closing)
		if s.running.Load() {
			<-s.runDone
		}
		var errs []error
		s.swMu.Lock()
		if rc := C.fl_call_u32(s.fn.disable, msptiKindMarker); rc != 0 {
			errs = append(errs, s.driverError("msptiActivityDisable", rc, nil))
		}
		s.markerOn = false
		s.swMu.Unlock()
		if err := s.flushAll(); err != nil {
			errs = append(errs, err)
		}
		if rc := C.fl_call_ptr(s.fn.unsubscribe, s.subscriber); rc != 0 {
			errs = append(errs, s.driverError("msptiUnsubscribe", rc, nil))
		}
		s.release()
		s.deliverMu.Lock()
		s.drain()
		C.free(unsafe.Pointer(s.reader))
		s.reader = nil
		s.deliverMu.Unlock()
		if n := s.freeAll(); n > 0 {
			s.cfg.Logger.Warn("npu: profiling library kept marker buffers at close; leaked", "buffers", n)
		}
		s.metrics.unregister()
		s.closeErr = errors.Join(errs...)
	})
	return s.closeErr
}

// discard frees the queued buffers without reading them, and the free ones.
func (s *MarkerSource) discard() {
	for {
		select {
		case b := <-s.completed:
			s.recycle(b.buf)
		default:
			s.freeAll()
			return
		}
	}
}

// freeAll frees every buffer not held by the library and returns how many
// the library still holds.
func (s *MarkerSource) freeAll() int {
	s.bufMu.Lock()
	defer s.bufMu.Unlock()
	for _, p := range s.free {
		C.free(p)
	}
	s.allocated -= len(s.free)
	s.free = nil
	return len(s.outstanding)
}

// takeBuffer returns a buffer for the library, or nil when MaxBuffers are
// taken or the source is closing.
func (s *MarkerSource) takeBuffer() unsafe.Pointer {
	select {
	case <-s.closing:
		return nil
	default:
	}
	s.bufMu.Lock()
	defer s.bufMu.Unlock()
	var p unsafe.Pointer
	if n := len(s.free); n > 0 {
		p = s.free[n-1]
		s.free = s.free[:n-1]
	} else if s.allocated < s.cfg.MaxBuffers {
		p = C.malloc(C.size_t(s.cfg.BufferBytes))
		if p == nil {
			return nil
		}
		s.allocated++
		s.metrics.outstanding.Set(float64(s.allocated))
	} else {
		return nil
	}
	s.outstanding[p] = struct{}{}
	return p
}

// complete takes a buffer back from the library and queues it for
// delivery. It runs on the library's thread and never waits.
func (s *MarkerSource) complete(p unsafe.Pointer, size, valid int) {
	s.bufMu.Lock()
	_, ours := s.outstanding[p]
	delete(s.outstanding, p)
	s.bufMu.Unlock()
	if !ours {
		s.foreign.Add(1)
		return
	}
	if valid < 0 || valid > s.cfg.BufferBytes || size != s.cfg.BufferBytes {
		s.malformed.Add(1)
		s.metrics.malformed.Inc()
		valid = 0
	}
	select {
	case s.completed <- completedBuffer{buf: p, valid: valid}:
	default:
		// Cannot happen: the channel holds MaxBuffers and no more buffers
		// exist. Recycle rather than block the library's thread.
		s.recycle(p)
	}
}

func (s *MarkerSource) recycle(p unsafe.Pointer) {
	s.bufMu.Lock()
	s.free = append(s.free, p)
	s.bufMu.Unlock()
}

// drain delivers every buffer already queued.
func (s *MarkerSource) drain() {
	for {
		select {
		case b := <-s.completed:
			s.deliver(b)
		default:
			return
		}
	}
}

// deliver reads the marker records of one buffer into the sink and
// recycles the buffer. Called with deliverMu held.
func (s *MarkerSource) deliver(b completedBuffer) {
	defer s.recycle(b.buf)
	if b.valid == 0 {
		return
	}
	r := s.reader
	skipped := uint64(r.skipped)
	C.fl_reader_reset(r, (*C.uint8_t)(b.buf), C.size_t(b.valid))
	var n uint64
	for {
		C.fl_read(r)
		batch := r.out[:r.n]
		for i := range batch {
			s.convert(&batch[i])
			s.cfg.Sink(&s.rec)
		}
		n += uint64(r.n)
		if r.state != C.FL_MORE {
			break
		}
	}
	switch r.state {
	case C.FL_ERROR:
		s.malformed.Add(1)
		s.metrics.malformed.Inc()
		s.cfg.Logger.Warn("npu: read marker buffer", "err", s.driverError("msptiActivityGetNextRecord", r.code, nil))
	case C.FL_MALFORMED:
		s.malformed.Add(1)
		s.metrics.malformed.Inc()
		s.cfg.Logger.Warn("npu: marker buffer holds a record outside its valid bytes; rest of buffer ignored", "valid", b.valid)
	}
	sk := uint64(r.skipped) - skipped
	s.records.Add(n)
	s.buffers.Add(1)
	s.skipped.Add(sk)
	s.metrics.records.Add(float64(n))
	s.metrics.buffers.Inc()
	s.metrics.skipped.Add(float64(sk))
}

// convert fills s.rec from a marker copied out of a buffer. mspti's object
// id is a union; both halves of the record get its two words, as
// MindCluster writes them, so that either side's tools read the same file.
func (s *MarkerSource) convert(m *C.fl_marker) {
	r := &s.rec
	r.Kind = trace.ActivityKindMarker
	r.Flag = trace.Flag(m.flag)
	r.SourceKind = uint32(m.source_kind)
	r.Timestamp = uint64(m.timestamp)
	r.ID = uint64(m.id)
	r.ProcessID, r.ThreadID = uint32(m.object0), uint32(m.object1)
	r.DeviceID, r.StreamID = uint32(m.object0), uint32(m.object1)
	r.Name = s.str(m.name, m.name_len)
	if m.domain == nil {
		r.Domain = trace.DomainDefault // mspti leaves the default domain's name NULL
	} else {
		r.Domain = s.str(m.domain, m.domain_len)
	}
}

// str copies a C string into Go memory, reusing an earlier copy of the same
// bytes: marker names repeat, and the sink must not see C memory that is
// recycled after the call.
func (s *MarkerSource) str(p *C.char, n C.uint32_t) string {
	if p == nil || n == 0 {
		return ""
	}
	view := unsafe.String((*byte)(unsafe.Pointer(p)), int(n))
	if v, ok := s.interned[view]; ok {
		return v
	}
	v := strings.Clone(view)
	if len(s.interned) < maxInterned {
		s.interned[v] = v
	}
	return v
}
