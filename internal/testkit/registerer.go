package testkit

import (
	"errors"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// SharedRegisterer checks the contract of a type whose constructor
// registers its metrics on a Registerer and whose Close unregisters them:
// a second one on the Registerer the first uses is refused with a
// prometheus.AlreadyRegisteredError whose message begins with
// field+": register "+metric; once the first is closed its metrics are
// gone and another registers; Close may be called twice. open builds one
// and returns its Close.
func SharedRegisterer(t *testing.T, field, metric string, open func(prometheus.Registerer) (func() error, error)) {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	closeFirst, err := open(reg)
	if err != nil {
		t.Fatal(err)
	}
	closeSecond, err := open(reg)
	if err == nil {
		closeSecond()
		t.Fatal("a second one registered its metrics beside the first")
	}
	var are prometheus.AlreadyRegisteredError
	if !errors.As(err, &are) || !strings.HasPrefix(err.Error(), field+": register "+metric) {
		t.Errorf("second on one Registerer: %v, want an AlreadyRegisteredError naming %s", err, field)
	}
	if err := closeFirst(); err != nil {
		t.Fatal(err)
	}
	if mfs, err := reg.Gather(); err != nil || len(mfs) != 0 {
		t.Fatalf("%d metric families left after Close (%v)", len(mfs), err)
	}
	closeAgain, err := open(reg)
	if err != nil {
		t.Fatalf("after Close: %v", err)
	}
	if err := closeAgain(); err != nil {
		t.Fatal(err)
	}
	closeAgain() // idempotent
}
