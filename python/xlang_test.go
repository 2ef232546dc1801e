package python_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
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

// stateMeta is the meta blob of a step that faultline.torch saved.
type stateMeta struct {
	Format  string          `json:"format"`
	Step    int64           `json:"step"`
	Tensors []stateTensor   `json:"tensors"`
	Tree    json.RawMessage `json:"tree"`
}

// stateTensor is an entry of its table of tensors.
type stateTensor struct {
	Blob  string  `json:"blob"`
	Off   int64   `json:"off"`
	Dtype string  `json:"dtype"`
	NP    string  `json:"np"`
	Shape []int64 `json:"shape"`
}

// bytes is the size of the tensor's data.
func (e stateTensor) bytes() (int64, error) {
	size := map[string]int64{"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
		"int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}[e.Dtype]
	if e.NP != "" { // numpy's dtype.str: byte order, kind, item size ("<u2"); U counts characters
		m := regexp.MustCompile(`^[<>|=]([biufcmMSU])([0-9]+)`).FindStringSubmatch(e.NP)
		if m == nil || e.Dtype != "" {
			return 0, fmt.Errorf("np %q, dtype %q", e.NP, e.Dtype)
		}
		size, _ = strconv.ParseInt(m[2], 10, 64)
		if m[1] == "U" {
			size *= 4
		}
	}
	if size == 0 {
		return 0, fmt.Errorf("dtype %q", e.Dtype)
	}
	for _, d := range e.Shape {
		size *= d
	}
	return size, nil
}

// walkTensors calls fn with the table index of every tensor node of tree.
func walkTensors(tree any, fn func(int)) {
	switch n := tree.(type) {
	case map[string]any:
		if k, ok := n["t"].(json.Number); ok {
			i, _ := k.Int64()
			fn(int(i))
		}
		for _, v := range n {
			walkTensors(v, fn)
		}
	case []any:
		for _, v := range n {
			walkTensors(v, fn)
		}
	}
}

// at is the node at a path of string keys through dict nodes of tree.
func at(t *testing.T, tree any, keys ...string) map[string]any {
	t.Helper()
	n, _ := tree.(map[string]any)
	for _, key := range keys {
		items, _ := n["d"].([]any)
		if od, ok := n["od"].([]any); ok {
			items = od
		}
		var next map[string]any
		for _, item := range items {
			if kv, _ := item.([]any); len(kv) == 2 && kv[0] == key {
				next, _ = kv[1].(map[string]any)
			}
		}
		if next == nil {
			t.Fatalf("meta: no key %q in %v", key, keys)
		}
		n = next
	}
	return n
}

// TestCrossLanguageCheckpoint saves state_dicts from Python into the
// segment of a real ckpt.Owner, which grows the segment when asked, seals,
// persists and loads them here with every CRC checked and every tensor of
// the meta's table found in its blob; Python loads the newest back bitwise.
// The newest holds over 65536 tensors, more than a step's blobs
// (layout.MaxBlobs).
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
			if hex.EncodeToString(sum[:]) == out.SHA256[blob.Name] {
				continue
			}
			if blob.Name == "meta" {
				t.Fatalf("%s: meta differs from what Python wrote (-python +loaded):\n%s", where, cmp.Diff(decode(t, out.Meta), decode(t, blob.Data)))
			}
			t.Fatalf("%s: blob %q differs from what Python wrote", where, blob.Name)
		}
		var meta stateMeta
		if err := json.Unmarshal(ck.Blob("meta"), &meta); err != nil || meta.Format != "faultline.state/2" || out.SHA256 == nil {
			t.Fatalf("%s: meta %+v, %v", where, meta, err)
		}
		tree := decode(t, meta.Tree)
		// Every tensor of the table lies in a data blob, and the tree
		// names each one.
		data := map[string][]byte{}
		for _, blob := range ck.Blobs {
			data[blob.Name] = blob.Data
		}
		named := map[int]bool{}
		walkTensors(tree, func(k int) { named[k] = true })
		for k, e := range meta.Tensors {
			n, err := e.bytes()
			if err != nil {
				t.Fatalf("%s: tensors[%d]: %v", where, k, err)
			}
			if b, ok := data[e.Blob]; !ok || e.Off%64 != 0 || e.Off+n > int64(len(b)) || !named[k] {
				t.Fatalf("%s: tensors[%d] %+v (%d bytes): not in blob %q of %d bytes at a multiple of 64, or not in the tree (%v)", where, k, e, n, e.Blob, len(b), named[k])
			}
		}
		if len(named) != len(meta.Tensors) {
			t.Fatalf("%s: the tree names %d tensors, the table has %d", where, len(named), len(meta.Tensors))
		}
		// Tied weights: one tensor at two key paths.
		w0, w1 := at(t, tree, "tied", "0.weight"), at(t, tree, "tied", "1.weight")
		if fmt.Sprint(w0) != fmt.Sprint(w1) {
			t.Fatalf("%s: tied weights are tensors %v and %v, want one", where, w0, w1)
		}
		if ck.Step != 3 {
			return
		}
		// Step 3: 70001 small tensors more, in few blobs, and "big" holds
		// float32 0, 1, 2, ... little-endian.
		if len(meta.Tensors) < 70001 || len(ck.Blobs) > 8 {
			t.Fatalf("%s: %d tensors in %d blobs, want over 70001 in a few", where, len(meta.Tensors), len(ck.Blobs))
		}
		k, err := at(t, tree, "big")["t"].(json.Number).Int64()
		if err != nil {
			t.Fatal(err)
		}
		e := meta.Tensors[k]
		big := data[e.Blob][e.Off:]
		for i := range int(e.Shape[0]) {
			if f := math.Float32frombits(binary.LittleEndian.Uint32(big[4*i:])); f != float32(i) {
				t.Fatalf("%s: big[%d] = %v", where, i, f)
			}
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
