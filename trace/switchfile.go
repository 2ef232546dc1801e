package trace

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/internal/promreg"
)

// DefaultPollInterval is how often a SwitchWatcher re-reads the file when
// it cannot watch the folder.
const DefaultPollInterval = time.Second

// maxSwitchBytes bounds the switch document a watcher reads.
const maxSwitchBytes = 64 << 10

// SwitchWatcherConfig configures a SwitchWatcher.
type SwitchWatcherConfig struct {
	Path string // default DefaultSwitchPath
	// PollInterval is how often the file is re-read while its folder cannot
	// be watched (it does not exist, inotify is unavailable); while watched,
	// it is still re-read every 10 PollIntervals in case an event was lost.
	// Default 1 s.
	PollInterval time.Duration
	// OnChange receives the switch when Run starts and whenever it changes;
	// Recorder.SetSwitch fits. Calls come from Run's goroutine, in order.
	OnChange   func(Switch)
	Registerer prometheus.Registerer // nil: no metrics
	Logger     *slog.Logger          // nil: discard

	noNotify bool // tests: poll only
}

// Validate reports the first field that cannot be used.
func (c SwitchWatcherConfig) Validate() error {
	if c.PollInterval < 0 {
		return fmt.Errorf("trace: SwitchWatcherConfig.PollInterval: %v is negative", c.PollInterval)
	}
	return nil
}

// SwitchWatcher keeps a switch in step with a file, typically the
// profilingSwitch key of a ConfigMap mounted into the pod. It watches the
// file's folder with inotify, so that it sees the kubelet's update (a new
// timestamped folder, a "..data_tmp" symlink to it renamed over "..data")
// as well as an in-place edit, and falls back to polling. A missing file
// means all off until it appears. A document that fails ParseSwitch is
// reported (Err, log, metric) and the last good switch stays in force.
type SwitchWatcher struct {
	cfg     SwitchWatcherConfig
	loads   *prometheus.CounterVec
	metrics *promreg.Registrar
	closing chan struct{}
	once    sync.Once
	running sync.Mutex

	mu      sync.Mutex
	cur     Switch
	lastErr error
	last    []byte // content last read; nil when missing
	loaded  bool
}

// NewSwitchWatcher returns a watcher; Run does the watching.
func NewSwitchWatcher(cfg SwitchWatcherConfig) (*SwitchWatcher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Path = cmp.Or(cfg.Path, DefaultSwitchPath)
	cfg.PollInterval = cmp.Or(cfg.PollInterval, DefaultPollInterval)
	cfg.Logger = cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	w := &SwitchWatcher{cfg: cfg, closing: make(chan struct{})}
	w.metrics = promreg.New(cfg.Registerer, "trace: SwitchWatcherConfig.Registerer")
	w.loads = promauto.With(w.metrics).NewCounterVec(prometheus.CounterOpts{
		Name: "faultline_trace_switch_loads_total",
		Help: "Reads of the profiling switch file that changed something, by result (ok, missing, error).",
	}, []string{"result"})
	if err := w.metrics.Err(); err != nil {
		return nil, err
	}
	return w, nil
}

// Switch returns the switch in force.
func (w *SwitchWatcher) Switch() Switch {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.cur
}

// Err returns why the file's current content is not in force, or nil.
func (w *SwitchWatcher) Err() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.lastErr
}

