package slownode

import (
	"bytes"
	"cmp"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
)

// Formats of a written result.
const (
	FormatText = "text"
	FormatJSON = "json"
	FormatHTML = "html"
)

// Write writes r in format (FormatText, FormatJSON or FormatHTML).
func Write(w io.Writer, r *Result, format string) error {
	switch format {
	case FormatText:
		return WriteText(w, r)
	case FormatJSON:
		return WriteJSON(w, r)
	case FormatHTML:
		return WriteHTML(w, r)
	}
	return fmt.Errorf("slownode: format %q: want %s, %s or %s", format, FormatText, FormatJSON, FormatHTML)
}

// WriteJSON writes r's JSON form, the MindCluster fields first.
func WriteJSON(w io.Writer, r *Result) error {
	b, err := r.Marshal()
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}

// textOKRanks is how many healthy ranks the text table lists after the
// slow and silent ones.
const textOKRanks = 16

// rankedRanks orders ranks for reading: slow first, then silent, then
// by relative score, lowest (slowest) first.
func rankedRanks(r *Result) []RankSummary {
	order := map[string]int{"slow": 0, "silent": 1, "waiting": 2, "ok": 3}
	rs := slices.Clone(r.Ranks)
	slices.SortStableFunc(rs, func(a, b RankSummary) int {
		return cmp.Or(cmp.Compare(order[a.Status], order[b.Status]),
			cmp.Compare(a.RelativeScore, b.RelativeScore), cmp.Compare(a.Rank, b.Rank))
	})
	return rs
}

func fmtMs(v float64) string { return strconv.FormatFloat(v, 'f', 1, 64) }

func joinInts(xs []int) string {
	var b strings.Builder
	for i, x := range xs {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(strconv.Itoa(x))
	}
	return b.String()
}

// subject names what a finding blames, in a few words.
func (f *Finding) subject() string {
	switch f.Kind {
	case KindCommunicationDomain:
		return fmt.Sprintf("%s %s [%s]", f.GroupKind, f.Group, joinInts(f.Ranks))
	case KindHost:
		return fmt.Sprintf("host %s [%s]", f.Node, joinInts(f.Ranks))
	}
	return fmt.Sprintf("rank %s on %s", joinInts(f.Ranks), f.Node)
}

// WriteText writes r for a terminal: the verdict, the findings with their
// evidence, and a table of ranks, slowest first.
func WriteText(w io.Writer, r *Result) error {
	ew := &errWriter{w: w}
	job := cmp.Or(r.JobID, "(unnamed)")
	switch {
	case r.LastStep < 0:
		ew.printf("job %s: no step evaluated yet\n", job)
	case r.IsSlow == 1:
		ew.printf("job %s: SLOW since step %d, degradation %s, confidence %.2f (last step %d)\n",
			job, r.OnsetStep, r.DegradationLevel, r.Confidence, r.LastStep)
	default:
		ew.printf("job %s: not slow (last step %d)\n", job, r.LastStep)
	}
	if r.BaselineMs > 0 {
		ew.printf("  step time: baseline %s ms, recent %s ms\n", fmtMs(r.BaselineMs), fmtMs(r.StepMs))
	}
	lists := []struct {
		name string
		v    string
	}{
		{"slow compute ranks", joinInts(r.SlowCalculateRanks)},
		{"slow hosts", strings.Join(r.SlowHostNodes, " ")},
		{"slow IO ranks", joinInts(r.SlowIORanks)},
		{"slow link ranks", joinInts(r.SlowCommunicationRanks)},
		{"silent ranks", joinInts(r.SilentRanks)},
	}
	for _, l := range lists {
		if l.v != "" {
			ew.printf("  %s: %s\n", l.name, l.v)
		}
	}
	for _, m := range r.Unavailable {
		ew.printf("  not computed: %s: %s\n", m.Figure, m.Reason)
	}
	for _, d := range r.SlowCommunicationDomains {
		ew.printf("  slow communication domain: [%s]\n", joinInts(d))
	}
	for _, p := range r.PhaseChanges {
		ew.printf("  phase change at step %d (seen at %d): step time %s → %s ms (×%.2f), not a slow node\n",
			p.Step, p.Detected, fmtMs(p.FromMs), fmtMs(p.ToMs), p.Ratio)
	}
	for _, warn := range r.Input.Warnings {
		ew.printf("  warning: %s\n", warn)
	}
	if len(r.Findings) > 0 {
		waited := slices.ContainsFunc(r.Findings, func(f Finding) bool { return f.WaitedOn > 0 })
		ew.printf("\nFINDINGS\n")
		tw := tabwriter.NewWriter(ew, 0, 0, 2, ' ', 0)
		head := "KIND\tSUBJECT\tMETRIC\tMETHOD\tPEERS ms\tRECENT ms\tRATIO"
		if waited {
			head += "\tPEERS WAITED FOR IT ms"
		}
		fmt.Fprintln(tw, head+"\tONSET\tSEEN\tCONF")
		for _, f := range r.Findings {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s", f.Kind, f.subject(), f.Metric, f.Method,
				orDash(f.Baseline, fmtMs), orDash(f.Recent, fmtMs), orDash(f.Ratio, fmtRatio))
			if waited {
				fmt.Fprintf(tw, "\t%s", f.waitedText())
			}
			fmt.Fprintf(tw, "\t%d\t%d\t%.2f\n", f.OnsetStep, f.DetectedStep, f.Confidence)
		}
		tw.Flush()
	}
	if len(r.Ranks) > 0 {
		ranks := rankedRanks(r)
		shown, ok := 0, 0
		for _, rk := range ranks {
			if rk.Status == "ok" {
				if ok == textOKRanks {
					break
				}
				ok++
			}
			shown++
		}
		ew.printf("\nRANKS (slowest first, %d of %d; medians of recent steps in ms)\n", shown, len(ranks))
		cols := rankColumns(r)
		var tb bytes.Buffer
		tw := tabwriter.NewWriter(&tb, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprint(tw, "RANK\tNODE\tSTAGE\tSTATUS\tLAST\t")
		for _, c := range cols {
			fmt.Fprint(tw, c.short, "\t")
		}
		fmt.Fprintln(tw, "FLAGS\t")
		for _, rk := range ranks[:shown] {
			fmt.Fprintf(tw, "%d\t%s\t%d\t%s\t%d\t", rk.Rank, rk.Node, rk.Stage, rk.Status, rk.LastStep)
			for _, c := range cols {
				fmt.Fprint(tw, c.cell(&rk), "\t")
			}
			fmt.Fprintln(tw, strings.Join(rk.Flags, ","), "\t")
		}
		tw.Flush()
		for line := range strings.Lines(tb.String()) {
			ew.printf("%s\n", strings.TrimRight(line, " \n"))
		}
	}
	in := r.Input
	ew.printf("\ninput: %d ranks, %d records, %d bytes, %d garbage lines, %d unmatched ends, %d steps evaluated\n",
		in.Ranks, in.Records, in.Bytes, in.GarbageLines, in.UnmatchedEnds, in.Detector.Evaluated)
	return ew.err
}

