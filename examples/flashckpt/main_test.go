package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/ckpt/layout"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// TestVerifyExitCode runs this binary as the command itself.
	if os.Getenv("FLASHCKPT_AS_MAIN") == "1" {
		os.Args = append([]string{"flashckpt"}, strings.Fields(os.Getenv("FLASHCKPT_ARGS"))...)
		main()
	}
	goleak.VerifyTestMain(m)
}

type env struct {
	t             *testing.T
	dir, shm, tmp string
}

func newEnv(t *testing.T) *env {
	shm := t.TempDir()
	if fi, err := os.Stat("/dev/shm"); err == nil && fi.IsDir() {
		d, err := os.MkdirTemp("/dev/shm", "flashckpt-test-")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(d) })
		shm = d
	}
	tmp := t.TempDir()
	return &env{t: t, dir: filepath.Join(tmp, "ckpt"), shm: shm, tmp: tmp}
}

// run runs the command in process and returns its exit code and output.
func (e *env) run(args ...string) (int, string) {
	e.t.Helper()
	code, stdout, stderr := e.run2(args...)
	return code, stdout + stderr
}

// run2 is run with standard output and standard error apart.
func (e *env) run2(args ...string) (code int, stdout, stderr string) {
	e.t.Helper()
	if len(args) > 0 {
		args = append([]string{args[0], "--dir", e.dir, "--shm", e.shm}, args[1:]...)
	}
	var out, errs bytes.Buffer
	code = run(args, &out, &errs)
	return code, out.String(), errs.String()
}

// flipBlob flips the byte off bytes into the first blob of step in a
// segment, finding it by the layout of ckpt's FORMAT doc alone.
func flipBlob(t *testing.T, seg string, step int64, off int) {
	t.Helper()
	b, err := os.ReadFile(seg)
	if err != nil {
		t.Fatal(err)
	}
	le := binary.LittleEndian
	half := int(le.Uint64(b[16:]))
	for i := range 2 {
		base := 4096 + i*half
		if int64(le.Uint64(b[base+24:])) == step && le.Uint32(b[base:]) == 2 {
			b[base+int(le.Uint64(b[base+64:]))+off] ^= 0xff
			if err := os.WriteFile(seg, b, 0o600); err != nil {
				t.Fatal(err)
			}
			return
		}
	}
	t.Fatalf("no half of %s holds step %d", seg, step)
}

