package main

import (
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
// on ranks ranks to step at, then on ranks2 from that step's checkpoint
// to steps (with at -1, on ranks2 only).
func resizedReference(t testing.TB, ranks, ranks2, at, steps int) string {
	t.Helper()
	dir := t.TempDir()
	w := filepath.Join(dir, "weights")
	id := "reference-" + randomHex(3)
	// The first run commits its last step, the second resumes from it.
	type run struct {
		procs, steps int
		disk         string
	}
	runs := []run{{ranks, at + 1, "1"}, {ranks2, steps, "10"}}
	if at < 0 {
		runs = runs[1:]
	}
	for _, run := range runs {
		j := start(t, filepath.Join(dir, "out"), []string{"--standalone", "--nproc-per-node", strconv.Itoa(run.procs), "--no-spares", "--rdzv-id", id},
			"--steps", strconv.Itoa(run.steps), "--disk-every", run.disk, "--ckpt", filepath.Join(dir, "ckpt"), "--weights", w)
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("the run without faults on %d ranks: %v\nstderr:\n%s", run.procs, err, j.errText())
		}
		if run.steps == steps && resumedFrom(j.stdout()) != at {
			t.Fatalf("the reference's run on %d ranks did not resume from step %d:\n%s", ranks2, at, j.stdout())
		}
	}
	return readHash(t, w)
}

// TestElasticStartsWithMin: of a job started with --nnodes 2:3, only
// nodes 0 and 1 come: once --join-timeout has passed with MIN nodes
// there, the job runs on those two, and ends with the weights of the
// same script run on 2 ranks.
func TestElasticStartsWithMin(t *testing.T) {
	t.Parallel() // hosts of their own
	c := newCluster(t, 2, 1)
	args := []string{"--steps", "20", "--weights", filepath.Join(c.dir, "weights")}
	flags := []string{"--nnodes", "2:3", "--join-timeout", "2s"}
	jobs := []*job{c.start(0, c.f.Hosts[0], flags, args...), c.start(1, c.f.Hosts[1], flags, args...)}
	for i, j := range jobs {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstdout:\n%s\nstderr:\n%s", i, err, j.stdout(), j.errText())
		}
	}
	if want := "nodes [2] did not join within --join-timeout 2s; the job goes on with 2 nodes of 3 (world 3 → 2)"; !strings.Contains(jobs[0].errText(), want) {
		t.Errorf("node 0 does not say %q:\n%s", want, jobs[0].errText())
	}
	// The ranks started once, in the world they trained in.
	for i, j := range jobs {
		if strings.Contains(j.stdout(), " of 3\n") || strings.Count(j.stdout(), "starting rank") != 1 {
			t.Errorf("node %d's rank did not start once, in a world of 2:\n%s", i, j.stdout())
		}
	}
	if got, want := readHash(t, filepath.Join(c.dir, "weights")), resizedReference(t, 2, 2, -1, 20); got != want {
		t.Fatalf("weights of the job that started with 2 nodes of 3: %s; on 2 ranks: %s", got, want)
	}
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
