package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/faultline-ml/faultline/ckpt"
	"github.com/faultline-ml/faultline/internal/atomicfile"
)

// summary is summary.json: the machine-readable account of a run.
type summary struct {
	Nodes        int            `json:"nodes"`
	ProcsPerNode int            `json:"procs_per_node"`
	Started      time.Time      `json:"started"`
	Seconds      float64        `json:"seconds"`
	FinalStep    int64          `json:"final_step"`
	Faults       []*faultResult `json:"faults"`
	// OK is set when every fault was detected and recovered from, and
	// training went on afterwards.
	OK bool `json:"ok"`
}

// run runs the demo with cfg, telling its story on w.
func run(ctx context.Context, cfg config, w io.Writer) (err error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return err
	}
	out, err := prepareOut(cfg.Out)
	if err != nil {
		return err
	}
	jctx, cancel := context.WithCancel(ctx)
	j := &job{cfg: cfg, out: out, start: time.Now(), cancel: cancel}
	j.con = newConsole(w, j.statusLine)
	conCtx, stopCon := context.WithCancel(context.Background())
	conDone := make(chan struct{})
	go func() { j.con.run(conCtx); close(conDone) }()
	defer func() {
		stopCon()
		<-conDone
	}()
	defer j.teardown()

	if err := j.setup(jctx); err != nil {
		return err
	}
	j.wg.Go(func() { j.diag.run(jctx) })
	j.setPhase("training")

	results := j.scenario(jctx)
	if ctx.Err() != nil {
		j.con.printf("\ninterrupted: stopping every process")
	}
	sum := summary{Nodes: cfg.Nodes, ProcsPerNode: cfg.ProcsPerNode, Started: j.start, Faults: results}
	j.mu.Lock()
	sum.FinalStep, _ = j.minStepLocked()
	j.mu.Unlock()
	sum.OK = ctx.Err() == nil && len(results) == len(cfg.Faults)
	for _, r := range results {
		sum.OK = sum.OK && r.Detected && r.Recovered && r.Healthy && r.Error == ""
	}
	j.setPhase("writing the outputs")
	j.finish(&sum)

	switch {
	case ctx.Err() != nil:
		return ctx.Err()
	case cfg.Keep:
		j.keep(ctx) // until Ctrl-C, the way a kept demo ends
	}
	if !sum.OK {
		return errors.New("not every fault was detected and recovered from; see " + j.rel(j.path("summary.json")))
	}
	return nil
}

// finish writes the outputs of the run and prints the summary.
func (j *job) finish(sum *summary) {
	j.con.printf("")
	j.writeInspect()
	j.writeOrchestrations()
	j.scrapeMetrics()
	sum.Seconds = time.Since(j.start).Seconds()
	b, _ := json.MarshalIndent(sum, "", "  ")
	if err := atomicfile.WriteFile(j.path("summary.json"), append(b, '\n'), 0o644); err != nil {
		j.con.printf("summary.json: %v", err)
	}
	var table strings.Builder
	tw := tabwriter.NewWriter(&table, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "FAULT\tWHERE\tDETECTED BY\tDETECTION\tRECOVERY\tRECOVERED IN\tRESUMED FROM\tOK")
	for _, r := range sum.Faults {
		where := fmt.Sprintf("rank %d, node %d", r.Rank, r.Node)
		by, _, _ := strings.Cut(r.DetectedBy, ",")
		det, rec, in, from := "-", "-", "-", "-"
		if r.Detected {
			det = seconds(r.DetectionSeconds)
		}
		if o := r.Recovery; o != nil {
			rec = fmt.Sprintf("#%d %s", o.ID, o.Strategy)
			if r.Recovered {
				in = seconds(r.RecoverySeconds)
			}
		}
		if r.RestoredStep >= 0 {
			from = fmt.Sprintf("step %d (%s)", r.RestoredStep, tiersShort(r.RestoredTiers))
		}
		ok := "yes"
		if r.Error != "" || !r.Recovered {
			ok = "NO"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Title, where, by, det, rec, in, from, ok)
	}
	tw.Flush()
	os.WriteFile(j.path("summary.txt"), []byte(table.String()), 0o644)
	j.con.printf("summary (%s; detection: from the fault to its detection; recovered in: from the manager taking the fault in to training resumed)\n%s",
		j.rel(j.path("summary.json")), table.String())
	j.con.printf("final step %d after %.0fs; outputs in %s:", sum.FinalStep, sum.Seconds, j.rel(j.out))
	for _, l := range j.outputs(sum) {
		j.con.printf("  %s", l)
	}
}

// seconds formats a duration in seconds: milliseconds below 0.1 s.
func seconds(s float64) string {
	if s < 0.1 {
		return fmt.Sprintf("%.1fms", s*1000)
	}
	return fmt.Sprintf("%.2fs", s)
}

func tiersShort(m map[string]int) string {
	var parts []string
	for t := range m {
		parts = append(parts, t)
	}
	return strings.Join(parts, "+")
}

// outputs lists the output folder's files worth opening.
func (j *job) outputs(sum *summary) []string {
	var lines []string
	for _, r := range sum.Faults {
		switch r.Name {
		case faultSlowCompute, faultSlowIO:
			lines = append(lines, fmt.Sprintf("%-28s slow-node report of the %s (open in a browser)", r.Dir+"/slownode.html", r.Title))
		case faultHang:
			lines = append(lines, fmt.Sprintf("%-28s merged flame graph of every rank's training goroutine", r.Dir+"/go_stack.svg"))
			lines = append(lines, fmt.Sprintf("%-28s where the ranks split; go tool pprof -top %s/stacks.pb.gz", r.Dir+"/verdict.txt", r.Dir))
		}
	}
	return append(lines,
		fmt.Sprintf("%-28s memory and disk tiers of the checkpoints, every CRC checked", "ckpt-inspect.txt"),
		fmt.Sprintf("%-28s every orchestration, its transitions and figures", "orchestrations.json"),
		fmt.Sprintf("%-28s the manager's fault log", "manager/faults.jsonl"),
		fmt.Sprintf("%-28s Prometheus metrics scraped at the end", "metrics/"),
		fmt.Sprintf("%-28s dotting files; stack files; disk checkpoints; logs", "profiling/ stacks/ ckpt/ logs/"),
	)
}