// TestLoadDoesNotRollBack is the reproduction of a damaged newest step in
// memory: load serves it from disk, where it is committed and intact,
// exits 0 and says why memory's copy was passed over; and --step finds a
// step in the older half of the segment.
func TestLoadDoesNotRollBack(t *testing.T) {
	e := newEnv(t)
	for step := range 2 {
		f := e.file("m.bin", bytes.Repeat([]byte{byte(step)}, 300000))
		if code, out := e.run("save", "--name", "rb1", "--step", fmt.Sprint(step+1), f); code != 0 {
			t.Fatalf("save: exit %d\n%s", code, out)
		}
	}
	flipBlob(t, filepath.Join(e.shm, "rb1-0"), 2, 100)
	outDir := filepath.Join(e.tmp, "o")
	code, stdout, stderr := e.run2("load", "--name", "rb1", "--out", outDir)
	if code != 0 || !strings.Contains(stdout, "loaded step 2 shard 0 from disk") ||
		!strings.Contains(stderr, "passed over: step 2: memory") || !strings.Contains(stderr, "crc32c") {
		t.Fatalf("load: exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	if got, _ := os.ReadFile(filepath.Join(outDir, "m.bin")); !bytes.Equal(got, bytes.Repeat([]byte{1}, 300000)) {
		t.Fatal("loaded blob differs from step 2's")
	}
	if code, out := e.run("load", "--name", "rb1", "--out", outDir, "--step", "1"); code != 0 || !strings.Contains(out, "loaded step 1 shard 0 from memory") {
		t.Fatalf("load --step 1: exit %d\n%s", code, out)
	}

	// Memory only: --step finds a step in either half.
	f := e.file("m.bin", []byte("w"))
	for _, step := range []string{"1", "2", "3"} {
		if code, out := e.run("save", "--name", "mo", "--memory-only", "--step", step, f); code != 0 {
			t.Fatalf("save: exit %d\n%s", code, out)
		}
	}
	for _, step := range []string{"2", "3"} {
		if code, out := e.run("load", "--name", "mo", "--out", outDir, "--step", step); code != 0 || !strings.Contains(out, "loaded step "+step+" shard 0 from memory") {
			t.Fatalf("load --step %s: exit %d\n%s", step, code, out)
		}
	}
}

// TestShardsLoadOneStep kills nothing but has shard 1 miss step 2, as a
// killed save would: load --shard 0 refuses step 2, naming the step the
// shards agree on, and --all-shards loads that step of each.
func TestShardsLoadOneStep(t *testing.T) {
	e := newEnv(t)
	for _, sh := range []string{"0", "1"} {
		f := e.file("m.bin", []byte("step 1 shard "+sh))
		if code, out := e.run("save", "--step", "1", "--shard", sh, "--num-shards", "2", f); code != 0 {
			t.Fatalf("save: exit %d\n%s", code, out)
		}
	}
	f := e.file("m.bin", []byte("step 2 shard 0"))
	if code, out := e.run("save", "--step", "2", "--shard", "0", "--num-shards", "2", f); code != 0 {
		t.Fatalf("save: exit %d\n%s", code, out)
	}
	outDir := filepath.Join(e.tmp, "o")
	code, stdout, stderr := e.run2("load", "--shard", "0", "--out", outDir)
	if code != exitNoStep || stdout != "" || !strings.Contains(stderr, "agree on step 1") || !strings.Contains(stderr, "step 2: shard 1 holds it in no tier") {
		t.Fatalf("load --shard 0: exit %d, want %d\nstdout:\n%s\nstderr:\n%s", code, exitNoStep, stdout, stderr)
	}
	if code, out := e.run("load", "--shard", "1", "--out", outDir); code != 0 || !strings.Contains(out, "loaded step 1 shard 1") {
		t.Fatalf("load --shard 1: exit %d\n%s", code, out)
	}
	code, out := e.run("load", "--all-shards", "--out", outDir)
	if code != 0 || !strings.Contains(out, "loaded step 1 shard 0") || !strings.Contains(out, "loaded step 1 shard 1") {
		t.Fatalf("load --all-shards: exit %d\n%s", code, out)
	}
	for _, sh := range []string{"0", "1"} {
		if got, _ := os.ReadFile(filepath.Join(outDir, "shard-0000"+sh, "m.bin")); string(got) != "step 1 shard "+sh {
			t.Errorf("shard %s loaded %q", sh, got)
		}
	}
	if code, out := e.run("load", "--shard", "0", "--step", "2", "--out", outDir); code != 0 || !strings.Contains(out, "loaded step 2 shard 0") {
		t.Fatalf("load --shard 0 --step 2: exit %d\n%s", code, out)
	}
}

// TestUncommittedStepSaysWhy: a step that one shard persisted and
// another never did is refused on disk with which shards hold it, not
// only with the steps the disk tier holds.
func TestUncommittedStepSaysWhy(t *testing.T) {
	e := newEnv(t)
	for _, sh := range []string{"0", "1"} {
		f := e.file("m.bin", []byte("step 1 shard "+sh))
		if code, out := e.run("save", "--step", "1", "--shard", sh, "--num-shards", "2", f); code != 0 {
			t.Fatalf("save: exit %d\n%s", code, out)
		}
	}
	f := e.file("m.bin", []byte("step 2 shard 0"))
	if code, out := e.run("save", "--step", "2", "--shard", "0", "--num-shards", "2", f); code != 0 {
		t.Fatalf("save: exit %d\n%s", code, out)
	}
	e.shm = t.TempDir() // disk only
	code, _, stderr := e.run2("load", "--shard", "0", "--step", "2", "--out", filepath.Join(e.tmp, "o"))
	if code != exitNoStep || !strings.Contains(stderr, "step 2 is not committed") || !strings.Contains(stderr, "shards [0] of 2 persisted it and shards [1] did not") {
		t.Fatalf("load --shard 0 --step 2: exit %d, want %d\nstderr:\n%s", code, exitNoStep, stderr)
	}
	code, _, stderr = e.run2("load", "--shard", "0", "--step", "5", "--out", filepath.Join(e.tmp, "o"))
	if code != exitNoStep || !strings.Contains(stderr, "step 5 was never persisted") {
		t.Fatalf("load --shard 0 --step 5: exit %d, want %d\nstderr:\n%s", code, exitNoStep, stderr)
	}
}

// TestExitCodes runs each outcome once: a memory-only checkpoint with no
// disk tier yet verifies and inspects clean; corruption, no intact step,
// usage and any other failure exit with their own codes; and reasons and
// the final error share standard error.
func TestExitCodes(t *testing.T) {
	e := newEnv(t)
	f := e.file("m.bin", bytes.Repeat([]byte{3}, 10000))
	if code, out := e.run("save", "--memory-only", "--step", "1", f); code != 0 {
		t.Fatalf("save --memory-only: exit %d\n%s", code, out)
	}
	if code, out := e.run("verify"); code != exitOK || !strings.Contains(out, "nothing on disk yet") {
		t.Fatalf("verify with no disk tier yet: exit %d\n%s", code, out)
	}
	if code, out := e.run("inspect"); code != exitOK || !strings.Contains(out, "nothing on disk yet") {
		t.Fatalf("inspect with no disk tier yet: exit %d\n%s", code, out)
	}

	if code, out := e.run("save", "--step", "2", f); code != 0 {
		t.Fatalf("save: exit %d\n%s", code, out)
	}
	data := filepath.Join(e.dir, "2", "shard-00000.bin")
	b, _ := os.ReadFile(data)
	b[10] ^= 1
	os.WriteFile(data, b, 0o640)
	code, stdout, stderr := e.run2("inspect")
	if code != exitCorrupt || !strings.Contains(stdout, "shard 0: BAD") || !strings.Contains(stderr, "BAD entries: 1") {
		t.Fatalf("inspect of a flipped bit: exit %d, want %d\nstdout:\n%s\nstderr:\n%s", code, exitCorrupt, stdout, stderr)
	}
	code, stdout, stderr = e.run2("verify")
	if code != exitCorrupt || stdout != "" || !strings.Contains(stderr, "CORRUPT") || !strings.Contains(stderr, "corruption found") {
		t.Fatalf("verify of a flipped bit: exit %d, want %d\nstdout:\n%s\nstderr:\n%s", code, exitCorrupt, stdout, stderr)
	}

	code, stdout, stderr = e.run2("load", "--step", "7")
	if code != exitNoStep || stdout != "" || !strings.Contains(stderr, "memory refused") || !strings.Contains(stderr, "flashckpt: ") {
		t.Fatalf("load of a step no tier holds: exit %d, want %d\nstdout:\n%s\nstderr:\n%s", code, exitNoStep, stdout, stderr)
	}
	if code, out := e.run("load", "--shard", "0", "--all-shards"); code != exitUsage {
		t.Fatalf("load --shard --all-shards: exit %d, want %d\n%s", code, exitUsage, out)
	}
	// --out names a file: the blobs cannot be written.
	if code, out := e.run("load", "--out", f); code != exitFailure {
		t.Fatalf("load into a file: exit %d, want %d\n%s", code, exitFailure, out)
	}
}

func (e *env) file(name string, data []byte) string {
	p := filepath.Join(e.tmp, name)
	if err := os.WriteFile(p, data, 0o640); err != nil {
		e.t.Fatal(err)
	}
	return p
}

func TestSaveInspectVerifyLoad(t *testing.T) {
	e := newEnv(t)
	model := bytes.Repeat([]byte("weights!"), 40000)
	mf, of := e.file("model.bin", model), e.file("optim.bin", []byte("adam state"))
	for _, step := range []string{"10", "20"} {
		if code, out := e.run("save", "--step", step, mf, of); code != 0 || !strings.Contains(out, "committed step "+step) {
			t.Fatalf("save %s: exit %d\n%s", step, code, out)
		}
	}
	code, out := e.run("inspect")
	for _, want := range []string{"half 0: step", "sealed, CRC ok", "model.bin", "tracker dlrover_latest.txt: step 20",
		"tracker latest_checkpointed_iteration.txt: step 20", "disk step 20: committed", "disk step 10: committed", "CRC ok"} {
		if code != 0 || !strings.Contains(out, want) {
			t.Fatalf("inspect: exit %d, output lacks %q:\n%s", code, want, out)
		}
	}
	if code, out := e.run("verify"); code != 0 {
		t.Fatalf("verify of a sound checkpoint: exit %d\n%s", code, out)
	}

	outDir := filepath.Join(e.tmp, "out")
	code, out = e.run("load", "--out", outDir)
	if code != 0 || !strings.Contains(out, "loaded step 20 shard 0 from memory") {
		t.Fatalf("load: exit %d\n%s", code, out)
	}
	if got, _ := os.ReadFile(filepath.Join(outDir, "model.bin")); !bytes.Equal(got, model) {
		t.Fatal("loaded model differs")
	}

	// Flip a bit of step 20 on disk and lose the memory tier.
	data := filepath.Join(e.dir, "20", "shard-00000.bin")
	b, _ := os.ReadFile(data)
	b[1234] ^= 1
	os.WriteFile(data, b, 0o640)
	os.Remove(filepath.Join(e.shm, "faultline-ckpt-0"))
	code, out = e.run("load", "--out", outDir)
	if code != 0 || !strings.Contains(out, "loaded step 10 shard 0 from disk") || !strings.Contains(out, "crc32c") {
		t.Fatalf("load after damage: exit %d\n%s", code, out)
	}
	code, out = e.run("inspect")
	if !strings.Contains(out, "shard 0: BAD") {
		t.Fatalf("inspect does not show the damage:\n%s", out)
	}
}

// TestVerifyExitCode runs the command as a process: verify exits 1 on a
// flipped bit and names what is corrupt.
func TestVerifyExitCode(t *testing.T) {
	e := newEnv(t)
	mf := e.file("model.bin", bytes.Repeat([]byte{7}, 100000))
	if code, out := e.run("save", "--step", "5", mf); code != 0 {
		t.Fatalf("save: %d\n%s", code, out)
	}
	verify := func() (int, string) {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "FLASHCKPT_AS_MAIN=1", "FLASHCKPT_ARGS=verify --dir "+e.dir+" --shm "+e.shm)
		out, err := cmd.CombinedOutput()
		if ee, ok := err.(*exec.ExitError); ok {
			return ee.ExitCode(), string(out)
		}
		if err != nil {
			t.Fatal(err)
		}
		return 0, string(out)
	}
	if code, out := verify(); code != 0 {
		t.Fatalf("verify: exit %d\n%s", code, out)
	}
	// A flipped bit in the shared-memory copy.
	seg := filepath.Join(e.shm, "faultline-ckpt-0")
	b, _ := os.ReadFile(seg)
	half := int(binary.LittleEndian.Uint64(b[16:])) // the documented header
	for i := range 2 {
		b[4096+i*half+50000] ^= 0x80
	}
	os.WriteFile(seg, b, 0o600)
	code, out := verify()
	if code != 1 || !strings.Contains(out, "CORRUPT") || !strings.Contains(out, `"model.bin"`) {
		t.Fatalf("verify after a bit flip: exit %d\n%s", code, out)
	}
	t.Logf("verify says:\n%s", out)
}

