package agent

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/faultline-ml/faultline/python"
	"github.com/faultline-ml/faultline/trace"
)

// produce writes records into r the way the Python producer does: padding
// to the end of the data area when a record does not fit, then the record,
// then the write index. It reports false when the ring is full.
func produce(r *Ring, typ RingRecordType, dom uint8, id uint64, name string) bool {
	le := binary.LittleEndian
	size := uint64(ringRecordSize + (len(name)+7)/8*8)
	capacity := r.mask + 1
	w := r.words[offWrite/8].Load()
	read := r.words[offRead/8].Load()
	off := w & r.mask
	need := size
	if capacity-off < size {
		need += capacity - off
	}
	if w+need-read > capacity {
		r.words[offDropped/8].Add(1)
		return false
	}
	if capacity-off < size {
		le.PutUint32(r.data[off:], uint32(capacity-off))
		r.data[off+4] = byte(RingPadding)
		w += capacity - off
		off = 0
	}
	rec := r.data[off : off+size]
	clear(rec)
	le.PutUint32(rec, uint32(size))
	rec[4], rec[5] = byte(typ), dom
	le.PutUint16(rec[6:], uint16(len(name)))
	le.PutUint64(rec[8:], uint64(1_700_000_000_000_000_000+id))
	le.PutUint64(rec[16:], id)
	le.PutUint32(rec[24:], 77)
	le.PutUint32(rec[28:], uint32(id))
	copy(rec[32:], name)
	r.words[offWrite/8].Store(w + size)
	return true
}

type got struct {
	Type RingRecordType
	Dom  uint8
	ID   uint64
	Name string
}

