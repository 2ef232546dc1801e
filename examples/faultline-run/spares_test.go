package main

import (
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// TestSpareNode: a job of 2 nodes x 2 ranks with a spare node, each on
// a host of its own. The spare runs no rank; node 1's ranks send their
// replicas to it, as to the node after them. Node 1's host is SIGKILLed
// once the spare holds the replicas of its ranks' step 37 (the ranks held
// in step 38): node 0 hands node 1's place to the spare as soon as its
// manager declares node 1 lost, the spare runs again as node 1, and its
// ranks resume from the replicas in its own memory, from the step where
// node 1 died: no step lost, and no operator started a node. The final
// weights are those of the job run without the fault.
func TestSpareNode(t *testing.T) {
	// Not parallel: a spare acts on a node declared lost within a heartbeat
	// interval, so these run before the parallel tests, on a machine less
	// loaded than among them.
	// A heartbeat deadline of 5 s, not the 3 s of the other node tests: a
	// node declared lost on a loaded machine has its place taken at once
	// where a spare waits, and the job restarts.
	c := newCluster(t, 3, 2)
	c.spares = true // the spare's point: warm interpreters
	args := []string{"--steps", "60", "--step-ms", "50", "--weights", filepath.Join(c.dir, "weights")}
	flags := []string{"--spare-nodes", "1", "--max-restarts", "3", "--heartbeat-deadline", "5s", "--node-timeout", "2m", "--collective-timeout", "60s"}
	hang := append([]string{"--hang-rank", "2", "--hang-step", "38"}, args...)
	jobs := []*job{c.start(0, c.f.Hosts[0], flags, hang...), c.start(1, c.f.Hosts[1], flags, hang...), c.start(2, c.f.Hosts[2], flags, hang...)}
	jobs[1].waitLine("[rank2]: blocking in get_batch at step 38", 3*time.Minute)
	c.waitReplicas(c.f.Hosts[2], 37, 2, 3)
	killed := time.Now()
	c.f.Hosts[1].Kill()
	back := jobs[2].waitLine("[rank2]: resumed from step", 3*time.Minute)
	for _, i := range []int{0, 2} {
		if err := jobs[i].wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstdout:\n%s\nstderr:\n%s", i, err, jobs[i].stdout(), jobs[i].errText())
		}
	}
	<-jobs[1].done
	t.Logf("from node 1's loss to its ranks resumed on the spare: %.2fs (heartbeat deadline 5s)", back.Sub(killed).Seconds())
	if !strings.Contains(jobs[0].errText(), "node 1 is lost; spare node 2 takes its place") {
		t.Errorf("node 0 does not say that the spare takes node 1's place:\n%s", jobs[0].errText())
	}
	if !strings.Contains(jobs[2].errText(), "node 2 goes on as node 1 of 2") {
		t.Errorf("the spare does not say that it goes on as node 1:\n%s", jobs[2].errText())
	}
	if st, ok := earliestResumed(jobs[2].stdout()); ok && st < 37 {
		t.Errorf("the spare as node 1 resumed from step %d: steps were lost, node 1 died in step 38\n%s", st, jobs[2].stdout())
	}
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), reference(t, "--steps", "60"); got != want {
		t.Fatalf("weights after the spare took node 1's place %s, without the fault %s", got, want)
	}
}

