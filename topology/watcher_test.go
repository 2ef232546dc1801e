package topology

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// configMapDir lays out a directory the way the kubelet mounts a
// ConfigMap: the key is a symlink through "..data", itself a symlink to a
// timestamped directory that an update replaces by an atomic rename.
type configMapDir struct {
	t   *testing.T
	dir string
	gen int
}

func newConfigMapDir(t *testing.T, content string) *configMapDir {
	c := &configMapDir{t: t, dir: t.TempDir()}
	c.update(content)
	if err := os.Symlink(filepath.Join("..data", "topology_config"), c.path()); err != nil {
		t.Fatal(err)
	}
	return c
}

func (c *configMapDir) path() string { return filepath.Join(c.dir, "topology_config") }

// update swaps in new content as the kubelet does.
func (c *configMapDir) update(content string) {
	c.gen++
	ts := fmt.Sprintf("..2024_01_01_00_00_%02d.%d", c.gen, c.gen)
	if err := os.Mkdir(filepath.Join(c.dir, ts), 0o755); err != nil {
		c.t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(c.dir, ts, "topology_config"), []byte(content), 0o644); err != nil {
		c.t.Fatal(err)
	}
	tmp := filepath.Join(c.dir, "..data_tmp")
	if err := os.Symlink(ts, tmp); err != nil {
		c.t.Fatal(err)
	}
	old, _ := os.Readlink(filepath.Join(c.dir, "..data"))
	if err := os.Rename(tmp, filepath.Join(c.dir, "..data")); err != nil {
		c.t.Fatal(err)
	}
	if old != "" {
		os.RemoveAll(filepath.Join(c.dir, old))
	}
}

// startWatcher runs a watcher on path and returns a channel of the
// topologies it reports.
func startWatcher(t *testing.T, cfg WatcherConfig) (*Watcher, <-chan *Topology) {
	t.Helper()
	changes := make(chan *Topology, 16)
	cfg.OnChange = func(topo *Topology) { changes <- topo }
	w, err := NewWatcher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-errc; err != context.Canceled {
			t.Errorf("Run = %v, want context.Canceled", err)
		}
		w.Close()
	})
	return w, changes
}

func next(t *testing.T, changes <-chan *Topology) *Topology {
	t.Helper()
	select {
	case topo := <-changes:
		return topo
	case <-time.After(20 * time.Second):
		t.Fatal("no change reported within 20 s")
		return nil
	}
}

func TestWatcherConfigMapSwap(t *testing.T) {
	cm := newConfigMapDir(t, "a p 10.0.0.1\n")
	reg := prometheus.NewRegistry()
	errs := make(errorRecords, 16)
	// A long poll interval: only inotify can see the changes in time.
	w, changes := startWatcher(t, WatcherConfig{Path: cm.path(), PollInterval: time.Hour, Registerer: reg, Logger: slog.New(errs)})
	if got := next(t, changes); got.Len() != 1 {
		t.Fatalf("first topology has %d nodes", got.Len())
	}
	cm.update("a p 10.0.0.1\nb p 10.0.0.2\n")
	if got := next(t, changes); got.Len() != 2 || w.Topology() != got {
		t.Fatalf("after the swap: %d nodes", got.Len())
	}

	// A bad update is logged and counted, and the last good one stays.
	cm.update("a p 10.0.0.1\nb p not-an-ip\n")
	select {
	case r := <-errs:
		if !strings.Contains(r.Message, "keeping the last good topology") {
			t.Fatalf("logged %q", r.Message)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("a bad update was not logged within 20 s")
	}
	if got := metric(t, reg, "faultline_topology_reloads_total", "error"); got != 1 {
		t.Fatalf("faultline_topology_reloads_total{result=error} = %v, want 1", got)
	}
	if w.Topology().Len() != 2 {
		t.Fatalf("a bad file replaced the topology")
	}
	cm.update("c q 10.0.0.3\n")
	if got := next(t, changes); got.Len() != 1 {
		t.Fatalf("after recovery: %d nodes", got.Len())
	}
	if got := metric(t, reg, "faultline_topology_reloads_total", "ok"); got != 3 {
		t.Fatalf("faultline_topology_reloads_total{result=ok} = %v, want 3", got)
	}
	if got := metric(t, reg, "faultline_topology_nodes", ""); got != 1 {
		t.Fatalf("faultline_topology_nodes = %v", got)
	}
}

// TestWatcherPollingAndLateFile runs in a bubble: each poll happens when
// the test lets time pass, so that what it reads is exact.
func TestWatcherPollingAndLateFile(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const poll = 10 * time.Second
		path := filepath.Join(t.TempDir(), "topology_config")
		w, changes := startWatcher(t, WatcherConfig{Path: path, PollInterval: poll, DisableInotify: true})
		time.Sleep(poll)
		synctest.Wait()
		if w.Topology() != nil || len(changes) != 0 {
			t.Fatal("a topology before the file exists")
		}
		// Written in place, not atomically: a poll may see half of it,
		// and the next one settles on the whole.
		f, err := os.Create(path)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		for want, line := range []string{"a p 10.0.0.1\n", "a p 10.0.0.2\n"} {
			if _, err := f.WriteString(line); err != nil {
				t.Fatal(err)
			}
			time.Sleep(poll)
			synctest.Wait()
			if got := next(t, changes); got.Len() != want+1 || w.Topology() != got {
				t.Fatalf("after %d lines: %d nodes", want+1, got.Len())
			}
		}
		time.Sleep(poll)
		synctest.Wait()
		if len(changes) != 0 {
			t.Fatal("a change reported for content already in force")
		}
	})
}

