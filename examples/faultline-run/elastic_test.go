package main

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// The tests of elastic jobs (--nnodes MIN:MAX) on hosts apart.

// resumedFrom returns the step the last "resumed from step N" line of
// out names, -1 when none does.
func resumedFrom(out string) int {
	st := -1
	for _, l := range strings.Split(out, "\n") {
		if i := strings.Index(l, "resumed from step "); i >= 0 {
			st, _ = strconv.Atoi(strings.TrimSpace(l[i+len("resumed from step "):]))
		}
	}
	return st
}

// earliestResumed returns the oldest step that a line of out says a rank
// resumed from, and whether one does.
func earliestResumed(out string) (int, bool) {
	st, found := 0, false
	for _, l := range strings.Split(out, "\n") {
		if i := strings.Index(l, "resumed from step "); i >= 0 {
			n, _ := strconv.Atoi(strings.TrimSpace(l[i+len("resumed from step "):]))
			if !found || n < st {
				st, found = n, true
			}
		}
	}
	return st, found
}

// TestElasticShrink: a job of 3 nodes of 2 ranks started with --nnodes
// 2:3 loses node 1, whole, and no node takes its place within
// --node-timeout: nodes 0 and 2 go on as a job of 2 (node 2 as node 1,
// its ranks 4 and 5 as ranks 2 and 3), from the newest step they hold in
// memory, and finish with the weights of the same script run on 6 ranks
// up to that step and then on 4 from its checkpoint.
func TestElasticShrink(t *testing.T) {
	t.Parallel() // hosts of their own
	c := newCluster(t, 3, 2)
	args := []string{"--steps", "40", "--step-ms", "50", "--weights", filepath.Join(c.dir, "weights")}
	flags := []string{"--nnodes", "2:3", "--max-restarts", "3", "--heartbeat-deadline", "3s", "--node-timeout", "4s", "--collective-timeout", "60s"}
	jobs := make([]*job, 3)
	for i := range jobs {
		jobs[i] = c.start(i, c.f.Hosts[i], flags, args...)
	}
	jobs[0].waitLine("[rank0]: step 20 loss", 3*time.Minute)
	killed := time.Now()
	c.f.Hosts[1].Kill()
	back := jobs[0].waitLine("[rank0]: resumed from step", 3*time.Minute)
	for _, i := range []int{0, 2} {
		if err := jobs[i].wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstdout:\n%s\nstderr:\n%s", i, err, jobs[i].stdout(), jobs[i].errText())
		}
	}
	<-jobs[1].done
	t.Logf("from node 1's loss to the job going on with 2 nodes: %v", back.Sub(killed).Round(time.Millisecond))
	if want := "nodes [1] were lost and no node took their place within --node-timeout 4s; the job goes on with 2 nodes of 3 (world 6 → 4)"; !strings.Contains(jobs[0].errText(), want) {
		t.Errorf("node 0 does not say %q:\n%s", want, jobs[0].errText())
	}
	if want := "node 2 goes on as node 1 of 2"; !strings.Contains(jobs[2].errText(), want) {
		t.Errorf("node 2 does not say %q:\n%s", want, jobs[2].errText())
	}
	for _, i := range []int{0, 2} {
		var said bool
		for _, in := range jobs[i].incidents() {
			said = said || strings.Contains(in.Outcome, "resized: nodes [1] were lost") && strings.Contains(in.Outcome, "(world 6 → 4)")
		}
		if !said {
			t.Errorf("node %d's incidents do not say that the world went from 6 to 4: %+v", i, jobs[i].incidents())
		}
	}
	// Every rank of the job that went on resumed from one step, node 2's
	// as ranks 2 and 3, from memory.
	from := resumedFrom(jobs[0].stdout())
	if from < 19 {
		t.Fatalf("node 0 resumed from step %d, before the step in which node 1 was lost (20 or later)\n%s", from, jobs[0].stdout())
	}
	for _, line := range []string{"[rank2]: resumed from step " + strconv.Itoa(from), "[rank3]: resumed from step " + strconv.Itoa(from)} {
		if !strings.Contains(jobs[2].stdout(), line) {
			t.Errorf("node 2 does not say %q:\n%s", line, jobs[2].stdout())
		}
	}
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), resizedReference(t, 6, 4, from, 40); got != want {
		t.Fatalf("weights after the job went on with 2 nodes from step %d: %s; on 6 ranks to that step, then on 4: %s", from, got, want)
	}
}

