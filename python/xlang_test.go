package python_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/ckpt/layout"
)

// decode decodes JSON keeping numbers as they are written.
func decode(t *testing.T, b []byte) any {
	t.Helper()
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

// TestCrossLanguageCheckpoint saves state_dicts from Python into the
// segment of a real ckpt.Owner, which grows the segment when asked, seals,
// persists and loads them here with every CRC checked; Python loads the
// newest back bitwise.
func TestCrossLanguageCheckpoint(t *testing.T) {
	py := requirePython(t, true)
	pkg := extracted(t)
	track(t, "testdata/xlang_ckpt.py")
	tmp := t.TempDir()
	disk := filepath.Join(tmp, "disk")
	owner, err := ckpt.NewOwner(ckpt.OwnerConfig{ShmDir: tmp, Name: "xlang", Shards: []int{0}, Capacity: 1 << 20, Dir: disk})
	if err != nil {
		t.Fatal(err)
	}
	defer owner.Close()
	a := startAgent(t, owner, disk, true)
	run := func(args ...string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, py, append([]string{"testdata/xlang_ckpt.py"}, args...)...)
		cmd.Env = pyEnv(pkg, "FAULTLINE_AGENT="+a.sock)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("xlang_ckpt.py %v: %v\n%s", args, err, out)
		}
	}
	outFile := filepath.Join(tmp, "out.json")
	run("save", disk, outFile)
	type saved struct {
		Meta     json.RawMessage   `json:"meta"`
		SHA256   map[string]string `json:"sha256"`
		HalfSize int64             `json:"half_size"`
	}
	var steps map[string]saved
	b, err := os.ReadFile(outFile)
	if err == nil {
		err = json.Unmarshal(b, &steps)
	}
	if err != nil {
		t.Fatal(err)
	}
	if steps["3"].HalfSize <= steps["2"].HalfSize {
		t.Fatalf("half size %d for step 3, %d for step 2: the segment did not grow", steps["3"].HalfSize, steps["2"].HalfSize)
	}

	// Memory: step 3, saved after the segment grew, sealed by the agent when
	// Python said saved, every CRC checked.
	ck, rep, err := owner.Load(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Tier != ckpt.TierMemory || ck.Step != 3 || ck.Unverified {
		t.Fatalf("owner loaded step %d from %s (unverified %v), want step 3 from memory, sealed", ck.Step, rep.Tier, ck.Unverified)
	}
	check := func(where string, ck *ckpt.Checkpoint) {
		t.Helper()
		out := steps[fmt.Sprint(ck.Step)]
		if len(ck.Blobs) != len(out.SHA256) || ck.Blobs[0].Name != "meta" {
			t.Fatalf("%s: blobs %d (first %q), Python wrote %d with meta first", where, len(ck.Blobs), ck.Blobs[0].Name, len(out.SHA256))
		}
		for _, blob := range ck.Blobs {
			sum := sha256.Sum256(blob.Data)
			if hex.EncodeToString(sum[:]) != out.SHA256[blob.Name] {
				t.Fatalf("%s: blob %q differs from what Python wrote", where, blob.Name)
			}
		}
		var meta struct {
			Format string          `json:"format"`
			Step   int64           `json:"step"`
			Tree   json.RawMessage `json:"tree"`
		}
		if err := json.Unmarshal(ck.Blob("meta"), &meta); err != nil || meta.Format != "faultline.state/1" || out.SHA256 == nil {
			t.Fatalf("%s: meta %+v, %v", where, meta, err)
		}
		if d := cmp.Diff(decode(t, out.Meta), decode(t, ck.Blob("meta"))); d != "" {
			t.Fatalf("%s: meta differs from what Python wrote (-python +loaded):\n%s", where, d)
		}
	}
	check("memory", ck)

	// Disk: step 2, persisted on the agent's word, trackers and CRCs in
	// place.
	dck, _, err := ckpt.LoadDisk(disk, 0)
	if err != nil {
		t.Fatal(err)
	}
	check("disk", dck)
	if b, err := os.ReadFile(filepath.Join(disk, layout.MegatronTrackerFile)); err != nil || string(bytes.TrimSpace(b)) != "2" {
		t.Fatalf("Megatron tracker %q, %v", b, err)
	}
	if err := ckpt.Verify(disk, owner.SegmentPath(0)); err != nil {
		t.Fatal(err)
	}

	// Python loads step 3 back, bitwise.
	run("load", disk)
}
