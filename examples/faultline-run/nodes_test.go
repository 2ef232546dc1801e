package main

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
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
	t          testing.TB
	f          *testkit.Fabric
	dir, id    string
	port       int
	token      string
	perNode    int
	master     string // node 0's address
	extraEnv   []string
	sharedDisk bool // one checkpoint folder for every node
	// spares: warm interpreters for the restarts, which cost a torch
	// import a rank; the tests that do not time recoveries go without.
	spares bool
}

func newCluster(t testing.TB, hosts, perNode int) *cluster {
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
	if !c.spares {
		flags = append([]string{"--no-spares"}, flags...)
	}
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

// waitReplicas waits until h's memory holds a replica of step of each of
// ranks.
func (c *cluster) waitReplicas(h *testkit.Host, step int64, ranks ...int) {
	c.t.Helper()
	for _, r := range ranks {
		path := ckpt.ReplicaPath(h.Shm, "faultline-"+c.id, r)
		for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
			rep, err := ckpt.InspectSegment(path)
			if err == nil && rep.NewestHalf >= 0 && rep.Halves[rep.NewestHalf].Meta.Step >= step {
				break
			}
			if time.Now().After(deadline) {
				c.t.Fatalf("%s holds no replica of rank %d's step %d after a minute: %+v, %v", h.Name, r, step, rep, err)
			}
		}
	}
}

// TestNodeLostFromReplicas: node 1 of a 2 x 2 job is SIGKILLed whole
// once node 0 holds the replicas of its ranks' step 37 (the ranks held in
// step 38), its memory and disk gone with it, and a new node 1 is started on a new
// address 3 s later. Each node has a disk folder of its own, so the new
// node finds nothing of its ranks there: they resume from the replicas
// node 0 holds in memory, from the step where node 1 died, and the job
// loses no step. The DISK steps commit job-wide all the same, though no
// node sees the others' shards: every folder names the last one.
func TestNodeLostFromReplicas(t *testing.T) {
	t.Parallel() // hosts of their own: two jobs at once share only the CPUs
	c := newCluster(t, 2, 2)
	args := []string{"--steps", "60", "--step-ms", "50", "--weights", filepath.Join(c.dir, "weights")}
	flags := []string{"--max-restarts", "3", "--heartbeat-deadline", "3s", "--collective-timeout", "60s"}
	// Rank 2 blocks before step 38's all-reduce and the others wait in
	// it, so that node 1 dies once node 0 holds its ranks' step 37: a
	// replica lands a moment after its save, and on a loaded machine a
	// kill in between costs steps (BenchmarkNodeLost counts them).
	hang := append([]string{"--hang-rank", "2", "--hang-step", "38"}, args...)
	n0 := c.start(0, c.f.Hosts[0], flags, hang...)
	n1 := c.start(1, c.f.Hosts[1], flags, hang...)
	n1.waitLine("[rank2]: blocking in get_batch at step 38", 3*time.Minute)
	c.waitReplicas(c.f.Hosts[0], 37, 2, 3)
	c.f.Hosts[1].Kill()
	time.Sleep(3 * time.Second)
	n1b := c.start(1, c.f.AddHost(), flags, args...)
	for i, j := range []*job{n0, n1b} {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstdout:\n%s\nstderr:\n%s\nthe new node 1's stderr:\n%s", i, err, j.stdout(), j.errText(), n1b.errText())
		}
	}
	<-n1.done
	if !strings.Contains(n0.errText(), "ranks [2 3] from replicas in memory") {
		t.Errorf("node 0 does not say that ranks 2 and 3 resume from replicas:\n%s", n0.errText())
	}
	if st, ok := earliestResumed(n1b.stdout()); ok && st < 37 {
		t.Errorf("the new node 1 resumed from step %d: steps were lost, node 1 died in step 37\n%s", st, n1b.stdout())
	}
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), reference(t, "--steps", "60"); got != want {
		t.Fatalf("weights after the node was replaced %s, without the fault %s", got, want)
	}
	for _, h := range []string{c.f.Hosts[0].Name, c.f.Hosts[2].Name} {
		dir := filepath.Join(c.dir, "ckpt-"+h)
		if steps, err := ckpt.CommittedSteps(dir); err != nil || len(steps) == 0 || steps[0] != 59 {
			t.Errorf("%s: committed steps %v (%v), want up to 59", dir, steps, err)
		}
	}
}