// TestSpareOfAnotherShape: a spare whose world cannot be made of whole
// nodes of the job's (one rank a node where the job has two) is refused
// by node 0's manager, and ends saying so rather than wait; so does a
// node started as one of a job of 3 nodes at the spare's place.
func TestSpareOfAnotherShape(t *testing.T) {
	// Not parallel: a spare acts on a node declared lost within a heartbeat
	// interval, so these run before the parallel tests, on a machine less
	// loaded than among them.
	c := newCluster(t, 2, 2)
	flags := []string{"--spare-nodes", "1", "--heartbeat-deadline", "3s"}
	n0 := c.start(0, c.f.Hosts[0], flags, "--steps", "5")
	spare := c.start(2, c.f.Hosts[1], append(flags, "--nproc-per-node", "1"), "--steps", "5")
	if err := spare.wait(2 * time.Minute); err == nil {
		t.Fatalf("the spare of another shape ended well:\n%s", spare.errText())
	}
	if want := "the job's manager refuses rank 2 of node 2"; !strings.Contains(spare.errText(), want) ||
		!strings.Contains(spare.errText(), "rank 2 is not of node 2, whose ranks are 4 to 5 with 2 a node") {
		t.Errorf("the spare does not say %q and why:\n%s", want, spare.errText())
	}
	node2 := c.start(2, c.f.Hosts[1], []string{"--nnodes", "3", "--heartbeat-deadline", "3s"}, "--steps", "5")
	if err := node2.wait(2 * time.Minute); err == nil {
		t.Fatalf("a node of a job of 3 at the spare's place ended well:\n%s", node2.errText())
	}
	if want := "node 2 was started with --nnodes 3 --spare-nodes 0 --nproc-per-node 2, the job's node 0 with --nnodes 2 --spare-nodes 1 --nproc-per-node 2"; !strings.Contains(node2.errText(), want) {
		t.Errorf("node 2 does not say %q:\n%s", want, node2.errText())
	}
	n0.cmd.Process.Signal(syscall.SIGTERM)
	n0.wait(time.Minute)
}

// BenchmarkSpareNode measures, on hosts apart, the time from a whole
// node's SIGKILL to the job back at the step where it died, with a spare
// node waiting (--spare-nodes 1, on a host of its own), beside the same
// job whose replacement an operator starts on a new host 3 s after the
// kill (BenchmarkNodeLost's faultline-run side), in the same run. The job:
// train.py, 2 nodes x 2 ranks, 100 ms a step, heartbeat deadline 3 s,
// node 1 killed in step 51 at (i+0.5)/N of the step. Run it with
//
//	go test -run '^$' -bench SpareNode -benchtime 2x ./examples/faultline-run/
//
// It reports both times, their ratio and the steps each lost, on
// average.
func BenchmarkSpareNode(b *testing.B) {
	needTorch(b)
	args := []string{"--steps", "80", "--step-ms", "100"}
	flags := []string{"--max-restarts", "3", "--heartbeat-deadline", "3s"}
	var spare, byHand time.Duration
	var spareLost, byHandLost int
	for i := range b.N {
		into := time.Duration((float64(i) + 0.5) / float64(b.N) * float64(100*time.Millisecond))
		c := newCluster(b, 3, 2)
		c.spares = true
		sf := append([]string{"--spare-nodes", "1"}, flags...)
		n0 := c.start(0, c.f.Hosts[0], sf, args...)
		c.start(1, c.f.Hosts[1], sf, args...)
		c.start(2, c.f.Hosts[2], sf, args...)
		d, lost := nodeLost(c, n0, into, func(*testkit.Host) {})
		spare, spareLost = spare+d, spareLost+lost

		c = newCluster(b, 2, 2)
		c.spares = true
		n0 = c.start(0, c.f.Hosts[0], flags, args...)
		c.start(1, c.f.Hosts[1], flags, args...)
		d, lost = nodeLost(c, n0, into, func(h *testkit.Host) { c.start(1, h, flags, args...) })
		byHand, byHandLost = byHand+d, byHandLost+lost
	}
	n := float64(b.N)
	b.ReportMetric(spare.Seconds()/n, "spare-s")
	b.ReportMetric(byHand.Seconds()/n, "by-hand-s")
	b.ReportMetric(spare.Seconds()/byHand.Seconds(), "x-by-hand")
	b.ReportMetric(float64(spareLost)/n, "spare-steps-lost")
	b.ReportMetric(float64(byHandLost)/n, "by-hand-steps-lost")
}

