package ckpt

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

func TestMetricsAndSpans(t *testing.T) {
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	defer tp.Shutdown(ctx)

	o, err := NewOwner(OwnerConfig{ShmDir: shmDir(t), Shards: []int{0}, Capacity: 1 << 20, Dir: t.TempDir(),
		Registerer: reg, TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Remove()
	w, err := NewWriter(WriterConfig{Path: o.SegmentPath(0), Registerer: reg, TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if err := w.Save(ctx, 1, blobs(1)...); err != nil {
		t.Fatal(err)
	}
	if _, err := o.Persist(ctx, 0); err != nil {
		t.Fatal(err)
	}
	seg := o.segs[0]
	i := seg.newest()[0]
	m, _ := seg.metaOK(i)
	flipBit(t, seg.path, seg.halfBase(i)+m.Blobs[0].Offset)
	if _, rep, err := o.Load(ctx, 0); err != nil || rep.Tier != TierDisk {
		t.Fatalf("Load = %s, %v", rep, err)
	}

	got := map[string]float64{}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			name := mf.GetName()
			for _, l := range m.GetLabel() {
				name += "{" + l.GetValue() + "}"
			}
			switch {
			case m.Counter != nil:
				got[name] = m.Counter.GetValue()
			case m.Histogram != nil:
				got[name] = float64(m.Histogram.GetSampleCount())
			}
		}
	}
	for name, want := range map[string]float64{
		"faultline_ckpt_save_blocking_seconds": 1,
		"faultline_ckpt_seal_seconds":          1,
		"faultline_ckpt_save_bytes_total":      float64(len(blobs(1)[0].Data) + len(blobs(1)[1].Data)),
		"faultline_ckpt_persist_seconds":       1,
		"faultline_ckpt_persist_bytes_total":   float64(len(blobs(1)[0].Data) + len(blobs(1)[1].Data)),
		"faultline_ckpt_commits_total":         1,
		"faultline_ckpt_crc_failures_total":    1,
		"faultline_ckpt_loads_total{disk}":     1,
	} {
		if got[name] != want {
			t.Errorf("%s = %v, want %v (all: %v)", name, got[name], want, got)
		}
	}
	var names []string
	for _, s := range spans.Ended() {
		names = append(names, s.Name())
	}
	for _, want := range []string{"ckpt.Save", "ckpt.Seal", "ckpt.Persist", "ckpt.Load"} {
		if !slices.Contains(names, want) {
			t.Errorf("spans %v lack %s", names, want)
		}
	}
}

// TestMetricsCollide shows both halves of the registration contract: a
// second Owner or Writer on one Registerer is an error of its constructor
// that names the config field and the metric, and Close unregisters, so
// that one built again registers afresh.
func TestMetricsCollide(t *testing.T) {
	reg := prometheus.NewRegistry()
	shm := shmDir(t)
	o, err := NewOwner(OwnerConfig{ShmDir: shm, Shards: []int{0, 1}, Capacity: 1 << 20, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Remove()
	_, err = NewOwner(OwnerConfig{ShmDir: shm, Name: "other", Shards: []int{0}, Capacity: 1 << 20, Registerer: reg})
	if err == nil || !strings.Contains(err.Error(), "OwnerConfig.Registerer") || !strings.Contains(err.Error(), "faultline_ckpt_") {
		t.Fatalf("a second Owner on one Registerer: %v, want an error naming OwnerConfig.Registerer and the metric", err)
	}
	if _, err := os.Stat(SegmentPath(shm, "other", 0)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the refused Owner left its segment: %v", err)
	}

	shardReg := func(s string) prometheus.Registerer {
		return prometheus.WrapRegistererWith(prometheus.Labels{"shard": s}, reg)
	}
	w0, err := NewWriter(WriterConfig{Path: o.SegmentPath(0), Registerer: shardReg("0")})
	if err != nil {
		t.Fatal(err)
	}
	// A second writer with the same labels collides, with an error, not a
	// panic.
	if _, err := NewWriter(WriterConfig{Path: o.SegmentPath(1), Registerer: shardReg("0")}); err == nil || !strings.Contains(err.Error(), "WriterConfig.Registerer") {
		t.Fatalf("a second Writer on one Registerer: %v, want an error naming WriterConfig.Registerer", err)
	}
	// Labelled apart, it does not.
	w1, err := NewWriter(WriterConfig{Path: o.SegmentPath(1), Registerer: shardReg("1")})
	if err != nil {
		t.Fatal(err)
	}
	defer w1.Close()
	// Close unregisters, so a writer opened again registers afresh.
	w0.Close()
	w0, err = NewWriter(WriterConfig{Path: o.SegmentPath(0), Registerer: shardReg("0")})
	if err != nil {
		t.Fatal(err)
	}
	w0.Close()
	// Closing the owner unregisters its collectors: another takes them.
	o.Close()
	o3, err := NewOwner(OwnerConfig{ShmDir: shm, Shards: []int{0, 1}, Capacity: 1 << 20, Registerer: reg})
	if err != nil {
		t.Fatalf("an Owner after the first one closed: %v", err)
	}
	o3.Close()
}
