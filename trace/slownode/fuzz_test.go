package slownode

import (
	"context"
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/faultline-ml/faultline/trace"
)

func FuzzParseResult(f *testing.F) {
	f.Add([]byte(`{"isSlow":1,"degradationLevel":"12.0%","jobId":"j","slowCalculateRanks":[3],"slowCommunicationDomains":[[0,1]],"slowHostNodes":["h"],"slowIORanks":[],"slowCommunicationRanks":[],"onsetStep":4,"findings":[{"kind":"compute","ranks":[3]}]}`))
	f.Add([]byte(`{"isSlow":0,"degradationLevel":"0.0%","slowCalculateRanks":null,"slowCommunicationDomains":null,"slowHostNodes":null,"slowIORanks":null,"slowCommunicationRanks":null}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := ParseResult(data)
		if err != nil {
			return
		}
		b, err := r.Marshal()
		if err != nil {
			t.Fatalf("marshal a parsed result: %v", err)
		}
		back, err := ParseResult(b)
		if err != nil {
			t.Fatalf("parse a marshalled result: %v\n%s", err, b)
		}
		if diff := cmp.Diff(r, back); diff != "" {
			t.Fatalf("round trip (-first +second):\n%s", diff)
		}
	})
}

func FuzzParseRankTable(f *testing.F) {
	f.Add([]byte(`{"version":"1.0","server_list":[{"server_id":"10.0.0.1","device":[{"device_id":"0","rank_id":"0"},{"rank_id":1}]}]}`))
	f.Add([]byte(`{"server_list":[{"host_ip":"h","device":[{"rank_id":"7"}]}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		tbl, err := ParseRankTable(data)
		if err != nil {
			return
		}
		b, err := tbl.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		back, err := ParseRankTable(b)
		if err != nil || !cmp.Equal(tbl, back) {
			t.Fatalf("round trip: %v\n%v\n%v", err, tbl, back)
		}
	})
}

// FuzzAnalyzeRankFile analyses a job whose rank 1 file holds the fuzzed
// bytes beside a well-formed rank 0: whatever the bytes, no panic, and a
// result that marshals.
func FuzzAnalyzeRankFile(f *testing.F) {
	var good []byte
	for n := range 5 {
		for _, r := range []trace.Record{
			{Kind: 1, Flag: trace.FlagDeviceStart, SourceKind: 1, Timestamp: uint64(n*100+1) * 1e6, ID: uint64(3 * n), Name: "forward", Domain: "default"},
			{Kind: 1, Flag: trace.FlagDeviceEnd, SourceKind: 1, Timestamp: uint64(n*100+50) * 1e6, ID: uint64(3 * n)},
			{Kind: 1, Flag: trace.FlagDeviceStart, SourceKind: 1, Timestamp: uint64(n*100) * 1e6, ID: uint64(3*n + 1), Name: "step " + string(rune('0'+n)), Domain: "default"},
			{Kind: 1, Flag: trace.FlagDeviceEnd, SourceKind: 1, Timestamp: uint64(n*100+99) * 1e6, ID: uint64(3*n + 1)},
		} {
			good = append(r.AppendJSON(good), '\n')
		}
	}
	f.Add(good)
	f.Add(good[:len(good)/2])
	f.Add([]byte("\x00\xff{\"Kind\":1}\n\n" + `{"Kind":1,"Flag":4,"SourceKind":0,"Timestamp":1,"Id":9}` + "\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		job := t.TempDir()
		for r, b := range [][]byte{good, data} {
			dir := filepath.Join(job, string(rune('0'+r)))
			os.Mkdir(dir, 0o750)
			if err := os.WriteFile(filepath.Join(dir, "1700000000"), b, 0o640); err != nil {
				t.Fatal(err)
			}
		}
		r, err := Analyze(context.Background(), job, Config{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := r.Marshal(); err != nil {
			t.Fatal(err)
		}
	})
}

// FuzzDetector feeds ranges decoded from the bytes (rank, kind, start,
// length) to a Detector: no panic, and a result that marshals, whatever
// the order, overlaps or step numbers.
func FuzzDetector(f *testing.F) {
	f.Add([]byte{0, 0, 0, 10, 0, 50, 0, 1, 0, 0, 100, 0, 0, 2, 0, 20, 0, 5})
	f.Add([]byte{1, 4, 255, 255, 0, 0, 3, 3, 1, 1, 1, 1})
	f.Fuzz(func(t *testing.T, data []byte) {
		d, err := New(Config{NormalSteps: 2, Window: 2, SilentSteps: 2, MaxPendingRanges: 16, HistoryPoints: 4})
		if err != nil {
			t.Fatal(err)
		}
		d.AddGroups(trace.ParallelGroups{"g": {GroupName: "tp", GlobalRanks: []int{0, 1, 2}}, "p": {GroupName: "pp", GlobalRanks: []int{2, 3}}})
		names := []string{"step 1", "step 2", "step 3", "forward", "dataloader", "save_checkpoint",
			commName("HcclAllReduce", "g"), commName("HcclSend", "p"), "step x", "other"}
		for len(data) >= 6 {
			rank := int(data[0] % 5)
			name := names[int(data[1])%len(names)]
			dom := trace.DomainDefault
			if name[0] == '{' {
				dom = trace.DomainCommunication
			}
			start := uint64(binary.BigEndian.Uint16(data[2:])) * uint64(time.Millisecond)
			length := uint64(binary.BigEndian.Uint16(data[4:])) * uint64(time.Microsecond)
			if data[1]&0x80 != 0 {
				d.AddStep(rank, Step{Number: int64(data[2]), Time: time.Duration(length), Compute: time.Duration(length / 2),
					Comm: []CommTime{{Group: "g", Op: "HcclSend", Time: time.Duration(length / 4)}}, Have: Figures(data[3])})
			} else {
				d.Add(rank, trace.Range{Name: name, Domain: dom, Start: start, End: start + length, SourceKind: uint32(data[5] & 1)})
			}
			data = data[6:]
		}
		if _, err := d.Result().Marshal(); err != nil {
			t.Fatal(err)
		}
		d.Flush()
		if _, err := d.Result().Marshal(); err != nil {
			t.Fatal(err)
		}
	})
}
