// Package promreg registers a component's Prometheus collectors so that
// they can be unregistered together when it closes, and turns a failed
// registration into an error its constructor returns instead of a panic.
//
// A component builds its metrics with promauto.With(r), where r is a
// Registrar on the Registerer its config names, checks r.Err, and calls
// r.UnregisterAll in Close, so that it can be built again on the same
// registry:
//
//	r := promreg.New(cfg.Registerer, "taskd: ManagerConfig.Registerer")
//	sent := promauto.With(r).NewCounter(prometheus.CounterOpts{Name: "faultline_taskd_sent_total"})
//	if err := r.Err(); err != nil {
//		return nil, err
//	}
package promreg
