// Command hang-viewer merges the stack files of every rank of a hung job
// into flame graphs, folded stacks and a pprof profile, and prints where
// the ranks split.
//
//	go run ./examples/hang-viewer --path <dir> [--out <dir>]
//
// It reads <rank:05d>-<world:05d>.stacktrace files and py-spy's own
// `dump --json` files named by rank (3.json, rank-3.json, ...), and writes
// py_stack.svg, cpp_stack.svg, py_stack.folded, cpp_stack.folded and
// stacks.pb.gz (plus go_stack.* for Go ranks) into --out, which defaults
// to --path; a kind no rank gave stacks of gets no file, and the listing
// says so. Files it cannot read are listed; the rest still merges.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/faultline-ml/faultline/hang"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run is main with its arguments and outputs, returning the exit code:
// 0 when merged, 1 when nothing could be merged, 2 for bad usage.
func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("hang-viewer", flag.ContinueOnError)
	fs.SetOutput(stderr)
	path := fs.String("path", "", "folder of stack files (required)")
	out := fs.String("out", "", "folder for the outputs (default: --path)")
	world := fs.Int("world", 0, "ranks in the job (default: what the files say)")
	maxDepth := fs.Int("max-depth", 0, "frames kept per stack (default 1024)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: hang-viewer --path <dir> [--out <dir>] [--world N] [--max-depth N]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if *path == "" || fs.NArg() > 0 {
		fs.Usage()
		return 2
	}
	if *out == "" {
		*out = *path
	}
	m, err := hang.MergeDir(*path, hang.MergeConfig{World: *world, MaxDepth: *maxDepth})
	if err != nil {
		fmt.Fprintln(stderr, "hang-viewer:", err)
		return 1
	}
	files, err := m.WriteFiles(*out)
	if err != nil {
		fmt.Fprintln(stderr, "hang-viewer:", err)
		return 1
	}
	fmt.Fprint(stdout, m.Verdict())
	fmt.Fprintln(stdout, "wrote:")
	for _, f := range files {
		fmt.Fprintln(stdout, " ", f)
	}
	for _, k := range []struct {
		kind      hang.Kind
		what      string
		svg, fold string
	}{
		{hang.KindPython, "Python", hang.PythonSVGFile, hang.PythonFoldedFile},
		{hang.KindNative, "native", hang.NativeSVGFile, hang.NativeFoldedFile},
	} {
		if !m.HasStacks(k.kind) {
			fmt.Fprintf(stdout, "no %s stacks from any rank: %s and %s not written\n", k.what, k.svg, k.fold)
		}
	}
	return 0
}
