// Command slownode says whether a training job is slow and what makes it
// so (ranks slow to compute, hosts, communicators, data loading, pipeline
// links), from the job's dotting files.
//
//	slownode --dir <root>/<job> [--ranks-per-node 8] [--rank-table hccl.json]
//	         [--format text|json|html] [--out FILE] [--follow] [--poll 1s]
//	         [--relative-threshold 0.15] [--min-effect 0.02] [--nsigma 3]
//	         [--consecutive 3] [--cluster-distance 1.3] [--normal-steps 15]
//	         [--degradation 0.3] [--window 8] [--silent-steps 100]
//	         [--job-gate]
//
// Without --follow it reads every rank folder to its end and prints one
// verdict. With --follow it keeps tailing the files and prints a new
// verdict each time it changes, until interrupted. --out writes the
// verdict (the latest one, with --follow) to FILE atomically instead of
// standard output. Progress goes to standard error on large inputs.
//
// The text format is a table to read in a terminal; json is MindCluster's
// ClusterJobResult with evidence added; html is one page with no external
// resources: charts of the job's step time and of the figures that set the
// slow ranks apart, and the sortable trajectory table.
//
// The threshold flags set the fields of slownode.Config of the same
// meaning (see its documentation for how each default was chosen); 0
// keeps the default. --job-gate examines the ranks only at steps where
// the job's step time is degraded, as MindCluster's FD-OL does; without
// it a rank slower than its peers is found however little it moves the
// job's step time.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/faultline-ml/faultline/internal/atomicfile"
	"github.com/faultline-ml/faultline/trace/slownode"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// Exit codes.
