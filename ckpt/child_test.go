package ckpt

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/internal/testkit"
)

// trialsEnv sets the number of SIGKILL trials of the crash tests, which
// run this test binary again in a role (runChild) and SIGKILL it; the
// default suite runs a reduced count.
const trialsEnv = "FAULTLINE_CKPT_TRIALS"

func trials(def int) int {
	if n, err := strconv.Atoi(os.Getenv(trialsEnv)); err == nil && n > 0 {
		return n
	}
	return def
}

// runChild runs a role and returns the exit code. It prints "ready" (and
// what the parent needs) once it is set up.
func runChild(role string) int {
	var err error
	switch role {
	case "saver":
		err = childSaver()
	case "persister":
		err = childPersister()
	case "sealer":
		err = childSealer()
	case "peer":
		err = childPeer()
	case "sender":
		err = childSender()
	case "node":
		err = childNode()
	case "benchnode":
		err = childBenchNode()
	case "benchpeer":
		err = childBenchPeer()
	case "shard":
		err = childShard()
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if err == nil {
		return 0
	}
	fmt.Fprintln(os.Stderr, "child:", err)
	return 2
}

func envInt(name string) int64 {
	n, _ := strconv.ParseInt(os.Getenv(name), 10, 64)
	return n
}

// testBlobs are the blobs of a step in the crash tests: eight layouts (by
// step % 8) with distinct sizes and contents, each stamped with the step in
// its first and last 8 bytes, so that any mix of two steps is told apart.
type testBlobs struct {
	scale    int
	variants [8][]Blob // made on first use
}

func newTestBlobs(scale int) *testBlobs { return &testBlobs{scale: scale} }

func (tb *testBlobs) step(step int64) []Blob {
	v := step % 8
	if tb.variants[v] == nil {
		r := rand.New(rand.NewPCG(uint64(v), 42))
		sizes := []int{tb.scale * int(4+v), tb.scale * int(8-v), 64 + int(v)}
		for k, n := range sizes {
			b := make([]byte, n)
			for i := 0; i+8 <= n; i += 8 {
				binary.LittleEndian.PutUint64(b[i:], r.Uint64())
			}
			tb.variants[v] = append(tb.variants[v], Blob{Name: []string{"model", "optimizer", "extra"}[k], Data: b})
		}
	}
	bs := tb.variants[v]
	for _, b := range bs {
		binary.LittleEndian.PutUint64(b.Data, uint64(step))
		binary.LittleEndian.PutUint64(b.Data[len(b.Data)-8:], uint64(step))
	}
	return bs
}

// check reports whether ck is exactly what step(ck.Step) saved.
func (tb *testBlobs) check(ck *Checkpoint) error {
	want := tb.step(ck.Step)
	if len(ck.Blobs) != len(want) {
		return fmt.Errorf("step %d: %d blobs, want %d", ck.Step, len(ck.Blobs), len(want))
	}
	for i, b := range want {
		got := ck.Blobs[i]
		if got.Name != b.Name || string(got.Data) != string(b.Data) {
			return fmt.Errorf("step %d: blob %d (%q, %d bytes) differs from what was saved (%q, %d bytes)",
				ck.Step, i, got.Name, len(got.Data), b.Name, len(b.Data))
		}
	}
	return nil
}

// childSaver saves steps into FAULTLINE_CKPT_SEGMENT as fast as it can
// until it is killed; with FAULTLINE_CKPT_REPORT set it saves a step a
// millisecond and says "saved N" after each save, and otherwise "ready"
// after the first.
func childSaver() error {
	w, err := NewWriter(WriterConfig{Path: os.Getenv("FAULTLINE_CKPT_SEGMENT")})
	if err != nil {
		return err
	}
	tb := newTestBlobs(64 << 10)
	ctx := context.Background()
	report := os.Getenv("FAULTLINE_CKPT_REPORT") != ""
	for step := envInt("FAULTLINE_CKPT_START"); ; step++ {
		var err error
		if report {
			// Each save takes a millisecond, so that one is likely under way
			// whenever the parent acts.
			var srcs []Source
			for _, b := range tb.step(step) {
				srcs = append(srcs, Source{Name: b.Name, Size: int64(len(b.Data)), R: io.MultiReader(
					bytes.NewReader(b.Data[:len(b.Data)/2]), slowReader{}, bytes.NewReader(b.Data[len(b.Data)/2:]))})
			}
			err = w.SaveFrom(ctx, step, srcs...)
		} else {
			err = w.Save(ctx, step, tb.step(step)...)
		}
		if err != nil && !errors.Is(err, ErrBusy) {
			return err
		}
		switch {
		case report && err == nil:
			fmt.Println("saved", step)
		case step == envInt("FAULTLINE_CKPT_START") && !report:
			// From here on, a kill at any point must leave a step.
			fmt.Println("ready")
		}
	}
}

// slowReader reads nothing, slowly.
type slowReader struct{}

func (slowReader) Read([]byte) (int, error) {
	time.Sleep(time.Millisecond / 3)
	return 0, io.EOF
}

// childPersister is a node agent and its trainer in one process: it saves
// two shards and persists each step to disk, until it is killed.
func childPersister() error {
	o, err := NewOwner(OwnerConfig{
		ShmDir: os.Getenv("FAULTLINE_CKPT_SHM"), Shards: []int{0, 1}, Capacity: 4 << 20,
		Dir: os.Getenv("FAULTLINE_CKPT_DIR"), Retention: Retention{KeepLatest: 2},
	})
	if err != nil {
		return err
	}
	var ws []*Writer
	for _, s := range []int{0, 1} {
		w, err := NewWriter(WriterConfig{Path: o.SegmentPath(s)})
		if err != nil {
			return err
		}
		ws = append(ws, w)
	}
	tb := newTestBlobs(32 << 10)
	fmt.Println("ready")
	ctx := context.Background()
	for step := envInt("FAULTLINE_CKPT_START"); ; step++ {
		for _, w := range ws {
			if err := w.Save(ctx, step, tb.step(step)...); err != nil {
				return err
			}
		}
		if _, err := o.PersistNewest(ctx); err != nil {
			return err
		}
	}
}

// childShard is the node agent of one shard (FAULTLINE_CKPT_SHARD) of a
// two-shard job whose nodes share the disk tier: for each step its parent
// writes on stdin it saves its shard and persists it, and says
// "persisted" or the error, on one line.
func childShard() error {
	shard := int(envInt("FAULTLINE_CKPT_SHARD"))
	o, err := NewOwner(OwnerConfig{
		ShmDir: os.Getenv("FAULTLINE_CKPT_SHM"), Shards: []int{shard}, NumShards: 2, Capacity: 1 << 20,
		Dir: os.Getenv("FAULTLINE_CKPT_DIR"), Retention: Retention{KeepLatest: 1},
	})
	if err != nil {
		return err
	}
	w, err := NewWriter(WriterConfig{Path: o.SegmentPath(shard)})
	if err != nil {
		return err
	}
	fmt.Println("ready")
	ctx := context.Background()
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		step, err := strconv.ParseInt(in.Text(), 10, 64)
		if err != nil {
			return err
		}
		if err := w.Save(ctx, step, blobs(step)...); err != nil {
			return err
		}
		if _, err := o.Persist(ctx, shard); err != nil {
			fmt.Println("error:", strings.ReplaceAll(err.Error(), "\n", "; "))
			continue
		}
		fmt.Println("persisted")
	}
	return in.Err()
}

