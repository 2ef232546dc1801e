package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"go.uber.org/goleak"

	"github.com/faultline-ml/faultline/trace"
	"github.com/faultline-ml/faultline/trace/slownode"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// writeJob writes 8 ranks × 40 steps in two tensor-parallel groups of
// four; rank 5 computes 50% slower from step 20 and its peers wait.
func writeJob(t *testing.T) string { return writeJobSlow(t, 150) }

// writeJobSlow is writeJob with rank 5 computing slow ms a step, against
// its peers' 100 to 102, from step 20.
func writeJobSlow(t *testing.T, slow uint64) string {
	t.Helper()
	job := filepath.Join(t.TempDir(), "job")
	const ms = uint64(1e6)
	groups := trace.ParallelGroups{}
	for g := range 2 {
		groups["tp"+strconv.Itoa(g)] = trace.ParallelGroup{GroupName: "tp", GlobalRanks: []int{4 * g, 4*g + 1, 4*g + 2, 4*g + 3}}
	}
	for r := range 8 {
		dir := filepath.Join(job, strconv.Itoa(r))
		if err := os.MkdirAll(dir, 0o750); err != nil {
			t.Fatal(err)
		}
		mine := groups["tp"+strconv.Itoa(r/4)]
		mine.GroupRank = r % 4
		b, _ := trace.ParallelGroups{"tp" + strconv.Itoa(r/4): mine}.Marshal()
		os.WriteFile(filepath.Join(dir, trace.ParallelGroupFile), b, 0o640)
		op := trace.CommOp{OpName: "HcclAllReduce", GroupName: "tp" + strconv.Itoa(r/4)}
		opName := string(op.AppendJSON(nil))
		var out []byte
		id := uint64(0)
		rng := func(name, dom string, a, z uint64) {
			id++
			s := trace.Record{Kind: 1, Flag: trace.FlagDeviceStart, SourceKind: 1, Timestamp: a, ID: id, Name: name, Domain: dom}
			e := trace.Record{Kind: 1, Flag: trace.FlagDeviceEnd, SourceKind: 1, Timestamp: z, ID: id}
			out = append(s.AppendJSON(out), '\n')
			out = append(e.AppendJSON(out), '\n')
		}
		t0 := uint64(1_700_000_000)*1e9 + uint64(r)*7e9 // clocks skewed by seconds
		for n := range 40 {
			compute, slowest := 100+uint64(r%3), uint64(102)
			if n >= 20 && r >= 4 { // rank 5's group waits for it
				slowest = slow
				if r == 5 {
					compute = slow
				}
			}
			start := t0 + uint64(n)*200*ms
			rng(trace.MarkerForward, trace.DomainDefault, start, start+compute*ms)
			rng(opName, trace.DomainCommunication, start+compute*ms, start+(slowest+10)*ms)
			rng("step "+strconv.Itoa(n), trace.DomainDefault, start, start+(slowest+10)*ms)
		}
		if err := os.WriteFile(filepath.Join(dir, "1700000000"), out, 0o640); err != nil {
			t.Fatal(err)
		}
	}
	return job
}

