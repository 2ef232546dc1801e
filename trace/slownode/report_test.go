package slownode

import (
	"bytes"
	"context"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/faultline-ml/faultline/internal/testkit"
	"github.com/faultline-ml/faultline/trace"
	"github.com/faultline-ml/faultline/trace/slownode/internal/gen"
)

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
	testkit.Golden(t, filepath.Join("testdata", "golden.txt"), text.Bytes())
	testkit.Golden(t, filepath.Join("testdata", "golden.json"), js.Bytes())

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

// homogenisationOnly returns the result of a 4-rank data-parallel job
// whose communication ranges cover forward and backward, so that no
// compute figure is computed, and whose rank 2 computes 1.6 times as long
// from step 20: homogenisation finds it late by its peers' wait. With
// forward set, the ranks' forward time is known.
func homogenisationOnly(t *testing.T, forward bool) *Result {
	t.Helper()
	d, err := New(Config{JobID: "hom"})
	if err != nil {
		t.Fatal(err)
	}
	d.AddGroups(trace.ParallelGroups{"dp-0": {GroupName: "dp", GlobalRanks: []int{0, 1, 2, 3}}})
	for n := int64(0); n < 40; n++ {
		fwd := make([]time.Duration, 4)
		var arrive time.Duration
		for r := range 4 {
			fwd[r] = time.Duration(30+n%3+int64(r)%2) * time.Millisecond
			if r == 2 && n >= 20 {
				fwd[r] = fwd[r] * 16 / 10
			}
			arrive = max(arrive, fwd[r])
		}
		for r := range 4 {
			st := Step{Number: n, Time: arrive + 5*time.Millisecond,
				Comm: []CommTime{{Group: "dp-0", Op: "allreduce", Time: arrive - fwd[r] + 5*time.Millisecond, Count: 1}},
				Have: FigStep | FigComm}
			if forward {
				st.Forward, st.Have = fwd[r], st.Have|FigForward
			}
			d.AddStep(r, st)
		}
	}
	return d.Result()
}

// TestHomogenisationFindingCarriesEvidence: a rank convicted by
// homogenisation carries the figures that convicted it, its forward time
// against its peers' where compute is not computed, and how long its
// peers waited for it; the reports print them, and leave out what was not
// computed (compute, the scores) with the reason.
func TestHomogenisationFindingCarriesEvidence(t *testing.T) {
	for _, forward := range []bool{true, false} {
		r := homogenisationOnly(t, forward)
		if len(r.Findings) != 1 || !slices.Equal(r.SlowCalculateRanks, []int{2}) {
			t.Fatalf("forward %v: findings %+v, want rank 2 slow to compute", forward, r.Findings)
		}
		f := r.Findings[0]
		if f.Method != "homogenisation" || f.Group != "dp-0" || f.GroupKind != "dp" || f.WaitedOn < 10 || f.WaitedOn > 25 {
			t.Errorf("forward %v: %+v, want homogenisation in dp-0 with its peers waiting about 18 ms for it", forward, f)
		}
		wantMetric := "communication"
		if forward {
			wantMetric = "forward"
			if f.Baseline < 29 || f.Baseline > 33 || f.Recent < 47 || f.Recent > 54 || f.Ratio < 1.5 || f.Ratio > 1.7 {
				t.Errorf("forward: peers %v ms, rank 2 %v ms, ratio %v; want about 31, 50 and 1.6", f.Baseline, f.Recent, f.Ratio)
			}
		} else if f.Baseline != 0 || f.Recent != 0 || f.Ratio != 0 {
			t.Errorf("no forward: figures %v %v %v where none was computed", f.Baseline, f.Recent, f.Ratio)
		}
		if f.Metric != wantMetric || f.RelativeScore != 0 || f.IndividualScore != 0 {
			t.Errorf("forward %v: metric %q scores %v %v; want %q and no score", forward, f.Metric, f.RelativeScore, f.IndividualScore, wantMetric)
		}
		missing := missingFigures(r)
		for _, m := range []string{"compute", relativeScore, individualScore} {
			if !slices.Contains(missing, m) {
				t.Errorf("forward %v: unavailable %v lacks %s", forward, missing, m)
			}
		}

		var js, text, page bytes.Buffer
		if err := WriteJSON(&js, r); err != nil {
			t.Fatal(err)
		}
		WriteText(&text, r)
		WriteHTML(&page, r)
		if strings.Contains(js.String(), `"relativeScore"`) || !strings.Contains(js.String(), `"waitedOnMs"`) {
			t.Errorf("forward %v: JSON:\n%s", forward, js.String())
		}
		if !strings.Contains(text.String(), "PEERS WAITED FOR IT ms") || !strings.Contains(text.String(), " in dp-0") ||
			strings.Contains(text.String(), "0.000") || strings.Contains(text.String(), "COMPUTE") ||
			!strings.Contains(text.String(), "not computed: compute: communication ranges covered") {
			t.Errorf("forward %v: text:\n%s", forward, text.String())
		}
		html := page.String()
		for _, bad := range []string{"0.000", "<th>Rel.</th>", "<th>Compute</th>", "Compute time per rank"} {
			if strings.Contains(html, bad) {
				t.Errorf("forward %v: page has %q, of a figure not computed", forward, bad)
			}
		}
		for _, want := range []string{"Peers waited for it", "Communication time per rank", "the slow rank waits least",
			"onset, step 20", "<li>compute: communication ranges covered"} {
			if !strings.Contains(html, want) {
				t.Errorf("forward %v: page lacks %q", forward, want)
			}
		}
	}
}
