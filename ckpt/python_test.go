package ckpt

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestPythonWriter saves steps with testdata/pywriter.py, which knows only
// the FORMAT section (mmap and struct), and loads and persists them here.
func TestPythonWriter(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed")
	}
	ctx := context.Background()
	dir := t.TempDir()
	commits := make(chan StepManifest, 4)
	o, w := newPair(t, OwnerConfig{Dir: dir, PollInterval: 5 * time.Millisecond,
		OnCommit: func(m StepManifest) { commits <- m }})
	running(t, o)
	for step := 1; step <= 3; step++ {
		args := []string{"testdata/pywriter.py", o.SegmentPath(0), fmt.Sprint(step)}
		if step == 3 {
			args = append(args, "--persist")
		}
		out, err := exec.Command(py, args...).CombinedOutput()
		if err != nil {
			t.Fatalf("pywriter step %d: %v\n%s", step, err, out)
		}
		if !strings.HasPrefix(string(out), "half") {
			t.Fatalf("pywriter step %d: %s", step, out)
		}
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
	ck, err := w.Load(ctx)
	if err != nil {
		t.Fatal(err)
	}
	check(ck, 3)
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
	// Go and Python writers take turns on one segment.
	if err := w.Save(ctx, 4, want(4)...); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(py, "testdata/pywriter.py", o.SegmentPath(0), "5").CombinedOutput(); err != nil {
		t.Fatalf("pywriter: %v\n%s", err, out)
	}
	ck, err = w.Load(ctx)
	if err != nil {
		t.Fatal(err)
	}
	check(ck, 5)
	if err := Verify(dir, o.SegmentPath(0)); err != nil {
		t.Fatal(err)
	}
}
