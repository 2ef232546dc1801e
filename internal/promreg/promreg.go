package promreg

import (
	"fmt"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// Registrar is a prometheus.Registerer that keeps what it registered on
// the Registerer underneath, and the first error instead of panicking. A
// nil Registerer underneath registers nothing. It is safe for concurrent
// use, so that a component's Close may race with another's.
type Registrar struct {
	reg   prometheus.Registerer
	field string // where reg came from, for errors

	mu   sync.Mutex
	done []prometheus.Collector
	err  error
}

var _ prometheus.Registerer = (*Registrar)(nil)

// New returns a Registrar on reg; field names where reg came from (such
// as "npu: MarkerConfig.Registerer") and starts its errors.
func New(reg prometheus.Registerer, field string) *Registrar {
	return &Registrar{reg: reg, field: field}
}

// Register registers c, with an error naming the field and the metric.
func (r *Registrar) Register(c prometheus.Collector) error {
	if r.reg == nil {
		return nil
	}
	if err := r.reg.Register(c); err != nil {
		return fmt.Errorf("%s: register %s: %w", r.field, metricName(c), err)
	}
	r.mu.Lock()
	r.done = append(r.done, c)
	r.mu.Unlock()
	return nil
}

// MustRegister registers each of cs, keeping the first error for Err
// (promauto calls it; it does not panic).
func (r *Registrar) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			r.mu.Lock()
			if r.err == nil {
				r.err = err
			}
			r.mu.Unlock()
		}
	}
}

// Unregister unregisters c.
func (r *Registrar) Unregister(c prometheus.Collector) bool {
	return r.reg != nil && r.reg.Unregister(c)
}

// Err returns the first error of MustRegister, having unregistered all
// that was registered; nil when every collector was registered.
func (r *Registrar) Err() error {
	r.mu.Lock()
	err := r.err
	r.mu.Unlock()
	if err != nil {
		r.UnregisterAll()
	}
	return err
}

// UnregisterAll unregisters what was registered. It is idempotent.
func (r *Registrar) UnregisterAll() {
	r.mu.Lock()
	done := r.done
	r.done = nil
	r.mu.Unlock()
	for _, c := range done {
		r.reg.Unregister(c)
	}
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
