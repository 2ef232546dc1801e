package promreg_test

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"

	"github.com/faultline-ml/faultline/internal/promreg"
)

// A component registers through a Registrar, returns its error, and
// unregisters in Close.
func Example() {
	reg := prometheus.NewRegistry()
	open := func() (*promreg.Registrar, error) {
		r := promreg.New(reg, "pkg: Config.Registerer")
		promauto.With(r).NewCounter(prometheus.CounterOpts{Name: "faultline_pkg_events_total", Help: "Events."})
		return r, r.Err()
	}
	first, _ := open()
	_, err := open()
	fmt.Println(err)
	first.UnregisterAll() // in Close
	_, err = open()
	fmt.Println(err)
	// Output:
	// pkg: Config.Registerer: register faultline_pkg_events_total: duplicate metrics collector registration attempted
	// <nil>
}
