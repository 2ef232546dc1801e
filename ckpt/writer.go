package ckpt

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// Blob is a named byte string of a step: a model's weights, an
// optimizer's state, the data loader's position.
type Blob struct {
	Name string
	Data []byte
}

// Source is a named blob read from R, which must yield exactly Size bytes.
type Source struct {
	Name string
	Size int64
	R    io.Reader
}

// Checkpoint is one shard's state at one step.
type Checkpoint struct {
	Step  int64
	Blobs []Blob
	// Unverified is set when the step was loaded from memory before its
	// owner sealed it (the owner was down): the step is complete, as the
	// save left it, but no CRC checked these bytes.
	Unverified bool
}

// Blob returns the data of the blob named name, or nil.
func (c *Checkpoint) Blob(name string) []byte {
	for _, b := range c.Blobs {
		if b.Name == name {
			return b.Data
		}
	}
	return nil
}

// Size is the sum of the blob sizes.
func (c *Checkpoint) Size() int64 {
	var n int64
	for _, b := range c.Blobs {
		n += int64(len(b.Data))
	}
	return n
}

// WriterConfig configures a Writer. The zero value of each field but Path
// is a documented default.
type WriterConfig struct {
	// Path is the shard's segment, created by the owner (see SegmentPath).
	Path string
	// Workers is the number of goroutines that copy a save; default
	// GOMAXPROCS. The trainer waits for the copy, so it may as well use
	// every core.
	Workers int

	Registerer     prometheus.Registerer // nil: metrics off
	TracerProvider trace.TracerProvider  // nil: no spans
	Logger         *slog.Logger          // nil: silent
}

// Validate reports the first invalid field.
func (c WriterConfig) Validate() error {
	switch {
	case c.Path == "":
		return errors.New("ckpt: WriterConfig.Path is empty")
	case c.Workers < 0:
		return fmt.Errorf("ckpt: WriterConfig.Workers is %d, want >= 0", c.Workers)
	}
	return nil
}

// Writer saves a trainer's shard into the shared-memory segment its owner
// created. A save blocks only for the copy; computing the CRCs of what it
// saved (sealing the step), persisting it to disk and copying it to peers
// is the owner's work. Methods are safe for
// concurrent use; saves are serialised.
type Writer struct {
	cfg    WriterConfig
	shard  int
	seg    *segment
	m      *writerMetrics
	tracer trace.Tracer
	log    *slog.Logger

	mu sync.Mutex
}

// NewWriter maps the segment at cfg.Path.
func NewWriter(cfg WriterConfig) (*Writer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	seg, err := openWritable(cfg.Path)
	if err != nil {
		return nil, err
	}
	m, err := newWriterMetrics(cfg.Registerer)
	if err != nil {
		seg.close()
		return nil, err
	}
	return &Writer{cfg: cfg, shard: seg.hdr.Shard, seg: seg, m: m,
		tracer: tracerOf(cfg.TracerProvider), log: loggerOf(cfg.Logger)}, nil
}

// openWritable maps the segment at path for a writer.
func openWritable(path string) (*segment, error) {
	seg, err := openSegment(path, false)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w (its owner, the node agent, creates it: start the owner first, or correct WriterConfig.Path)", err)
	}
	if err != nil {
		return nil, err
	}
	if seg.hdr.Flags&layout.FlagReplica != 0 {
		seg.close()
		return nil, fmt.Errorf("ckpt: %s holds a peer's replica, not a shard to write: give WriterConfig.Path the shard's SegmentPath", path)
	}
	if err := seg.writable(); err != nil {
		seg.close()
		return nil, err
	}
	return seg, nil
}

// remap maps the segment's path again if it names another file than the
// one mapped: a save in another process, or an owner, grew it. The caller
// holds w.mu.
func (w *Writer) remap() error {
	if w.seg == nil || !w.seg.replaced() {
		return nil
	}
	seg, err := openWritable(w.cfg.Path)
	if err != nil {
		return fmt.Errorf("ckpt: map the grown segment: %w", err)
	}
	if seg.hdr.Shard != w.shard {
		seg.close()
		return fmt.Errorf("ckpt: %s now holds shard %d, not %d: remove it, and let the owner create it again", w.cfg.Path, seg.hdr.Shard, w.shard)
	}
	w.seg.close()
	w.seg = seg
	return nil
}

// Shard is the shard the segment holds.
func (w *Writer) Shard() int { return w.shard }

// Capacity is the largest step, in bytes of a half (header, table and
// data), that the segment holds now; a larger save grows it.
func (w *Writer) Capacity() int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.seg == nil {
		return 0
	}
	return w.seg.hdr.HalfSize
}

