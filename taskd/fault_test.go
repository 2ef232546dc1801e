package taskd

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/google/go-cmp/cmp"

	pb "github.com/faultline-ml/faultline/internal/taskdpb"
)

func TestFaultLog(t *testing.T) {
	l := newFaultLog(3)
	for i, id := range []string{"a", "b", "a", "c", "d"} {
		f, fresh := l.add(Fault{ID: id, Kind: FaultHang}, t0.Add(time.Duration(i)*time.Second))
		if dup := id == "a" && i == 2; fresh == dup {
			t.Fatalf("add %s: fresh=%v", id, fresh)
		}
		if id == "a" && f.Seq != 1 {
			t.Fatalf("duplicate of a got seq %d", f.Seq)
		}
	}
	var ids []string
	var seqs []uint64
	for _, f := range l.after(0) {
		ids, seqs = append(ids, f.ID), append(seqs, f.Seq)
	}
	// Bounded to 3: the oldest went first; order and numbering hold.
	if !cmp.Equal(ids, []string{"b", "c", "d"}) || !cmp.Equal(seqs, []uint64{2, 3, 4}) {
		t.Fatalf("log = %v %v", ids, seqs)
	}
	if got := l.after(3); len(got) != 1 || got[0].ID != "d" {
		t.Fatalf("after(3) = %v", got)
	}
	// A fault dropped from the bounded log can come in again.
	if _, fresh := l.add(Fault{ID: "a", Kind: FaultHang}, t0); !fresh {
		t.Fatal("evicted id refused")
	}
}

func TestFaultLogFileRoundTrip(t *testing.T) {
	in := []Fault{
		{Seq: 1, ID: "w/1", Kind: FaultProcessExit, Position: Position{1, 9}, Code: 137, Message: "killed", Attrs: map[string]string{"signal": "KILL"},
			Time: t0, Received: t0.Add(time.Millisecond), Reporter: Position{1, 9}, ReporterRole: RoleWorker},
		{Seq: 5, ID: "lost/x/1", Kind: FaultLost, Position: Position{2, -1}, Time: t0, Received: t0, Reporter: Position{-1, -1}, ReporterRole: RoleManager},
	}
	var data []byte
	for _, f := range in {
		b, err := marshalFault(f)
		if err != nil {
			t.Fatal(err)
		}
		data = append(data, b...)
	}
	out, tail, err := parseFaultLog(data)
	if err != nil || tail != len(data) {
		t.Fatalf("parse: tail %d of %d, %v", tail, len(data), err)
	}
	if d := cmp.Diff(in, out); d != "" {
		t.Fatal(d)
	}
	// A torn last record is cut off, the rest kept.
	out, tail, err = parseFaultLog(append(data, `{"seq":6,"id":"to`...))
	if err != nil || tail != len(data) || len(out) != 2 {
		t.Fatalf("torn tail: %d faults, tail %d, %v", len(out), tail, err)
	}
	for _, bad := range []string{
		`{"seq":1,"id":"a","kind":"hang"}` + "\n" + `{"seq":1,"id":"b","kind":"hang"}` + "\n",
		`{"seq":1,"id":"","kind":"hang"}` + "\n",
		`{"seq":1,"id":"a","kind":"hang","extra":1}` + "\n",
		`not json` + "\n",
	} {
		var fe *FaultLogError
		if _, _, err := parseFaultLog([]byte(bad)); !errors.As(err, &fe) || fe.Line < 1 {
			t.Errorf("%q: %v, want a *FaultLogError with its line", bad, err)
		}
	}
}