// TestHangJobWide: rank 3, on node 1, blocks in its data loader while
// ranks 0 to 2 wait in the all-reduce: each node sees a 1-1 or 2-0 split
// of its own two ranks, and only the stacks of all four name the culprit.
// Both nodes' incidents hold the job-wide verdict: rank 3, in get_batch.
func TestHangJobWide(t *testing.T) {
	t.Parallel() // hosts of their own: two jobs at once share only the CPUs
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
	t.Parallel() // hosts of their own: two jobs at once share only the CPUs
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
// it was replaced and ends them. The job goes on from the replicas (the
// nodes share a checkpoint folder here, whose older steps it passes over).
func TestPartitionLong(t *testing.T) {
	t.Parallel() // hosts of their own: two jobs at once share only the CPUs
	c := newCluster(t, 2, 2)
	c.sharedDisk = true
	// Steps enough that the old node, back, finds the job still running:
	// with its manager gone, it would wait --node-timeout for it.
	args := []string{"--steps", "300", "--step-ms", "50", "--weights", filepath.Join(c.dir, "weights")}
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
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), reference(t, "--steps", "300"); got != want {
		t.Fatalf("weights after node 1 was cut off and replaced %s, without it %s", got, want)
	}
}

// TestLastDiskStepCommits: the ranks of a job of two nodes, a disk
// folder each, exit right after their last save, a DISK one of 64 MiB,
// which their agents persist after the save returned. The job's manager
// has the nodes commit it once every node's shard is durable; a node
// whose ranks had all left would not hear of it, so each rank waits at
// exit until it is committed, and every folder commits it.
func TestLastDiskStepCommits(t *testing.T) {
	t.Parallel() // hosts of their own: two jobs at once share only the CPUs
	c := newCluster(t, 2, 1)
	args := []string{"--steps", "10", "--exit-at-once", "--state-mb", "64"}
	jobs := []*job{c.start(0, c.f.Hosts[0], nil, args...), c.start(1, c.f.Hosts[1], nil, args...)}
	for i, j := range jobs {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstderr:\n%s", i, err, j.errText())
		}
	}
	for i, h := range c.f.Hosts {
		dir := filepath.Join(c.dir, "ckpt-"+h.Name)
		if steps, err := ckpt.CommittedSteps(dir); err != nil || !slices.Contains(steps, 9) {
			t.Errorf("node %d's folder %s commits steps %v (%v), not the last DISK step, 9:\n%s", i, dir, steps, err, jobs[i].errText())
		}
	}
}

// TestFirstLoadsAgree: a job of two nodes with a checkpoint folder each
// runs to its end, then node 1's folder is lost, and the job is run again:
// node 0 alone holds the last DISK step, and every rank starts over
// rather than the nodes' ranks training on from different steps.
func TestFirstLoadsAgree(t *testing.T) {
	t.Parallel() // hosts of their own: two jobs at once share only the CPUs
	c := newCluster(t, 2, 2)
	args := []string{"--steps", "20", "--weights", filepath.Join(c.dir, "weights")}
	run := func() []*job {
		jobs := []*job{c.start(0, c.f.Hosts[0], nil, args...), c.start(1, c.f.Hosts[1], nil, args...)}
		for i, j := range jobs {
			if err := j.wait(3 * time.Minute); err != nil {
				jobs[1-i].wait(3 * time.Minute) // the other's side of it too
				t.Fatalf("node %d: %v\nnode 0's stderr:\n%s\nnode 1's stderr:\n%s", i, err, jobs[0].errText(), jobs[1].errText())
			}
		}
		return jobs
	}
	run()
	if err := os.RemoveAll(filepath.Join(c.dir, "ckpt-"+c.f.Hosts[1].Name)); err != nil {
		t.Fatal(err)
	}
	jobs := run()
	for i, j := range jobs {
		if strings.Contains(j.stdout(), "resumed from step") {
			t.Errorf("node %d's ranks resumed, where node 1 holds nothing:\n%s", i, j.stdout())
		}
	}
	if !strings.Contains(jobs[0].errText(), "the ranks' first loads found different steps (none: ranks 2,3; step 19: ranks 0,1)") {
		t.Errorf("node 0 does not say why its ranks start over:\n%s", jobs[0].errText())
	}
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), reference(t, "--steps", "20"); got != want {
		t.Fatalf("weights %s, without the loss %s", got, want)
	}
}

