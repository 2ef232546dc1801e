package rescheduling

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/faultline-ml/faultline/internal/testkit"
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
			testkit.SharedRegisterer(t, tc.field, "faultline_rescheduling_", tc.open)
		})
	}
}
