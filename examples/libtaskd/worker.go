package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"

	"github.com/faultline-ml/faultline/npu"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/trace"
)

const defaultMarkerLibrary = npu.DefaultMarkerLibrary

var (
	errStarted = errors.New("already started")
	errClosed  = errors.New("destroyed")
)

// worker is a training process's end of libtaskd: a dotting recorder, the
// node's ager when this process runs it, the control-plane worker that
// feeds them the profiling switch and the recovery requests, and the
// profiling library's marker source when one can be loaded.
type worker struct {
	set    workerSettings
	log    *slog.Logger
	ctx    context.Context
	cancel context.CancelFunc
	rec    *trace.Recorder
	ranges *rangeTable
	tw     *taskd.Worker
	cbs    *callbacks

	mu      sync.Mutex
	started bool
	closed  bool
	ager    *trace.Ager
	markers *npu.MarkerSource
	wg      sync.WaitGroup
}

func newLogger(level slog.Level, component string) *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})).With("component", component)
}

// newWorker builds the recorder and the control-plane worker. Ranges may be
// recorded from here on; the switch is all off until the manager sends one.
func newWorker(set workerSettings) (*worker, error) {
	w := &worker{set: set, log: newLogger(set.LogLevel, "libtaskd-worker"), cbs: newCallbacks()}
	w.ctx, w.cancel = context.WithCancel(context.Background())
	rec, err := trace.NewRecorder(context.Background(), trace.RecorderConfig{
		Root: set.Root, Job: set.Job, Rank: set.Rank, FlushInterval: set.FlushInterval, Logger: w.log,
	})
	if err != nil {
		w.cancel()
		return nil, err
	}
	w.rec = rec
	w.ranges = newRangeTable(rec, set.Device)
	w.tw, err = taskd.NewWorker(taskd.WorkerConfig{
		Job: set.Job, Node: set.Node, Rank: set.Rank, Upstream: set.Upstream, Security: set.Security,
		OnSwitch: w.applySwitch, OnMessage: w.onMessage, Logger: w.log,
	})
	if err != nil {
		rec.Close()
		w.cancel()
		return nil, err
	}
	return w, nil
}

// start connects to the control plane, starts the ager if this process
// runs it and opens the marker source if the profiling library loads.
func (w *worker) start() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case w.closed:
		return errClosed
	case w.started:
		return errStarted
	}
	if w.set.RunAger {
		a, err := trace.NewAger(trace.AgerConfig{Root: w.set.Root, BudgetBytes: w.set.BudgetBytes, Logger: w.log})
		if err != nil {
			return err
		}
		w.ager = a
		w.goRun("ager", a.Run)
	}
	w.started = true
	w.goRun("control plane", w.tw.Run)
	if w.set.MarkerLibrary == "" {
		return nil
	}
	src, err := npu.OpenMarkers(npu.MarkerConfig{
		Library: w.set.MarkerLibrary,
		Sink:    func(r *trace.Record) { w.rec.Record(r) },
		Switch:  w.rec.Switch(),
		Logger:  w.log,
	})
	switch {
	case errors.Is(err, npu.ErrNoDevice) || errors.Is(err, npu.ErrUnsupported):
		w.log.Info("no profiling library; ranges come from range_start and range_end only", "library", w.set.MarkerLibrary, "err", err)
	case err != nil:
		w.log.Warn("profiling library not used", "library", w.set.MarkerLibrary, "err", err)
	default:
		w.markers = src
		w.goRun("marker source", src.Run)
	}
	return nil
}

func (w *worker) goRun(what string, run func(context.Context) error) {
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		if err := run(w.ctx); err != nil {
			w.log.Error(what+" stopped", "err", err)
		}
	}()
}

// applySwitch is the control plane's OnSwitch: the recorder filters per
// kind, the marker source enables marker domains, and the trainer's
// profiling-switch callback, if any, hears of it last.
func (w *worker) applySwitch(sw trace.Switch) error {
	w.rec.SetSwitch(sw)
	w.mu.Lock()
	src := w.markers
	w.mu.Unlock()
	if src != nil {
		if err := src.ApplySwitch(sw); err != nil {
			return fmt.Errorf("marker source: %w", err)
		}
	}
	return w.cbs.call(eventProfilingSwitch, sw.String())
}

// onMessage is the control plane's OnMessage: messages whose kind names a
// callback event run that callback with the payload.
func (w *worker) onMessage(m taskd.Message) error {
	ev, ok := eventByName(m.Kind)
	if !ok || ev == eventProfilingSwitch {
		w.log.Debug("message ignored", "kind", m.Kind)
		return nil
	}
	return w.cbs.call(ev, string(m.Payload))
}

// flush writes the records taken so far to the file.
func (w *worker) flush() error {
	return w.rec.Flush()
}

// close stops everything, delivers the marker source's last records and
// flushes and syncs the record file. It is idempotent.
func (w *worker) close() error {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return nil
	}
	w.closed = true
	src, ager := w.markers, w.ager
	w.mu.Unlock()
	// Run of each part returns when the context ends; Close then releases
	// it. The recorder, on a context of its own, goes last so that it
	// takes the marker source's last records.
	w.cancel()
	w.wg.Wait()
	var errs []error
	if src != nil {
		errs = append(errs, src.Close())
	}
	errs = append(errs, w.tw.Close())
	if ager != nil {
		errs = append(errs, ager.Close())
	}
	errs = append(errs, w.rec.Close())
	return errors.Join(errs...)
}
