package ckpt

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/faultline-ml/faultline/ckpt/layout"
)

// TestPythonWriter saves steps with testdata/pywriter.py, which knows only
// the FORMAT section (mmap and struct) and computes no blob CRC, and shows
// the owner sealing them, persisting them and loading them here.
func TestPythonWriter(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed")
	}
	ctx := context.Background()
	dir := t.TempDir()
	commits := make(chan layout.StepManifest, 4)
	o, w := newPair(t, OwnerConfig{Dir: dir, PollInterval: 5 * time.Millisecond,
		OnCommit: func(m layout.StepManifest) { commits <- m }})
	pywrite := func(step int64, args ...string) int {
		t.Helper()
		args = append([]string{"testdata/pywriter.py", o.SegmentPath(0), fmt.Sprint(step)}, args...)
		out, err := exec.Command(py, args...).CombinedOutput()
		f := strings.Fields(string(out))
		if err != nil || len(f) < 2 || f[0] != "half" {
			t.Fatalf("pywriter step %d: %v\n%s", step, err, out)
		}
		half, _ := strconv.Atoi(f[1])
		return half
	}
	want := func(step int64) []Blob {
		return []Blob{{Name: "model", Data: bytes.Repeat([]byte{byte(step)}, 1000)}, {Name: "optimizer", Data: bytes.Repeat([]byte("py\n"), 700)}}
	}
	check := func(ck *Checkpoint, step int64) {
		t.Helper()
		w := want(step)
		if ck.Step != step || len(ck.Blobs) != 2 || !bytes.Equal(ck.Blob("model"), w[0].Data) || !bytes.Equal(ck.Blob("optimizer"), w[1].Data) {
			t.Fatalf("loaded step %d with blobs %v, want step %d", ck.Step, ck.Blobs, step)
		}
	}
	checkCRCs := func(blobs []layout.BlobEntry, step int64) {
		t.Helper()
		for i, b := range want(step) {
			if blobs[i].Name != b.Name || blobs[i].CRC32C != layout.CRC32C(b.Data) {
				t.Fatalf("step %d blob %d: %+v, want %q with CRC32C %#08x", step, i, blobs[i], b.Name, layout.CRC32C(b.Data))
			}
		}
	}

	// Saved by Python: complete, not sealed; a trainer may load it as it is.
	half := pywrite(1)
	rep, err := InspectSegment(o.SegmentPath(0))
	if err != nil {
		t.Fatal(err)
	}
	if h := rep.Halves[half]; h.Err != nil || h.State != layout.StateComplete || h.Meta.Sealed || h.Meta.Step != 1 {
		t.Fatalf("half %d after the Python save: %+v", half, h)
	}
	ck, err := w.Load(ctx)
	if err != nil || !ck.Unverified {
		t.Fatalf("Load of the unsealed step = %+v, %v", ck, err)
	}
	check(ck, 1)

	// The owner seals it in its Run loop, with the CRC of every blob.
	running(t, o)
	for deadline := time.Now().Add(30 * time.Second); !rep.Halves[half].Meta.Sealed; {
		if time.Now().After(deadline) {
			t.Fatalf("the owner did not seal the Python save in 30s: %+v", rep.Halves[half])
		}
		time.Sleep(5 * time.Millisecond)
		if rep, err = InspectSegment(o.SegmentPath(0)); err != nil {
			t.Fatal(err)
		}
	}
	if err := rep.Halves[half].Err; err != nil {
		t.Fatal(err)
	}
	checkCRCs(rep.Halves[half].Meta.Blobs, 1)
	if ck, err = w.Load(ctx); err != nil || ck.Unverified {
		t.Fatalf("Load of the sealed step = %+v, %v", ck, err)
	}
	check(ck, 1)

	// Python asks for a persist: the owner seals and persists the step, and
	// the manifest carries the CRCs the owner computed.
	pywrite(2)
	pywrite(3, "--persist")
	select {
	case m := <-commits:
		if m.Step != 3 {
			t.Fatalf("committed %d", m.Step)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the owner did not persist the step Python asked for")
	}
	ck, _, err = LoadDisk(dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	check(ck, 3)
	man, err := checkDiskShard(dir, 3, 0)
	if err != nil {
		t.Fatal(err)
	}
	checkCRCs(man.Blobs, 3)

	// Go and Python writers take turns on one segment.
	if err := w.Save(ctx, 4, want(4)...); err != nil {
		t.Fatal(err)
	}
	pywrite(5)
	ck, err = w.Load(ctx)
	if err != nil {
		t.Fatal(err)
	}
	check(ck, 5)
	if err := o.Seal(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if err := Verify(dir, o.SegmentPath(0)); err != nil {
		t.Fatal(err)
	}

	// A Python trainer that mapped the segment before a Go save grew it
	// learns of the new file, and its size, as the FORMAT says, and saves
	// into it.
	cmd := exec.Command(py, "testdata/pywriter.py", o.SegmentPath(0), "7", "--hold")
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	lines := bufio.NewScanner(stdout)
	small := w.Capacity()
	if !lines.Scan() || lines.Text() != fmt.Sprint("mapped ", small) {
		t.Fatalf("pywriter: %q, want it to map halves of %d", lines.Text(), small)
	}
	if err := w.Save(ctx, 6, Blob{Name: "model", Data: make([]byte, 2*small)}); err != nil {
		t.Fatal(err)
	}
	in.Close()
	if !lines.Scan() {
		t.Fatalf("pywriter said nothing after the grow: %v", cmd.Wait())
	}
	if f := strings.Fields(lines.Text()); len(f) != 6 || f[5] != fmt.Sprint(w.Capacity()) || w.Capacity() <= small {
		t.Fatalf("pywriter mapped halves of %d, the segment grew to %d, and it says %q", small, w.Capacity(), lines.Text())
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("pywriter: %v", err)
	}
	ck, err = w.Load(ctx)
	if err != nil {
		t.Fatal(err)
	}
	check(ck, 7)
}
