package main

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/internal/testkit"
)

// The tests of a job whose nodes are hosts apart: each node a network
// namespace with its own address, its own /dev/shm and its own disk
// folder (testkit.Fabric), as the nodes of a cluster are.

// cluster is one job run on hosts of a fabric, a faultline-run per node.
type cluster struct {
	t          *testing.T
	f          *testkit.Fabric
	dir, id    string
	port       int
	token      string
	perNode    int
	master     string // node 0's address
	extraEnv   []string
	sharedDisk bool // one checkpoint folder for every node
}

func newCluster(t *testing.T, hosts, perNode int) *cluster {
	t.Helper()
	needTorch(t)
	f := testkit.NewFabric(t, hosts)
	port, err := freePorts()
	if err != nil {
		t.Fatal(err)
	}
	return &cluster{t: t, f: f, dir: t.TempDir(), id: "flrun-nodes-" + randomHex(3), port: port, token: randomHex(16),
		perNode: perNode, master: f.Hosts[0].IP}
}

// start runs node's faultline-run on h with flags, then train.py with
// args; its --out and checkpoint folder are h's own.
func (c *cluster) start(node int, h *testkit.Host, flags []string, args ...string) *job {
	c.t.Helper()
	flags = append([]string{"--nnodes", "2", "--node-rank", strconv.Itoa(node), "--nproc-per-node", strconv.Itoa(c.perNode),
		"--master-addr", c.master, "--master-port", strconv.Itoa(c.port), "--rdzv-id", c.id}, flags...)
	ckpt := filepath.Join(c.dir, "ckpt-"+h.Name)
	if c.sharedDisk {
		ckpt = filepath.Join(c.dir, "ckpt")
	}
	args = append([]string{"--ckpt", ckpt}, args...)
	env := append([]string{"TASKD_TOKEN=" + c.token, "GLOO_SOCKET_IFNAME=" + h.Iface}, c.extraEnv...)
	return startCmd(c.t, h.Command, filepath.Join(c.dir, "out-"+h.Name), env, flags, "train.py", args...)
}

// TestNodeLost: node 1 of a 2 x 2 job is SIGKILLed whole, its memory and
// disk gone with it, and a new node 1 is started on a new address 3 s
// later: the job goes on.
func TestNodeLost(t *testing.T) {
	c := newCluster(t, 2, 2)
	c.sharedDisk = true
	args := []string{"--steps", "60", "--step-ms", "50", "--weights", filepath.Join(c.dir, "weights")}
	n0 := c.start(0, c.f.Hosts[0], []string{"--max-restarts", "3"}, args...)
	n1 := c.start(1, c.f.Hosts[1], []string{"--max-restarts", "3"}, args...)
	n1.waitLine("[rank2]: step 37 loss", 3*time.Minute)
	c.f.Hosts[1].Kill()
	time.Sleep(3 * time.Second)
	h2 := c.f.AddHost()
	n1b := c.start(1, h2, []string{"--max-restarts", "3"}, args...)
	for i, j := range []*job{n0, n1b} {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstdout:\n%s\nstderr:\n%s", i, err, j.stdout(), j.errText())
		}
	}
	<-n1.done
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), reference(t, "--steps", "60"); got != want {
		t.Fatalf("weights after the node was replaced %s, without the fault %s", got, want)
	}
}

// TestNodeLostFromReplicas: as TestNodeLost, with a disk folder per node,
// so that the new node 1 finds nothing of its ranks on its disk: they
// resume from the replicas node 0 holds in memory, from the step where
// node 1 died, and the job loses no step.
func TestNodeLostFromReplicas(t *testing.T) {
	c := newCluster(t, 2, 2)
	args := []string{"--steps", "60", "--step-ms", "50", "--weights", filepath.Join(c.dir, "weights")}
	flags := []string{"--max-restarts", "3", "--heartbeat-deadline", "3s"}
	n0 := c.start(0, c.f.Hosts[0], flags, args...)
	n1 := c.start(1, c.f.Hosts[1], flags, args...)
	n1.waitLine("[rank2]: step 37 loss", 3*time.Minute)
	c.f.Hosts[1].Kill()
	time.Sleep(3 * time.Second)
	n1b := c.start(1, c.f.AddHost(), flags, args...)
	for i, j := range []*job{n0, n1b} {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstdout:\n%s\nstderr:\n%s\nthe new node 1's stderr:\n%s", i, err, j.stdout(), j.errText(), n1b.errText())
		}
	}
	<-n1.done
	if !strings.Contains(n0.errText(), "ranks [2 3] from replicas in other nodes' memory") {
		t.Errorf("node 0 does not say that ranks 2 and 3 resume from replicas:\n%s", n0.errText())
	}
	for _, l := range strings.Split(n1b.stdout(), "\n") {
		if strings.Contains(l, "resumed from step") {
			if st, _ := strconv.Atoi(l[strings.LastIndex(l, " ")+1:]); st < 36 {
				t.Errorf("the new node 1 %q: steps were lost, node 1 died in step 37", l)
			}
		}
	}
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), reference(t, "--steps", "60"); got != want {
		t.Fatalf("weights after the node was replaced %s, without the fault %s", got, want)
	}
}