// resizedReference returns the weights of train.py run without a fault
// on ranks ranks to step at, then on ranks2 from that step to steps (with
// at -1, on ranks2 only).
func resizedReference(t testing.TB, ranks, ranks2, at, steps int) string {
	t.Helper()
	if at < 0 {
		return phasedReference(t, part{ranks2, steps - 1})
	}
	return phasedReference(t, part{ranks, at}, part{ranks2, steps - 1})
}

// part is a run of an elastic job's reference: on ranks ranks, to step
// upTo.
type part struct{ ranks, upTo int }

// phasedReference returns the weights of train.py run without a fault
// in parts, each on its ranks from the state in which the last ended
// (--save-state, then --init) to its step.
func phasedReference(t testing.TB, parts ...part) string {
	t.Helper()
	dir := t.TempDir()
	w := filepath.Join(dir, "weights")
	state := ""
	for i, p := range parts {
		args := []string{"--steps", strconv.Itoa(p.upTo + 1), "--ckpt", filepath.Join(dir, "ckpt-"+strconv.Itoa(i)), "--weights", w}
		if state != "" {
			args = append(args, "--init", state)
		}
		state = filepath.Join(dir, "state-"+strconv.Itoa(i))
		args = append(args, "--save-state", state)
		j := start(t, filepath.Join(dir, "out-"+strconv.Itoa(i)), []string{"--standalone", "--nproc-per-node", strconv.Itoa(p.ranks), "--no-spares", "--rdzv-id", "reference-" + randomHex(3)}, args...)
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("the run without faults on %d ranks to step %d: %v\nstderr:\n%s", p.ranks, p.upTo, err, j.errText())
		}
		if i > 0 && resumedFrom(j.stdout()) != parts[i-1].upTo {
			t.Fatalf("the reference's run on %d ranks did not resume from step %d:\n%s", p.ranks, parts[i-1].upTo, j.stdout())
		}
	}
	return readHash(t, w)
}

// BenchmarkElasticShrink times a job going on with fewer nodes: from the
// moment node 1 of 3 (one rank each, train.py at 100 ms a step, killed
// in step 51 at points spread over the step) is SIGKILLed whole, with no
// node to take its place, to nodes 0 and 2 back at the step after the
// newest one done before the kill. Beside it, in the same run, torchrun
// --nnodes 2:3 (c10d rendezvous, torch.save every 10 steps to a folder
// the hosts share) on the same hosts. Each waits 5 s for a node to take
// the lost one's place (--node-timeout, torchrun's last_call_timeout);
// faultline-run also waits --heartbeat-deadline 3s before it calls the
// node lost. Run it with
//
//	go test -run '^$' -bench ElasticShrink -benchtime 2x ./examples/faultline-run/
func BenchmarkElasticShrink(b *testing.B) {
	needTorchrun(b)
	args := []string{"--steps", "80", "--step-ms", "100"}
	none := func(*testkit.Host) {}
	var r recoveries
	for i := range b.N {
		into := time.Duration((float64(i) + 0.5) / float64(b.N) * float64(100*time.Millisecond))
		c := newCluster(b, 3, 1)
		c.spares = true
		flags := []string{"--nnodes", "2:3", "--max-restarts", "3", "--heartbeat-deadline", "3s", "--node-timeout", "5s"}
		n0 := c.start(0, c.f.Hosts[0], flags, args...)
		c.start(1, c.f.Hosts[1], flags, args...)
		c.start(2, c.f.Hosts[2], flags, args...)
		d, lost := nodeLost(c, n0, into, none)
		r.fl, r.flLost = r.fl+d, r.flLost+lost

		c = newCluster(b, 3, 1)
		t0 := c.torchrun(c.f.Hosts[0], "2:3", ",last_call_timeout=5", args...)
		c.torchrun(c.f.Hosts[1], "2:3", ",last_call_timeout=5", args...)
		c.torchrun(c.f.Hosts[2], "2:3", ",last_call_timeout=5", args...)
		d, lost = nodeLost(c, t0, into, none)
		r.tr, r.trLost = r.tr+d, r.trLost+lost
	}
	r.report(b)
}