// TestNodeLostStartsOver: node 1 of a job without replicas is SIGKILLed
// whole, its disk folder gone with it, and a new node 1 comes on another
// host. Node 0's ranks hold their steps on disk, node 1's hold none, so
// every rank starts over, and node 0's incident says so rather than name
// the step its rank first loaded.
func TestNodeLostStartsOver(t *testing.T) {
	t.Parallel() // hosts of their own: two jobs at once share only the CPUs
	c := newCluster(t, 3, 1)
	args := []string{"--steps", "40", "--step-ms", "50", "--weights", filepath.Join(c.dir, "weights")}
	flags := []string{"--replicas", "-1", "--max-restarts", "3", "--heartbeat-deadline", "3s", "--collective-timeout", "60s"}
	n0, n1 := c.start(0, c.f.Hosts[0], flags, args...), c.start(1, c.f.Hosts[1], flags, args...)
	n0.waitLine("[rank0]: step 25 loss", 3*time.Minute)
	c.f.Hosts[1].Kill()
	<-n1.done
	n1b := c.start(1, c.f.Hosts[2], flags, args...)
	for i, j := range []*job{n0, n1b} {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstderr:\n%s", i, err, j.errText())
		}
	}
	if want := "recovered: resumed from the start (no step held by every rank)"; !strings.Contains(n0.errText(), want) {
		t.Errorf("node 0 does not say %q:\n%s", want, n0.errText())
	}
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), resizedReference(t, 2, 2, -1, 40); got != want {
		t.Fatalf("weights after the job started over %s, without the fault %s", got, want)
	}
}

// BenchmarkNodeLost measures, on hosts apart, the time from a whole node's
// SIGKILL to the job back at the step where it died, the replacement
// started on a new host 3 s after the kill: under faultline-run (memory
// checkpoints every step, each rank's replicated to the other node, a
// folder per node) and under torch.distributed.run with a c10d rendezvous
// (torch.save every 10 steps to a folder both nodes share, as a torchrun
// job checkpoints). The job: train.py, 2 nodes x 2 ranks, 100 ms a step,
// node 1 killed in step 51: iteration i of N at (i+0.5)/N of the step,
// so that the kills spread evenly over it, as a fault's time would. Run
// it with
//
//	go test -run '^$' -bench NodeLost -benchtime 4x ./examples/faultline-run/
//
// It reports both times, their ratio (faultline-run's over torchrun's) and
// the steps each lost (trained again after the resume), on average: a
// kill in the moment between a step's end and its replica's arrival costs
// that step.
func BenchmarkNodeLost(b *testing.B) {
	needTorchrun(b)
	args := []string{"--steps", "80", "--step-ms", "100"}
	var r recoveries
	for i := range b.N {
		into := time.Duration((float64(i) + 0.5) / float64(b.N) * float64(100*time.Millisecond))
		c := newCluster(b, 2, 2)
		c.spares = true
		flags := []string{"--max-restarts", "3", "--heartbeat-deadline", "3s"}
		n0 := c.start(0, c.f.Hosts[0], flags, args...)
		c.start(1, c.f.Hosts[1], flags, args...)
		d, lost := nodeLost(c, n0, into, func(h *testkit.Host) { c.start(1, h, flags, args...) })
		r.fl, r.flLost = r.fl+d, r.flLost+lost

		c = newCluster(b, 2, 2)
		t0 := c.torchrun(c.f.Hosts[0], "2", "", args...)
		c.torchrun(c.f.Hosts[1], "2", "", args...)
		d, lost = nodeLost(c, t0, into, func(h *testkit.Host) { c.torchrun(h, "2", "", args...) })
		r.tr, r.trLost = r.tr+d, r.trLost+lost
	}
	r.report(b)
}

// recoveries sums, over a benchmark's iterations, the recovery times and
// the steps lost under faultline-run and under torchrun.
type recoveries struct {
	fl, tr         time.Duration
	flLost, trLost int
}