// TestHangJobWide: rank 3, on node 1, blocks in its data loader while
// ranks 0 to 2 wait in the all-reduce: each node sees a 1-1 or 2-0 split
// of its own two ranks, and only the stacks of all four name the culprit.
// Both nodes' incidents hold the job-wide verdict: rank 3, in get_batch.
func TestHangJobWide(t *testing.T) {
	c := newCluster(t, 2, 2)
	args := []string{"--steps", "30", "--hang-rank", "3", "--hang-step", "10"}
	flags := []string{"--max-restarts", "1", "--collective-timeout", "3s"}
	jobs := []*job{c.start(0, c.f.Hosts[0], flags, args...), c.start(1, c.f.Hosts[1], flags, args...)}
	for i, j := range jobs {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstderr:\n%s", i, err, j.errText())
		}
	}
	for i, j := range jobs {
		in := j.incidents()
		if len(in) == 0 || !strings.Contains(in[0].Verdict, "rank 3 in get_batch") || in[0].Fault.Rank != 3 {
			t.Fatalf("node %d's incident: %+v\nstderr:\n%s", i, in, j.errText())
		}
		b, err := os.ReadFile(filepath.Join(in[0].Dir, "verdict.txt"))
		if err != nil || !strings.Contains(string(b), "Job-wide: the stacks of 4 ranks on nodes [0 1]") {
			t.Fatalf("node %d's verdict.txt (%v):\n%s", i, err, b)
		}
	}
}

// TestPartitionShort: node 1 is cut off for 4 s, less than the heartbeat
// deadline and the collective timeout: the job waits for it and goes on,
// with no incident and no step lost.
func TestPartitionShort(t *testing.T) {
	c := newCluster(t, 2, 2)
	args := []string{"--steps", "60", "--step-ms", "50", "--weights", filepath.Join(c.dir, "weights")}
	flags := []string{"--max-restarts", "3", "--heartbeat-deadline", "10s", "--collective-timeout", "10s"}
	jobs := []*job{c.start(0, c.f.Hosts[0], flags, args...), c.start(1, c.f.Hosts[1], flags, args...)}
	jobs[1].waitLine("[rank2]: step 30 loss", 3*time.Minute)
	c.f.Hosts[1].LinkDown()
	time.Sleep(4 * time.Second)
	c.f.Hosts[1].LinkUp()
	for i, j := range jobs {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstderr:\n%s", i, err, j.errText())
		}
		if b, err := os.ReadFile(filepath.Join(j.out, "incidents.jsonl")); err == nil {
			t.Errorf("node %d recorded incidents after a short partition:\n%s", i, b)
		}
	}
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), reference(t, "--steps", "60"); got != want {
		t.Fatalf("weights after a short partition %s, without it %s", got, want)
	}
}

// TestPartitionLong: node 1 is cut off past the heartbeat deadline, so it
// is lost, and a new node 1 replaces it on another host; when the old
// node's link comes back its ranks must not touch the job: it learns that
// it was replaced and ends them. The job goes on from the replicas.
func TestPartitionLong(t *testing.T) {
	c := newCluster(t, 2, 2)
	args := []string{"--steps", "60", "--step-ms", "50", "--weights", filepath.Join(c.dir, "weights")}
	flags := []string{"--max-restarts", "3", "--heartbeat-deadline", "3s", "--collective-timeout", "5s"}
	n0 := c.start(0, c.f.Hosts[0], flags, args...)
	n1 := c.start(1, c.f.Hosts[1], flags, args...)
	n1.waitLine("[rank2]: step 30 loss", 3*time.Minute)
	c.f.Hosts[1].LinkDown()
	time.Sleep(3 * time.Second)
	n1b := c.start(1, c.f.AddHost(), flags, args...)
	n1b.waitLine("loss", 3*time.Minute)
	c.f.Hosts[1].LinkUp()
	for i, j := range []*job{n0, n1b} {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstderr:\n%s\nthe old node 1's stderr:\n%s", i, err, j.errText(), n1.errText())
		}
	}
	if err := n1.wait(time.Minute); err == nil {
		t.Errorf("the old node 1 ended as if it had finished the job:\n%s", n1.errText())
	}
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), reference(t, "--steps", "60"); got != want {
		t.Fatalf("weights after node 1 was cut off and replaced %s, without it %s", got, want)
	}
}

// TestDiskPerNode: with a checkpoint folder per node, where no node sees
// the others' shards, DISK steps commit job-wide all the same: every
// node's folder names the last one, asked for in the last step.
func TestDiskPerNode(t *testing.T) {
	c := newCluster(t, 2, 2)
	args := []string{"--steps", "30", "--disk-every", "10"}
	jobs := []*job{c.start(0, c.f.Hosts[0], nil, args...), c.start(1, c.f.Hosts[1], nil, args...)}
	for i, j := range jobs {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstderr:\n%s", i, err, j.errText())
		}
	}
	for _, h := range c.f.Hosts {
		dir := filepath.Join(c.dir, "ckpt-"+h.Name)
		steps, err := ckpt.CommittedSteps(dir)
		if err != nil || len(steps) == 0 || steps[0] != 29 {
			t.Errorf("%s: committed steps %v (%v), want up to 29", dir, steps, err)
		}
	}
}
