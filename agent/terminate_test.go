package agent

import (
	"errors"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// TestTerminate: Terminate sends the signal to each rank's process
// group, where the rank's own handler runs; a rank that ignores it is
// killed once three quarters of the grace period are past; no exit is a
// fault, none is restarted, and Run returns ErrTerminated.
func TestTerminate(t *testing.T) {
	a, out, dir := shellAgent(t, 2, 3, `if [ "$RANK" = 0 ]; then trap 'echo "got TERM"; exit 0' TERM; else trap '' TERM; fi
echo "start $TORCHELASTIC_RESTART_COUNT"
sleep 60 & wait
sleep 60 & wait`)
	a.cfg.GracePeriod = time.Second
	errc := make(chan error, 1)
	go func() { errc <- run(t, a) }()
	testkit.WaitFor(t, "both ranks started", func() bool {
		o := output(t, out)
		return strings.Contains(o, "[rank0]: start 0") && strings.Contains(o, "[rank1]: start 0")
	})
	a.Terminate(syscall.SIGTERM)
	err := <-errc
	if !errors.Is(err, ErrTerminated) || !strings.Contains(err.Error(), "SIGTERM") {
		t.Fatalf("Run = %v, want ErrTerminated by SIGTERM\n%s", err, output(t, out))
	}
	got := output(t, out)
	for _, want := range []string{"[rank0]: got TERM", "rank 0 exited with code 0", "rank 1 was killed, still running after"} {
		if !strings.Contains(got, want) {
			t.Errorf("no %q in the output:\n%s", want, got)
		}
	}
	if strings.Contains(got, "start 1") {
		t.Errorf("a rank was restarted after the signal:\n%s", got)
	}
	if in := incidentsOf(t, dir); len(in) != 0 {
		t.Errorf("incidents of a terminated job: %+v", in)
	}
}
