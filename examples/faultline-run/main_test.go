package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/agent"
	"github.com/faultline-ml/faultline/internal/freeport"
	"github.com/faultline-ml/faultline/internal/testkit"
)

// The tests run real PyTorch (Debian's python3-torch: torch 1.13, CPU,
// gloo) under the faultline-run binary built once here, with
// examples/faultline-run/train.py: a 4-rank data-parallel job whose
// final weights are bitwise reproducible, broken each way.

var (
	binOnce sync.Once
	binPath string
	binErr  error
)

// torchPython is the interpreter that has torch: Debian's, which the
// python3 first on PATH may not be.
const torchPython = "/usr/bin/python3"

// freePorts returns the first of 16 ports in a row that are free, for a
// job's store, its manager and the replica servers of up to 14 ranks a
// host, which the tests' jobs find at --master-port and above.
func freePorts() (int, error) { return freeport.Find(16) }

func needTorch(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("real PyTorch jobs take seconds each; not under -short")
	}
	if err := exec.Command(torchPython, "-c", "import torch.distributed").Run(); err != nil {
		t.Skipf("needs torch importable from %s (Debian package python3-torch): %v", torchPython, err)
	}
}

// binary builds faultline-run once for the package's tests.
func binary(t testing.TB) string {
	t.Helper()
	binOnce.Do(func() {
		dir, err := os.MkdirTemp("", "faultline-run-test-")
		if err != nil {
			binErr = err
			return
		}
		binPath = filepath.Join(dir, "faultline-run")
		out, err := exec.Command("go", "build", "-o", binPath, ".").CombinedOutput()
		if err != nil {
			binErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return binPath
}

// job is one run of faultline-run.
type job struct {
	t      testing.TB
	cmd    *exec.Cmd
	out    string // --out
	mu     sync.Mutex
	lines  []line
	done   chan struct{}
	exit   error
	stderr bytes.Buffer
}

type line struct {
	text string
	at   time.Time
}

// start starts faultline-run with flags, then train.py with args.
func start(t testing.TB, out string, flags []string, args ...string) *job {
	t.Helper()
	return startScript(t, out, flags, "train.py", args...)
}

// startScript starts faultline-run with flags, then script with args.
func startScript(t testing.TB, out string, flags []string, script string, args ...string) *job {
	t.Helper()
	return startCmd(t, exec.Command, out, nil, flags, script, args...)
}

// startCmd starts faultline-run with flags, then script with args, as
// command makes it (exec.Command, or a host's Command to run it on that
// host), with env added to the test's environment.
func startCmd(t testing.TB, command func(string, ...string) *exec.Cmd, out string, env, flags []string, script string, args ...string) *job {
	t.Helper()
	script, _ = filepath.Abs(script)
	argv := append([]string{"--python", torchPython, "--out", out}, flags...)
	argv = append(argv, script)
	argv = append(argv, args...)
	cmd := command(binary(t), argv...)
	cmd.Env = append(append(os.Environ(), "OMP_NUM_THREADS=1"), env...)
	return startProc(t, out, cmd)
}

// startProc starts cmd, a job whose --out is out, and keeps its lines.
func startProc(t testing.TB, out string, cmd *exec.Cmd) *job {
	t.Helper()
	j := &job{t: t, out: out, cmd: cmd, done: make(chan struct{})}
	stdout, err := j.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	j.cmd.Stderr = io.MultiWriter(&syncWriter{j: j}, testWriter{t})
	if err := j.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			j.mu.Lock()
			j.lines = append(j.lines, line{sc.Text(), time.Now()})
			j.mu.Unlock()
		}
		j.exit = j.cmd.Wait()
		close(j.done)
	}()
	t.Cleanup(func() {
		j.cmd.Process.Kill()
		select {
		case <-j.done:
		case <-time.After(10 * time.Second):
			// A child it left (a torchrun worker) holds the pipe open.
			stdout.Close()
			<-j.done
		}
	})
	return j
}

type syncWriter struct{ j *job }

func (w *syncWriter) Write(p []byte) (int, error) {
	w.j.mu.Lock()
	defer w.j.mu.Unlock()
	return w.j.stderr.Write(p)
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	if testing.Verbose() {
		w.t.Logf("%s", bytes.TrimRight(p, "\n"))
	}
	return len(p), nil
}

// wait waits for the job to end and returns its exit error.
func (j *job) wait(timeout time.Duration) error {
	j.t.Helper()
	select {
	case <-j.done:
		return j.exit
	case <-time.After(timeout):
		j.cmd.Process.Kill()
		<-j.done
		j.t.Fatalf("faultline-run did not end within %v\nstdout:\n%s\nstderr:\n%s", timeout, j.stdout(), j.errText())
		return nil
	}
}

func (j *job) stdout() string {
	j.mu.Lock()
	defer j.mu.Unlock()
	var b strings.Builder
	for _, l := range j.lines {
		b.WriteString(l.text + "\n")
	}
	return b.String()
}

func (j *job) errText() string {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.stderr.String()
}

// waitLine waits for a line of output containing s and returns when it
// came.
func (j *job) waitLine(s string, timeout time.Duration) time.Time {
	j.t.Helper()
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		j.mu.Lock()
		for _, l := range j.lines {
			if strings.Contains(l.text, s) {
				j.mu.Unlock()
				return l.at
			}
		}
		j.mu.Unlock()
		select {
		case <-j.done:
			j.t.Fatalf("faultline-run ended (%v) before printing %q\nstdout:\n%s\nstderr:\n%s", j.exit, s, j.stdout(), j.errText())
		default:
		}
	}
	j.t.Fatalf("no %q within %v\nstdout:\n%s\nstderr:\n%s", s, timeout, j.stdout(), j.errText())
	return time.Time{}
}

