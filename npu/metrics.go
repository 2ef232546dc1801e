//go:build cgo

package npu

import (
	"fmt"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
)

// registrar is the Registerer a source's promauto factory registers
// through: it keeps what it registered on reg, so that Close can
// unregister it and a source can be opened again on the same registry,
// and it keeps the first error instead of panicking, so that the
// constructor can return it. A nil reg registers nothing.
type registrar struct {
	reg   prometheus.Registerer
	field string // the config field reg came from, for errors
	done  []prometheus.Collector
	err   error
}

func newRegistrar(reg prometheus.Registerer, field string) *registrar {
	return &registrar{reg: reg, field: field}
}

// Register registers c on reg.
func (r *registrar) Register(c prometheus.Collector) error {
	if r.reg == nil {
		return nil
	}
	if err := r.reg.Register(c); err != nil {
		return fmt.Errorf("npu: %s: register %s: %w", r.field, metricName(c), err)
	}
	r.done = append(r.done, c)
	return nil
}

// MustRegister registers each of cs, keeping the first error.
func (r *registrar) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil && r.err == nil {
			r.err = err
		}
	}
}

// Unregister unregisters c from reg.
func (r *registrar) Unregister(c prometheus.Collector) bool {
	return r.reg != nil && r.reg.Unregister(c)
}

// check returns the first registration error, having unregistered all
// that was registered; nil when every collector was registered.
func (r *registrar) check() error {
	if r.err != nil {
		r.unregisterAll()
	}
	return r.err
}

// unregisterAll unregisters what was registered. It is idempotent.
func (r *registrar) unregisterAll() {
	for _, c := range r.done {
		r.reg.Unregister(c)
	}
	r.done = nil
}

// metricName returns the name of c's first metric, for errors.
func metricName(c prometheus.Collector) string {
	ch := make(chan *prometheus.Desc, 64)
	go func() { c.Describe(ch); close(ch) }()
	name := fmt.Sprintf("%T", c)
	first := true
	for d := range ch {
		if !first {
			continue // drain
		}
		first = false
		// Desc has no accessor for its name; its String form starts with it.
		if _, rest, ok := strings.Cut(d.String(), `fqName: "`); ok {
			if n, _, ok := strings.Cut(rest, `"`); ok {
				name = n
			}
		}
	}
	return name
}