// TestElasticReplaced: in a job started with --nnodes 2:3, node 1 is
// SIGKILLed whole and a new node 1 comes on a new host within
// --node-timeout: it takes node 1's place, as in a job of fixed
// membership, its ranks started as the others' are, and the job finishes
// on 3 nodes with the weights of a run without the fault.
func TestElasticReplaced(t *testing.T) {
	t.Parallel() // hosts of their own
	c := newCluster(t, 3, 1)
	args := []string{"--steps", "40", "--step-ms", "50", "--weights", filepath.Join(c.dir, "weights")}
	flags := []string{"--nnodes", "2:3", "--max-restarts", "3", "--heartbeat-deadline", "3s", "--node-timeout", "2m", "--collective-timeout", "60s"}
	jobs := make([]*job, 3)
	for i := range jobs {
		jobs[i] = c.start(i, c.f.Hosts[i], flags, args...)
	}
	t.Cleanup(func() {
		if t.Failed() { // what the other nodes saw, for a failure that names one
			t.Logf("node 0's stderr:\n%s\nnode 2's stderr:\n%s", jobs[0].errText(), jobs[2].errText())
		}
	})
	jobs[0].waitLine("[rank0]: step 15 loss", 3*time.Minute)
	c.f.Hosts[1].Kill()
	<-jobs[1].done
	jobs[1] = c.start(1, c.f.AddHost(), flags, args...)
	for i, j := range jobs {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstdout:\n%s\nstderr:\n%s", i, err, j.stdout(), j.errText())
		}
	}
	if strings.Contains(jobs[0].errText(), "goes on with") {
		t.Errorf("the job went on with fewer nodes though node 1 was replaced:\n%s", jobs[0].errText())
	}
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), resizedReference(t, 3, 3, -1, 40); got != want {
		t.Fatalf("weights after node 1 was replaced: %s; without the fault: %s", got, want)
	}
}

// TestElasticGrow: a job of 3 nodes of 2 ranks started with --nnodes 2:3
// loses node 1, whole, and goes on with nodes 0 and 2; then node 1 comes
// back, on a new host, started as it was. It finds the job under its new
// shape's name, waits to join it, and the job takes it in at the next
// step its ranks save: every rank stops, and the job goes on with 3 nodes
// from that step, the new node's ranks 4 and 5 with the state of ranks 0
// and 1. It finishes with the weights of the same script run on 6 ranks
// to the step the shrink resumed from, on 4 to the step of the grow, and
// on 6 from there.
func TestElasticGrow(t *testing.T) {
	t.Parallel() // hosts of their own
	c := newCluster(t, 3, 2)
	c.spares = true
	args := []string{"--steps", "60", "--step-ms", "50", "--weights", filepath.Join(c.dir, "weights")}
	flags := []string{"--nnodes", "2:3", "--max-restarts", "3", "--heartbeat-deadline", "3s", "--node-timeout", "4s", "--join-timeout", "2s", "--collective-timeout", "60s"}
	jobs := make([]*job, 3)
	for i := range jobs {
		jobs[i] = c.start(i, c.f.Hosts[i], flags, args...)
	}
	t.Cleanup(func() {
		if t.Failed() { // what the other nodes saw, for a failure that names one
			t.Logf("node 0's stderr:\n%s\nnode 2's stderr:\n%s", jobs[0].errText(), jobs[2].errText())
		}
	})
	jobs[0].waitLine("[rank0]: step 15 loss", 3*time.Minute)
	c.f.Hosts[1].Kill()
	jobs[0].waitLine("[rank0]: resumed from step", 3*time.Minute)
	<-jobs[1].done
	shrunk := resumedFrom(jobs[0].stdout())
	came := time.Now()
	jobs[1] = c.start(1, c.f.AddHost(), flags, args...)
	joined := jobs[1].waitLine("[rank4]: resumed from step", 3*time.Minute)
	t.Logf("from node 1's start to its ranks resumed in the grown job: %v", joined.Sub(came).Round(time.Millisecond))
	for i, j := range jobs {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstdout:\n%s\nstderr:\n%s", i, err, j.stdout(), j.errText())
		}
	}
	grown := resumedFrom(jobs[1].stdout())
	want := fmt.Sprintf("the nodes started as --node-rank [1] joined; the job goes on with 3 nodes of 3 (world 4 → 6), from step %d", grown)
	if !strings.Contains(jobs[0].errText(), want) {
		t.Errorf("node 0 does not say %q:\n%s", want, jobs[0].errText())
	}
	if want := "waits to join job " + c.id + "-g1"; !strings.Contains(jobs[1].errText(), want) {
		t.Errorf("the node that came back does not say %q:\n%s", want, jobs[1].errText())
	}
	// Every rank of the grown job resumed from one step, and no rank had
	// gone past the step after it.
	for i, ranks := range [][]int{{0, 1}, {4, 5}, {2, 3}} {
		for _, r := range ranks {
			if line := fmt.Sprintf("[rank%d]: resumed from step %d", r, grown); !strings.Contains(jobs[i].stdout(), line) {
				t.Errorf("node %d does not say %q:\n%s", i, line, jobs[i].stdout())
			}
		}
	}
	out := jobs[0].stdout()
	if i := strings.Index(out, fmt.Sprintf("[rank0]: step %d loss", grown+2)); i >= 0 && i < strings.LastIndex(out, "[rank0]: resumed from step") {
		t.Errorf("the ranks had done step %d before the job went on from step %d: steps were lost\n%s", grown+2, grown, jobs[0].stdout())
	}
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), phasedReference(t, part{6, shrunk}, part{4, grown}, part{6, 59}); got != want {
		t.Fatalf("weights after the job went on with 2 nodes from step %d and with 3 from step %d: %s; on 6, 4 and 6 ranks so: %s", shrunk, grown, got, want)
	}
}