// incidents reads the job's incidents.
func (j *job) incidents() []agent.Incident {
	j.t.Helper()
	b, err := os.ReadFile(filepath.Join(j.out, agent.IncidentsFile))
	if err != nil {
		j.t.Fatalf("%v\nstderr:\n%s", err, j.errText())
	}
	var out []agent.Incident
	for _, l := range bytes.Split(bytes.TrimSpace(b), []byte("\n")) {
		var in agent.Incident
		if err := json.Unmarshal(l, &in); err != nil {
			j.t.Fatalf("%s: %v: %s", agent.IncidentsFile, err, l)
		}
		out = append(out, in)
	}
	return out
}

const steps = "30"

var (
	refMu     sync.Mutex
	refHashes = map[string]string{} // by train.py's extra arguments
)

// reference is the weights' hash of the job run without a fault, with
// train.py's extra arguments args.
func reference(t testing.TB, args ...string) string {
	t.Helper()
	key := strings.Join(args, " ")
	refMu.Lock()
	defer refMu.Unlock()
	if h, ok := refHashes[key]; ok {
		return h
	}
	dir := t.TempDir()
	w := filepath.Join(dir, "weights")
	id := "reference-" + randomHex(3)
	j := start(t, filepath.Join(dir, "out"), []string{"--standalone", "--nproc-per-node", "4", "--no-spares", "--rdzv-id", id},
		append([]string{"--steps", steps, "--ckpt", filepath.Join(dir, "ckpt"), "--weights", w}, args...)...)
	if err := j.wait(3 * time.Minute); err != nil {
		t.Fatalf("the run without faults: %v\nstderr:\n%s", err, j.errText())
	}
	// A job that finished gives its memory back.
	if shm, _ := filepath.Glob("/dev/shm/faultline-" + id + "*"); len(shm) > 0 {
		for _, f := range shm {
			os.Remove(f)
		}
		t.Fatalf("the finished job left %v in /dev/shm", shm)
	}
	h := readHash(t, w)
	if h == "" {
		t.Fatal("no reference weights")
	}
	refHashes[key] = h
	return h
}