// TestManagerFaultLogSurvivesRestart checks the state file: faults come
// back with their numbering, a torn tail is dropped, and a corrupt middle
// line stops the manager with the file and line named.
func TestManagerFaultLogSurvivesRestart(t *testing.T) {
	dir := t.TempDir()
	cfg := ManagerConfig{Job: "j", Listen: "127.0.0.1:0", Security: Security{Insecure: true}, StateDir: dir}
	m, err := NewManager(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"a", "b"} {
		m.faults.add(Fault{ID: id, Kind: FaultOpError}, t0)
	}
	m.faults.flush() // as the manager's Run does
	m.Close()
	name := filepath.Join(dir, "faults.jsonl")
	fh, _ := os.OpenFile(name, os.O_APPEND|os.O_WRONLY, 0)
	fh.WriteString(`{"seq":3,"id":"c","ki`)
	fh.Close()

	m, err = NewManager(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if got := m.Faults(0); len(got) != 2 || got[1].ID != "b" || got[1].Seq != 2 {
		t.Fatalf("after restart: %+v", got)
	}
	m.faults.add(Fault{ID: "c", Kind: FaultHang}, t0)
	m.faults.flush()
	m.Close()
	m, err = NewManager(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if got := m.Faults(0); len(got) != 3 || got[2].Seq != 3 {
		t.Fatalf("after the second restart: %+v", got)
	}
	m.Close()

	data, _ := os.ReadFile(name)
	os.WriteFile(name, append([]byte("garbage\n"), data...), 0o644)
	var fe *FaultLogError
	if _, err := NewManager(cfg); !errors.As(err, &fe) || fe.Line != 1 {
		t.Fatalf("corrupt state: %v", err)
	}
	if after, _ := os.ReadFile(name); len(after) != len(data)+len("garbage\n") {
		t.Fatal("a corrupt state file was modified")
	}
}

func FuzzFaultLog(f *testing.F) {
	f.Add([]byte(`{"seq":1,"id":"a","kind":"hang","position":{"Node":0,"Rank":1},"time":"2026-01-01T00:00:00Z","received":"2026-01-01T00:00:00Z","reporter":{"Node":0,"Rank":1},"reporter_role":3}` + "\n"))
	f.Add([]byte("{\"seq\":2,\"id\":\"b\",\"kind\":\"x\"}\n{\"seq\":3"))
	f.Add([]byte("\n\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		faults, tail, err := parseFaultLog(data)
		if err != nil {
			return
		}
		if tail > len(data) {
			t.Fatalf("tail %d beyond %d", tail, len(data))
		}
		var again []byte
		for _, f := range faults {
			b, err := marshalFault(f)
			if err != nil {
				t.Fatal(err)
			}
			again = append(again, b...)
		}
		back, tail2, err := parseFaultLog(again)
		if err != nil || tail2 != len(again) {
			t.Fatalf("re-parse: %v", err)
		}
		if d := cmp.Diff(faults, back); d != "" {
			t.Fatal(d)
		}
	})
}

func TestListFaultsPages(t *testing.T) {
	m, err := NewManager(ManagerConfig{Job: "j", Listen: "127.0.0.1:0", Security: Security{Insecure: true}})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	for i := range 1500 {
		m.faults.add(Fault{ID: fmt.Sprint(i), Kind: FaultHang}, t0)
	}
	api := &managerAdmin{m: m}
	var got int
	var after uint64
	for {
		res, err := api.ListFaults(context.Background(), &pb.ListFaultsReq{JobNsName: "j", After: after})
		if err != nil || res.GetCode() != pb.Code_CODE_OK {
			t.Fatal(res, err)
		}
		if len(res.GetFaults()) == 0 {
			break
		}
		if len(res.GetFaults()) > maxFaultsPerList {
			t.Fatalf("%d faults in one answer", len(res.GetFaults()))
		}
		got += len(res.GetFaults())
		after = res.GetFaults()[len(res.GetFaults())-1].GetSeq()
	}
	if got != 1500 {
		t.Fatalf("paged through %d faults, want 1500", got)
	}
	if res, _ := api.ListFaults(context.Background(), &pb.ListFaultsReq{JobNsName: "other"}); res.GetCode() != pb.Code_CODE_UNKNOWN_JOB {
		t.Fatalf("unknown job: %v", res)
	}
}

// TestFaultLogAddIsConstant: once the log is full, adding a fault drops
// the oldest in place: it costs the fault, not a copy of the log.
func TestFaultLogAddIsConstant(t *testing.T) {
	l := newFaultLog(10000)
	for i := range 10000 {
		l.add(Fault{ID: fmt.Sprint("old/", i), Kind: FaultHang}, t0)
	}
	ids := make([]string, 1000)
	for i := range ids {
		ids[i] = fmt.Sprint("new/", i)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for _, id := range ids {
		l.add(Fault{ID: id, Kind: FaultHang}, t0)
	}
	runtime.ReadMemStats(&after)
	if perAdd := (after.TotalAlloc - before.TotalAlloc) / 1000; perAdd > 1024 {
		t.Fatalf("adding to a full log of 10000 allocates %d bytes a fault", perAdd)
	}
	if got := l.after(0); len(got) != 10000 || got[0].ID != "old/1000" || got[9999].ID != "new/999" || got[9999].Seq != 11000 {
		t.Fatalf("log of %d, from %s to %s", len(got), got[0].ID, got[len(got)-1].ID)
	}
	if f := l.get(10500); f.ID != "new/499" {
		t.Fatalf("get(10500) = %+v", f)
	}
}

// TestCutCopies: a field cut to its bound does not keep the rest of what
// it was cut from.
func TestCutCopies(t *testing.T) {
	big := strings.Repeat("x", 1<<20)
	if c := cut(big, 10); len(c) != 10 || unsafe.StringData(c) == unsafe.StringData(big) {
		t.Fatalf("cut shares the memory of what it cut (%d bytes)", len(c))
	}
	if c := cut("é", 1); c != "" {
		t.Fatalf("cut a rune in half: %q", c)
	}
}