// TestSpareLost: the spare of a job of 2 nodes x 2 ranks, which holds
// node 1's replicas (the node after it), is SIGKILLed with its host. The
// job goes on, and node 1 sends its replicas to node 0 instead: when
// node 1's host dies in turn and a new node 1 is started by hand, its
// ranks resume from them, from the step where node 1 died, rather than
// the job starting over for want of them.
func TestSpareLost(t *testing.T) {
	// Not parallel: a spare acts on a node declared lost within a heartbeat
	// interval, so these run before the parallel tests, on a machine less
	// loaded than among them.
	c := newCluster(t, 3, 2)
	args := []string{"--steps", "60", "--step-ms", "50", "--weights", filepath.Join(c.dir, "weights")}
	flags := []string{"--spare-nodes", "1", "--max-restarts", "3", "--heartbeat-deadline", "5s", "--node-timeout", "2m", "--collective-timeout", "60s"}
	hang := append([]string{"--hang-rank", "2", "--hang-step", "38"}, args...)
	jobs := []*job{c.start(0, c.f.Hosts[0], flags, hang...), c.start(1, c.f.Hosts[1], flags, hang...), c.start(2, c.f.Hosts[2], flags, hang...)}
	c.waitReplicas(c.f.Hosts[2], 1, 2, 3)
	c.f.Hosts[2].Kill()
	jobs[1].waitLine("[rank2]: blocking in get_batch at step 38", 3*time.Minute)
	c.waitReplicas(c.f.Hosts[0], 37, 2, 3)
	c.f.Hosts[1].Kill()
	n1 := c.start(1, c.f.AddHost(), flags, args...)
	for i, j := range []*job{jobs[0], n1} {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstdout:\n%s\nstderr:\n%s", i, err, j.stdout(), j.errText())
		}
	}
	if st := resumedFrom(n1.stdout()); st < 37 {
		t.Errorf("the new node 1 resumed from step %d: steps were lost, node 1 died in step 38\n%s", st, n1.stdout())
	}
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), reference(t, "--steps", "60"); got != want {
		t.Fatalf("weights after the spare and node 1 were lost %s, without the fault %s", got, want)
	}
}

// TestSpareThenShrink: a job of 3 nodes of one rank, --nnodes 2:3, with a
// spare, which holds node 2's replica (the node after it). Nodes 1 and 2
// die together: the spare takes node 2's place, whose replica it holds,
// rather than node 1's, whose replica died with node 2; no node takes
// node 1's within --node-timeout, so the job goes on with nodes 0 and 2,
// node 2 as node 1 from the replica the spare held. No step is lost: the
// weights are those of 3 ranks to the step the ranks held, then 2.
func TestSpareThenShrink(t *testing.T) {
	// Not parallel: a spare acts on a node declared lost within a heartbeat
	// interval, so these run before the parallel tests, on a machine less
	// loaded than among them.
	c := newCluster(t, 4, 1)
	args := []string{"--steps", "40", "--step-ms", "50", "--weights", filepath.Join(c.dir, "weights")}
	flags := []string{"--nnodes", "2:3", "--spare-nodes", "1", "--max-restarts", "3", "--heartbeat-deadline", "5s",
		"--node-timeout", "6s", "--collective-timeout", "60s"}
	// Rank 0 blocks before step 20's all-reduce: every rank holds step 19.
	hang := append([]string{"--hang-rank", "0", "--hang-step", "20"}, args...)
	jobs := make([]*job, 4)
	for i := range jobs {
		jobs[i] = c.start(i, c.f.Hosts[i], flags, hang...)
	}
	jobs[0].waitLine("[rank0]: blocking in get_batch at step 20", 3*time.Minute)
	c.waitReplicas(c.f.Hosts[3], 19, 2)
	c.f.Hosts[1].Kill()
	c.f.Hosts[2].Kill()
	for _, i := range []int{0, 3} {
		if err := jobs[i].wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstdout:\n%s\nstderr:\n%s", i, err, jobs[i].stdout(), jobs[i].errText())
		}
	}
	if !strings.Contains(jobs[0].errText(), "node 2 is lost; spare node 3 takes its place") {
		t.Errorf("the spare does not take node 2's place, whose replica it holds:\n%s", jobs[0].errText())
	}
	if from := resumedFrom(jobs[0].stdout()); from != 19 {
		t.Fatalf("the job resumed from step %d, want 19, where every rank was\n%s", from, jobs[0].stdout())
	}
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), resizedReference(t, 3, 2, 19, 40); got != want {
		t.Fatalf("weights after the spare and the shrink %s, on 3 ranks to step 19 then on 2: %s", got, want)
	}
}