// childSealer is a node agent and its trainer in one process: it saves a
// step and seals it, pausing between the stores of the seal so that a
// kill is likely to land inside one, step after step until it is killed.
func childSealer() error {
	o, err := NewOwner(OwnerConfig{ShmDir: os.Getenv("FAULTLINE_CKPT_SHM"), Shards: []int{0}, Capacity: 2 << 20})
	if err != nil {
		return err
	}
	w, err := NewWriter(WriterConfig{Path: o.SegmentPath(0)})
	if err != nil {
		return err
	}
	seg := o.segs[0]
	tb := newTestBlobs(64 << 10)
	ctx := context.Background()
	pause := func() { time.Sleep(200 * time.Microsecond) }
	for step := envInt("FAULTLINE_CKPT_START"); ; step++ {
		if err := w.Save(ctx, step, tb.step(step)...); err != nil {
			return err
		}
		if step == envInt("FAULTLINE_CKPT_START") {
			fmt.Println("ready")
		}
		if err := o.sealHalf(ctx, seg, seg.newest()[0], pause); err != nil {
			return err
		}
	}
}

// child is a running child process.
type child struct {
	cmd    *exec.Cmd
	lines  *bufio.Scanner
	exited chan struct{} // closed once the process is reaped
}

// startChild runs this binary in role with env, and waits for its "ready"
// line; the words after "ready" come back.
func startChild(t testing.TB, role string, env ...string) (*child, []string) {
	t.Helper()
	cmd := testkit.Command(t, role, env...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{cmd: cmd, lines: bufio.NewScanner(out), exited: make(chan struct{})}
	var ready []string
	ok := false
	for c.lines.Scan() {
		if f := strings.Fields(c.lines.Text()); len(f) > 0 && f[0] == "ready" {
			ready, ok = f[1:], true
			break
		}
	}
	go func() {
		io.Copy(io.Discard, out)
		cmd.Wait()
		close(c.exited)
	}()
	t.Cleanup(c.kill)
	if !ok {
		c.kill()
		t.Fatalf("child %s exited before it was ready", role)
	}
	return c, ready
}

// kill SIGKILLs the child and waits until it is reaped; it is idempotent.
func (c *child) kill() {
	c.cmd.Process.Signal(syscall.SIGKILL)
	<-c.exited
}

// killAfter lets the child run for a random time below max, then kills it.
// The wait is the point in the child's work where it dies, not a way to
// synchronise with it.
func (c *child) killAfter(r *rand.Rand, max time.Duration) {
	time.Sleep(time.Duration(r.Int64N(int64(max))))
	c.kill()
}