// report reports both launchers' times, their ratio (faultline-run's over
// torchrun's) and the steps each lost, on average.
func (r recoveries) report(b *testing.B) {
	n := float64(b.N)
	b.ReportMetric(r.fl.Seconds()/n, "faultline-s")
	b.ReportMetric(r.tr.Seconds()/n, "torchrun-s")
	b.ReportMetric(r.fl.Seconds()/r.tr.Seconds(), "x-torchrun")
	b.ReportMetric(float64(r.flLost)/n, "faultline-steps-lost")
	b.ReportMetric(float64(r.trLost)/n, "torchrun-steps-lost")
}

// needTorchrun skips b without torch.distributed.run.
func needTorchrun(b *testing.B) {
	needTorch(b)
	if err := exec.Command(torchPython, "-c", "import torch.distributed.run").Run(); err != nil {
		b.Skipf("needs torch importable from %s (Debian package python3-torch): %v", torchPython, err)
	}
}

// torchrun starts train.py --baseline with args on h under
// torch.distributed.run, --nnodes nnodes, c's ranks per node, a c10d
// rendezvous served by node 0's host (conf adds to its --rdzv_conf), and
// torch.save checkpoints in a folder every host shares.
func (c *cluster) torchrun(h *testkit.Host, nnodes, conf string, args ...string) *job {
	c.t.Helper()
	torchrun, _ := filepath.Abs(filepath.Join("testdata", "torchrun.py"))
	train, _ := filepath.Abs("train.py")
	// Node 0 hosts the rendezvous's store, and each host is named by its
	// address, which torchrun gives its ranks as the master's: the
	// namespaces share the machine's host name.
	conf = "is_host=" + strconv.FormatBool(h == c.f.Hosts[0]) + conf
	cmd := h.Command("unshare", append([]string{"--uts", "sh", "-c", `hostname "$0" && exec "$@"`, h.IP, torchPython, torchrun,
		"--nnodes", nnodes, "--nproc_per_node", strconv.Itoa(c.perNode), "--max_restarts", "3",
		"--rdzv_backend", "c10d", "--rdzv_endpoint", net.JoinHostPort(c.master, strconv.Itoa(c.port)), "--rdzv_id", c.id,
		"--rdzv_conf", conf, train, "--baseline", "--ckpt", filepath.Join(c.dir, "tr-ckpt")}, args...)...)
	cmd.Env = append(os.Environ(), "OMP_NUM_THREADS=1", "PYTHONUNBUFFERED=1", "GLOO_SOCKET_IFNAME="+h.Iface)
	return startProc(c.t, filepath.Join(c.dir, "out-"+h.Name), cmd)
}

// nodeLost kills c's node 1 a time into after node 0's job n0 is past
// step 50, starts a replacement on a new host 3 s later, and returns the
// time from the kill to n0's first line, once resumed, of the step after
// the newest one done before the kill, and the steps done before the kill
// that were trained again.
func nodeLost(c *cluster, n0 *job, into time.Duration, replace func(*testkit.Host)) (time.Duration, int) {
	c.t.Helper()
	n0.waitLine("step 50 loss", 5*time.Minute)
	time.Sleep(into)
	// From the moment the kill begins: Kill returns once every process
	// of the host is gone, and a line node 0 printed meanwhile is of a
	// step node 1 did not live through.
	killed := time.Now()
	c.f.Hosts[1].Kill()
	time.Sleep(3 * time.Second)
	replace(c.f.AddHost())
	back, lost := backAfter(c, n0, killed, false, "the node's loss")
	// A step node 1 finished between the kill's start and its processes'
	// end may be resumed from: none is lost then.
	return back.Sub(killed), lost
}

// backAfter waits until n0, resumed from a restart after since, prints
// the line of the step after the newest one it had done, and returns
// when, with the steps done that were trained again. A step is done when
// n0 printed it before since or, with doneUntilResume (the job trained on
// meanwhile), before it resumed.
func backAfter(c *cluster, n0 *job, since time.Time, doneUntilResume bool, after string) (time.Time, int) {
	c.t.Helper()
	for deadline := time.Now().Add(5 * time.Minute); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		done, resumed := -1, -1 // each look reads the lines from the first
		var back time.Time
		n0.mu.Lock()
		for _, l := range n0.lines {
			var st int
			i := strings.Index(l.text, "step ")
			switch {
			case resumed < 0 && l.at.After(since) && strings.Contains(l.text, "resumed from step "):
				fmt.Sscanf(l.text[strings.Index(l.text, "resumed from step "):], "resumed from step %d", &resumed)
			case resumed < 0 && (doneUntilResume || l.at.Before(since)):
				if _, err := fmt.Sscanf(l.text[max(i, 0):], "step %d loss", &st); i >= 0 && err == nil {
					done = max(done, st)
				}
			case resumed >= 0 && strings.Contains(l.text, fmt.Sprintf("step %d loss", max(done, resumed)+1)):
				back = l.at
			}
			if !back.IsZero() {
				break
			}
		}
		n0.mu.Unlock()
		if !back.IsZero() {
			return back, max(done-resumed, 0)
		}
	}
	c.t.Fatalf("the job is not back after %s:\n%s\n%s", after, n0.stdout(), n0.errText())
	return time.Time{}, 0
}