func drainAll(t *testing.T, r *Ring) []got {
	t.Helper()
	var out []got
	if _, err := r.Drain(func(rec *RingRecord) {
		out = append(out, got{rec.Type, rec.Domain, rec.ID, string(rec.Name)})
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

func TestCreateRing(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ring")
	if err := os.WriteFile(path, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	r, err := CreateRing(path, RingMinCapacity)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	st, err := os.Stat(path)
	if err != nil || st.Mode().Perm() != 0o600 || st.Size() != RingHeaderSize+RingMinCapacity {
		t.Fatalf("ring file: %v, %v", st, err)
	}
	b, _ := os.ReadFile(path)
	le := binary.LittleEndian
	if string(b[:8]) != "FLTRING\x00" || le.Uint32(b[8:]) != 1 || le.Uint32(b[12:]) != 4096 ||
		le.Uint64(b[16:]) != RingMinCapacity || le.Uint32(b[24:]) != 0 || le.Uint32(b[28:]) != RingTimeCollectives {
		t.Fatalf("header % x", b[:32])
	}
	r.SetSwitch(trace.Switch{FP: true, CommunicationOperator: true})
	r.SetFlags(0)
	b, _ = os.ReadFile(path)
	if le.Uint32(b[24:]) != 1<<trace.FP|1<<trace.CommunicationOperator || le.Uint32(b[28:]) != 0 {
		t.Fatalf("switch %#x flags %#x", le.Uint32(b[24:]), le.Uint32(b[28:]))
	}
	for _, c := range []int{0, RingMinCapacity / 2, RingMinCapacity + 8, 3 << 16, RingMaxCapacity * 2} {
		if _, err := CreateRing(filepath.Join(t.TempDir(), "r"), c); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("capacity %d", c)) {
			t.Errorf("CreateRing(capacity %d) = %v, want an error naming it", c, err)
		}
	}
}

func TestRingWrapsAroundAndCounts(t *testing.T) {
	r, err := CreateRing(filepath.Join(t.TempDir(), "ring"), RingMinCapacity)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	var want []got
	id := uint64(0)
	for lap := 0; lap < 3; lap++ {
		for {
			id++
			name := strings.Repeat("n", int(id%40))
			typ := RingRecordType(1 + id%6)
			if !produce(r, typ, uint8(id%2), id, name) {
				break
			}
			want = append(want, got{typ, uint8(id % 2), id, name})
		}
		if d := cmp.Diff(want, drainAll(t, r)); d != "" {
			t.Fatalf("lap %d (-want +got):\n%s", lap, d)
		}
		want = want[:0]
	}
	if r.Dropped() != 3 {
		t.Fatalf("dropped %d, want 3", r.Dropped())
	}
	if n, err := r.Drain(func(*RingRecord) { t.Fatal("a record in an empty ring") }); n != 0 || err != nil {
		t.Fatalf("Drain of an empty ring = %d, %v", n, err)
	}
}

func TestRingDrainAllocatesNothing(t *testing.T) {
	r, err := CreateRing(filepath.Join(t.TempDir(), "ring"), RingMinCapacity)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	var n int
	count := func(rec *RingRecord) { n += len(rec.Name) }
	allocs := testing.AllocsPerRun(100, func() {
		for i := range 100 {
			produce(r, RingRangeStart, 0, uint64(i), "forward")
		}
		if _, err := r.Drain(count); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Fatalf("%v allocations per drain of 100 records", allocs)
	}
}

func TestRingCorruptionIsAnError(t *testing.T) {
	le := binary.LittleEndian
	cases := []struct {
		field string
		spoil func(rec []byte)
	}{
		{"len", func(rec []byte) { le.PutUint32(rec, 12) }},
		{"len", func(rec []byte) { le.PutUint32(rec, 0) }},
		{"len", func(rec []byte) { le.PutUint32(rec, 1<<20) }},
		{"len", func(rec []byte) { le.PutUint32(rec, 16) }},
		{"type", func(rec []byte) { rec[4] = 9 }},
		{"domain", func(rec []byte) { rec[5] = 2 }},
		{"name_len", func(rec []byte) { le.PutUint16(rec[6:], 9) }},
		{"len", func(rec []byte) { rec[4] = 0 }}, // padding that stops short of the end
	}
	for _, c := range cases {
		r, err := CreateRing(filepath.Join(t.TempDir(), "ring"), RingMinCapacity)
		if err != nil {
			t.Fatal(err)
		}
		produce(r, RingMark, 0, 1, "good")
		at := r.words[offWrite/8].Load()
		produce(r, RingMark, 0, 2, "bad")
		produce(r, RingMark, 0, 3, "lost")
		c.spoil(r.data[at:])
		var names []string
		_, err = r.Drain(func(rec *RingRecord) { names = append(names, string(rec.Name)) })
		var re *RingError
		if !errors.As(err, &re) || !errors.Is(err, ErrRingCorrupt) || re.Field != c.field || re.Index != at {
			t.Errorf("%s: Drain = %v, want a RingError on field %s at index %d", c.field, err, c.field, at)
		}
		if !strings.Contains(fmt.Sprint(err), r.Path()) {
			t.Errorf("%v does not name the ring", err)
		}
		if len(names) != 1 || names[0] != "good" {
			t.Errorf("%s: delivered %q before the corrupt record, want [good]", c.field, names)
		}
		// The next drain starts at the producer's next record.
		produce(r, RingMark, 0, 4, "next")
		if d := cmp.Diff([]got{{RingMark, 0, 4, "next"}}, drainAll(t, r)); d != "" {
			t.Errorf("%s: after the corruption (-want +got):\n%s", c.field, d)
		}
		r.Close()
	}

	r, err := CreateRing(filepath.Join(t.TempDir(), "ring"), RingMinCapacity)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	r.words[offWrite/8].Store(RingMinCapacity + 8) // beyond the capacity
	if _, err := r.Drain(func(*RingRecord) {}); !errors.Is(err, ErrRingCorrupt) {
		t.Fatalf("Drain with a write index past the capacity = %v", err)
	}
}

// FuzzRingDrain drains a data area of arbitrary bytes: records or a
// RingError, never a panic, and the read index ends at the write index.
func FuzzRingDrain(f *testing.F) {
	seed := func(build func(r *Ring)) []byte {
		mem := make([]byte, RingHeaderSize+RingMinCapacity)
		binary.LittleEndian.PutUint64(mem[offCapacity:], RingMinCapacity)
		r := newRing("seed", mem)
		build(r)
		w := r.words[offWrite/8].Load()
		return append(binary.LittleEndian.AppendUint64(nil, w), r.data[:min(w, RingMinCapacity)]...)
	}
	f.Add(seed(func(r *Ring) {}))
	f.Add(seed(func(r *Ring) {
		produce(r, RingRangeStart, 0, 1, "forward")
		produce(r, RingRangeEnd, 0, 1, "")
		produce(r, RingCollectiveStart, 1, 2, `{"opName":"allreduce","groupName":"default_pg","count":"4","dataType":"float32"}`)
		produce(r, RingCollectiveError, 1, 2, "Connection closed by peer")
	}))
	f.Add(seed(func(r *Ring) {
		for i := uint64(0); produce(r, RingMark, 0, i, "wrap"); i++ {
			if i == 1000 {
				r.words[offRead/8].Store(r.words[offWrite/8].Load())
			}
		}
	}))
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) < 8 {
			return
		}
		mem := make([]byte, RingHeaderSize+RingMinCapacity)
		binary.LittleEndian.PutUint64(mem[offCapacity:], RingMinCapacity)
		copy(mem[RingHeaderSize:], b[8:])
		r := newRing("fuzz", mem)
		w := binary.LittleEndian.Uint64(b) % (2 * RingMinCapacity)
		r.words[offWrite/8].Store(w)
		n, err := r.Drain(func(rec *RingRecord) {
			if rec.Type == RingPadding || rec.Type >= numRingTypes || len(rec.Name) > RingMinCapacity {
				t.Fatalf("delivered %+v", rec)
			}
		})
		if err != nil && !errors.Is(err, ErrRingCorrupt) {
			t.Fatalf("Drain = %d, %v", n, err)
		}
		if w%8 == 0 && r.read != w {
			t.Fatalf("read index %d after a drain to %d (%v)", r.read, w, err)
		}
	})
}

// TestPythonProducer has faultline's Python producer fill a small ring,
// lap after lap, while this consumer drains it: the records read are
// exactly those Python wrote.
func TestPythonProducer(t *testing.T) {
	const py = "/usr/bin/python3"
	if _, err := os.Stat(py); err != nil {
		t.Skipf("%s not found: install the Debian package python3 (python3-torch brings it)", py)
	}
	pkg, err := python.Extract(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	r, err := CreateRing(filepath.Join(t.TempDir(), "ring"), RingMinCapacity)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	r.SetSwitch(trace.AllOn())
	cmd := exec.Command(py, "-c", pyProducer)
	cmd.Env = append(os.Environ(), "PYTHONPATH="+pkg, "PYTHONDONTWRITEBYTECODE=1", "FAULTLINE_RING="+r.Path())
	cmd.Stderr = os.Stderr
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	defer stdin.Close()
	lines := bufio.NewScanner(stdout)
	lines.Buffer(nil, 16<<20)
	type want struct {
		Type int    `json:"type"`
		Dom  int    `json:"dom"`
		Name string `json:"name"`
		Aux  uint32 `json:"aux"`
	}
	var tid uint32
	for batch := 0; lines.Scan(); batch++ {
		var b struct {
			TID     uint32 `json:"tid"`
			Records []want `json:"records"`
			Dropped uint64 `json:"dropped"`
		}
		if err := json.Unmarshal(lines.Bytes(), &b); err != nil {
			t.Fatalf("batch %d: %v: %s", batch, err, lines.Bytes())
		}
		tid = b.TID
		var got []want
		open := map[uint64]string{}
		if _, err := r.Drain(func(rec *RingRecord) {
			got = append(got, want{int(rec.Type), int(rec.Domain), string(rec.Name), rec.Aux})
			switch rec.Type {
			case RingRangeStart, RingCollectiveStart:
				open[rec.ID] = string(rec.Name)
			case RingRangeEnd, RingCollectiveEnd, RingCollectiveError:
				if _, ok := open[rec.ID]; !ok {
					t.Errorf("batch %d: %s with id %d has no start", batch, rec.Type, rec.ID)
				}
				delete(open, rec.ID)
			}
			if rec.TID != tid {
				t.Errorf("batch %d: tid %d, Python's is %d", batch, rec.TID, tid)
			}
			if rec.Time < time.Now().Add(-time.Hour).UnixNano() || rec.Time > time.Now().UnixNano() {
				t.Errorf("batch %d: time %d is not now", batch, rec.Time)
			}
		}); err != nil {
			t.Fatalf("batch %d: %v", batch, err)
		}
		if d := cmp.Diff(b.Records, got); d != "" {
			t.Fatalf("batch %d (-python +go):\n%s", batch, d)
		}
		if len(open) != 0 || r.Dropped() != b.Dropped || r.Pid() != cmd.Process.Pid {
			t.Fatalf("batch %d: open %v, dropped %d (Python %d), pid %d", batch, open, r.Dropped(), b.Dropped, r.Pid())
		}
		if _, err := io.WriteString(stdin, "\n"); err != nil {
			t.Fatal(err)
		}
	}
	if err := lines.Err(); err != nil {
		t.Fatal(err)
	}
	if r.words[offWrite/8].Load() < 3*RingMinCapacity {
		t.Fatalf("Python wrote %d bytes, want three laps", r.words[offWrite/8].Load())
	}
}

// pyProducer writes batches of records, prints what it wrote as a JSON
// line, and waits for a line on stdin (the batch drained) before the next.
const pyProducer = `
import json, sys, threading
import faultline
from faultline import _ring

tid = threading.get_native_id()
for batch in range(12):
    recs = []
    def rng(name, dom=0):
        recs.append({"type": 1, "dom": dom, "name": name, "aux": 0})
        recs.append({"type": 2, "dom": dom, "name": "", "aux": 0})
    for i in range(150):
        n = batch * 150 + i
        with faultline.step(n):
            faultline.mark("dataloader")
            recs.append({"type": 3, "dom": 0, "name": "dataloader", "aux": 0})
            with faultline.span("forward"):
                pass
            rng("forward")
        rng("step %d" % n)
    name = '{"opName":"allreduce","groupName":"tp","count":"%d","dataType":"float32"}'
    with faultline.comm_span("allreduce", "tp", batch, "float32"):
        pass
    rng(name % batch, 1)
    c = _ring.collective("broadcast", "default_pg", 7, "int64")
    rid = _ring.collective_start(c, 7)
    _ring.collective_error(rid, "Connection closed by peer é")
    recs.append({"type": 4, "dom": 1, "name": c.text, "aux": 7})
    recs.append({"type": 6, "dom": 1, "name": "Connection closed by peer é", "aux": 0})
    print(json.dumps({"tid": tid, "records": recs, "dropped": faultline.dropped()}), flush=True)
    if not sys.stdin.readline():
        break
`

// BenchmarkRingDrain drains records of 48 bytes; the baseline copies the
// same bytes, the least a consumer must touch.
func BenchmarkRingDrain(b *testing.B) {
	r, err := CreateRing(filepath.Join(b.TempDir(), "ring"), 1<<20)
	if err != nil {
		b.Fatal(err)
	}
	defer r.Close()
	const batch = 16 << 10
	var sink int
	count := func(rec *RingRecord) { sink += len(rec.Name) }
	b.Run("drain", func(b *testing.B) {
		b.SetBytes(48 * batch)
		for b.Loop() {
			b.StopTimer()
			for i := range batch {
				produce(r, RingRangeStart, 0, uint64(i), "forward")
			}
			b.StartTimer()
			if _, err := r.Drain(count); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/record")
	})
	b.Run("baseline-copy", func(b *testing.B) {
		dst := make([]byte, 48*batch)
		b.SetBytes(48 * batch)
		for b.Loop() {
			copy(dst, r.data[:len(dst)])
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/record")
	})
	_ = sink
}