// Save copies blobs into shared memory as the given step, over
// WriterConfig.Workers goroutines, and computes nothing else: the owner
// seals the step (computes its CRCs) afterwards. When Save returns nil the
// step is complete in memory and survives the trainer's death; a crash
// during Save leaves the previous step intact. A step that does not fit
// grows the segment first: a new, larger segment receives the newest step
// and then this one, and replaces the old one under its name (growing, in
// the FORMAT section); the owner and any other process mapping it follow.
// It returns ErrBusy, without copying, when the owner is still reading
// the only half it could write, and ErrTooLarge when the step does not
// fit and the segment cannot grow (joined with ErrNoSpace when shared
// memory lacks the room).
func (w *Writer) Save(ctx context.Context, step int64, blobs ...Blob) error {
	names := make([]string, len(blobs))
	sizes := make([]int64, len(blobs))
	for i, b := range blobs {
		names[i], sizes[i] = b.Name, int64(len(b.Data))
	}
	return w.save(ctx, step, names, sizes, func(hw *halfWriter) error {
		dst := make([][]byte, len(blobs))
		src := make([][]byte, len(blobs))
		for i, b := range blobs {
			dst[i], src[i] = hw.blob(i), b.Data
		}
		_, err := copyBlobs(dst, src, w.cfg.Workers, false)
		return err
	})
}

// SaveFrom is Save with blobs read from readers.
func (w *Writer) SaveFrom(ctx context.Context, step int64, srcs ...Source) error {
	names := make([]string, len(srcs))
	sizes := make([]int64, len(srcs))
	for i, s := range srcs {
		names[i], sizes[i] = s.Name, s.Size
		if s.Size < 0 {
			return fmt.Errorf("ckpt: source %q: size %d is negative", s.Name, s.Size)
		}
	}
	return w.save(ctx, step, names, sizes, func(hw *halfWriter) error {
		for i, s := range srcs {
			dst := hw.blob(i)
			if n, err := io.ReadFull(s.R, dst); err != nil {
				return fmt.Errorf("ckpt: read source %q at byte %d of %d: %w", s.Name, n, len(dst), err)
			}
		}
		return nil
	})
}

func (w *Writer) save(ctx context.Context, step int64, names []string, sizes []int64, fill func(*halfWriter) error) (err error) {
	start := time.Now()
	meta := layout.PlaceBlobs(step, names, sizes)
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.seg == nil {
		return fmt.Errorf("ckpt: save to %s: %w", w.cfg.Path, errClosed)
	}
	_, span := w.tracer.Start(ctx, "ckpt.Save", trace.WithAttributes(
		attribute.Int64("ckpt.step", step), attribute.Int("ckpt.shard", w.seg.hdr.Shard),
		attribute.Int64("ckpt.bytes", meta.DataSize())))
	defer func() {
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}()
	// A segment file cut short under the mapping faults on access: make
	// that an error of this save, not the death of the trainer.
	defer recoverFault(&err, debug.SetPanicOnFault(true))
	if err := w.lockFitting(meta); err != nil {
		return err
	}
	defer w.seg.flock(unix.LOCK_UN)
	hw, err := w.seg.begin(meta)
	if errors.Is(err, ErrBusy) {
		w.m.saveSkipped.Inc()
		w.log.Warn("ckpt: save skipped: the owner reads one half and the other waits for it", "step", step, "segment", w.cfg.Path)
	}
	if err != nil {
		return err
	}
	if err := fill(hw); err != nil {
		// The half stays in the writing state: it holds no step, and the
		// other half keeps the previous one.
		return err
	}
	if err := hw.commit(nil); err != nil {
		return err
	}
	w.m.saveSeconds.Observe(time.Since(start).Seconds())
	w.m.saveBytes.Add(float64(meta.DataSize()))
	return nil
}

var errClosed = errors.New("closed")

// lockFitting leaves w.seg mapping the file its path names, with halves
// that hold meta, and holding its shared lock (growing, in the FORMAT
// section): it follows a segment another process grew, and grows one
// that is too small.
func (w *Writer) lockFitting(meta layout.StepMeta) error {
	// Bad input grows nothing.
	if err := meta.Check(layout.MaxHalfSize); err != nil {
		return badSave(meta, err)
	}
	for {
		if err := w.remap(); err != nil {
			return err
		}
		if err := w.seg.flock(unix.LOCK_SH); err != nil {
			return err
		}
		if w.seg.replaced() { // grown between the check and the lock
			w.seg.flock(unix.LOCK_UN)
			continue
		}
		need := meta.End()
		if need <= w.seg.hdr.HalfSize {
			return nil
		}
		w.seg.flock(unix.LOCK_UN)
		g, err := w.seg.grow(need, 1)
		if errors.Is(err, errReplaced) {
			continue
		}
		if err != nil {
			return fmt.Errorf("%w: step %d needs %d bytes per half (%d of data in %d blobs), segment %s has %d: %w",
				ErrTooLarge, meta.Step, need, meta.DataSize(), len(meta.Blobs), w.cfg.Path, w.seg.hdr.HalfSize, err)
		}
		w.log.Info("ckpt: segment grown", "segment", w.cfg.Path, "step", meta.Step, "half_size", g.hdr.HalfSize, "was", w.seg.hdr.HalfSize)
		w.seg.close()
		w.seg = g
	}
}

