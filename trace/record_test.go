package trace

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

const sampleStart = `{"Kind":1,"Flag":16,"SourceKind":1,"Timestamp":1731000000123456789,"Id":42,"MsptiObjectId":{"Pt":{"ProcessId":1234,"ThreadId":1234},"Ds":{"DeviceId":3,"StreamId":7}},"Name":"step 12","Domain":"default"}`

func TestRecordCanonicalRoundTrip(t *testing.T) {
	r, err := ParseRecord([]byte(sampleStart))
	if err != nil {
		t.Fatal(err)
	}
	want := Record{Kind: 1, Flag: FlagDeviceStart, SourceKind: 1, Timestamp: 1731000000123456789, ID: 42,
		ProcessID: 1234, ThreadID: 1234, DeviceID: 3, StreamID: 7, Name: "step 12", Domain: "default"}
	if diff := cmp.Diff(want, r); diff != "" {
		t.Fatalf("ParseRecord (-want +got):\n%s", diff)
	}
	if got := string(r.AppendJSON(nil)); got != sampleStart {
		t.Fatalf("AppendJSON:\n got %s\nwant %s", got, sampleStart)
	}
}

func TestRecordGenericShapes(t *testing.T) {
	op := CommOp{OpName: "HcclAllReduce", GroupName: "tp<0>", Count: 4096, DataType: "fp16", StreamID: 3}
	commName := string(op.AppendJSON(nil))
	comm := Record{Kind: 1, Flag: FlagDeviceStart, SourceKind: 1, Timestamp: 5, ID: 9, Name: commName, Domain: DomainCommunication}
	line := comm.AppendJSON(nil)
	got, err := ParseRecord(line)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(comm, got); diff != "" {
		t.Fatalf("escaped name round trip (-want +got):\n%s", diff)
	}
	// encoding/json must read what we write, field for field.
	var generic map[string]any
	if err := json.Unmarshal(line, &generic); err != nil {
		t.Fatalf("encoding/json rejects %s: %v", line, err)
	}
	if generic["Name"] != commName {
		t.Fatalf("encoding/json reads Name %q, want %q", generic["Name"], commName)
	}
	gotOp, err := ParseCommOp(got.Name)
	if err != nil || gotOp != op {
		t.Fatalf("ParseCommOp = %+v, %v; want %+v", gotOp, err, op)
	}

	// Another order, whitespace, -1 in the union half, an unknown field.
	other := `{ "Id": 7, "Kind": 1, "Flag": 2, "Timestamp": 10, "Extra": [1,2],
		"MsptiObjectId": {"Ds": {"DeviceId": -1, "StreamId": -1}, "Pt": {"ProcessId": 5, "ThreadId": 6}},
		"Domain": "default", "Name": "forward" }`
	got, err = ParseRecord([]byte(other))
	if err != nil {
		t.Fatal(err)
	}
	want := Record{Kind: 1, Flag: FlagHostStart, Timestamp: 10, ID: 7, ProcessID: 5, ThreadID: 6,
		DeviceID: 1<<32 - 1, StreamID: 1<<32 - 1, Name: "forward", Domain: "default"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("generic parse (-want +got):\n%s", diff)
	}
}

func TestParseRecordErrors(t *testing.T) {
	tests := []struct{ in, field string }{
		{`garbage`, ""},
		{`{"Kind":1,"Flag":16`, ""},
		{`{"Flag":16,"Timestamp":1,"Id":1}`, "Kind"},
		{`{"Kind":1,"Flag":16,"Id":1}`, "Timestamp"},
		{`{"Kind":1,"Flag":16,"Timestamp":-5,"Id":1}`, "Timestamp"},
		{`{"Kind":1,"Flag":16,"Timestamp":1.5,"Id":1}`, "Timestamp"},
		{`{"Kind":1,"Flag":16,"Timestamp":1,"Id":1,"Name":3}`, "Name"},
		{`{"Kind":1,"Flag":99999999999,"Timestamp":1,"Id":1}`, "Flag"},
		{"\x00\x01\x02", ""},
		{`{"Kind":1,"Flag":16,"Timestamp":1,"Id":1,"Name":"` + strings.Repeat("x", MaxLineBytes) + `"}`, ""},
	}
	for _, tt := range tests {
		_, err := ParseRecord([]byte(tt.in))
		var re *ParseError
		if !errors.As(err, &re) || !errors.Is(err, ErrRecord) {
			t.Errorf("ParseRecord(%.60q) = %v, want a *ParseError", tt.in, err)
			continue
		}
		if re.Field != tt.field {
			t.Errorf("ParseRecord(%.60q): field %q, want %q (%v)", tt.in, re.Field, tt.field, err)
		}
	}
}

