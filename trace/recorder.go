package trace

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/faultline-ml/faultline/internal/promreg"
)

// Recorder defaults.
const (
	DefaultBufferRecords = 16384
	pollMin              = 2 * time.Millisecond
	pollMax              = 50 * time.Millisecond
)

// RecorderConfig configures a Recorder. The zero value records nothing
// until SetSwitch turns kinds on, then writes rank 0 under DefaultRoot.
type RecorderConfig struct {
	Root          string        // default DefaultRoot
	Job           string        // default ResolveJob(Root)
	Rank          int           // global rank; must not be negative
	MaxFileBytes  int64         // default 10 MiB
	FlushInterval time.Duration // records reach the file at least this often; default 5 s
	// BufferRecords bounds the records waiting for the writer goroutine,
	// rounded up to a power of two; default 16384 (2.7 MiB). When it
	// is full, new records are dropped and counted.
	BufferRecords int
	Switch        Switch                // initial switch; default all off
	Registerer    prometheus.Registerer // nil: no metrics
	Logger        *slog.Logger          // nil: discard
}

// Validate reports the first field that cannot be used.
func (c RecorderConfig) Validate() error {
	if c.Job != "" {
		if err := ValidateJob(c.Job); err != nil {
			return fmt.Errorf("trace: RecorderConfig.Job: %w", err)
		}
	}
	switch {
	case c.Rank < 0:
		return fmt.Errorf("trace: RecorderConfig.Rank: %d is negative", c.Rank)
	case c.MaxFileBytes < 0:
		return fmt.Errorf("trace: RecorderConfig.MaxFileBytes: %d is negative", c.MaxFileBytes)
	case c.FlushInterval < 0:
		return fmt.Errorf("trace: RecorderConfig.FlushInterval: %v is negative", c.FlushInterval)
	case c.BufferRecords < 0:
		return fmt.Errorf("trace: RecorderConfig.BufferRecords: %d is negative", c.BufferRecords)
	case c.BufferRecords > 1<<24:
		return fmt.Errorf("trace: RecorderConfig.BufferRecords: %d exceeds %d", c.BufferRecords, 1<<24)
	}
	return nil
}

// writerConfig is the config of the recorder's writer; its metrics are
// the recorder's.
func (c RecorderConfig) writerConfig() fileWriterConfig {
	return fileWriterConfig{Root: c.Root, Job: c.Job, Rank: c.Rank, MaxFileBytes: c.MaxFileBytes, Logger: c.Logger}
}

// Bits of Recorder.bits above the kinds.
const (
	bitDomDefault = 1 << (numKinds + iota)
	bitDomComm
	bitOpen  = 1 << 31
	kindMask = 1<<numKinds - 1
)

// Flags of each kind's records, as MindCluster writes them: phases that
// launch device work mark "with device", host-only phases do not.
var (
	startFlags   = [numKinds]Flag{FlagDeviceStart, FlagDeviceStart, FlagHostStart, FlagHostStart, FlagDeviceStart}
	endFlags     = [numKinds]Flag{FlagDeviceEnd, FlagDeviceEnd, FlagHostEnd, FlagHostEnd, FlagDeviceEnd}
	instantFlags = [numKinds]Flag{FlagDeviceInstant, FlagDeviceInstant, FlagInstant, FlagInstant, FlagDeviceInstant}
)

// Recorder is the dotting hot path of a training process. Calls with a
// kind switched off cost an atomic load and a branch. Calls with it on
// take a timestamp and put an entry into a bounded lock-free ring with no
// allocation and no lock; Run encodes the entries and writes them to the
// rank's files. When Run falls behind the ring fills and records are
// dropped and counted; a caller never waits.
//
// All methods are safe for concurrent use. Ids are unique per Recorder
// and, being offset by the start time in nanoseconds, across restarts of
// a rank.
type Recorder struct {
	bits   atomic.Uint32 // kinds on, domains on, open
	ring   *ring
	idBase uint64
	wall0  uint64    // unix ns at t0
	t0     time.Time // carries the monotonic clock
	pid    uint32

	dropped [numDomains]atomic.Uint64 // ring full

	cfg     RecorderConfig
	swMu    sync.Mutex
	metrics *promreg.Registrar

	wmu      sync.Mutex  // held to drain the ring into w
	w        *fileWriter // guarded by wmu
	sink     func(*entry, *side)
	closed   bool  // guarded by wmu: w is closed
	closeErr error // guarded by wmu

	running  sync.Mutex    // held by Run
	active   atomic.Bool   // Run is in its loop and takes reqs
	reqs     chan func()   // work for Run's goroutine: Flush, WriteParallelGroups
	left     chan struct{} // closed once Run has left its loop
	leftOnce sync.Once
	stop     chan struct{}
	stopOnce sync.Once
}

