package main

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/internal/freeport"
	"github.com/faultline-ml/faultline/internal/testkit"
)

// manager is one taskd-manager process.
type manager struct {
	cmd    *exec.Cmd
	stderr *testkit.Output
	done   chan struct{}
}

// startManager starts taskd-manager, built from examples/taskd-manager,
// as the candidate name.
func startManager(t *testing.T, bin, name string, args ...string) *manager {
	t.Helper()
	m := &manager{stderr: testkit.NewOutput(name, false), done: make(chan struct{})}
	m.cmd = exec.Command(bin, args...)
	m.cmd.Env = append(os.Environ(), "POD_NAME="+name)
	m.cmd.Stderr = m.stderr
	if err := m.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { m.cmd.Wait(); close(m.done) }()
	t.Cleanup(func() {
		m.cmd.Process.Kill()
		<-m.done
		t.Logf("%s:\n%s", name, m.stderr.String())
	})
	return m
}

// TestManagersApart: the Kubernetes deployment's shape on loopback. Two
// taskd-manager --agents processes share a lease file and a state
// folder; two faultline-run nodes follow whichever leads. The leader is
// SIGKILLed the moment a rank kills itself: the standby takes the lease,
// finishes the recovery, and the job ends with the weights of a run
// without either fault.
func TestManagersApart(t *testing.T) {
	needTorch(t)
	ref := reference(t)
	dir := t.TempDir()
	mgrBin := filepath.Join(dir, "taskd-manager")
	if out, err := exec.Command("go", "build", "-o", mgrBin, "../taskd-manager").CombinedOutput(); err != nil {
		t.Fatalf("go build ../taskd-manager: %v\n%s", err, out)
	}
	// The job's 16 ports (see freePorts), then the two managers': asked
	// for at once, as none of them is held until its server binds it.
	port, err := freeport.Find(18)
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("TASKD_TOKEN", randomHex(16))
	id := "apart-" + randomHex(3)
	addrs := []string{net.JoinHostPort("127.0.0.1", strconv.Itoa(port+16)), net.JoinHostPort("127.0.0.1", strconv.Itoa(port+17))}
	var mgrs []*manager
	for i, addr := range addrs {
		mgrs = append(mgrs, startManager(t, mgrBin, fmt.Sprintf("manager-%d", i), "--agents", "--insecure", "--job", id,
			"--nodes", "2", "--procs-per-node", "2", "--listen", addr, "--state-dir", filepath.Join(dir, "state"),
			"--lease", "file", "--lease-file", filepath.Join(dir, "manager.lease")))
		// The first leads: the second is started once it listens.
		if i == 0 {
			testkit.WaitFor(t, "manager 0 listening on "+addr, func() bool {
				c, err := net.Dial("tcp", addr)
				if err == nil {
					c.Close()
				}
				return err == nil
			})
		}
	}
	w := filepath.Join(dir, "weights")
	host := testkit.HostAddr(t)
	var jobs []*job
	for node := range 2 {
		jobs = append(jobs, start(t, filepath.Join(dir, fmt.Sprintf("out-%d", node)),
			[]string{"--nnodes", "2", "--node-rank", fmt.Sprint(node), "--nproc-per-node", "2", "--master-addr", host, "--master-port", fmt.Sprint(port),
				"--rdzv-id", id, "--max-restarts", "2", "--manager", strings.Join(addrs, ",")},
			"--steps", steps, "--ckpt", filepath.Join(dir, "ckpt"), "--kill-rank", "3", "--kill-step", "12", "--weights", w))
	}
	jobs[1].waitLine("[rank3]: killing myself at step 12", 2*time.Minute)
	mgrs[0].cmd.Process.Kill()
	<-mgrs[0].done
	for node, j := range jobs {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstderr:\n%s\nmanager 1:\n%s", node, err, j.errText(), mgrs[1].stderr.String())
		}
		if in := j.incidents(); len(in) == 0 || in[0].ResumedStep < 9 || in[0].CaughtUp.IsZero() {
			t.Fatalf("node %d: incidents %+v", node, in)
		}
	}
	if !strings.Contains(mgrs[1].stderr.String(), "leading") {
		t.Errorf("manager 1 never led:\n%s", mgrs[1].stderr.String())
	}
	if got := readHash(t, w); got != ref {
		t.Fatalf("weights after the recovery and the failover %s, without them %s", got, ref)
	}
}
