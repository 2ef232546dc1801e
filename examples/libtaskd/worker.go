package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/faultline-ml/faultline/npu"
	"github.com/faultline-ml/faultline/taskd"
	"github.com/faultline-ml/faultline/trace"
)

const defaultMarkerLibrary = npu.DefaultMarkerLibrary

// Errors the C ABI turns into codes (see codeOf).
var (
	errStarted     = errors.New("already started")
	errClosed      = errors.New("destroyed")
	errBadHandle   = errors.New("not a live handle")
	errBadArgument = errors.New("bad argument")
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
	cbs    *callbacks
	stop   *stopTrack

	mu      sync.Mutex
	started bool
	trained bool // tw has a trainer
	closed  bool
	tw      *taskd.Worker
	ager    *trace.Ager
	markers *npu.MarkerSource
	wg      sync.WaitGroup
}

func newLogger(level slog.Level, component string) *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})).With("component", component)
}

// switchCallbackTimeout bounds the profiling-switch callback, which runs
// on the control plane's receive loop.
const switchCallbackTimeout = 30 * time.Second

// stopCallWait bounds how long closing waits for a Stop call in progress
// before it stops the control plane, which then sends the call's
// acknowledgement: a trainer typically exits as soon as it stopped, and
// an unacknowledged stop would leave the manager waiting out its deadline.
const stopCallWait = 5 * time.Second

// newWorker builds the recorder, so that ranges may be recorded from here
// on; the switch is all off until the manager sends one.
func newWorker(set workerSettings) (*worker, error) {
	w := &worker{set: set, log: newLogger(set.LogLevel, "libtaskd-worker"), cbs: newCallbacks(), stop: newStopTrack()}
	if err := w.taskdConfig().Validate(); set.Upstream != "" && err != nil {
		return nil, &configError{Config: "worker", Msg: err.Error()}
	}
	// The recorder has a context of its own: it is closed last, after the
	// marker source has handed it its last records.
	rec, err := trace.NewRecorder(trace.RecorderConfig{
		Root: set.Root, Job: set.Job, Rank: set.Rank, FlushInterval: set.FlushInterval, Switch: set.Switch, Logger: w.log,
	})
	if err != nil {
		return nil, err
	}
	go rec.Run(context.Background())
	w.rec = rec
	w.ranges = newRangeTable(rec, set.Device)
	w.ctx, w.cancel = context.WithCancel(context.Background())
	return w, nil
}

// taskdConfig is the control-plane worker's configuration. The trainer is
// set when any orchestration callback is registered; without one the
// worker refuses orchestration, and recovery treats the rank as one it
// cannot pause.
func (w *worker) taskdConfig() taskd.WorkerConfig {
	cfg := taskd.WorkerConfig{
		Job: w.set.Job, Node: w.set.Node, Rank: w.set.Rank, Upstream: w.set.Upstream, Security: w.set.Security,
		OnSwitch: w.applySwitch, Logger: w.log,
	}
	if w.cbs.anyRecovery() {
		cfg.Trainer = trainer{cbs: w.cbs, stop: w.stop}
	}
	return cfg
}

// register sets the callback of e. Orchestration callbacks must come
// before start, which decides whether the worker has a trainer.
func (w *worker) register(e event, fn callback) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if e.recovery() && w.started && !w.trained {
		return fmt.Errorf("%w: register %s callbacks before starting the worker", errStarted, e)
	}
	return w.cbs.set(e, fn)
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
	cfg := w.taskdConfig()
	var tw *taskd.Worker
	if w.set.Upstream != "" { // else no control plane was named: dotting alone
		var err error
		if tw, err = taskd.NewWorker(cfg); err != nil {
			return err
		}
	}
	var ager *trace.Ager
	var err error
	if w.set.RunAger {
		if ager, err = trace.NewAger(trace.AgerConfig{Root: w.set.Root, BudgetBytes: w.set.BudgetBytes, Logger: w.log}); err != nil {
			if tw != nil {
				tw.Close()
			}
			return err
		}
	}
	w.started, w.tw, w.trained, w.ager = true, tw, tw != nil && cfg.Trainer != nil, ager
	if ager != nil {
		w.goRun("ager", ager.Run)
	}
	if tw != nil {
		w.goRun("control plane", tw.Run)
	} else {
		w.log.Info("no control plane named (TASKD_UPSTREAM and a credential): the worker dots into files only")
		if cfg.Trainer != nil {
			// Nothing would resume the trainer, which begins paused: start it.
			w.goRun("trainer start", func(ctx context.Context) error {
				return cfg.Trainer.Resume(ctx, taskd.ResumeRequest{Step: -1})
			})
		}
	}
	w.log.Info("worker started", "job", w.set.Job, "node", w.set.Node, "rank", w.set.Rank,
		"framework", w.set.Framework, "upstream", w.set.Upstream, "trainer", w.trained, "ager", ager != nil)
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
	if !w.cbs.registered(eventProfilingSwitch) {
		return nil
	}
	ctx, cancel := context.WithTimeout(w.ctx, switchCallbackTimeout)
	defer cancel()
	_, err := w.cbs.call(ctx, eventProfilingSwitch, sw.String())
	return err
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
	tw, src, ager, trained := w.tw, w.markers, w.ager, w.trained
	w.mu.Unlock()
	if trained {
		w.stop.wait(stopCallWait)
	}
	// Run of each part returns when the context ends; Close then releases
	// it. The recorder goes last so that it takes the marker source's last
	// records.
	w.cancel()
	w.wg.Wait()
	var errs []error
	if src != nil {
		errs = append(errs, src.Close())
	}
	if tw != nil {
		tw.Finish() // destroyed: the rank ran its last step
		errs = append(errs, tw.Close())
	}
	if ager != nil {
		errs = append(errs, ager.Close())
	}
	errs = append(errs, w.rec.Close())
	return errors.Join(errs...)
}