// NewRecorder returns a Recorder; Run writes its records. Until Run
// starts they wait in the ring, and are dropped once it is full.
func NewRecorder(cfg RecorderConfig) (*Recorder, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.FlushInterval = cmp.Or(cfg.FlushInterval, defaultFlushInterval)
	cfg.BufferRecords = cmp.Or(cfg.BufferRecords, DefaultBufferRecords)
	cfg.Logger = cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	w, err := newFileWriter(cfg.writerConfig())
	if err != nil {
		return nil, err
	}
	t0 := time.Now()
	r := &Recorder{
		ring:   newRing(cfg.BufferRecords),
		idBase: uint64(t0.UnixNano()),
		wall0:  uint64(t0.UnixNano()),
		t0:     t0,
		pid:    uint32(os.Getpid()),
		w:      w,
		cfg:    cfg,
		reqs:   make(chan func()),
		left:   make(chan struct{}),
		stop:   make(chan struct{}),
	}
	r.sink = r.write
	r.bits.Store(bitOpen | switchBits(cfg.Switch))
	r.metrics = promreg.New(cfg.Registerer, "trace: RecorderConfig.Registerer")
	r.metrics.MustRegister(newStatsCollector(w.c, &r.dropped, &r.bits))
	if err := r.metrics.Err(); err != nil {
		w.Close()
		return nil, err
	}
	return r, nil
}

func switchBits(s Switch) uint32 {
	b := s.Bits()
	if s.DomainEnabled(DomainDefault) {
		b |= bitDomDefault
	}
	if s.DomainEnabled(DomainCommunication) {
		b |= bitDomComm
	}
	return b
}

// SetSwitch puts s in force; calls that start after it returns see it.
// A range already started still records its end. After Close it does
// nothing.
func (r *Recorder) SetSwitch(s Switch) {
	r.swMu.Lock()
	defer r.swMu.Unlock()
	if b := r.bits.Load(); b&bitOpen != 0 {
		r.bits.Store(bitOpen | switchBits(s))
		if b&kindMask != s.Bits() {
			r.cfg.Logger.Info("trace: switch changed", "switch", s.String(), "rank", r.cfg.Rank)
		}
	}
}

// Switch returns the switch in force.
func (r *Recorder) Switch() Switch { return SwitchFromBits(r.bits.Load() & kindMask) }

// Enabled reports whether kind k is on, for callers that would otherwise
// build a name or CommOp for nothing.
func (r *Recorder) Enabled(k Kind) bool { return r.bits.Load()&kindBit(k) != 0 }

func kindBit(k Kind) uint32 { return 1 << k & kindMask }

func (r *Recorder) now() uint64 { return r.wall0 + uint64(time.Since(r.t0)) }

// Span is a started range; End records its end. The zero Span, returned
// while the kind is off, ends as a no-op; a Span whose start was dropped
// counts its end as dropped too.
type Span struct {
	r           *Recorder
	id          uint64
	dev, stream uint32
	kind        Kind
}

// ID returns the id that the start and end records share, 0 for a Span
// whose start was not recorded.
func (s Span) ID() uint64 { return s.id }

// End records the end of the range.
func (s Span) End() {
	if s.r == nil {
		return
	}
	s.r.end(s)
}

// Start records the start of a range of kind k named name (MarkerForward,
// MarkerDataLoader, MarkerSaveCheckpoint or a name of the caller's) on
// device and stream.
func (r *Recorder) Start(k Kind, name string, device, stream uint32) Span {
	if r.bits.Load()>>k&1 == 0 {
		return Span{}
	}
	return r.startLiteral(k, name, device, stream)
}

// StartStep records the start of training step n (a Step range named
// "step <n>").
func (r *Recorder) StartStep(n uint64, device, stream uint32) Span {
	if r.bits.Load()&(1<<Step) == 0 {
		return Span{}
	}
	return r.startStep(n, device, stream)
}

// StartComm records the start of a communication operator (a
// CommunicationOperator range whose name is op as JSON). op is copied.
func (r *Recorder) StartComm(op *CommOp, device, stream uint32) Span {
	if r.bits.Load()&(1<<CommunicationOperator) == 0 {
		return Span{}
	}
	return r.startComm(op, device, stream)
}

