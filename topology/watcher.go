package topology

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/faultline-ml/faultline/internal/promreg"
)

// WatcherConfig configures a Watcher. The zero value of every field but
// Path is a documented default.
type WatcherConfig struct {
	// Path is the node-topology-config file, for example the topology_config
	// key of the node-topology-config ConfigMap where it is mounted.
	// Required.
	Path string
	// PollInterval is how often the file is re-read whatever inotify says:
	// a safety net, and the only mechanism when inotify is off or fails.
	// Default 10 s.
	PollInterval time.Duration
	// DisableInotify turns inotify off, for file systems that do not report
	// changes (some network and FUSE mounts); polling alone remains.
	DisableInotify bool
	// OnChange, if set, is called on Run's goroutine with the topology in
	// force when Run starts, if any, and with each new one after. It must
	// not block for long, nor call Close.
	OnChange func(*Topology)
	// Logger receives reload failures; nil discards them.
	Logger *slog.Logger
	// Registerer receives the watcher's metrics; nil means none.
	Registerer prometheus.Registerer
}

// Validate reports a field that cannot work.
func (c WatcherConfig) Validate() error {
	if c.Path == "" {
		return errors.New("topology: WatcherConfig.Path is required")
	}
	if c.PollInterval < 0 {
		return fmt.Errorf("topology: WatcherConfig.PollInterval = %v: must not be negative", c.PollInterval)
	}
	return nil
}

// settle is how long the watcher waits after a file event before it reads:
// one ConfigMap update is a burst of events, and a writer that is not atomic
// needs a moment to finish.
const settle = 50 * time.Millisecond

// Watcher keeps the node-topology-config at a path loaded while it changes.
// It watches the file's directory with inotify, so that the atomic swap of
// the "..data" symlink that Kubernetes uses to update a mounted ConfigMap is
// seen as well as a plain rewrite or rename, and it also polls. A file that
// fails to parse is logged and counted, and the last good topology stays in
// force.
type Watcher struct {
	cfg     WatcherConfig
	log     *slog.Logger
	cur     atomic.Pointer[Topology]
	seen    []byte // content last read, good or bad; used by Run's goroutine only
	lastErr string // last read or parse error logged, to log each once
	reg     *promreg.Registrar
	reloads *prometheus.CounterVec
	nodes   prometheus.Gauge

	running   atomic.Bool
	closeOnce sync.Once
	closed    chan struct{}
	done      chan struct{} // closed when Run returns
}

// NewWatcher returns a watcher for cfg.Path and reads the file once, so that
// Topology answers at once when the file is good. A file that is missing or
// bad is not an error here: Run keeps trying. The watcher's metrics are
// registered on cfg.Registerer until Close.
func NewWatcher(cfg WatcherConfig) (*Watcher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.PollInterval = cmp.Or(cfg.PollInterval, 10*time.Second)
	log := cmp.Or(cfg.Logger, slog.New(slog.DiscardHandler))
	r := promreg.New(cfg.Registerer, "topology: WatcherConfig.Registerer")
	f := promauto.With(r)
	w := &Watcher{
		cfg: cfg,
		log: log.With("path", cfg.Path),
		reg: r,
		reloads: f.NewCounterVec(prometheus.CounterOpts{
			Name: "faultline_topology_reloads_total",
			Help: "Reads of the node-topology-config that found new content, by result (ok, error).",
		}, []string{"result"}),
		nodes: f.NewGauge(prometheus.GaugeOpts{
			Name: "faultline_topology_nodes",
			Help: "Nodes in the node-topology-config in force.",
		}),
		closed: make(chan struct{}),
		done:   make(chan struct{}),
	}
	if err := r.Err(); err != nil {
		return nil, err
	}
	w.reload()
	return w, nil
}

// Topology returns the topology in force: the last content of the file that
// parsed, or nil if none has yet.
func (w *Watcher) Topology() *Topology { return w.cur.Load() }

// Run watches the file until ctx ends (it returns ctx.Err()) or Close is
// called (it returns nil). It may be called once.
func (w *Watcher) Run(ctx context.Context) error {
	if !w.running.CompareAndSwap(false, true) {
		return errors.New("topology: Watcher.Run called twice")
	}
	defer close(w.done)
	select {
	case <-w.closed:
		return nil
	default:
	}

	var events <-chan fsnotify.Event
	var errs <-chan error
	if !w.cfg.DisableInotify {
		fsw, err := fsnotify.NewWatcher()
		if err == nil {
			// The directory, not the file: the file is a symlink whose
			// target is swapped, and editors replace files by rename.
			err = fsw.Add(filepath.Dir(w.cfg.Path))
			if err != nil {
				fsw.Close()
			}
		}
		if err != nil {
			w.log.Warn("topology: inotify unavailable, polling only", "interval", w.cfg.PollInterval, "err", err)
		} else {
			defer fsw.Close()
			events, errs = fsw.Events, fsw.Errors
		}
	}
	if t := w.cur.Load(); t != nil && w.cfg.OnChange != nil {
		w.cfg.OnChange(t)
	}
	w.reload() // whatever changed before the watch began

	poll := time.NewTicker(w.cfg.PollInterval)
	defer poll.Stop()
	wait := time.NewTimer(settle)
	wait.Stop()
	defer wait.Stop()
	base := filepath.Base(w.cfg.Path)
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-w.closed:
			return nil
		case ev := <-events:
			if name := filepath.Base(ev.Name); name == base || strings.HasPrefix(name, "..") {
				wait.Reset(settle)
			}
		case err := <-errs:
			w.log.Warn("topology: inotify", "err", err)
		case <-wait.C:
			w.reload()
		case <-poll.C:
			w.reload()
		}
	}
}

// reload reads the file and, if its content is new and parses, puts it in
// force and calls OnChange (but not before Run).
func (w *Watcher) reload() {
	data, err := readConfig(w.cfg.Path)
	if err != nil {
		w.fail(err)
		return
	}
	if w.seen != nil && bytes.Equal(data, w.seen) {
		return
	}
	w.seen = data
	t, err := parseConfig(w.cfg.Path, data)
	if err != nil {
		w.fail(err)
		return
	}
	w.lastErr = ""
	w.reloads.WithLabelValues("ok").Inc()
	w.nodes.Set(float64(t.Len()))
	w.cur.Store(t)
	w.log.Info("topology: loaded", "nodes", t.Len())
	if w.running.Load() && w.cfg.OnChange != nil {
		w.cfg.OnChange(t)
	}
}

func (w *Watcher) fail(err error) {
	if msg := err.Error(); msg != w.lastErr {
		w.lastErr = msg
		w.reloads.WithLabelValues("error").Inc()
		w.log.Error("topology: keeping the last good topology", "err", err)
	}
}

// Close stops Run, waits for it to return and unregisters the watcher's
// metrics, so that another watcher may use the Registerer. It is safe to
// call more than once.
func (w *Watcher) Close() error {
	w.closeOnce.Do(func() { close(w.closed) })
	if w.running.Load() {
		<-w.done
	}
	w.reg.UnregisterAll()
	return nil
}
