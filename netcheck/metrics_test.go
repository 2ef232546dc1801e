package netcheck

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// TestSharedRegisterer: a second checker, agent or switchbox on a
// Registerer that one already uses gets an error naming the field, not a
// panic; once the first is closed, its metrics are gone and a new one
// registers.
func TestSharedRegisterer(t *testing.T) {
	for _, tc := range []struct {
		name  string
		field string
		open  func(prometheus.Registerer) (func() error, error)
	}{
		{"Checker", "netcheck: Config.Registerer", func(reg prometheus.Registerer) (func() error, error) {
			c, err := NewChecker(Config{Registerer: reg})
			if err != nil {
				return nil, err
			}
			return c.Close, nil
		}},
		{"Agent", "netcheck: AgentConfig.Registerer", func(reg prometheus.Registerer) (func() error, error) {
			a, err := NewAgent(AgentConfig{Listen: "127.0.0.1:0", Registerer: reg})
			if err != nil {
				return nil, err
			}
			return a.Close, nil
		}},
		{"Switchbox", "netcheck: SwitchboxConfig.Registerer", func(reg prometheus.Registerer) (func() error, error) {
			s, err := NewSwitchbox(SwitchboxConfig{Prober: &devices{}, Registerer: reg})
			if err != nil {
				return nil, err
			}
			return s.Close, nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			testkit.SharedRegisterer(t, tc.field, "faultline_netcheck_", tc.open)
		})
	}
}