// Mark records an instant of kind k.
func (r *Recorder) Mark(k Kind, name string, device, stream uint32) {
	if r.bits.Load()>>k&1 != 0 {
		r.mark(k, name, device, stream)
	}
}

// The slow halves of the methods above stay out of line, so that the
// checks of the switch inline into the caller.

func (r *Recorder) startLiteral(k Kind, name string, dev, stream uint32) Span {
	if k >= numKinds { // the check inlined above reads bits by shifting
		return Span{}
	}
	id := r.put(k, startFlags[k], nameLiteral, name, 0, nil, dev, stream)
	return Span{r: r, id: id, dev: dev, stream: stream, kind: k}
}

func (r *Recorder) startStep(n uint64, dev, stream uint32) Span {
	id := r.put(Step, startFlags[Step], nameStep, "", n, nil, dev, stream)
	return Span{r: r, id: id, dev: dev, stream: stream, kind: Step}
}

func (r *Recorder) startComm(op *CommOp, dev, stream uint32) Span {
	id := r.put(CommunicationOperator, startFlags[CommunicationOperator], nameComm, "", 0, op, dev, stream)
	return Span{r: r, id: id, dev: dev, stream: stream, kind: CommunicationOperator}
}

func (r *Recorder) mark(k Kind, name string, dev, stream uint32) {
	if k >= numKinds {
		return
	}
	r.put(k, instantFlags[k], nameLiteral, name, 0, nil, dev, stream)
}

func (r *Recorder) end(s Span) {
	if s.id == 0 { // the start was dropped
		r.dropped[domainOf(s.kind)].Add(1)
		return
	}
	if r.bits.Load()&bitOpen == 0 {
		return
	}
	ts := r.now()
	c, pos, ok := r.ring.claim()
	if !ok {
		r.dropped[domainOf(s.kind)].Add(1)
		return
	}
	c.e = entry{ts: ts, id: s.id, dev: s.dev, stream: s.stream, flag: uint8(endFlags[s.kind]),
		form: nameNone, dom: uint8(domainOf(s.kind))}
	c.seq.Store(pos + 1)
}

// put enqueues one record and returns its id, or 0 when it was dropped.
func (r *Recorder) put(k Kind, flag Flag, form uint8, name string, step uint64, op *CommOp, dev, stream uint32) uint64 {
	ts := r.now()
	c, pos, ok := r.ring.claim()
	if !ok {
		r.dropped[domainOf(k)].Add(1)
		return 0
	}
	id := r.idBase + pos
	c.e = entry{ts: ts, id: id, name: name, step: step, dev: dev, stream: stream, flag: uint8(flag),
		form: form, dom: uint8(domainOf(k))}
	if op != nil {
		r.ring.side(pos).op = *op
	}
	c.seq.Store(pos + 1)
	return id
}

// write hands an entry of the ring to the writer, as the record it
// stands for; r.wmu is held.
func (r *Recorder) write(e *entry, sd *side) {
	if e.form == nameRecord {
		r.w.put(int(e.dom), &sd.rec, nameLiteral, 0, nil)
		return
	}
	rec := Record{Kind: ActivityKindMarker, Flag: Flag(e.flag), SourceKind: SourceKindHost,
		Timestamp: e.ts, ID: e.id, ProcessID: r.pid, ThreadID: r.pid, DeviceID: e.dev, StreamID: e.stream,
		Name: e.name, Domain: domainNames[e.dom]}
	form := e.form
	if form == nameNone {
		rec.Domain, form = "", nameLiteral
	}
	r.w.put(int(e.dom), &rec, form, e.step, &sd.op)
}

func domainOf(k Kind) int {
	if k == CommunicationOperator {
		return domComm
	}
	return domDefault
}

// Record enqueues a record built elsewhere (an accelerator's marker
// activity, a replay), copying it. It is filtered by domain as
// Switch.DomainEnabled says; a record with an empty domain (mspti leaves
// it empty on end records) follows the default domain. It reports whether
// the record was taken.
func (r *Recorder) Record(rec *Record) bool {
	bit := uint32(bitDomDefault)
	dom := domDefault
	if rec.Domain == DomainCommunication {
		bit, dom = bitDomComm, domComm
	}
	if r.bits.Load()&bit == 0 {
		return false
	}
	c, pos, ok := r.ring.claim()
	if !ok {
		r.dropped[dom].Add(1)
		return false
	}
	r.ring.side(pos).rec = *rec
	c.e = entry{form: nameRecord, dom: uint8(dom)}
	c.seq.Store(pos + 1)
	return true
}