const (
	exitOK    = 0
	exitError = 1
	exitUsage = 2
)

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("slownode", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("dir", "", "job folder: <root>/<job>, holding one folder per rank (required)")
	rpn := fs.Int("ranks-per-node", slownode.DefaultRanksPerNode, "ranks per host, to name hosts when there is no rank table")
	rankTable := fs.String("rank-table", "", "rank table (hccl.json) naming the host of each rank")
	format := fs.String("format", slownode.FormatText, "output format: text, json or html")
	out := fs.String("out", "", "write the verdict to this file instead of standard output")
	follow := fs.Bool("follow", false, "keep tailing the files and print each new verdict")
	poll := fs.Duration("poll", slownode.DefaultPollInterval, "with --follow, how often to look for new records")
	quiet := fs.Bool("quiet", false, "no progress on standard error")
	jobGate := fs.Bool("job-gate", false, "judge ranks only at steps whose job step time is degraded (--degradation, --nsigma), as MindCluster's FD-OL does")
	var cfg slownode.Config
	thresholds := []struct {
		name, field, usage string
		f                  *float64
		i                  *int
	}{
		{"relative-threshold", "RelativeThreshold", "how far above its healthy peers' median (a fraction) a rank's figure must be", &cfg.RelativeThreshold, nil},
		{"min-effect", "MinEffect", "the smallest difference worth a finding, as a fraction of the step time", &cfg.MinEffect, nil},
		{"nsigma", "NSigma", "how many deviations of the ranks' noise a figure must stand above its peers, and the step time above its baseline", &cfg.NSigma, nil},
		{"consecutive", "Consecutive", "anomalous steps in a row that make a finding, and normal ones that clear it", nil, &cfg.Consecutive},
		{"cluster-distance", "ClusterMeanDistance", "homogenisation: how many times longer the members that wait more must wait", &cfg.ClusterMeanDistance, nil},
		{"normal-steps", "NormalSteps", "steps that make the job's step-time baseline", nil, &cfg.NormalSteps},
		{"degradation", "DegradationPercentage", "how far above its baseline (a fraction) the job's step time must be", &cfg.DegradationPercentage, nil},
		{"window", "Window", "recent steps the evidence and the scores are taken over", nil, &cfg.Window},
		{"silent-steps", "SilentSteps", "steps behind the job after which a rank that stopped writing is silent", nil, &cfg.SilentSteps},
	}
	flagOf := map[string]string{"RanksPerNode": "ranks-per-node", "PollInterval": "poll"}
	for _, th := range thresholds {
		flagOf[th.field] = th.name
		if th.f != nil {
			fs.Float64Var(th.f, th.name, defaultOf(th.field), th.usage)
		} else {
			fs.IntVar(th.i, th.name, int(defaultOf(th.field)), th.usage)
		}
	}
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	if *dir == "" || fs.NArg() > 0 {
		fmt.Fprintln(stderr, "usage: slownode --dir <root>/<job> [--ranks-per-node N] [--rank-table FILE] [--format text|json|html] [--out FILE] [--follow] [threshold flags, see -h]")
		return exitUsage
	}
	switch *format {
	case slownode.FormatText, slownode.FormatJSON, slownode.FormatHTML:
	default:
		fmt.Fprintf(stderr, "slownode: --format %q: want text, json or html\n", *format)
		return exitUsage
	}
	cfg.RanksPerNode, cfg.PollInterval, cfg.JobGate = *rpn, *poll, *jobGate
	if *rankTable != "" {
		b, err := os.ReadFile(*rankTable)
		if err == nil {
			cfg.Nodes, err = slownode.ParseRankTable(b)
		}
		if err != nil {
			fmt.Fprintf(stderr, "slownode: --rank-table: %v\n", err)
			return exitUsage
		}
	}
	if err := cfg.Validate(); err != nil {
		var ce *slownode.ConfigError
		if errors.As(err, &ce) && flagOf[ce.Field] != "" {
			fmt.Fprintf(stderr, "slownode: --%s: %v %s\n", flagOf[ce.Field], ce.Value, ce.Why)
		} else {
			fmt.Fprintln(stderr, err)
		}
		return exitUsage
	}
	if !*quiet {
		cfg.Progress = progressPrinter(stderr)
	}
	emit := func(r *slownode.Result) error {
		var buf bytes.Buffer
		if err := slownode.Write(&buf, r, *format); err != nil {
			return err
		}
		if *out != "" {
			return atomicfile.WriteFile(*out, buf.Bytes(), 0o644)
		}
		if *follow && *format == slownode.FormatText {
			fmt.Fprintf(&buf, "\n")
		}
		_, err := stdout.Write(buf.Bytes())
		return err
	}
	if !*follow {
		r, err := slownode.Analyze(ctx, *dir, cfg)
		if err == nil {
			err = emit(r)
		}
		if err != nil {
			fmt.Fprintf(stderr, "slownode: %v\n", err)
			return exitError
		}
		return exitOK
	}
	var werr error
	err := slownode.Watch(ctx, *dir, cfg, func(r *slownode.Result) {
		if werr == nil {
			werr = emit(r)
		}
	})
	if err == nil {
		err = werr
	}
	if err != nil && !errors.Is(err, context.Canceled) {
		fmt.Fprintf(stderr, "slownode: %v\n", err)
		return exitError
	}
	return exitOK
}

// defaultOf returns the default of the threshold field of slownode.Config.
func defaultOf(field string) float64 {
	return map[string]float64{
		"RelativeThreshold":     slownode.DefaultRelativeThreshold,
		"MinEffect":             slownode.DefaultMinEffect,
		"NSigma":                slownode.DefaultNSigma,
		"Consecutive":           slownode.DefaultConsecutive,
		"ClusterMeanDistance":   slownode.DefaultClusterMeanDistance,
		"NormalSteps":           slownode.DefaultNormalSteps,
		"DegradationPercentage": slownode.DefaultDegradationPercentage,
		"Window":                slownode.DefaultWindow,
		"SilentSteps":           slownode.DefaultSilentSteps,
	}[field]
}

// progressPrinter reports reading progress on large inputs.
func progressPrinter(w io.Writer) func(slownode.Progress) {
	return func(p slownode.Progress) {
		state := "read"
		if p.Done {
			state = "caught up:"
		}
		fmt.Fprintf(w, "slownode: %s %d ranks, %.1f MB, %d records, step %d evaluated\n",
			state, p.Ranks, float64(p.Bytes)/1e6, p.Records, p.LastStep)
	}
}