func TestJSONStringMatchesEncodingJSON(t *testing.T) {
	for _, s := range []string{"", "plain", `q"uote\back`, "tab\tnl\ncr\r", "\x00\x1f", "<a&b>", "ünï©ødé", "bad\xffutf8", "\u2028\u2029"} {
		want, _ := json.Marshal(s)
		if got := appendJSONString(nil, s); string(got) != string(want) {
			t.Errorf("appendJSONString(%q) = %s, want %s", s, got, want)
		}
	}
}

func TestParseCommOpForms(t *testing.T) {
	for _, in := range []string{
		`{"opName":"ncclAllReduce","groupName":"dp","count":"10","dataType":"bf16","streamId":"2"}`,
		`{"opName":"ncclAllReduce","groupName":"dp","count":10,"dataType":"bf16","streamId":2,"extra":true}`,
	} {
		op, err := ParseCommOp(in)
		want := CommOp{OpName: "ncclAllReduce", GroupName: "dp", Count: 10, DataType: "bf16", StreamID: 2}
		if err != nil || op != want {
			t.Errorf("ParseCommOp(%s) = %+v, %v", in, op, err)
		}
	}
	for _, in := range []string{``, `step 3`, `{"groupName":"x"}`, `{"opName":"a","count":"x"}`} {
		if _, err := ParseCommOp(in); !errors.Is(err, ErrRecord) {
			t.Errorf("ParseCommOp(%q) = %v, want ErrRecord", in, err)
		}
	}
}

func FuzzParseRecord(f *testing.F) {
	f.Add([]byte(sampleStart))
	f.Add([]byte(`{"Kind":1,"Flag":32,"SourceKind":1,"Timestamp":1,"Id":1,"MsptiObjectId":{"Pt":{"ProcessId":1,"ThreadId":1},"Ds":{"DeviceId":0,"StreamId":0}},"Name":"{\"opName\":\"HcclSend\"}","Domain":"communication"}`))
	f.Add([]byte(`{"Id":1,"Kind":1,"Flag":4,"Timestamp":3}`))
	f.Add([]byte("{\"Kind\":1,\xff"))
	f.Add([]byte(strings.Replace(sampleStart, "step 12", "step 012", 1)))
	f.Add([]byte(`{"Kind":1,"Flag":16,"SourceKind":0,"Timestamp":5,"Id":9,"MsptiObjectId":{"Pt":{"ProcessId":1,"ThreadId":1},"Ds":{"DeviceId":0,"StreamId":0}},"Name":"a\u00e9\ud83d\ude00\/\b\f\n\r\t\\","Domain":"default"}`))
	f.Fuzz(func(t *testing.T, line []byte) {
		// The fast path must agree with encoding/json wherever it answers:
		// without a table of names, with one that meets the names for the
		// first time, and with one that has seen them.
		trimmed := bytes.TrimSpace(line)
		in := &interner{}
		for _, in := range []*interner{nil, in, in} {
			var c Record
			if !parseCanonical(trimmed, &c, in) {
				continue
			}
			g, err := parseGeneric(trimmed)
			if err != nil {
				t.Fatalf("canonical path accepts what the generic path rejects (%v): %q", err, line)
			}
			if g != c {
				t.Fatalf("paths disagree on %q:\ncanonical %+v\ngeneric   %+v", line, c, g)
			}
		}
		r, err := ParseRecord(line)
		if err != nil {
			if !errors.Is(err, ErrRecord) {
				t.Fatalf("error %v does not wrap ErrRecord", err)
			}
			return
		}
		out := r.AppendJSON(nil)
		again, err := ParseRecord(out)
		if err != nil {
			t.Fatalf("re-parse of %s: %v", out, err)
		}
		// Invalid UTF-8 in names is replaced on write, so compare the rest.
		again.Name, again.Domain, r.Name, r.Domain = "", "", "", ""
		if again != r {
			t.Fatalf("round trip changed the record: %+v != %+v", again, r)
		}
	})
}

