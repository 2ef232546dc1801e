package trace

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// kubeletUpdate does what the kubelet's atomic writer does to a ConfigMap
// volume: write the new content into a fresh timestamped folder, point a
// "..data_tmp" symlink at it, rename that over "..data", create the key's
// symlink into ..data the first time, and remove the old folder.
func kubeletUpdate(t *testing.T, dir, key, content string, seq int) {
	t.Helper()
	ts := fmt.Sprintf("..2026_11_23_08_00_%02d.%09d", seq%60, seq)
	if err := os.MkdirAll(filepath.Join(dir, ts), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, ts, key), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	old, _ := os.Readlink(filepath.Join(dir, "..data"))
	if err := os.Symlink(ts, filepath.Join(dir, "..data_tmp")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(filepath.Join(dir, key)); errors.Is(err, os.ErrNotExist) {
		if err := os.Symlink(filepath.Join("..data", key), filepath.Join(dir, key)); err != nil {
			t.Fatal(err)
		}
	}
	if old != "" {
		os.RemoveAll(filepath.Join(dir, old))
	}
}

// startWatcher runs a watcher whose changes arrive on the returned channel.
func startWatcher(t *testing.T, cfg SwitchWatcherConfig) (*SwitchWatcher, <-chan Switch) {
	t.Helper()
	ch := make(chan Switch, 16)
	cfg.OnChange = func(s Switch) { ch <- s }
	w, err := NewSwitchWatcher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
		w.Close()
	})
	return w, ch
}

func nextSwitch(t *testing.T, ch <-chan Switch, want Switch, since time.Time) {
	t.Helper()
	select {
	case got := <-ch:
		if got != want {
			t.Fatalf("switch %v, want %v", got, want)
		}
		t.Logf("switch %v in force after %v", got, time.Since(since).Round(time.Millisecond))
	case <-time.After(20 * time.Second):
		t.Fatalf("switch %v never arrived", want)
	}
}

func TestSwitchWatcherKubeletSwap(t *testing.T) {
	for _, mode := range []string{"inotify", "polling"} {
		t.Run(mode, func(t *testing.T) {
			mount := filepath.Join(t.TempDir(), "datatrace-config")
			reg := prometheus.NewPedanticRegistry()
			cfg := SwitchWatcherConfig{Path: filepath.Join(mount, "profilingSwitch"), Registerer: reg, noNotify: mode == "polling"}
			w, ch := startWatcher(t, cfg)
			nextSwitch(t, ch, Switch{}, time.Now()) // missing: all off

			// The volume appears, then is updated twice.
			start := time.Now()
			kubeletUpdate(t, mount, "profilingSwitch", AllOn().String(), 1)
			nextSwitch(t, ch, AllOn(), start)
			commOnly := Switch{CommunicationOperator: true}
			start = time.Now()
			kubeletUpdate(t, mount, "profilingSwitch", commOnly.String(), 2)
			nextSwitch(t, ch, commOnly, start)

			// A bad document is reported and changes nothing.
			kubeletUpdate(t, mount, "profilingSwitch", `{"Step":"maybe"}`, 3)
			testkit.WaitFor(t, "the bad document to be reported", func() bool { return w.Err() != nil })
			if err := w.Err(); !errors.Is(err, ErrSwitch) || !strings.Contains(err.Error(), "field Step") {
				t.Fatalf("Err() = %v", err)
			}
			if got := w.Switch(); got != commOnly {
				t.Fatalf("switch %v after a bad document, want %v kept", got, commOnly)
			}
			start = time.Now()
			kubeletUpdate(t, mount, "profilingSwitch", Switch{Step: true}.String(), 4)
			nextSwitch(t, ch, Switch{Step: true}, start)
			if err := w.Err(); err != nil {
				t.Fatalf("Err() = %v after a good document", err)
			}
			// Removing the key (the ConfigMap lost it) means all off.
			os.Remove(filepath.Join(mount, "profilingSwitch"))
			nextSwitch(t, ch, Switch{}, time.Now())
			select {
			case s := <-ch:
				t.Fatalf("unexpected change to %v", s)
			default:
			}
			want := []string{
				`faultline_trace_switch_loads_total{result="error"} 1`,
				`faultline_trace_switch_loads_total{result="missing"} 2`,
				`faultline_trace_switch_loads_total{result="ok"} 3`,
			}
			if diff := cmp.Diff(want, gatherLines(t, reg, "faultline_trace_switch_loads_total")); diff != "" {
				t.Errorf("metrics (-want +got):\n%s", diff)
			}
		})
	}
}

func TestSwitchWatcherPlainFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "profilingSwitch")
	os.WriteFile(path, []byte(`{"FP":"on"}`), 0o644)
	w, ch := startWatcher(t, SwitchWatcherConfig{Path: path})
	nextSwitch(t, ch, Switch{FP: true}, time.Now())
	// Edited in place, as a person with an editor or echo would.
	start := time.Now()
	os.WriteFile(path, []byte(`{"FP":"on","DataLoader":"on"}`), 0o644)
	nextSwitch(t, ch, Switch{FP: true, DataLoader: true}, start)
	// Rewritten with the same content: no change reported.
	os.WriteFile(path, []byte(`{"FP":"on","DataLoader":"on"}`), 0o644)
	os.WriteFile(path, []byte(`{"DataLoader":"on","FP":"on"}`), 0o644)
	os.WriteFile(path, []byte(`{"FP":"off"}`), 0o644)
	nextSwitch(t, ch, Switch{}, start)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestSwitchWatcherBadFirstDocumentIsAllOff(t *testing.T) {
	path := filepath.Join(t.TempDir(), "profilingSwitch")
	os.WriteFile(path, []byte(`{"Step":"on",}`), 0o644)
	w, ch := startWatcher(t, SwitchWatcherConfig{Path: path})
	nextSwitch(t, ch, Switch{}, time.Now())
	if err := w.Err(); !errors.Is(err, ErrSwitch) || !strings.Contains(err.Error(), path) {
		t.Fatalf("Err() = %v", err)
	}
}

// TestSwitchWatcherRefusesFIFO puts a FIFO where the switch file should
// be: opening it for reading would block until a writer came, so the
// watcher would never stop. It is refused instead, as all off.
func TestSwitchWatcherRefusesFIFO(t *testing.T) {
	path := filepath.Join(t.TempDir(), "profilingSwitch")
	if err := unix.Mkfifo(path, 0o644); err != nil {
		t.Fatal(err)
	}
	w, ch := startWatcher(t, SwitchWatcherConfig{Path: path})
	nextSwitch(t, ch, Switch{}, time.Now())
	if err := w.Err(); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Fatalf("Err() = %v, want a refusal of the FIFO", err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestSwitchWatcherDrivesRecorder(t *testing.T) {
	path := filepath.Join(t.TempDir(), "profilingSwitch")
	rec := newTestRecorder(t, RecorderConfig{})
	applied := make(chan Switch, 4)
	w, err := NewSwitchWatcher(SwitchWatcherConfig{Path: path, OnChange: func(s Switch) {
		rec.SetSwitch(s)
		applied <- s
	}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error)
	go func() { done <- w.Run(ctx) }()
	<-applied
	os.WriteFile(path, []byte(`{"Step":"on"}`), 0o644)
	nextSwitch(t, applied, Switch{Step: true}, time.Now())
	if !rec.Enabled(Step) || rec.Enabled(FP) {
		t.Fatalf("recorder switch %v", rec.Switch())
	}
	w.Close()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestSwitchWatcherConfig(t *testing.T) {
	if _, err := NewSwitchWatcher(SwitchWatcherConfig{PollInterval: -time.Second}); err == nil {
		t.Fatal("negative PollInterval accepted")
	}
	w, err := NewSwitchWatcher(SwitchWatcherConfig{})
	if err != nil || w.cfg.Path != DefaultSwitchPath || w.cfg.PollInterval != time.Second {
		t.Fatalf("defaults: %+v, %v", w.cfg, err)
	}
}
