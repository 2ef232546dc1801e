package lease

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func sampleRecord() Record {
	return Record{Job: "llm", Config: "3f2a9c1e0b7d4a65", Token: 7, Holder: "mgr-a-1234",
		Term: "9b1f03c2e4d5a6b7", Acquired: time.Date(2026, 11, 25, 19, 43, 59, 500_000_000, time.UTC)}
}

func TestRecordRoundTrip(t *testing.T) {
	r := sampleRecord()
	data, err := r.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	got, err := ParseRecord(data)
	if err != nil {
		t.Fatalf("ParseRecord(%s): %v", data, err)
	}
	if diff := cmp.Diff(r, got); diff != "" {
		t.Errorf("round trip (-want +got):\n%s", diff)
	}
	const want = `{"version":1,"job":"llm","config":"3f2a9c1e0b7d4a65","token":7,"holder":"mgr-a-1234","term":"9b1f03c2e4d5a6b7","acquired":"2026-11-25T19:43:59.5Z","crc32c":`
	if !strings.HasPrefix(string(data), want) {
		t.Errorf("Marshal = %s, want it to start %s", data, want)
	}
	// Blanks between members are the reader's business, not the checksum's.
	indented := bytes.ReplaceAll(data, []byte(`,"`), []byte(",\n  \""))
	if _, err := ParseRecord(indented); err != nil {
		t.Errorf("indented record: %v", err)
	}
}

func TestParseRecordErrors(t *testing.T) {
	good, err := sampleRecord().Marshal()
	if err != nil {
		t.Fatal(err)
	}
	edit := func(old, new string) []byte { return bytes.Replace(good, []byte(old), []byte(new), 1) }
	tests := []struct {
		name  string
		data  []byte
		field string // the ParseError's Field
		msg   string // a part of the message
	}{
		{"empty", nil, "", "not a JSON object"},
		{"array", []byte(`[1]`), "", "not a JSON object"},
		{"no version", []byte(`{"job":"llm"}`), "version", "missing"},
		{"future version", edit(`"version":1`, `"version":2`), "version", "unknown"},
		{"version as text", edit(`"version":1`, `"version":"1"`), "version", "unknown"},
		{"unknown member", edit(`"job"`, `"jobs":"x","job"`), "", "unknown field"},
		{"trailing data", append(bytes.Clone(good), `{}`...), "", "after top-level value"},
		{"empty job", edit(`"job":"llm"`, `"job":""`), "job", "empty"},
		{"control in job", edit(`"job":"llm"`, `"job":"l\u0007m"`), "job", "control"},
		{"bad config", edit(`"config":"3f2a9c1e0b7d4a65"`, `"config":"a b"`), "config", "want 1 to 64"},
		{"bad holder", edit(`"holder":"mgr-a-1234"`, `"holder":""`), "holder", "want 1 to 253"},
		{"token 0", edit(`"token":7`, `"token":0`), "token", "at least 1"},
		{"negative token", edit(`"token":7`, `"token":-7`), "", "cannot unmarshal"},
		{"short term", edit(`"term":"9b1f03c2e4d5a6b7"`, `"term":"9b1f"`), "term", "16 hexadecimal"},
		{"no time", edit(`"acquired":"2026-11-25T19:43:59.5Z",`, ``), "acquired", "missing"},
		{"local time", edit(`59.5Z`, `59.5+01:00`), "acquired", "UTC"},
		{"flipped token", edit(`"token":7`, `"token":6`), "crc32c", "does not match"},
		{"no checksum", edit(`,"crc32c":`, `,"x":`), "", "unknown field"},
		{"huge", bytes.Repeat([]byte(" "), maxRecordBytes+1), "", "more than"},
	}
	for _, tt := range tests {
		_, err := ParseRecord(tt.data)
		var pe *ParseError
		if !errors.As(err, &pe) || !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: err = %v, want a *ParseError wrapping ErrInvalid", tt.name, err)
			continue
		}
		if pe.Field != tt.field || !strings.Contains(err.Error(), tt.msg) {
			t.Errorf("%s: err = %v (field %q), want field %q and %q", tt.name, err, pe.Field, tt.field, tt.msg)
		}
	}
}

func TestMarshalRefusesWhatParseRefuses(t *testing.T) {
	for _, r := range []Record{
		{},
		func() Record { r := sampleRecord(); r.Token = 0; return r }(),
		func() Record { r := sampleRecord(); r.Term = "x"; return r }(),
		func() Record { r := sampleRecord(); r.Holder = "a b"; return r }(),
		func() Record { r := sampleRecord(); r.Acquired = time.Time{}; return r }(),
	} {
		if data, err := r.Marshal(); err == nil {
			t.Errorf("Marshal(%+v) = %s, want an error", r, data)
		}
	}
}

// FuzzParseRecord checks that no input panics and that whatever parses
// survives Marshal and ParseRecord unchanged.
func FuzzParseRecord(f *testing.F) {
	good, _ := sampleRecord().Marshal()
	f.Add(good)
	f.Add([]byte(`{"version":2}`))
	f.Add([]byte(`{"version":1,"job":"llm","config":"c","token":1,"holder":"h","term":"0000000000000000","acquired":"2026-01-01T00:00:00Z","crc32c":"00000000"}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := ParseRecord(data)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error does not wrap ErrInvalid: %v", err)
			}
			return
		}
		out, err := r.Marshal()
		if err != nil {
			t.Fatalf("Marshal of a parsed record: %v", err)
		}
		again, err := ParseRecord(out)
		if err != nil {
			t.Fatalf("ParseRecord(Marshal) failed: %v\n%s", err, out)
		}
		if diff := cmp.Diff(r, again); diff != "" {
			t.Fatalf("round trip (-want +got):\n%s", diff)
		}
	})
}