// TestNodeZeroLost: the shape the docs recommend for clusters, the
// manager apart (taskd-manager --agents on a lease, on a host of its own),
// and node 0, which hosts the job's store, SIGKILLed whole in step 38,
// once node 1 holds the replicas of its ranks' step 37. Its
// replacement comes up 3 s later under node 0's address, as a recreated
// pod does under its headless Service's name, hosts the store again, and
// its ranks resume from the replicas node 1 holds: no step is lost and the
// weights are those of a run without the fault.
func TestNodeZeroLost(t *testing.T) {
	t.Parallel() // hosts of their own: two jobs at once share only the CPUs
	c := newCluster(t, 3, 2)
	mgrBin := filepath.Join(c.dir, "taskd-manager")
	if out, err := exec.Command("go", "build", "-o", mgrBin, "../taskd-manager").CombinedOutput(); err != nil {
		t.Fatalf("go build ../taskd-manager: %v\n%s", err, out)
	}
	mh := c.f.Hosts[2]
	addr := net.JoinHostPort(mh.IP, "9601")
	mgr := mh.Command(mgrBin, "--agents", "--insecure", "--job", c.id, "--nodes", "2", "--procs-per-node", "2",
		"--listen", addr, "--heartbeat-deadline", "3s", "--state-dir", filepath.Join(c.dir, "manager"),
		"--lease", "file", "--lease-file", filepath.Join(c.dir, "manager.lease"))
	mgrOut := testkit.NewOutput("manager", testing.Verbose())
	mgr.Env = append(os.Environ(), "TASKD_TOKEN="+c.token, "POD_NAME=manager-0")
	mgr.Stderr = mgrOut
	if err := mgr.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mgr.Process.Kill(); mgr.Wait() })

	args := []string{"--steps", "60", "--step-ms", "50", "--weights", filepath.Join(c.dir, "weights")}
	flags := []string{"--max-restarts", "3", "--manager", addr, "--collective-timeout", "60s"}
	// Rank 0 blocks before step 38's all-reduce, so that node 0 dies once
	// node 1 holds its ranks' step 37 (as in TestNodeLostFromReplicas).
	hang := append([]string{"--hang-rank", "0", "--hang-step", "38"}, args...)
	n0 := c.start(0, c.f.Hosts[0], flags, hang...)
	n1 := c.start(1, c.f.Hosts[1], flags, hang...)
	n0.waitLine("[rank0]: blocking in get_batch at step 38", 3*time.Minute)
	c.waitReplicas(c.f.Hosts[1], 37, 0, 1)
	c.f.Hosts[0].Kill()
	time.Sleep(3 * time.Second)
	n0b := c.start(0, c.f.Replace(c.f.Hosts[0]), flags, args...)
	for i, j := range []*job{n0b, n1} {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstdout:\n%s\nstderr:\n%s\nmanager:\n%s", i, err, j.stdout(), j.errText(), mgrOut.String())
		}
	}
	<-n0.done
	if st, ok := earliestResumed(n0b.stdout()); ok && st < 37 {
		t.Errorf("the new node 0 resumed from step %d: steps were lost, node 0 died in step 37\n%s", st, n0b.stdout())
	}
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), reference(t, "--steps", "60"); got != want {
		t.Fatalf("weights after node 0 was replaced %s, without the fault %s\nmanager:\n%s", got, want, mgrOut.String())
	}
}

