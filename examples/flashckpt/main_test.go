package main

import (
	"context"

	"bytes"
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/faultline-ml/faultline/ckpt"
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
	if len(args) > 0 {
		args = append([]string{args[0], "--dir", e.dir, "--shm", e.shm}, args[1:]...)
	}
	var out bytes.Buffer
	code := run(args, &out, &out)
	return code, out.String()
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
	o, err := ckpt.NewOwner(ckpt.OwnerConfig{ShmDir: e.shm, Shards: []int{0}, Capacity: ckpt.StepSize(names, sizes)})
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