func readHash(t testing.TB, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// TestKillRank: a rank SIGKILLed mid-run is detected at once, every rank
// is restarted (from warm interpreters) and resumes from the step every
// rank holds in memory, and the final weights are bitwise those of a run
// without the fault.
func TestKillRank(t *testing.T) {
	killRank(t)
}

// TestKillRankBuckets is TestKillRank with DDP's gradients in three
// buckets, which the run without the fault has rebuilt by the step the
// restarted ranks resume from, while a new process begins with all of them
// in one: the restarted ranks reduce their first step in the rebuilt
// buckets too, or the weights would not be bitwise the same.
func TestKillRankBuckets(t *testing.T) {
	killRank(t, "--bucket-cap-mb", "0.0002")
}

// killRank runs train.py with args, rank 2 SIGKILLed at step 12, and
// checks the recovery and the final weights.
func killRank(t *testing.T, args ...string) {
	t.Helper()
	needTorch(t)
	ref := reference(t, args...)
	dir := t.TempDir()
	w := filepath.Join(dir, "weights")
	j := start(t, filepath.Join(dir, "out"), []string{"--standalone", "--nproc-per-node", "4", "--max-restarts", "2"},
		append([]string{"--steps", steps, "--ckpt", filepath.Join(dir, "ckpt"), "--kill-rank", "2", "--kill-step", "12", "--weights", w}, args...)...)
	if err := j.wait(3 * time.Minute); err != nil {
		t.Fatalf("faultline-run: %v\nstderr:\n%s", err, j.errText())
	}
	in := j.incidents()
	if len(in) != 1 {
		t.Fatalf("incidents: %+v", in)
	}
	c := in[0]
	// Memory serves every rank that holds the step; one whose double
	// buffer moved past a step it had persisted (its peers' persists of it
	// still under way, on a loaded machine) loads it from disk: "disk+memory".
	if c.Fault.Rank != 2 || !strings.Contains(c.Fault.Message, "SIGKILL") || !strings.Contains(c.Tier, "memory") || c.ResumedStep < 9 || c.CaughtUp.IsZero() {
		t.Fatalf("incident: %+v", c)
	}
	if got := readHash(t, w); got != ref {
		t.Fatalf("weights after the recovery %s, without the fault %s", got, ref)
	}
	t.Logf("blamed rank %d by %q; recovered in %.2fs: stopped %v, restarted %v, loaded %v, first step %v after the kill",
		c.Fault.Rank, c.Evidence, c.RecoverySeconds, c.Stopped.Sub(c.FaultTime), c.Restarted.Sub(c.FaultTime), c.Loaded.Sub(c.FaultTime), c.FirstStep.Sub(c.FaultTime))
}

// TestHang: a rank blocked before an all-reduce is detected within the
// collective timeout and a second; the merged stacks name it and where it
// is; the job recovers to the same weights.
func TestHang(t *testing.T) {
	needTorch(t)
	ref := reference(t)
	dir := t.TempDir()
	w := filepath.Join(dir, "weights")
	const timeout = 3 * time.Second
	j := start(t, filepath.Join(dir, "out"), []string{"--standalone", "--nproc-per-node", "4", "--max-restarts", "1", "--collective-timeout", timeout.String()},
		"--steps", steps, "--ckpt", filepath.Join(dir, "ckpt"), "--hang-rank", "1", "--hang-step", "10", "--weights", w)
	blocked := j.waitLine("[rank1]: blocking in get_batch", 2*time.Minute)
	if err := j.wait(3 * time.Minute); err != nil {
		t.Fatalf("faultline-run: %v\nstderr:\n%s", err, j.errText())
	}
	in := j.incidents()
	if len(in) != 1 {
		t.Fatalf("incidents: %+v", in)
	}
	c := in[0]
	if c.Fault.Kind != "hang" || !strings.Contains(c.Tier, "memory") || c.CaughtUp.IsZero() {
		t.Fatalf("incident: %+v", c)
	}
	if took := c.Detected.Sub(blocked); took > timeout+time.Second {
		t.Errorf("detected %v after rank 1 blocked; want within the collective timeout %v and a second", took, timeout)
	}
	if !strings.Contains(c.Verdict, "rank 1 in get_batch_forever, where no other rank is") {
		t.Errorf("verdict %q does not name rank 1 where it is", c.Verdict)
	}
	for _, f := range []string{"verdict.txt", "py_stack.svg", "py_stack.folded", "stacks.pb.gz"} {
		if _, err := os.Stat(filepath.Join(c.Dir, f)); err != nil {
			t.Errorf("hang output: %v", err)
		}
	}
	if got := readHash(t, w); got != ref {
		t.Fatalf("weights after the recovery %s, without the fault %s", got, ref)
	}
}

// TestSlowRank: a rank slow in forward is named in the output folder
// while the job runs.
func TestSlowRank(t *testing.T) {
	needTorch(t)
	dir := t.TempDir()
	out := filepath.Join(dir, "out")
	j := start(t, out, []string{"--standalone", "--nproc-per-node", "4"},
		"--steps", "400", "--ckpt", filepath.Join(dir, "ckpt"), "--slow-rank", "3", "--slow-ms", "20")
	var r struct {
		IsSlow             int   `json:"isSlow"`
		SlowCalculateRanks []int `json:"slowCalculateRanks"`
		LastStep           int64 `json:"lastStep"`
	}
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("no verdict naming rank 3 in %s within 2 minutes: %+v\nstderr:\n%s", out, r, j.errText())
		}
		select {
		case <-j.done:
			t.Fatalf("the job ended (%v) before a verdict named rank 3: %+v\nstderr:\n%s", j.exit, r, j.errText())
		default:
		}
		if b, err := os.ReadFile(filepath.Join(out, "slownode.json")); err == nil && json.Unmarshal(b, &r) == nil &&
			r.IsSlow == 1 && slices.Equal(r.SlowCalculateRanks, []int{3}) {
			break
		}
	}
	t.Logf("rank 3 named slow at step %d while the job ran", r.LastStep)
	j.cmd.Process.Signal(syscall.SIGTERM)
	j.wait(time.Minute)
}