func TestTextJSONHTML(t *testing.T) {
	job := writeJob(t)
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"--dir", job}, &out, &errb); code != exitOK {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	if !strings.Contains(out.String(), "slow compute ranks: 5") || !strings.Contains(out.String(), "SLOW since step 20") {
		t.Errorf("text:\n%s", out.String())
	}
	out.Reset()
	if code := run(context.Background(), []string{"--dir", job, "--format", "json", "--ranks-per-node", "4"}, &out, &errb); code != exitOK {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	r, err := slownode.ParseResult(out.Bytes())
	if err != nil || r.IsSlow != 1 || len(r.SlowHostNodes) != 0 || r.Ranks[5].Node != "node-1" {
		t.Errorf("json: %v %+v", err, r)
	}
	page := filepath.Join(t.TempDir(), "report.html")
	out.Reset()
	if code := run(context.Background(), []string{"--dir", job, "--format", "html", "--out", page}, &out, &errb); code != exitOK {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	if b, err := os.ReadFile(page); err != nil || !bytes.Contains(b, []byte("<svg")) || out.Len() != 0 {
		t.Errorf("html: %v, %d bytes on stdout", err, out.Len())
	}
}

func TestRankTable(t *testing.T) {
	job := writeJob(t)
	tbl := slownode.RankTable{}
	for r := range 8 {
		tbl[r] = "10.1.0." + strconv.Itoa(r/2)
	}
	b, _ := tbl.Marshal()
	path := filepath.Join(t.TempDir(), "hccl.json")
	os.WriteFile(path, b, 0o644)
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"--dir", job, "--rank-table", path, "--format", "json"}, &out, &errb); code != exitOK {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	if !strings.Contains(out.String(), `"node": "10.1.0.2"`) {
		t.Errorf("rank table hosts missing:\n%.400s", out.String())
	}
}

func TestUsageAndErrors(t *testing.T) {
	bad := filepath.Join(t.TempDir(), "bad.json")
	os.WriteFile(bad, []byte("{"), 0o644)
	for _, tc := range []struct {
		args []string
		code int
		msg  string
	}{
		{nil, exitUsage, "usage"},
		{[]string{"--dir", "x", "extra"}, exitUsage, "usage"},
		{[]string{"--dir", "x", "--format", "xml"}, exitUsage, "--format"},
		{[]string{"--dir", "x", "--ranks-per-node", "-1"}, exitUsage, "--ranks-per-node: -1 is negative"},
		{[]string{"--dir", "x", "--rank-table", bad}, exitUsage, "--rank-table"},
		{[]string{"--dir", filepath.Join(t.TempDir(), "missing")}, exitError, "job folder"},
		{[]string{"--dir", t.TempDir()}, exitError, "no rank folders"},
	} {
		var out, errb bytes.Buffer
		if code := run(context.Background(), tc.args, &out, &errb); code != tc.code || !strings.Contains(errb.String(), tc.msg) {
			t.Errorf("%v: exit %d, stderr %q; want %d and %q", tc.args, code, errb.String(), tc.code, tc.msg)
		}
	}
}

// verdictWriter cancels the run once a verdict has been written.
type verdictWriter struct {
	mu     sync.Mutex
	buf    bytes.Buffer
	cancel context.CancelFunc
}

func (w *verdictWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.cancel()
	return w.buf.Write(p)
}

func TestFollow(t *testing.T) {
	job := writeJob(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w := &verdictWriter{cancel: cancel}
	var errb bytes.Buffer
	if code := run(ctx, []string{"--dir", job, "--follow", "--poll", "10ms", "--quiet"}, w, &errb); code != exitOK {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	if !strings.Contains(w.buf.String(), "slow compute ranks: 5") {
		t.Errorf("follow printed:\n%s", w.buf.String())
	}
}

// TestThresholdFlags sets thresholds from the command line: a finding
// needs as many slow steps in a row as --consecutive says, and a value the
// detector cannot use is refused naming the flag.
func TestThresholdFlags(t *testing.T) {
	job := writeJob(t)
	var out, errb bytes.Buffer
	if code := run(context.Background(), []string{"--dir", job, "--quiet", "--consecutive", "25"}, &out, &errb); code != exitOK {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	if !strings.Contains(out.String(), "not slow") {
		t.Errorf("20 slow steps made a finding with --consecutive 25:\n%s", out.String())
	}
	for _, tc := range []struct{ args []string }{
		{[]string{"--min-effect", "1.5"}},
		{[]string{"--job-gate=maybe"}},
		{[]string{"--cluster-distance", "0.9"}},
		{[]string{"--consecutive", "-1"}},
		{[]string{"--nsigma", "abc"}},
	} {
		var out, errb bytes.Buffer
		code := run(context.Background(), append([]string{"--dir", job}, tc.args...), &out, &errb)
		name, _, _ := strings.Cut(strings.TrimLeft(tc.args[0], "-"), "=")
		if code != exitUsage || !strings.Contains(errb.String(), name) ||
			strings.Contains(errb.String(), "Config.") {
			t.Errorf("%v: exit %d, %q; want exit %d naming the flag", tc.args, code, errb.String(), exitUsage)
		}
	}
}

// TestJobGate: rank 5 computing 20% slower moves the job's step time
// (the median over the 8 ranks) by 8%, under DegradationPercentage: found
// by default, not with --job-gate (MindCluster's FD-OL), which finds the
// 80% slowdown that moves it by 35%.
func TestJobGate(t *testing.T) {
	for _, tc := range []struct {
		slow  uint64
		args  []string
		found bool
	}{
		{120, nil, true},
		{120, []string{"--job-gate"}, false},
		{180, []string{"--job-gate"}, true},
	} {
		var out, errb bytes.Buffer
		args := append([]string{"--dir", writeJobSlow(t, tc.slow), "--quiet", "--format", "json"}, tc.args...)
		if code := run(context.Background(), args, &out, &errb); code != exitOK {
			t.Fatalf("%v: exit %d: %s", args, code, errb.String())
		}
		var r struct {
			SlowCalculateRanks []int `json:"slowCalculateRanks"`
		}
		if err := json.Unmarshal(out.Bytes(), &r); err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		if found := slices.Equal(r.SlowCalculateRanks, []int{5}); found != tc.found {
			t.Errorf("rank 5 at %d ms, %v: slowCalculateRanks %v, want rank 5 found %v", tc.slow, tc.args, r.SlowCalculateRanks, tc.found)
		}
	}
}