// TestElasticStartsWithMin: of a job started with --nnodes 2:3, only
// nodes 0 and 1 come: once --join-timeout has passed with MIN nodes
// there, the job runs on those two, its ranks started once, in a world of
// 2. Then node 2 comes. It waits to join, and the job takes it in at the
// next step its ranks save, and finishes on 3 nodes with the weights of
// the same script run on 2 ranks to that step and on 3 from it.
func TestElasticStartsWithMin(t *testing.T) {
	t.Parallel() // hosts of their own
	c := newCluster(t, 3, 1)
	args := []string{"--steps", "80", "--step-ms", "100", "--weights", filepath.Join(c.dir, "weights")}
	flags := []string{"--nnodes", "2:3", "--join-timeout", "2s", "--max-restarts", "1", "--collective-timeout", "60s"}
	jobs := []*job{c.start(0, c.f.Hosts[0], flags, args...), c.start(1, c.f.Hosts[1], flags, args...)}
	jobs[0].waitLine("[rank0]: step 10 loss", 3*time.Minute)
	if want := "nodes [2] did not join within --join-timeout 2s; the job goes on with 2 nodes of 3 (world 3 → 2)"; !strings.Contains(jobs[0].errText(), want) {
		t.Errorf("node 0 does not say %q:\n%s", want, jobs[0].errText())
	}
	// The ranks started once, in the world they trained in.
	for i, j := range jobs {
		if strings.Contains(j.stdout(), " of 3\n") || strings.Count(j.stdout(), "starting rank") != 1 {
			t.Errorf("node %d's rank did not start once, in a world of 2:\n%s", i, j.stdout())
		}
	}
	jobs = append(jobs, c.start(2, c.f.Hosts[2], flags, args...))
	for i, j := range jobs {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstdout:\n%s\nstderr:\n%s", i, err, j.stdout(), j.errText())
		}
	}
	grown := resumedFrom(jobs[2].stdout())
	if grown < 10 || !strings.Contains(jobs[0].stdout(), fmt.Sprintf("[rank0]: resumed from step %d", grown)) {
		t.Fatalf("the job did not go on from one step after step 10 with node 2 (node 2 resumed from %d):\n%s\n%s", grown, jobs[0].stdout(), jobs[2].stdout())
	}
	want := fmt.Sprintf("the nodes started as --node-rank [2] joined; the job goes on with 3 nodes of 3 (world 2 → 3), from step %d", grown)
	if !strings.Contains(jobs[0].errText(), want) {
		t.Errorf("node 0 does not say %q:\n%s", want, jobs[0].errText())
	}
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), phasedReference(t, part{2, grown}, part{3, 79}); got != want {
		t.Fatalf("weights of the job that took in node 2 at step %d: %s; on 2 ranks to that step, then on 3: %s", grown, got, want)
	}
}

// BenchmarkElasticGrow times a job taking in a node: from the moment a
// third node is started (train.py at 100 ms a step, one rank a node, on
// hosts apart, started at points spread over step 51 of a job that runs
// on 2 nodes of --nnodes 2:3) to the job, on 3 nodes, back at the step
// after the newest one done before it stopped for the new node. Beside
// it, in the same run, torchrun --nnodes 2:3 (c10d rendezvous, torch.save
// every 10 steps to a folder the hosts share) on the same hosts, whose
// agents restart every worker when they see a node waiting. Run it with
//
//	go test -run '^$' -bench ElasticGrow -benchtime 2x ./examples/faultline-run/
func BenchmarkElasticGrow(b *testing.B) {
	needTorchrun(b)
	args := []string{"--steps", "90", "--step-ms", "100"}
	var r recoveries
	for i := range b.N {
		into := time.Duration((float64(i) + 0.5) / float64(b.N) * float64(100*time.Millisecond))
		c := newCluster(b, 3, 1)
		c.spares = true
		flags := []string{"--nnodes", "2:3", "--join-timeout", "3s", "--max-restarts", "3"}
		n0 := c.start(0, c.f.Hosts[0], flags, args...)
		c.start(1, c.f.Hosts[1], flags, args...)
		d, redone := nodeJoins(c, n0, into, func() { c.start(2, c.f.Hosts[2], flags, args...) })
		r.fl, r.flLost = r.fl+d, r.flLost+redone

		c = newCluster(b, 3, 1)
		conf := ",last_call_timeout=3"
		t0 := c.torchrun(c.f.Hosts[0], "2:3", conf, args...)
		c.torchrun(c.f.Hosts[1], "2:3", conf, args...)
		d, redone = nodeJoins(c, t0, into, func() { c.torchrun(c.f.Hosts[2], "2:3", conf, args...) })
		r.tr, r.trLost = r.tr+d, r.trLost+redone
	}
	r.report(b)
}