// TestTwoNodes: TestKillRank's job on two launchers of two ranks each,
// as on two hosts: the rank killed on node 1 stops and restarts node 0's
// ranks too, and both resume from memory to the same weights.
func TestTwoNodes(t *testing.T) {
	needTorch(t)
	ref := reference(t)
	dir := t.TempDir()
	w := filepath.Join(dir, "weights")
	port, err := freePorts()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("TASKD_TOKEN", randomHex(16))
	id := "two-nodes-" + randomHex(3)
	host := testkit.HostAddr(t)
	var jobs []*job
	for node := range 2 {
		jobs = append(jobs, start(t, filepath.Join(dir, fmt.Sprintf("out-%d", node)),
			[]string{"--nnodes", "2", "--node-rank", strconv.Itoa(node), "--nproc-per-node", "2", "--master-addr", host, "--master-port", strconv.Itoa(port),
				"--rdzv-id", id, "--max-restarts", "2"},
			"--steps", steps, "--ckpt", filepath.Join(dir, "ckpt"), "--kill-rank", "3", "--kill-step", "12", "--weights", w))
	}
	var tiers []string
	for node, j := range jobs {
		if err := j.wait(3 * time.Minute); err != nil {
			t.Fatalf("node %d: %v\nstderr:\n%s", node, err, j.errText())
		}
		in := j.incidents()
		if len(in) == 0 || in[0].ResumedStep < 9 || in[0].ResumedStep != jobs[0].incidents()[0].ResumedStep || in[0].CaughtUp.IsZero() {
			t.Fatalf("node %d: incidents %+v", node, in)
		}
		tiers = append(tiers, in[0].Tier)
	}
	// Memory (or a replica) serves the ranks that hold the step. Where the
	// persist of step 9 is slow on a loaded machine, a rank that holds it
	// keeps it while the others move past it: those load it from disk, and
	// a node whose ranks all did says "disk" alone, but not both nodes.
	if !slices.ContainsFunc(tiers, func(t string) bool { return strings.Contains(t, "memory") || strings.Contains(t, "replica") }) {
		t.Fatalf("no rank resumed from memory or a replica: tiers by node %q", tiers)
	}
	if c := jobs[1].incidents()[0]; c.Fault.Rank != 3 || !strings.Contains(c.Fault.Message, "SIGKILL") {
		t.Errorf("node 1's incident blames %+v, not rank 3's SIGKILL", c.Fault)
	}
	if got := readHash(t, w); got != ref {
		t.Fatalf("weights after the recovery %s, without the fault %s", got, ref)
	}
}

// TestLauncherKilled: a launcher SIGKILLed takes its ranks with it, and
// a new launcher resumes the job from the disk tier.
func TestLauncherKilled(t *testing.T) {
	needTorch(t)
	ref := reference(t)
	dir := t.TempDir()
	w, ckpt := filepath.Join(dir, "weights"), filepath.Join(dir, "ckpt")
	// The launcher SIGKILLed leaves its segments and rings behind.
	id := "killed-" + randomHex(3)
	t.Cleanup(func() {
		shm, _ := filepath.Glob("/dev/shm/faultline-" + id + "-*")
		for _, f := range shm {
			os.Remove(f)
		}
	})
	j := start(t, filepath.Join(dir, "out-1"), []string{"--standalone", "--nproc-per-node", "4", "--rdzv-id", id},
		"--steps", steps, "--step-ms", "100", "--ckpt", ckpt, "--weights", w)
	j.waitLine("step 13 loss", 2*time.Minute)
	j.cmd.Process.Kill()
	<-j.done
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if out, _ := exec.Command("pgrep", "-f", ckpt).Output(); len(out) == 0 {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("ranks outlived their launcher: pids %s", out)
		}
	}
	j2 := start(t, filepath.Join(dir, "out-2"), []string{"--standalone", "--nproc-per-node", "4"},
		"--steps", steps, "--ckpt", ckpt, "--weights", w)
	if err := j2.wait(3 * time.Minute); err != nil {
		t.Fatalf("the new launcher: %v\nstderr:\n%s", err, j2.errText())
	}
	j2.waitLine("[rank0]: resumed from step 9", time.Second)
	if got := readHash(t, w); got != ref {
		t.Fatalf("weights after the relaunch %s, without the fault %s", got, ref)
	}
}