// rankColumn is a figure of the rank tables.
type rankColumn struct {
	short, long string // text and HTML headers
	figure      string // what Unavailable calls it
	value       func(*RankSummary) float64
	score       bool // printed with three decimals, not as milliseconds
}

var allRankColumns = []rankColumn{
	{"STEP", "Step", "step", func(r *RankSummary) float64 { return r.StepMs }, false},
	{"GAP", "Gap", "trajectory", func(r *RankSummary) float64 { return r.GapMs }, false},
	{"FP+BP", "FP+BP", "trajectory", func(r *RankSummary) float64 { return r.FPBPMs }, false},
	{"TRAIL", "Trailing", "trajectory", func(r *RankSummary) float64 { return r.TrailingMs }, false},
	{"COMPUTE", "Compute", "compute", func(r *RankSummary) float64 { return r.ComputeMs }, false},
	{"FWD", "Forward", "forward", func(r *RankSummary) float64 { return r.ForwardMs }, false},
	{"DATA", "Data", "dataloader", func(r *RankSummary) float64 { return r.DataLoaderMs }, false},
	{"CKPT", "Ckpt", "checkpoint", func(r *RankSummary) float64 { return r.CheckpointMs }, false},
	{"COMM", "Comm", "communication", func(r *RankSummary) float64 { return r.CommMs }, false},
	{"SEND", "Send", "send", func(r *RankSummary) float64 { return r.SendMs }, false},
	{"REL", "Rel.", relativeScore, func(r *RankSummary) float64 { return r.RelativeScore }, true},
	{"IND", "Ind.", individualScore, func(r *RankSummary) float64 { return r.IndividualScore }, true},
}

// rankColumns returns the columns of the figures some rank has: a column
// no rank computed is left out (r.Unavailable says why).
func rankColumns(r *Result) []rankColumn {
	var cols []rankColumn
	for _, c := range allRankColumns {
		if !slices.ContainsFunc(r.Unavailable, func(m Missing) bool { return m.Figure == c.figure }) {
			cols = append(cols, c)
		}
	}
	return cols
}

// cell formats the column's figure of a rank, "-" where the rank lacks it.
func (c *rankColumn) cell(r *RankSummary) string {
	if r.Status == "waiting" || slices.Contains(r.Unavailable, c.figure) {
		return "-"
	}
	if c.score {
		return strconv.FormatFloat(c.value(r), 'f', 3, 64)
	}
	return fmtMs(c.value(r))
}

// orDash formats v, or "-" for a figure not computed (0).
func orDash(v float64, format func(float64) string) string {
	if v == 0 {
		return "-"
	}
	return format(v)
}

func fmtRatio(v float64) string { return strconv.FormatFloat(v, 'f', 2, 64) }

// waitedText says how long a rank's peers waited for it, and where.
func (f *Finding) waitedText() string {
	if f.WaitedOn == 0 {
		return "-"
	}
	return fmtMs(f.WaitedOn) + " in " + f.Group
}

type errWriter struct {
	w   io.Writer
	err error
}

func (e *errWriter) Write(p []byte) (int, error) {
	if e.err != nil {
		return 0, e.err
	}
	n, err := e.w.Write(p)
	e.err = err
	return n, err
}

func (e *errWriter) printf(format string, args ...any) { fmt.Fprintf(e, format, args...) }