func TestShardsCommitTogether(t *testing.T) {
	e := newEnv(t)
	mf := e.file("model.bin", []byte("w"))
	code, out := e.run("save", "--step", "3", "--shard", "0", "--num-shards", "2", mf)
	if code != 0 || !strings.Contains(out, "waits for the other shards") {
		t.Fatalf("shard 0: exit %d\n%s", code, out)
	}
	code, out = e.run("save", "--step", "3", "--shard", "1", "--num-shards", "2", mf)
	if code != 0 || !strings.Contains(out, "committed step 3") {
		t.Fatalf("shard 1: exit %d\n%s", code, out)
	}
}

func TestUsage(t *testing.T) {
	e := newEnv(t)
	for _, args := range [][]string{nil, {"bogus"}, {"save"}, {"save", "--step", "1"}} {
		if code, out := e.run(args...); code != exitUsage {
			t.Errorf("%v: exit %d, want %d\n%s", args, code, exitUsage, out)
		}
	}
	var out bytes.Buffer
	if code := run([]string{"verify"}, &out, &out); code != exitUsage || !strings.Contains(out.String(), "--dir") {
		t.Errorf("verify without --dir: exit %d\n%s", code, out.String())
	}
}

// TestLoadBlobNames loads a step whose blob names hold slashes and dots,
// as a trainer may save them: each lands in its own file inside --out.
func TestLoadBlobNames(t *testing.T) {
	e := newEnv(t)
	names := []string{"model/layer.0", "optim/layer.0", "..", "100%"}
	var blobs []ckpt.Blob
	var sizes []int64
	for i, n := range names {
		blobs = append(blobs, ckpt.Blob{Name: n, Data: []byte{byte(i)}})
		sizes = append(sizes, 1)
	}
	o, err := ckpt.NewOwner(ckpt.OwnerConfig{ShmDir: e.shm, Shards: []int{0}, Capacity: layout.StepSize(names, sizes)})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	w, err := ckpt.NewWriter(ckpt.WriterConfig{Path: o.SegmentPath(0)})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if err := w.Save(context.Background(), 1, blobs...); err != nil {
		t.Fatal(err)
	}
	// Saved by a trainer, not yet sealed by an owner: inspect says so, and
	// load takes the step as saved.
	if code, out := e.run("inspect"); !strings.Contains(out, "unsealed (CRCs not computed yet)") || !strings.Contains(out, "crc32c -") {
		t.Fatalf("inspect of an unsealed step: exit %d\n%s", code, out)
	}
	outDir := filepath.Join(e.tmp, "out")
	if code, out := e.run("load", "--out", outDir); code != 0 || !strings.Contains(out, "not sealed yet") {
		t.Fatalf("load: exit %d\n%s", code, out)
	}
	for i, f := range []string{"model%2Flayer.0", "optim%2Flayer.0", "%2E%2E", "100%25"} {
		if got, err := os.ReadFile(filepath.Join(outDir, f)); err != nil || !bytes.Equal(got, []byte{byte(i)}) {
			t.Errorf("blob %q: file %s holds %v, %v", names[i], f, got, err)
		}
	}
	if ents, _ := os.ReadDir(e.tmp); len(ents) != 1 { // out/ and nothing else
		var got []string
		for _, e := range ents {
			got = append(got, e.Name())
		}
		t.Errorf("load wrote outside --out: %s holds %v", e.tmp, got)
	}
}

