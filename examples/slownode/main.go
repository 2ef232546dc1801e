// Command slownode says whether a training job is slow and what makes it
// so (ranks slow to compute, hosts, communicators, data loading, pipeline
// links), from the job's dotting files.
//
//	slownode --dir <root>/<job> [--ranks-per-node 8] [--rank-table hccl.json]
//	         [--format text|json|html] [--out FILE] [--follow] [--poll 1s]
//
// Without --follow it reads every rank folder to its end and prints one
// verdict. With --follow it keeps tailing the files and prints a new
// verdict each time it changes, until interrupted. --out writes the
// verdict (the latest one, with --follow) to FILE atomically instead of
// standard output. Progress goes to standard error on large inputs.
//
// The text format is a table to read in a terminal; json is MindCluster's
// ClusterJobResult with evidence added; html is one page with no external
// resources: charts of step time per rank and the sortable trajectory
// table.
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
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	if *dir == "" || fs.NArg() > 0 {
		fmt.Fprintln(stderr, "usage: slownode --dir <root>/<job> [--ranks-per-node N] [--rank-table FILE] [--format text|json|html] [--out FILE] [--follow]")
		return exitUsage
	}
	switch *format {
	case slownode.FormatText, slownode.FormatJSON, slownode.FormatHTML:
	default:
		fmt.Fprintf(stderr, "slownode: --format %q: want text, json or html\n", *format)
		return exitUsage
	}
	cfg := slownode.Config{RanksPerNode: *rpn, PollInterval: *poll}
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
		fmt.Fprintln(stderr, err)
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