// TestCanonicalFastPath checks that the lines a Recorder and MindCluster write
// take the fast path, names seen before included, and read as the generic
// path reads them.
func TestCanonicalFastPath(t *testing.T) {
	lines, n := benchLines()
	all := bytes.SplitN(lines, []byte{'\n'}, n)
	all[len(all)-1] = bytes.TrimSuffix(all[len(all)-1], []byte{'\n'})
	all = append(all, []byte(`{"Kind":1,"Flag":2,"SourceKind":0,"Timestamp":500,"Id":3,"MsptiObjectId":{"Pt":{"ProcessId":4242,"ThreadId":4243},"Ds":{"DeviceId":-1,"StreamId":-1}},"Name":"dataloader","Domain":"default"}`))
	// Object ids that share the previous line's text up to a digit, or
	// all of it but one: read in full, not taken from that line's.
	all = append(all, []byte(`{"Kind":1,"Flag":2,"SourceKind":0,"Timestamp":501,"Id":4,"MsptiObjectId":{"Pt":{"ProcessId":42421,"ThreadId":4243},"Ds":{"DeviceId":-1,"StreamId":-1}},"Name":"dataloader","Domain":"default"}`))
	all = append(all, []byte(`{"Kind":1,"Flag":2,"SourceKind":0,"Timestamp":502,"Id":5,"MsptiObjectId":{"Pt":{"ProcessId":42421,"ThreadId":4243},"Ds":{"DeviceId":-1,"StreamId":7}},"Name":"dataloader","Domain":"default"}`))
	var in interner
	for round := range 2 {
		for _, l := range all {
			var c Record
			if !parseCanonical(l, &c, &in) {
				t.Fatalf("round %d: %s: not on the fast path", round, l)
			}
			g, err := parseGeneric(l)
			if err != nil || g != c {
				t.Fatalf("round %d: %s:\ncanonical %+v\ngeneric   %+v, %v", round, l, c, g, err)
			}
		}
	}
}

// TestStepNames checks the step names an interner carves from batches:
// each is the name the line holds, steps one after the other, a step
// that jumps, and a second batch; names that are not a plain "step <n>"
// are left to decodeString.
func TestStepNames(t *testing.T) {
	var in interner
	var names []string
	for _, n := range []int{0, 1, 2, 3, 9, 10, 1000, 999, 5} {
		for k := range stepBatch + 2 {
			names = append(names, fmt.Sprint("step ", n*100+k))
		}
	}
	names = append(names, "step 007", "step -1", "step 1a", "step ", "step 1234567890123456789", "step 7", "step 7")
	for _, name := range names {
		raw, err := json.Marshal(name)
		if err != nil {
			t.Fatal(err)
		}
		got, ok := in.get(raw[1 : len(raw)-1])
		if !ok || got != name {
			t.Errorf("get(%s) = %q, %v", raw, got, ok)
		}
	}
	// A jump just after a batch was made: batches resume within half a
	// batch of steps.
	var sn stepNames
	for n := range 2000 {
		if n > stepBatch {
			n += 1000
		}
		sn.get([]byte(fmt.Sprint("step ", n)))
	}
	if sn.first < 1000+stepBatch {
		t.Errorf("the last batch starts at step %d, before the jump to %d", sn.first, 1000+stepBatch)
	}
	for _, raw := range []string{"step 007", "step -1", "step 1a", "step 1234567890123456789"} {
		var sn stepNames
		if _, ok := sn.get([]byte(raw)); ok {
			t.Errorf("stepNames.get(%q) took it", raw)
		}
	}
}