// writeInspect writes ckpt-inspect.txt: both tiers of the checkpoints.
func (j *job) writeInspect() {
	var b strings.Builder
	for n, o := range j.owners {
		for _, s := range j.ckpts.shards[n] {
			path := o.SegmentPath(s)
			r, err := ckpt.InspectSegment(path)
			if err != nil {
				fmt.Fprintf(&b, "memory %s: %v\n", path, err)
				continue
			}
			fmt.Fprintf(&b, "memory shard %d (node %d) %s: halves of %d bytes\n", s, n, path, r.Header.HalfSize)
			for i, h := range r.Halves {
				mark := " "
				if i == r.NewestHalf {
					mark = "*"
				}
				switch {
				case h.Err == nil:
					status := "sealed, every CRC holds"
					if !h.Meta.Sealed {
						status = "not sealed yet"
					}
					fmt.Fprintf(&b, "  %s half %d: step %d, %d blobs, %d bytes, %s\n", mark, i, h.Meta.Step, len(h.Meta.Blobs), h.Meta.DataSize(), status)
				case h.Corrupt:
					fmt.Fprintf(&b, "  %s half %d: CORRUPT: %v\n", mark, i, h.Err)
				default:
					fmt.Fprintf(&b, "  %s half %d: %v\n", mark, i, h.Err)
				}
			}
		}
	}
	r, err := ckpt.InspectDir(j.path("ckpt"))
	if err != nil {
		fmt.Fprintf(&b, "disk %s: %v\n", j.path("ckpt"), err)
	}
	for _, t := range r.Trackers {
		switch {
		case t.Err != nil:
			fmt.Fprintf(&b, "tracker %s: BAD: %v\n", t.File, t.Err)
		case t.Step < 0:
			fmt.Fprintf(&b, "tracker %s: absent\n", t.File)
		default:
			fmt.Fprintf(&b, "tracker %s: step %d\n", t.File, t.Step)
		}
	}
	for _, s := range r.Steps {
		state := "committed"
		if !s.Committed {
			state = "not committed (a persist in progress)"
		}
		bad := 0
		for _, sh := range s.Shards {
			if sh.Err != nil && !sh.Absent {
				bad++
				fmt.Fprintf(&b, "  step %d shard %d: BAD: %v\n", s.Step, sh.Shard, sh.Err)
			}
		}
		fmt.Fprintf(&b, "disk step %d: %s, %d shards, %d bad\n", s.Step, state, len(s.Shards), bad)
	}
	for _, p := range r.Problems {
		fmt.Fprintf(&b, "problem: %v\n", p)
	}
	path := j.path("ckpt-inspect.txt")
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		j.con.printf("%s: %v", path, err)
	}
}

// writeOrchestrations writes orchestrations.json: the manager's history.
func (j *job) writeOrchestrations() {
	st := j.m.Orchestrations(0)
	var all []*recoveryResult
	for _, o := range st.History {
		all = append(all, recoveryOf(o))
	}
	if st.Current != nil {
		all = append(all, recoveryOf(*st.Current))
	}
	b, _ := json.MarshalIndent(all, "", "  ")
	os.WriteFile(j.path("orchestrations.json"), append(b, '\n'), 0o644)
}

// scrapeMetrics scrapes the /metrics of the launcher (manager, checkpoint
// owners, policy, slow-node watcher), the proxies and the workers.
func (j *job) scrapeMetrics() {
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	targets := map[string]string{"manager.prom": j.metrics}
	for _, p := range j.proxies {
		targets[fmt.Sprintf("proxy-%d.prom", p.node)] = p.metrics
	}
	j.mu.Lock()
	for _, v := range j.ranks {
		if v.metrics != "" {
			targets[fmt.Sprintf("rank-%d.prom", v.rank)] = v.metrics
		}
	}
	j.mu.Unlock()
	for name, url := range targets {
		if err := scrape(client, url, j.path("metrics", name)); err != nil {
			j.log.Error("demo: scrape", "url", url, "err", err)
		}
	}
}

// keep leaves the job training until ctx ends, printing where to look.
func (j *job) keep(ctx context.Context) {
	j.setPhase("kept running: Ctrl-C ends it")
	j.con.printf("\n--keep: the job keeps training; Ctrl-C ends it. Metrics (curl them):")
	j.con.printf("  manager  %s  (taskd, ckpt owners, rescheduling policy, slownode, trace ager)", j.metrics)
	for _, p := range j.proxies {
		j.con.printf("  proxy %d  %s", p.node, p.metrics)
	}
	j.mu.Lock()
	var lines []string
	for _, v := range j.ranks {
		lines = append(lines, fmt.Sprintf("  rank %d   %s", v.rank, v.metrics))
	}
	j.mu.Unlock()
	for _, l := range lines {
		j.con.printf("%s", l)
	}
	j.con.printf("  checkpoints in memory: %s (go run ./examples/flashckpt inspect --shm %s --name ckpt --dir %s)",
		j.shm, j.shm, j.path("ckpt"))
	<-ctx.Done()
}