// Run drains the ring into the rank's files, polling faster while
// records flow, and flushes them every FlushInterval, until ctx is done or
// Close is called. Then it stops recording, writes what is buffered,
// fsyncs and closes the file, and returns nil; records after that are
// dropped.
func (r *Recorder) Run(ctx context.Context) error {
	if !r.running.TryLock() {
		return errors.New("trace: Recorder.Run called twice")
	}
	defer r.running.Unlock()
	defer r.shutdown()
	r.active.Store(true)
	defer r.leftOnce.Do(func() { close(r.left) })
	defer r.active.Store(false)
	interval := pollMax
	timer := time.NewTimer(interval)
	defer timer.Stop()
	lastFlush := time.Now()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-r.stop:
			return nil
		case fn := <-r.reqs:
			fn()
			continue
		case <-timer.C:
		}
		r.wmu.Lock()
		if r.closed {
			r.wmu.Unlock()
			return nil
		}
		if r.drain() > 0 {
			interval = pollMin
		} else if interval *= 2; interval > pollMax {
			interval = pollMax
		}
		if now := time.Now(); now.Sub(lastFlush) >= r.cfg.FlushInterval {
			r.w.Flush()
			lastFlush = now
		}
		r.wmu.Unlock()
		timer.Reset(interval)
	}
}

// drain writes what the ring holds; r.wmu is held.
func (r *Recorder) drain() int {
	total := 0
	for {
		n := r.ring.consume(1024, r.sink)
		total += n
		if n < 1024 {
			return total
		}
	}
}

// shutdown stops recording and closes the writer, once.
func (r *Recorder) shutdown() {
	r.swMu.Lock()
	r.bits.Store(0)
	r.swMu.Unlock()
	r.wmu.Lock()
	defer r.wmu.Unlock()
	if r.closed {
		return
	}
	// Producers that loaded the bits before the store may still publish;
	// take what is there, leave the rest.
	r.drain()
	r.closeErr = r.w.Close()
	r.closed = true
}

// do runs fn on the writer after the ring is drained: on Run's goroutine
// while Run runs, so that the caller's thread neither encodes nor writes,
// else on the caller's.
func (r *Recorder) do(fn func(*fileWriter) error) error {
	if r.active.Load() {
		errc := make(chan error, 1)
		select {
		case r.reqs <- func() { errc <- r.drainAnd(fn) }:
			return <-errc
		case <-r.left:
		}
	}
	return r.drainAnd(fn)
}

// drainAnd drains the ring and runs fn on the writer.
func (r *Recorder) drainAnd(fn func(*fileWriter) error) error {
	r.wmu.Lock()
	defer r.wmu.Unlock()
	if r.closed {
		return fmt.Errorf("trace: recorder: %w", os.ErrClosed)
	}
	r.drain()
	return fn(r.w)
}

// Flush writes every record recorded before the call to the file.
func (r *Recorder) Flush() error { return r.do((*fileWriter).Flush) }

// WriteParallelGroups writes g as parallel_group.json into this rank's
// folder.
func (r *Recorder) WriteParallelGroups(g ParallelGroups) error {
	return r.do(func(w *fileWriter) error { return w.WriteParallelGroups(g) })
}

// Dir returns the rank folder once the writer has resolved it, else "".
func (r *Recorder) Dir() string {
	r.w.c.mu.Lock()
	defer r.w.c.mu.Unlock()
	return r.w.c.dir
}

// Stats returns what the recorder has written and dropped.
func (r *Recorder) Stats() Stats {
	s := r.w.Stats()
	s.Dropped.Default += r.dropped[domDefault].Load()
	s.Dropped.Communication += r.dropped[domComm].Load()
	return s
}

// Close stops Run and waits for it to return, stops recording, writes
// what is buffered, fsyncs and closes the file, and unregisters the
// metrics. It is idempotent and returns the final write error, if any.
func (r *Recorder) Close() error {
	r.stopOnce.Do(func() {
		close(r.stop)
		r.metrics.UnregisterAll()
	})
	r.running.Lock() // held by Run until it returns
	r.running.Unlock()
	r.shutdown() // for a Recorder that Run never ran
	r.wmu.Lock()
	defer r.wmu.Unlock()
	return r.closeErr
}