func TestWatcherPlainFileRename(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "topology_config")
	if err := os.WriteFile(path, []byte("a p 10.0.0.1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	w, changes := startWatcher(t, WatcherConfig{Path: path, PollInterval: time.Hour})
	if w.Topology() == nil {
		t.Fatal("NewWatcher did not load the file")
	}
	next(t, changes)
	tmp := filepath.Join(dir, ".new")
	if err := os.WriteFile(tmp, []byte("a p 10.0.0.1\nb p 10.0.0.9\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
	if got := next(t, changes); got.Len() != 2 {
		t.Fatalf("%d nodes after rename", got.Len())
	}
}

func TestWatcherCloseAndValidate(t *testing.T) {
	if _, err := NewWatcher(WatcherConfig{}); err == nil || !strings.Contains(err.Error(), "Path") {
		t.Fatalf("empty config: err = %v", err)
	}
	if _, err := NewWatcher(WatcherConfig{Path: "x", PollInterval: -1}); err == nil || !strings.Contains(err.Error(), "PollInterval") {
		t.Fatalf("negative interval: err = %v", err)
	}
	w, err := NewWatcher(WatcherConfig{Path: filepath.Join(t.TempDir(), "none")})
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { errc <- w.Run(context.Background()) }()
	w.Close()
	w.Close()
	// Run either saw Close or had not started; both end with nil.
	if err := <-errc; err != nil {
		t.Fatalf("Run after Close = %v", err)
	}
	if err := w.Run(context.Background()); err == nil {
		t.Fatal("second Run succeeded")
	}
}

// errorRecords is a slog.Handler that passes on the records at error
// level.
type errorRecords chan slog.Record

func (c errorRecords) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelError }
func (c errorRecords) Handle(_ context.Context, r slog.Record) error {
	c <- r
	return nil
}
func (c errorRecords) WithAttrs([]slog.Attr) slog.Handler { return c }
func (c errorRecords) WithGroup(string) slog.Handler      { return c }

// metric returns the value of the series of name whose single label has
// value label ("" for an unlabelled metric), or -1 if there is none.
func metric(t *testing.T, reg *prometheus.Registry, name, label string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if l := m.GetLabel(); (len(l) == 0 && label == "") || (len(l) == 1 && l[0].GetValue() == label) {
				if m.Counter != nil {
					return m.GetCounter().GetValue()
				}
				return m.GetGauge().GetValue()
			}
		}
	}
	return -1
}

// TestWatcherSharedRegisterer: a second watcher on a Registerer that one
// already uses gets an error naming the field, not a panic; once the
// first is closed, its metrics are gone and a new one registers.
func TestWatcherSharedRegisterer(t *testing.T) {
	path := filepath.Join(t.TempDir(), "none")
	testkit.SharedRegisterer(t, "topology: WatcherConfig.Registerer", "faultline_topology_", func(reg prometheus.Registerer) (func() error, error) {
		w, err := NewWatcher(WatcherConfig{Path: path, Registerer: reg})
		if err != nil {
			return nil, err
		}
		return w.Close, nil
	})
}