// TestNodeZeroLostStandalone: node 0 of the standalone shape runs the
// job's manager and store; SIGKILLed whole in step 37 with no replacement,
// it takes the job with it. Node 1 ends after --node-timeout, but first
// persists its ranks' newest step and the replicas it holds of node 0's
// at that step, so the step commits in the folder the nodes share: run
// again, the job resumes from it and ends with the weights of a run
// without the fault.
func TestNodeZeroLostStandalone(t *testing.T) {
	t.Parallel() // hosts of their own: two jobs at once share only the CPUs
	c := newCluster(t, 2, 2)
	c.sharedDisk = true
	args := []string{"--steps", "60", "--step-ms", "50", "--weights", filepath.Join(c.dir, "weights")}
	flags := []string{"--max-restarts", "3", "--heartbeat-deadline", "3s", "--node-timeout", "4s", "--collective-timeout", "60s"}
	loseQuietly(c, flags, args, 0)
	h0 := c.f.Replace(c.f.Hosts[0])
	flags = flags[:len(flags)-4] // node 0 may take longer than 4 s to start
	again := []*job{c.start(0, h0, flags, args...), c.start(1, c.f.Hosts[1], flags, args...)}
	for i, j := range again {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d, run again: %v\nstderr:\n%s", i, err, j.errText())
		}
		if !strings.Contains(j.stdout(), "resumed from step 37") {
			t.Errorf("node %d, run again, does not resume from the step node 0 died in:\n%s", i, j.stdout())
		}
	}
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), reference(t, "--steps", "60"); got != want {
		t.Fatalf("weights after node 0 was lost and the job run again %s, without the fault %s", got, want)
	}
}

// BenchmarkReplicaCost measures what replicas cost a training job's step
// time, on hosts apart whose links are shaped to 1 Gbit/s: train.py on 2
// nodes x 1 rank, each rank's state 256 MiB (a buffer saved with the
// model), saved to memory every step, its newest step copied to the other
// node in the background (2.1 s at the link's rate); beside the same job
// with --replicas -1, in the same run. With steps of 3 s the replicas keep
// up; with steps of 1 s they cannot (two saves during each transfer, said
// on the agent's output). The links' queues honor the replicas' marks (a
// bulk socket priority), as Linux's default queueing and a switch's QoS
// classes do; the same job with replicas over links with one FIFO queue,
// where the transfers delay the gradients' all-reduce by up to the queue's
// 50 ms, runs beside them too (x-none-fifo). Run it with
//
//	go test -run '^$' -bench ReplicaCost -benchtime 1x ./examples/faultline-run/
//
// It reports the median step time of each, their ratios, and the transfers
// given up for a newer save, a step.
func BenchmarkReplicaCost(b *testing.B) {
	for _, step := range []time.Duration{time.Second, 3 * time.Second} {
		b.Run("step="+step.String(), func(b *testing.B) {
			steps := 20
			args := []string{"--steps", strconv.Itoa(steps), "--step-ms", strconv.Itoa(int(step.Milliseconds())), "--state-mb", "256", "--disk-every", "1000"}
			var with, fifo, without time.Duration
			var givenUp int
			for range b.N {
				for _, arm := range []struct {
					replicas string
					fifo     bool
				}{{"1", false}, {"1", true}, {"-1", false}} {
					c := newCluster(b, 2, 1)
					for _, h := range c.f.Hosts {
						if arm.fifo {
							h.ShapeFIFO("1gbit")
						} else {
							h.Shape("1gbit")
						}
					}
					flags := []string{"--replicas", arm.replicas, "-v"}
					jobs := []*job{c.start(0, c.f.Hosts[0], flags, args...), c.start(1, c.f.Hosts[1], flags, args...)}
					for i, j := range jobs {
						if err := j.wait(5 * time.Minute); err != nil {
							b.Fatalf("node %d: %v\n%s", i, err, j.errText())
						}
					}
					d := medianStep(b, jobs[0])
					switch {
					case arm.fifo:
						fifo += d
					case arm.replicas == "1":
						with += d
						givenUp += strings.Count(jobs[0].errText(), "replica given up")
					default:
						without += d
					}
				}
			}
			n := float64(b.N)
			b.ReportMetric(with.Seconds()/n, "replicas-step-s")
			b.ReportMetric(without.Seconds()/n, "none-step-s")
			b.ReportMetric(with.Seconds()/without.Seconds(), "x-none")
			b.ReportMetric(fifo.Seconds()/without.Seconds(), "x-none-fifo")
			b.ReportMetric(float64(givenUp)/n/float64(steps), "given-up/step")
		})
	}
}