// TestBudget: a script that fails at once every time ends the job when
// the restart budget is spent, saying so.
func TestBudget(t *testing.T) {
	needTorch(t)
	dir := t.TempDir()
	script := filepath.Join(dir, "bad.py")
	os.WriteFile(script, []byte("import sys\nsys.exit(3)\n"), 0o644)
	cmd := exec.Command(binary(t), "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--python", torchPython,
		"--out", filepath.Join(dir, "out"), script)
	out, err := cmd.CombinedOutput()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != exitStopped {
		t.Fatalf("exit %v, want %d\n%s", err, exitStopped, out)
	}
	if !bytes.Contains(out, []byte("restart budget is spent: 2 restarts of 2 allowed")) {
		t.Fatalf("no word of the budget:\n%s", out)
	}
}

// TestTimeoutShorterThanAStep: a collective timeout shorter than the
// job's steps is warned of.
func TestTimeoutShorterThanAStep(t *testing.T) {
	needTorch(t)
	dir := t.TempDir()
	j := start(t, filepath.Join(dir, "out"), []string{"--standalone", "--nproc-per-node", "2", "--collective-timeout", "1s", "--no-spares"},
		"--steps", "2", "--step-ms", "1200", "--ckpt", filepath.Join(dir, "ckpt"))
	if err := j.wait(2 * time.Minute); err != nil {
		t.Fatalf("faultline-run: %v\nstderr:\n%s", err, j.errText())
	}
	if !strings.Contains(j.errText(), "longer than --collective-timeout 1s") {
		t.Fatalf("no warning of the timeout shorter than a step:\n%s", j.errText())
	}
}

// TestAdmin: a rank reads what the manager's Admin API serves through its
// node agent.
func TestAdmin(t *testing.T) {
	needTorch(t)
	dir := t.TempDir()
	script, _ := filepath.Abs(filepath.Join("testdata", "admin.py"))
	out, err := exec.Command(binary(t), "--standalone", "--nproc-per-node", "2", "--no-spares", "--python", torchPython,
		"--out", filepath.Join(dir, "out"), script).CombinedOutput()
	if err != nil {
		t.Fatalf("faultline-run: %v\n%s", err, out)
	}
	for _, want := range []string{`[rank0]: admin 0 {"workers": [0, 1]`, `[rank1]: admin 1 {"workers": [0, 1]`, `"Step": "on"`} {
		if !bytes.Contains(out, []byte(want)) {
			t.Errorf("no %q in:\n%s", want, out)
		}
	}
}