// nodeJoins starts a node a time into after node 0's job n0 is past step
// 50, and returns the time from that start to n0's first line, once
// resumed, of the step after the newest one done before the restart that
// took the node in, and the steps done before that were trained again.
func nodeJoins(c *cluster, n0 *job, into time.Duration, start func()) (time.Duration, int) {
	c.t.Helper()
	n0.waitLine("step 50 loss", 5*time.Minute)
	time.Sleep(into)
	began := time.Now()
	start()
	back, redone := backAfter(c, n0, began, true, "a node came to join it")
	return back.Sub(began), redone
}

// TestElasticWaitingNodeTakesPlace: a job of --nnodes 2:4 runs on nodes
// 0 and 1, and node 2 comes to join it; before the job takes it in, node
// 1 is SIGKILLed. Node 2 takes node 1's place as a spare would, its rank
// resuming from the replica of node 1's in node 0's memory, and the job
// finishes on 2 nodes with the weights of the same script run on 2 ranks
// without the fault.
//
// Node 1 dies where no save and no transfer is in flight, as in
// loseQuietly: a replica lands a moment after its save, and a kill in
// between, on a loaded machine, leaves no step that node 0's rank holds
// and node 1's replica too (BenchmarkNodeLost counts what that costs).
func TestElasticWaitingNodeTakesPlace(t *testing.T) {
	t.Parallel() // hosts of their own
	c := newCluster(t, 3, 1)
	args := []string{"--steps", "80", "--step-ms", "50", "--weights", filepath.Join(c.dir, "weights")}
	flags := []string{"--nnodes", "2:4", "--join-timeout", "10s", "--max-restarts", "3", "--heartbeat-deadline", "3s",
		"--node-timeout", "1m", "--collective-timeout", "60s"}
	// Rank 1 blocks before step 15's all-reduce, rank 0 waits in it: the
	// job makes no save, so no restart point takes node 2 in, until node
	// 1 is gone.
	hang := append([]string{"--hang-rank", "1", "--hang-step", "15"}, args...)
	jobs := []*job{c.start(0, c.f.Hosts[0], flags, hang...), c.start(1, c.f.Hosts[1], flags, hang...)}
	jobs[0].waitLine("[rank0]: step 5 loss", 3*time.Minute)
	jobs = append(jobs, c.start(2, c.f.Hosts[2], flags, args...))
	for deadline := time.Now().Add(time.Minute); !strings.Contains(jobs[0].errText(), "came to join the job"); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("node 0 does not say that node 2 came:\n%s", jobs[0].errText())
		}
	}
	jobs[1].waitLine("[rank1]: blocking in get_batch at step 15", 3*time.Minute)
	c.waitReplicas(c.f.Hosts[0], 14, 1)
	c.f.Hosts[1].Kill()
	<-jobs[1].done
	for _, i := range []int{0, 2} {
		if err := jobs[i].wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstdout:\n%s\nstderr:\n%s", i, err, jobs[i].stdout(), jobs[i].errText())
		}
	}
	if want := "node 1 is lost; the node started as --node-rank 2 (waiting to join) takes its place"; !strings.Contains(jobs[0].errText(), want) {
		t.Errorf("node 0 does not say %q:\n%s", want, jobs[0].errText())
	}
	if st := resumedFrom(jobs[2].stdout()); st < 14 {
		t.Errorf("node 2's rank resumed from step %d, not from where node 1 was:\n%s\nnode 0:\n%s\nnode 2:\n%s", st, jobs[2].stdout(), jobs[0].errText(), jobs[2].errText())
	}
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), resizedReference(t, 2, 2, -1, 80); got != want {
		t.Fatalf("weights after node 2 took node 1's place: %s; without the fault: %s", got, want)
	}
}
