package hang

import (
	"bytes"
	"regexp"
	"strconv"
	"strings"
)

var (
	fhThreadHeader = regexp.MustCompile(`^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):$`)
	fhFrame        = regexp.MustCompile(`^  File "(.*)", line (\d+|\?\?\?) in (.*)$`)
)

// ParseFaulthandler parses what Python's faulthandler writes (on a signal
// registered with faulthandler.register, a fatal error or
// dump_traceback): one block per thread, a header line ("Thread 0x...
// (most recent call first):", "Current thread 0x..." for the thread that
// took the signal) followed by its frames, innermost first:
//
//	File "/usr/lib/python3/dist-packages/torch/distributed/distributed_c10d.py", line 1320 in all_reduce
//
// It returns the threads as KindPython; like the other parsers it never
// fails, skipping a line it does not understand. faulthandler writes from
// a signal handler, so it works while the interpreter is blocked in C
// (inside a collective), where py-spy needs ptrace; it gives no locals
// and no native frames.
//
// A frame's File is shortened to the path below site-packages or
// dist-packages, or below the standard library's folder, so that ranks
// whose interpreters live under other prefixes merge; other paths (the
// training script) are kept whole.
func ParseFaulthandler(text []byte) []Thread {
	var threads []Thread
	var cur *Thread
	for raw := range bytes.SplitSeq(text, []byte("\n")) {
		line := strings.TrimRight(string(raw), "\r")
		if m := fhThreadHeader.FindStringSubmatch(line); m != nil {
			id, _ := strconv.ParseUint(m[2][2:], 16, 64)
			th := Thread{Kind: KindPython, ID: id}
			if m[1] == "Current thread" {
				th.State = "signalled"
			}
			threads = append(threads, th)
			cur = &threads[len(threads)-1]
			continue
		}
		if cur == nil {
			continue
		}
		m := fhFrame.FindStringSubmatch(line)
		if m == nil {
			if strings.TrimSpace(line) == "" {
				cur = nil
			}
			continue
		}
		n, _ := strconv.Atoi(m[2]) // "???": 0, unknown
		cur.Frames = append(cur.Frames, Frame{Func: m[3], File: shortPythonPath(m[1]), Line: n})
	}
	return threads
}

// shortPythonPath cuts a module's path down to what follows the last
// site-packages or dist-packages folder, or the standard library's
// pythonX.Y folder.
func shortPythonPath(p string) string {
	for _, dir := range []string{"/site-packages/", "/dist-packages/"} {
		if i := strings.LastIndex(p, dir); i >= 0 {
			return p[i+len(dir):]
		}
	}
	if i := strings.Index(p, "/lib/python"); i >= 0 {
		rest := p[i+len("/lib/python"):]
		if j := strings.IndexByte(rest, '/'); j > 0 {
			return rest[j+1:]
		}
	}
	return p
}
