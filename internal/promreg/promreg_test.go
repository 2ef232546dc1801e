package promreg_test

import (
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/faultline-ml/faultline/internal/promreg"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func build(reg prometheus.Registerer) (*promreg.Registrar, error) {
	r := promreg.New(reg, "pkg: Config.Registerer")
	promauto.With(r).NewCounter(prometheus.CounterOpts{Name: "faultline_test_a_total", Help: "a"})
	promauto.With(r).NewGauge(prometheus.GaugeOpts{Name: "faultline_test_b", Help: "b"})
	return r, r.Err()
}

func TestRegisterTwiceThenAgainAfterUnregister(t *testing.T) {
	reg := prometheus.NewRegistry()
	first, err := build(reg)
	if err != nil {
		t.Fatal(err)
	}
	_, err = build(reg)
	var are prometheus.AlreadyRegisteredError
	if !errors.As(err, &are) || !strings.Contains(err.Error(), "pkg: Config.Registerer: register faultline_test_a_total") {
		t.Fatalf("second build: %v", err)
	}
	// The failed build left nothing registered, and the first one's
	// metrics are still there.
	if mfs, _ := reg.Gather(); len(mfs) != 2 {
		t.Fatalf("%d metric families after a failed build, want 2", len(mfs))
	}
	first.UnregisterAll()
	first.UnregisterAll()
	if mfs, _ := reg.Gather(); len(mfs) != 0 {
		t.Fatalf("%d metric families after UnregisterAll, want 0", len(mfs))
	}
	if _, err := build(reg); err != nil {
		t.Fatalf("build after UnregisterAll: %v", err)
	}
}

func TestNilRegistererRegistersNothing(t *testing.T) {
	r, err := build(nil)
	if err != nil {
		t.Fatal(err)
	}
	r.UnregisterAll()
}

func TestUnregisterAllConcurrently(t *testing.T) {
	reg := prometheus.NewRegistry()
	r, err := build(reg)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(r.UnregisterAll)
	}
	wg.Wait()
	if _, err := build(reg); err != nil {
		t.Fatalf("build after concurrent UnregisterAll: %v", err)
	}
}
