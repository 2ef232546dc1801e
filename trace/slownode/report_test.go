package slownode

import (
	"bytes"
	"context"
	"flag"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/faultline-ml/faultline/trace/slownode/internal/gen"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata")

// goldenResult analyses a small fixed job: 16 ranks (TP 4 × DP 4) on two
// hosts, a slow rank from step 30 and slow data loading on another from
// step 35, with checkpoints and garbage lines.
func goldenResult(t *testing.T) *Result {
	t.Helper()
	root := t.TempDir()
	_, err := gen.Generate(gen.Config{Root: root, Job: "golden", TP: 4, DP: 4, PP: 1, Steps: 50, Seed: 42,
		CheckpointEach: 20, Garbage: true, Inject: []gen.Injection{
			{Kind: gen.SlowRank, Rank: 9, From: 30, Factor: 1.4},
			{Kind: gen.SlowIO, Rank: 2, From: 35, Factor: 6},
		}})
	if err != nil {
		t.Fatal(err)
	}
	r, err := Analyze(context.Background(), filepath.Join(root, "golden"), Config{})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func checkGolden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -update to create it)", err)
	}
	if diff := cmp.Diff(string(want), string(got)); diff != "" {
		t.Errorf("%s differs (-want +got; go test -update rewrites it):\n%s", path, diff)
	}
}

func TestGoldenReports(t *testing.T) {
	r := goldenResult(t)
	if !equalInts(r.SlowCalculateRanks, 9) || !equalInts(r.SlowIORanks, 2) {
		t.Fatalf("compute %v io %v, want [9] and [2]", r.SlowCalculateRanks, r.SlowIORanks)
	}
	var text, js bytes.Buffer
	if err := WriteText(&text, r); err != nil {
		t.Fatal(err)
	}
	if err := WriteJSON(&js, r); err != nil {
		t.Fatal(err)
	}
	checkGolden(t, "golden.txt", text.Bytes())
	checkGolden(t, "golden.json", js.Bytes())

	// The JSON form round-trips, history aside.
	back, err := ParseResult(js.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	r.History = nil
	if diff := cmp.Diff(r, back); diff != "" {
		t.Errorf("round trip (-wrote +read):\n%s", diff)
	}
}

func equalInts(got []int, want ...int) bool { return cmp.Equal(got, want) }

func TestHTMLIsSelfContained(t *testing.T) {
	r := goldenResult(t)
	r.JobID = `<script>alert("x")</script>`
	var b bytes.Buffer
	if err := WriteHTML(&b, r); err != nil {
		t.Fatal(err)
	}
	page := b.String()
	for _, want := range []string{"<svg", "<polyline", `class="slow"`, "<table class=\"sortable\"", "addEventListener(\"click\"",
		"Iteration trajectory", "<td>9</td>", "&lt;script&gt;"} {
		if !strings.Contains(page, want) {
			t.Errorf("page lacks %q", want)
		}
	}
	// Nothing is fetched: no src or href attribute, no url(), no @import.
	if m := regexp.MustCompile(`(?i)(\bsrc\s*=|\bhref\s*=|url\(|@import)`).FindString(page); m != "" {
		t.Errorf("page refers to an external resource: %q", m)
	}
	if strings.Contains(page, `<script>alert`) {
		t.Error("job id not escaped")
	}
	if strings.Count(page, "<tr class=\"st-") != 16 {
		t.Errorf("trajectory table has %d rank rows, want 16", strings.Count(page, "<tr class=\"st-"))
	}
}

func TestWriteFormats(t *testing.T) {
	r := goldenResult(t)
	for _, f := range []string{FormatText, FormatJSON, FormatHTML} {
		var b bytes.Buffer
		if err := Write(&b, r, f); err != nil || b.Len() == 0 {
			t.Errorf("%s: %v, %d bytes", f, err, b.Len())
		}
	}
	if err := Write(&bytes.Buffer{}, r, "xml"); err == nil {
		t.Error("format xml accepted")
	}
}

func TestParseResultErrors(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{`[]`, "cannot unmarshal"},
		{`{"isSlow":0}`, `"degradationLevel" missing`},
		{`{"isSlow":"no","degradationLevel":"","slowCalculateRanks":[],"slowCommunicationDomains":[],"slowHostNodes":[],"slowIORanks":[],"slowCommunicationRanks":[]}`, `"isSlow"`},
		{`{"isSlow":2,"degradationLevel":"","slowCalculateRanks":[],"slowCommunicationDomains":[],"slowHostNodes":[],"slowIORanks":[],"slowCommunicationRanks":[]}`, "neither 0 nor 1"},
	} {
		_, err := ParseResult([]byte(tc.in))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error with %q", tc.in, err, tc.want)
		}
	}
	// MindCluster's own output, nulls and all, parses.
	mc := `{"isSlow":1,"degradationLevel":"12.0%","jobId":"j","slowCalculateRanks":[3],"slowCommunicationDomains":null,"slowHostNodes":null,"slowIORanks":null,"slowCommunicationRanks":null}`
	r, err := ParseResult([]byte(mc))
	if err != nil || r.IsSlow != 1 || !equalInts(r.SlowCalculateRanks, 3) {
		t.Errorf("MindCluster result: %v %+v", err, r)
	}
}

func TestRankTableRoundTrip(t *testing.T) {
	hccl := `{"version":"1.0","server_count":"2","server_list":[
	 {"server_id":"10.0.0.1","device":[{"device_id":"0","device_ip":"192.168.1.1","rank_id":"0"},{"device_id":"1","rank_id":"1"}]},
	 {"server_id":"10.0.0.2","device":[{"device_id":"0","rank_id":2},{"device_id":"1","rank_id":"3"}]}],"status":"completed"}`
	tbl, err := ParseRankTable([]byte(hccl))
	if err != nil {
		t.Fatal(err)
	}
	want := RankTable{0: "10.0.0.1", 1: "10.0.0.1", 2: "10.0.0.2", 3: "10.0.0.2"}
	if diff := cmp.Diff(want, tbl); diff != "" {
		t.Fatalf("(-want +got):\n%s", diff)
	}
	b, err := tbl.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	back, err := ParseRankTable(b)
	if err != nil || !cmp.Equal(back, tbl) {
		t.Fatalf("round trip: %v %v", err, back)
	}
	for _, tc := range []struct{ in, want string }{
		{`{}`, `"server_list" missing`},
		{`{"server_list":[{"device":[]}]}`, `server_list[0]: field "server_id" missing`},
		{`{"server_list":[{"server_id":"a","device":[{"rank_id":"x"}]}]}`, `server_list[0].device[0].rank_id`},
		{`{"server_list":[{"server_id":"a","device":[{"rank_id":"-1"}]}]}`, `is not a rank`},
		{`{"server_list":[{"server_id":"a","device":[{"rank_id":"1"},{"rank_id":1}]}]}`, `is on a already`},
		{`{"server_list":[]} {}`, `data after`},
	} {
		_, err := ParseRankTable([]byte(tc.in))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error with %q", tc.in, err, tc.want)
		}
	}
}
