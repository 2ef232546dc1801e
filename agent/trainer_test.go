package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/internal/freeport"
	"github.com/faultline-ml/faultline/taskd"
)

// TestRestartStartsFinishedRanks: a rank that finished before another
// rank's fault is restarted with it, as torchrun restarts its whole
// worker group: the restarted ranks could not rebuild their process group
// without it.
func TestRestartStartsFinishedRanks(t *testing.T) {
	a, out, dir := shellAgent(t, 2, 1, `echo "start $TORCHELASTIC_RESTART_COUNT"
[ "$TORCHELASTIC_RESTART_COUNT" != 0 ] && exit 0
if [ "$RANK" = 1 ]; then echo $$ > "$WORK/rank1.pid"; exit 0; fi
# Rank 0 fails once rank 1's process is gone.
while [ ! -s "$WORK/rank1.pid" ] || kill -0 "$(cat "$WORK/rank1.pid")" 2>/dev/null; do sleep 0.02; done
sleep 0.2
exit 3`)
	if err := run(t, a); err != nil {
		t.Fatalf("Run: %v\n%s", err, output(t, out))
	}
	got := output(t, out)
	for _, want := range []string{"[rank0]: start 1", "[rank1]: start 1"} {
		if !strings.Contains(got, want) {
			t.Errorf("no %q in the output: the job was not restarted whole:\n%s", want, got)
		}
	}
	if in := incidentsOf(t, dir); len(in) != 1 || in[0].Fault.Rank != 0 || in[0].Restarted.IsZero() {
		t.Errorf("incidents: %+v", in)
	}
}

// TestRestartRefusedWithoutFinishedNode: when every rank of node 1
// finished and its agent left, a fault on node 0 ends the job, saying
// why, rather than restart node 0's ranks to wait for ever for node 1's.
func TestRestartRefusedWithoutFinishedNode(t *testing.T) {
	sec := taskd.Security{Token: "0123456789abcdef0123456789abcdef", Insecure: true}
	port, err := freeport.Find(1)
	if err != nil {
		t.Fatal(err)
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	dir := t.TempDir()
	left := filepath.Join(dir, "node1-left")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var agents [2]*Agent
	for node := range 2 {
		cfg := Config{Job: "finished-node", Nodes: 2, NodeRank: node, MaxRestarts: 2,
			Command: []string{"sh", "-c", `[ "$RANK" = 1 ] && exit 0
while [ ! -e "$LEFT" ]; do sleep 0.02; done
exit 3`},
			NoPython: true, Out: filepath.Join(dir, fmt.Sprint(node)), ShmDir: dir, Security: sec,
			Env: append(os.Environ(), "LEFT="+left), Stdout: os.Stderr, Stderr: os.Stderr}
		if node == 0 {
			cfg.ManagerListen = addr
		} else {
			cfg.Manager = addr
		}
		a, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer a.Close()
		agents[node] = a
	}
	errs := make(chan error, 1)
	go func() { errs <- agents[0].Run(ctx) }()
	if err := agents[1].Run(ctx); err != nil {
		t.Fatalf("node 1: %v", err)
	}
	if err := os.WriteFile(left, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	err = <-errs
	if !errors.Is(err, ErrStopped) || !strings.Contains(err.Error(), "ranks [1] had finished and left the job") ||
		!strings.Contains(err.Error(), "exited with code 3") {
		t.Fatalf("node 0: Run = %v, want ErrStopped saying rank 1 finished and left", err)
	}
}