// TestSaveGrowsSegment saves a step larger than the segment: the segment
// grows and keeps the step it held; --capacity sizes a new one; and a
// step saved again after its disk copy was damaged is written again.
func TestSaveGrowsSegment(t *testing.T) {
	e := newEnv(t)
	small, big := e.file("small.bin", bytes.Repeat([]byte{1}, 3000)), e.file("big.bin", bytes.Repeat([]byte{2}, 30000))
	if code, out := e.run("save", "--step", "1", small); code != 0 {
		t.Fatalf("save: exit %d\n%s", code, out)
	}
	code, out := e.run("save", "--step", "2", big)
	if code != 0 || !strings.Contains(out, "grew segment") {
		t.Fatalf("save of a larger step: exit %d\n%s", code, out)
	}
	code, out = e.run("inspect")
	if code != 0 || !strings.Contains(out, "half 0: step 1") || !strings.Contains(out, "half 1: step 2") {
		t.Fatalf("inspect after the grow: exit %d\n%s", code, out)
	}
	if code, out := e.run("save", "--name", "sized", "--capacity", "1MiB", "--memory-only", "--step", "1", small); code != 0 {
		t.Fatalf("save --capacity: exit %d\n%s", code, out)
	}
	if code, out := e.run("inspect", "--name", "sized"); code != 0 || !strings.Contains(out, "halves of 1048576 bytes") {
		t.Fatalf("inspect of a segment sized by --capacity: exit %d\n%s", code, out)
	}
	if code, out := e.run("save", "--capacity", "1MB", "--step", "1", small); code != exitUsage {
		t.Fatalf("--capacity 1MB: exit %d, want %d\n%s", code, exitUsage, out)
	}

	// Step 2's disk copy damaged, then step 2 saved again.
	data := filepath.Join(e.dir, "2", "shard-00000.bin")
	b, _ := os.ReadFile(data)
	b[10] ^= 1
	os.WriteFile(data, b, 0o640)
	code, stdout, stderr := e.run2("save", "--step", "2", big)
	if code != 0 || !strings.Contains(stdout, "was committed already") || !strings.Contains(stderr, "wrote it again") {
		t.Fatalf("save of a committed step with a damaged copy: exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	if code, out := e.run("verify"); code != 0 {
		t.Fatalf("verify after the rewrite: exit %d\n%s", code, out)
	}
	// Other content under a committed step number is refused.
	if code, out := e.run("save", "--step", "2", small); code != exitFailure || !strings.Contains(out, "kept the committed step") {
		t.Fatalf("save of other content as a committed step: exit %d, want %d\n%s", code, exitFailure, out)
	}
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{"4096": 4096, "64KiB": 64 << 10, "512MiB": 512 << 20, "2G": 2 << 30, "0": 0, "7B": 7} {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "MiB", "1MB", "-1", "1.5G", "9999999999999T", "1 MiB", "0x10"} {
		if got, err := parseSize(in); err == nil {
			t.Errorf("parseSize(%q) = %d, want an error", in, got)
		}
	}
}

func FuzzParseSize(f *testing.F) {
	for _, s := range []string{"4096", "64KiB", "512M", "8TiB", "1MB", "", "-3G"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := parseSize(s)
		if err != nil {
			if !strings.Contains(err.Error(), "byte count") {
				t.Fatalf("parseSize(%q): error %v does not say what it wants", s, err)
			}
			return
		}
		if n < 0 {
			t.Fatalf("parseSize(%q) = %d", s, n)
		}
		if back, err := parseSize(strconv.FormatInt(n, 10)); err != nil || back != n {
			t.Fatalf("parseSize(%q) = %d, which reads back as %d, %v", s, n, back, err)
		}
	})
}
