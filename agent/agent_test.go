package agent

import (
	"bytes"
	"context"
	"encoding/json"
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
	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/taskd"
)

// The agent's own tests run ranks that are shell commands (NoPython):
// process handling, restarts, the budget and incidents, in seconds.
// examples/faultline-run's tests run real PyTorch jobs through it.

// shellAgent builds an agent of n ranks, each running script with sh.
func shellAgent(t testing.TB, n, restarts int, script string) (*Agent, *os.File, string) {
	t.Helper()
	dir := t.TempDir()
	out, err := os.Create(filepath.Join(dir, "output"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { out.Close() })
	a, err := New(Config{Job: "agent-test-" + strings.ReplaceAll(t.Name(), "/", "-"), ProcsPerNode: n, MaxRestarts: restarts,
		Command: []string{"sh", "-c", script}, NoPython: true, Out: filepath.Join(dir, "out"), ShmDir: dir,
		ManagerListen: "127.0.0.1:0", Security: taskd.Security{Token: "0123456789abcdef0123456789abcdef", Insecure: true},
		Env: append(os.Environ(), "WORK="+dir), Stdout: out, Stderr: out})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	return a, out, dir
}

func run(t *testing.T, a *Agent) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	return a.Run(ctx)
}

func output(t *testing.T, f *os.File) string {
	t.Helper()
	b, err := os.ReadFile(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func incidentsOf(t *testing.T, dir string) []Incident {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "out", IncidentsFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	var in []Incident
	for _, l := range bytes.Split(bytes.TrimSpace(b), []byte("\n")) {
		var c Incident
		if err := json.Unmarshal(l, &c); err != nil {
			t.Fatal(err)
		}
		in = append(in, c)
	}
	return in
}

// TestRunFinishes: every rank exits 0 with torchrun's environment; the
// output is prefixed by rank; Run returns nil.
func TestRunFinishes(t *testing.T) {
	a, out, dir := shellAgent(t, 2, 0, `echo "rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE restart=$TORCHELASTIC_RESTART_COUNT job=$TORCHELASTIC_RUN_ID"`)
	if err := run(t, a); err != nil {
		t.Fatal(err)
	}
	got := output(t, out)
	for _, want := range []string{"[rank0]: rank=0 local=0 world=2 restart=0 job=agent-test-TestRunFinishes",
		"[rank1]: rank=1 local=1 world=2 restart=0 job=agent-test-TestRunFinishes"} {
		if !strings.Contains(got, want) {
			t.Errorf("no %q in the output:\n%s", want, got)
		}
	}
	if in := incidentsOf(t, dir); len(in) != 0 {
		t.Errorf("incidents of a job without faults: %+v", in)
	}
}

// TestRunRestarts: a rank that fails once is restarted together with the
// other rank, within the budget; the incident says so.
func TestRunRestarts(t *testing.T) {
	// Rank 0's first process waits to be stopped: one that finished first,
	// on a loaded machine, would leave the job nothing to restart it into.
	a, out, dir := shellAgent(t, 2, 2, `if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then [ "$RANK" = 1 ] && exit 7; sleep 60; fi; echo "done $RANK after $TORCHELASTIC_RESTART_COUNT"`)
	if err := run(t, a); err != nil {
		t.Fatalf("%v\n%s", err, output(t, out))
	}
	got := output(t, out)
	for _, want := range []string{"rank 1 (pid ", "exited with code 7", "[rank0]: done 0 after 1", "[rank1]: done 1 after 1"} {
		if !strings.Contains(got, want) {
			t.Errorf("no %q in the output:\n%s", want, got)
		}
	}
	in := incidentsOf(t, dir)
	if len(in) != 1 || in[0].Fault.Rank != 1 || in[0].Fault.Code != 7 || in[0].Restarted.IsZero() || in[0].Strategy != string(taskd.StrategyRecoverInPlace) {
		t.Fatalf("incidents: %+v", in)
	}
}

// TestRunStopsWhenBudgetSpent: a rank that fails at once every time ends
// the job once the budget is spent, with the reason and the last fault.
func TestRunStopsWhenBudgetSpent(t *testing.T) {
	a, out, _ := shellAgent(t, 2, 1, `exit 3`)
	err := run(t, a)
	if !errors.Is(err, ErrStopped) || !strings.Contains(err.Error(), "the restart budget is spent: 1 restarts of 1 allowed") ||
		!strings.Contains(err.Error(), "exited with code 3") {
		t.Fatalf("Run = %v\n%s", err, output(t, out))
	}
}

func TestConfigValidate(t *testing.T) {
	ok := Config{Job: "j", Command: []string{"train.py"}}
	if err := ok.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		edit  func(*Config)
		field string
	}{
		{func(c *Config) { c.Job = "" }, "Job"},
		{func(c *Config) { c.Job = "../x" }, "Job"},
		{func(c *Config) { c.Command = nil }, "Command"},
		{func(c *Config) { c.Nodes = -1 }, "Nodes"},
		{func(c *Config) { c.Nodes, c.NodeRank = 2, 2 }, "NodeRank"},
		{func(c *Config) { c.ProcsPerNode = -1 }, "ProcsPerNode"},
		{func(c *Config) { c.MasterPort = 70000 }, "MasterPort"},
		{func(c *Config) { c.MaxRestarts = -1 }, "MaxRestarts"},
		{func(c *Config) { c.CollectiveTimeout = -time.Second }, "CollectiveTimeout"},
		{func(c *Config) { c.HeartbeatDeadline = -time.Second }, "HeartbeatDeadline"},
		{func(c *Config) { c.GracePeriod = -time.Second }, "GracePeriod"},
		{func(c *Config) { c.Module, c.NoPython = true, true }, "Module"},
		{func(c *Config) { c.Nodes, c.SpareNodes = 2, -1 }, "SpareNodes"},
		{func(c *Config) { c.SpareNodes = 1 }, "SpareNodes"},
		{func(c *Config) { c.Nodes, c.SpareNodes, c.Manager = 2, 1, "h:1" }, "SpareNodes"},
		{func(c *Config) { c.Nodes, c.SpareNodes, c.NodeRank = 2, 1, 3 }, "NodeRank"},
	} {
		c := ok
		tc.edit(&c)
		err := c.Validate()
		if !errors.Is(err, errConfig) || !strings.Contains(err.Error(), tc.field+" = ") {
			t.Errorf("Validate of %+v = %v, want an error naming %s", c, err, tc.field)
		}
	}
}

// TestManagerApart: two nodes' agents and a taskd manager running apart
// with Orchestration: a rank on node 1 that fails once restarts both
// nodes' ranks, and the job finishes.
func TestManagerApart(t *testing.T) {
	sec := taskd.Security{Token: "0123456789abcdef0123456789abcdef", Insecure: true}
	orch, h, err := Orchestration(2, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer orch.Policy.Close()
	m, err := taskd.NewManager(taskd.ManagerConfig{Job: "apart", Listen: "127.0.0.1:0", Nodes: 2, ProcsPerNode: 1, Security: sec,
		Handlers: []taskd.Handler{h}, Orchestration: orch})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	mdone := make(chan error, 1)
	go func() { mdone <- m.Run(ctx) }()
	defer func() { cancel(); <-mdone; m.Close() }()
	dir := t.TempDir()
	errs := make(chan error, 2)
	for node := range 2 {
		out := filepath.Join(dir, fmt.Sprint(node))
		a, err := New(Config{Job: "apart", Nodes: 2, NodeRank: node, Manager: m.Addr().String(), MaxRestarts: 1,
			Command:  []string{"sh", "-c", `if [ "$RANK" = 1 ] && [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then exit 7; fi; sleep 0.3; echo done`},
			NoPython: true, Out: out, ShmDir: dir, Security: sec, Stdout: os.Stderr, Stderr: os.Stderr})
		if err != nil {
			t.Fatal(err)
		}
		defer a.Close()
		go func() { errs <- a.Run(ctx) }()
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if js := m.JobStatus(); !js.Complete {
		t.Errorf("job status %+v, want complete", js)
	}
	st := m.Orchestrations(0)
	if len(st.History) != 1 || st.History[0].State != taskd.StateRecovered {
		t.Fatalf("orchestrations: %+v", st)
	}
}

// TestManagerListensEverywhere: node 0's manager listens on every
// interface, as the ranks' store does, and not only on MasterAddr: the
// other nodes reach it whichever address of this host MasterAddr names.
func TestManagerListensEverywhere(t *testing.T) {
	host := testkit.HostAddr(t)
	port, err := freeport.Find(2)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	a, err := New(Config{Job: "listen", MasterAddr: "127.0.0.1", MasterPort: port,
		Command: []string{"sh", "-c", `while [ ! -e "$WORK/go" ]; do sleep 0.02; done`}, NoPython: true,
		Out: filepath.Join(dir, "out"), ShmDir: dir, Security: taskd.Security{Token: "0123456789abcdef0123456789abcdef", Insecure: true},
		Env: append(os.Environ(), "WORK="+dir), Stdout: os.Stderr, Stderr: os.Stderr})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	errc := make(chan error, 1)
	go func() { errc <- run(t, a) }()
	addr := net.JoinHostPort(host, strconv.Itoa(port+1)) // the manager's, after the store's
	testkit.WaitFor(t, "the manager at "+addr, func() bool {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	if err := os.WriteFile(filepath.Join(dir, "go"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}
