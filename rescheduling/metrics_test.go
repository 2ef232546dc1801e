package rescheduling

import (
	"errors"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// TestSharedRegisterer: a second policy or watchdog on a Registerer that
// one already uses gets an error naming the field, not a panic; once the
// first is closed, its metrics are gone and a new one registers.
func TestSharedRegisterer(t *testing.T) {
	for _, tc := range []struct {
		name  string
		field string
		open  func(prometheus.Registerer) (func() error, error)
	}{
		{"Policy", "rescheduling: Config.Registerer", func(reg prometheus.Registerer) (func() error, error) {
			p, err := NewPolicy(Config{Registerer: reg})
			if err != nil {
				return nil, err
			}
			return p.Close, nil
		}},
		{"Watchdog", "rescheduling: WatchdogConfig.Registerer", func(reg prometheus.Registerer) (func() error, error) {
			p, err := NewPolicy(Config{})
			if err != nil {
				return nil, err
			}
			w, err := NewWatchdog(WatchdogConfig{Policy: p, Executor: &recorder{}, Faults: make(chan Fault), Registerer: reg})
			if err != nil {
				return nil, err
			}
			return w.Close, nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg := prometheus.NewRegistry()
			closeFirst, err := tc.open(reg)
			if err != nil {
				t.Fatal(err)
			}
			_, err = tc.open(reg)
			var are prometheus.AlreadyRegisteredError
			if !errors.As(err, &are) || !strings.HasPrefix(err.Error(), tc.field+": register faultline_rescheduling_") {
				t.Fatalf("second on one Registerer: err = %v", err)
			}
			if err := closeFirst(); err != nil {
				t.Fatal(err)
			}
			if mfs, _ := reg.Gather(); len(mfs) != 0 {
				t.Fatalf("%d metric families left after Close", len(mfs))
			}
			closeAgain, err := tc.open(reg)
			if err != nil {
				t.Fatalf("after Close: %v", err)
			}
			closeAgain()
			closeAgain() // idempotent
		})
	}
}