// medianStep is the median time between rank 0's steps, past the first
// five (imports, the first saves).
func medianStep(b *testing.B, j *job) time.Duration {
	j.mu.Lock()
	defer j.mu.Unlock()
	var at []time.Time
	for _, l := range j.lines {
		if strings.Contains(l.text, "[rank0]: step ") {
			at = append(at, l.at)
		}
	}
	if len(at) < 10 {
		b.Fatalf("rank 0 printed %d steps", len(at))
	}
	var ds []time.Duration
	for i := 6; i < len(at); i++ {
		ds = append(ds, at[i].Sub(at[i-1]))
	}
	slices.Sort(ds)
	return ds[len(ds)/2]
}

// loseQuietly runs a job of two nodes with flags and args, loses node
// lost whole where no save and no transfer is in flight (its first rank
// blocks before step 38's all-reduce, the others wait in it, so every
// rank and every replica holds step 37), and checks that the other node
// ends the job, having committed step 37 with the lost node's shards from
// its replicas. It returns the other node's job.
func loseQuietly(c *cluster, flags, args []string, lost int) *job {
	c.t.Helper()
	hang := append([]string{"--hang-rank", strconv.Itoa(lost * c.perNode), "--hang-step", "38"}, args...)
	jobs := []*job{c.start(0, c.f.Hosts[0], flags, hang...), c.start(1, c.f.Hosts[1], flags, hang...)}
	left := jobs[1-lost]
	jobs[lost].waitLine(fmt.Sprintf("[rank%d]: blocking in get_batch at step 38", lost*c.perNode), 3*time.Minute)
	ranks := make([]int, c.perNode)
	for i := range ranks {
		ranks[i] = lost*c.perNode + i
	}
	c.waitReplicas(c.f.Hosts[1-lost], 37, ranks...)
	c.f.Hosts[lost].Kill()
	if err := left.wait(2 * time.Minute); err == nil {
		c.t.Fatalf("node %d ended as if the job had finished:\n%s", 1-lost, left.errText())
	}
	<-jobs[lost].done
	want := fmt.Sprintf("step 37, the newest that every rank here holds in memory and the replicas held here hold, is committed with every rank's shard, those of ranks %v from the replicas",
		[]int{lost * c.perNode, lost*c.perNode + 1})
	if !strings.Contains(left.errText(), want) {
		c.t.Fatalf("node %d does not say that it persisted node %d's ranks from its replicas:\n%s", 1-lost, lost, left.errText())
	}
	return left
}

// TestNodeLostNoReplacement: node 1 is SIGKILLed whole and no node takes
// its place within --node-timeout: node 0 gives the job up, but first
// persists its ranks' newest step with the replicas it holds of node 1's
// ranks, so that the step commits, and it says why the job stopped.
func TestNodeLostNoReplacement(t *testing.T) {
	t.Parallel() // hosts of their own: two jobs at once share only the CPUs
	c := newCluster(t, 2, 2)
	args := []string{"--steps", "60", "--step-ms", "50"}
	flags := []string{"--max-restarts", "3", "--heartbeat-deadline", "3s", "--node-timeout", "4s", "--collective-timeout", "60s"}
	n0 := loseQuietly(c, flags, args, 1)
	dir := filepath.Join(c.dir, "ckpt-"+c.f.Hosts[0].Name)
	if steps, err := ckpt.CommittedSteps(dir); err != nil || len(steps) == 0 || steps[0] != 37 {
		t.Errorf("%s: committed steps %v (%v), want 37 first", dir, steps, err)
	}
	if !strings.Contains(n0.errText(), "stopped: replacing timed out") {
		t.Errorf("node 0 does not say that no node took node 1's place in time:\n%s", n0.errText())
	}
	// Run again where node 0 ran, its --out the same: the recovery the
	// last run gave up is over, and does not stop this one.
	again := []*job{c.start(0, c.f.Hosts[0], flags[:len(flags)-4], "--steps", "40"), c.start(1, c.f.AddHost(), flags[:len(flags)-4], "--steps", "40")}
	for i, j := range again {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d, run again: %v\nstderr:\n%s", i, err, j.errText())
		}
	}
}