// Run watches until ctx is done or Close is called, and returns nil then.
func (w *SwitchWatcher) Run(ctx context.Context) error {
	if !w.running.TryLock() {
		return errors.New("trace: SwitchWatcher.Run called twice")
	}
	defer w.running.Unlock()
	dir := filepath.Dir(w.cfg.Path)
	var fsw *fsnotify.Watcher
	if !w.cfg.noNotify {
		var err error
		if fsw, err = fsnotify.NewWatcher(); err != nil {
			w.cfg.Logger.Warn("trace: switch file: inotify unavailable, polling", "path", w.cfg.Path, "err", err)
			fsw = nil
		} else {
			defer fsw.Close()
		}
	}
	watching := false
	var events chan fsnotify.Event
	var errs chan error
	if fsw != nil {
		events, errs = fsw.Events, fsw.Errors
	}
	w.load()
	ticker := time.NewTicker(w.cfg.PollInterval)
	defer ticker.Stop()
	ticks := 0
	for {
		if fsw != nil && !watching {
			if err := fsw.Add(dir); err == nil {
				watching = true
				w.load() // it may have changed before the watch began
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-w.closing:
			return nil
		case ev, ok := <-events:
			if !ok {
				events = nil
				continue
			}
			if ev.Name == dir && ev.Op&(fsnotify.Remove|fsnotify.Rename) != 0 {
				watching = false // the folder went; watch it again when it is back
				fsw.Remove(dir)
			}
			w.load()
		case err, ok := <-errs:
			if !ok {
				errs = nil
				continue
			}
			// Typically an overflow: events were lost, so look again.
			w.cfg.Logger.Warn("trace: switch file watch", "path", w.cfg.Path, "err", err)
			w.load()
		case <-ticker.C:
			ticks++
			if !watching || ticks%10 == 0 {
				w.load()
			}
		}
	}
}

// Close stops Run, waits for it to return and unregisters the metrics. It
// is idempotent.
func (w *SwitchWatcher) Close() error {
	w.once.Do(func() {
		close(w.closing)
		w.metrics.UnregisterAll()
	})
	w.running.Lock() // held by Run until it returns
	w.running.Unlock()
	return nil
}

// load reads the file and applies it if it changed.
func (w *SwitchWatcher) load() {
	data, err := readSwitchFile(w.cfg.Path)
	missing := errors.Is(err, fs.ErrNotExist)
	w.mu.Lock()
	if w.loaded && err == nil && w.last != nil && bytes.Equal(data, w.last) {
		w.mu.Unlock()
		return
	}
	if w.loaded && missing && w.last == nil && w.lastErr == nil {
		w.mu.Unlock()
		return
	}
	var s Switch
	result := "ok"
	switch {
	case missing:
		s, result = Switch{}, "missing"
		w.last, w.lastErr = nil, nil
	case err != nil:
		result = "error"
	default:
		w.last = data
		if s, err = ParseSwitch(data); err != nil {
			result = "error"
			if pe := (*ParseError)(nil); errors.As(err, &pe) {
				pe.File = w.cfg.Path // a fresh error of ParseSwitch's
			}
		}
	}
	if result == "error" {
		sameErr := w.lastErr != nil && w.lastErr.Error() == err.Error()
		w.lastErr = err
		w.mu.Unlock()
		if !sameErr {
			w.cfg.Logger.Warn("trace: switch file rejected, keeping the last good switch", "err", err)
			w.loads.WithLabelValues(result).Inc()
		}
		if !w.loaded {
			w.apply(Switch{}, true) // nothing good yet: all off
		}
		return
	}
	w.lastErr = nil
	w.mu.Unlock()
	w.loads.WithLabelValues(result).Inc()
	w.apply(s, !w.loaded)
}

func (w *SwitchWatcher) apply(s Switch, first bool) {
	w.mu.Lock()
	changed := first || s != w.cur
	w.cur, w.loaded = s, true
	w.mu.Unlock()
	if changed {
		w.cfg.Logger.Info("trace: switch", "path", w.cfg.Path, "switch", s.String())
		if w.cfg.OnChange != nil {
			w.cfg.OnChange(s)
		}
	}
}

// readSwitchFile reads the switch document. The path itself is followed
// (the kubelet makes it a symlink into ..data) but must lead to a regular
// file: a FIFO there would block the watcher for good. The size is
// bounded.
func readSwitchFile(path string) ([]byte, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	f, err := regularFile(fd, path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxSwitchBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	if len(data) > maxSwitchBytes {
		return nil, fmt.Errorf("%s: larger than %d bytes", path, maxSwitchBytes)
	}
	return data, nil
}