// Persist asks the owner to write step to disk. The step must be the
// newest one saved. A writer has one request outstanding: Persist first
// waits, until ctx ends, for the owner to be done with the previous one,
// so that every step asked for is persisted (a disk slower than the
// requests slows the trainer down rather than lose them). The owner
// persists that step, not a newer one; the trainer does not wait for it,
// and its saves leave the step's half alone until the owner is done.
func (w *Writer) Persist(ctx context.Context, step int64) (err error) {
	defer recoverFault(&err, debug.SetPanicOnFault(true))
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.seg == nil {
		return fmt.Errorf("ckpt: persist in %s: %w", w.cfg.Path, errClosed)
	}
	if err := w.remap(); err != nil {
		return err
	}
	c := w.seg.newest()
	if len(c) == 0 {
		return fmt.Errorf("%w in %s to persist step %d", ErrNoStep, w.cfg.Path, step)
	}
	m, _ := w.seg.metaOK(c[0])
	if m.Step != step {
		return fmt.Errorf("ckpt: persist step %d: the newest step in %s is %d", step, w.cfg.Path, m.Step)
	}
	for wait := time.Millisecond; w.seg.persistSeq() != 0; wait = min(2*wait, 50*time.Millisecond) {
		select {
		case <-ctx.Done():
			return fmt.Errorf("ckpt: persist step %d: the owner of %s is not done with the persist asked for before it (save %d): %w",
				step, w.cfg.Path, w.seg.persistSeq(), ctx.Err())
		case <-time.After(wait):
		}
	}
	w.seg.setPersistSeq(m.Seq)
	return nil
}

// Load returns the newest step in memory whose every CRC holds, or which
// is complete but not yet sealed by its owner (then the Checkpoint is
// Unverified). It reads memory alone: a newer step that fails its checks
// there is logged (WriterConfig.Logger) and passed over, though the disk
// tier may hold it intact, so a trainer restarts from the step its agent
// chose with Owner.Load (or LoadShard, which weighs the disk tier too).
// Its error wraps ErrNoStep and says why each half was refused.
func (w *Writer) Load(ctx context.Context) (*Checkpoint, error) {
	return w.load(ctx, nil)
}

// LoadInto is Load into dst, reusing the buffers of dst's blobs that have
// the names and room of the loaded ones (say, the tensors of a model being
// restored) instead of allocating. After an error dst's content is
// undefined.
func (w *Writer) LoadInto(ctx context.Context, dst *Checkpoint) error {
	_, err := w.load(ctx, dst)
	return err
}

func (w *Writer) load(ctx context.Context, reuse *Checkpoint) (_ *Checkpoint, err error) {
	defer recoverFault(&err, debug.SetPanicOnFault(true))
	_, span := w.tracer.Start(ctx, "ckpt.LoadMemory")
	defer span.End()
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.seg == nil {
		return nil, fmt.Errorf("ckpt: load from %s: %w", w.cfg.Path, errClosed)
	}
	if err := w.remap(); err != nil {
		return nil, err
	}
	ck, why := w.seg.load(w.cfg.Workers, reuse)
	if ck == nil {
		err := fmt.Errorf("%w in %s: %w", ErrNoStep, w.cfg.Path, errors.Join(why...))
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
		return nil, err
	}
	span.SetAttributes(attribute.Int64("ckpt.step", ck.Step), attribute.Int64("ckpt.bytes", ck.Size()),
		attribute.Bool("ckpt.unverified", ck.Unverified))
	if ck.Unverified {
		w.log.Warn("ckpt: loaded a step its owner has not sealed: complete, but no CRC checked it", "step", ck.Step, "segment", w.cfg.Path)
	}
	for _, e := range why {
		w.log.Warn("ckpt: passed over in memory", "loaded_step", ck.Step, "segment", w.cfg.Path, "err", e)
	}
	return ck, nil
}

// Close unmaps the segment and unregisters the metrics. The steps it holds
// stay in shared memory.
func (w *Writer) Close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.seg == nil {
		return nil
	}
	err := w.seg.close()
	w.seg = nil
	w.m.reg.UnregisterAll()
	return err
}