// TestUsage: bad command lines are refused with the flag named.
func TestUsage(t *testing.T) {
	badTopo := filepath.Join(t.TempDir(), "topology_config")
	if err := os.WriteFile(badTopo, []byte("asw-1 psw-1 not-an-ip\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{}, "name the training script"},
		{[]string{"--nnodes", "3:2", "x.py"}, `--nnodes "3:2": MIN 3 is more than MAX 2`},
		{[]string{"--nnodes", "0:2", "x.py"}, `--nnodes "0:2": give a positive number of nodes, or MIN:MAX with MIN at least 1`},
		{[]string{"--nnodes", "1:x", "x.py"}, `--nnodes "1:x": MAX must be a positive number`},
		{[]string{"--nnodes", "0", "x.py"}, "--nnodes"},
		{[]string{"--nnodes", "2:3", "--node-rank", "3", "--rdzv-id", "j", "x.py"}, "--node-rank 3: outside [0, 3)"},
		{[]string{"--nnodes", "2:3", "--manager", "10.0.0.1:29501", "--rdzv-id", "j", "x.py"}, "an elastic job's manager is node 0's"},
		{[]string{"--nnodes", "2:3", "--join-timeout", "0s", "--rdzv-id", "j", "x.py"}, "--join-timeout 0s"},
		{[]string{"--standalone", "--nnodes", "1:2", "x.py"}, "--standalone with --nnodes 1:2: a standalone job is one node"},
		{[]string{"--nnodes", "2", "--spare-nodes", "-1", "--rdzv-id", "j", "x.py"}, "--spare-nodes -1: negative"},
		{[]string{"--nnodes", "1", "--spare-nodes", "1", "--rdzv-id", "j", "x.py"}, "--spare-nodes 1 with --nnodes 1: a spare takes the place of a lost node other than node 0"},
		{[]string{"--nnodes", "2", "--spare-nodes", "1", "--manager", "10.0.0.1:29501", "--rdzv-id", "j", "x.py"}, "--spare-nodes with --manager"},
		{[]string{"--nnodes", "2:3", "--spare-nodes", "1", "--node-rank", "4", "--rdzv-id", "j", "x.py"}, "--node-rank 4: outside [0, 4) for --nnodes 2:3 and --spare-nodes 1"},
		{[]string{"--standalone", "--nnodes", "2", "--spare-nodes", "1", "x.py"}, "--standalone with --spare-nodes"},
		{[]string{"--standalone", "--spare-nodes", "1", "x.py"}, "--standalone with --spare-nodes"},
		{[]string{"--nproc-per-node", "zero", "x.py"}, "--nproc-per-node"},
		{[]string{"--python", "/nonexistent/python3", "x.py"}, "--python /nonexistent/python3"},
		{[]string{"--nnodes", "2", "x.py"}, "--rdzv-id"},
		{[]string{"--nnodes", "2", "--rdzv-id", "j", "--master-addr", "192.0.2.1", "x.py"}, "TASKD_TOKEN"},
		{[]string{"--nnodes", "2", "--rdzv-id", "j", "x.py"}, `--master-addr "127.0.0.1" resolves to [127.0.0.1], a loopback address`},
		{[]string{"--nnodes", "2", "--rdzv-id", "j", "--master-addr", "localhost", "x.py"}, "a loopback address, where the job's other nodes cannot reach node 0"},
		{[]string{"--monitor-interval", "0", "x.py"}, "--monitor-interval"},
		{[]string{"--heartbeat-deadline", "0s", "x.py"}, "--heartbeat-deadline"},
		{[]string{"--grace-period", "-1s", "x.py"}, "--grace-period"},
		{[]string{"--rdzv-id", "../x", "x.py"}, "--rdzv-id"},
		{[]string{"--topology", "/nonexistent/topology_config", "x.py"}, "--topology: open /nonexistent/topology_config"},
		{[]string{"--topology", badTopo, "x.py"}, "--topology " + badTopo + ": topology: node-topology-config: line 1: field ip"},
	} {
		t.Setenv("MINDX_TASK_ID", "")
		t.Setenv("TASKD_TOKEN", "")
		_, err := parse(tc.args)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parse(%q) = %v, want an error with %q", tc.args, err, tc.want)
		}
	}
	cfg, err := parse([]string{"--nproc_per_node=3", "--max_restarts", "2", "--rdzv-id", "job-9", "--heartbeat-deadline", "12s", "--grace-period", "20s",
		"train.py", "--lr", "1"})
	if err != nil || cfg.ProcsPerNode != 3 || cfg.MaxRestarts != 2 || cfg.Job != "job-9" || strings.Join(cfg.Command, " ") != "train.py --lr 1" ||
		cfg.HeartbeatDeadline != 12*time.Second || cfg.GracePeriod != 20*time.Second {
		t.Fatalf("parse = %+v, %v", cfg, err)
	}
	t.Setenv("TASKD_TOKEN", "t")
	cfg, err = parse([]string{"--nnodes", "2:3", "--node-rank", "2", "--master-addr", "192.0.2.1", "--rdzv-id", "j", "--join-timeout", "5s", "train.py"})
	if err != nil || cfg.MinNodes != 2 || cfg.Nodes != 3 || cfg.NodeRank != 2 || cfg.JoinTimeout != 5*time.Second {
		t.Fatalf("parse of an elastic range = %+v, %v", cfg, err)
	}
}
