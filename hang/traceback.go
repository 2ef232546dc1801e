package hang

import (
	"bytes"
	"regexp"
	"strconv"
	"strings"
)

// Parsers of the stack dumps that tools print. They never fail: a line
// they do not understand is skipped, so a tool's warnings mixed into its
// output cost nothing.

var (
	goroutineHeader = regexp.MustCompile(`^goroutine (\d+)(?: [^\[]*)? \[(.*)\]:$`)
	gdbThreadHeader = regexp.MustCompile(`^Thread \d+ \((.*)\):$`)
	gdbLWP          = regexp.MustCompile(`(?:LWP|process) (\d+)`)
	gdbThreadName   = regexp.MustCompile(`"([^"]*)"\)?$`)
	gdbAt           = regexp.MustCompile(`^(.*) at (\S.*):(\d+)$`)
	gdbFrom         = regexp.MustCompile(`^(.*) from (\S+)$`)
	euThreadHeader  = regexp.MustCompile(`^TID (\d+):$`)
	euFrame         = regexp.MustCompile(`^#\d+\s+0x[0-9a-fA-F]+(?:\s+(.*))?$`)
	euSource        = regexp.MustCompile(`^\s+(\S.*?):(\d+)(?::\d+)?$`)
)

// parseGoroutines parses the text of runtime.Stack(buf, true), a Go
// panic or SIGQUIT dump into one KindGo thread per goroutine.
func parseGoroutines(text []byte) []Thread {
	var threads []Thread
	var cur *Thread
	var fn string // function line waiting for its file line
	for raw := range bytes.SplitSeq(text, []byte("\n")) {
		line := strings.TrimRight(string(raw), "\r")
		if m := goroutineHeader.FindStringSubmatch(line); m != nil {
			id, _ := strconv.ParseUint(m[1], 10, 64)
			threads = append(threads, Thread{Kind: KindGo, ID: id, Name: "goroutine " + m[1], State: m[2]})
			cur, fn = &threads[len(threads)-1], ""
			continue
		}
		if cur == nil {
			continue
		}
		switch {
		case line == "":
			cur, fn = nil, ""
		case strings.HasPrefix(line, "\t"):
			if fn == "" {
				continue
			}
			loc := strings.TrimSpace(line)
			if i := strings.LastIndex(loc, " +0x"); i >= 0 {
				loc = loc[:i]
			}
			file, ln := loc, 0
			if i := strings.LastIndexByte(loc, ':'); i >= 0 {
				if n, err := strconv.Atoi(loc[i+1:]); err == nil {
					file, ln = loc[:i], n
				}
			}
			cur.Frames = append(cur.Frames, Frame{Func: fn, File: file, Line: ln})
			fn = ""
		case strings.HasPrefix(line, "created by "), strings.HasPrefix(line, "..."), strings.HasPrefix(line, "[originating"):
			fn = "" // not a frame of this stack; skip its file line too
		default:
			fn = stripArgs(line)
		}
	}
	return threads
}

// stripArgs removes the trailing "(args)" of a traceback's function line,
// keeping parentheses that belong to the name ("(*T).M", "operator()").
func stripArgs(s string) string {
	s = strings.TrimSpace(s)
	if !strings.HasSuffix(s, ")") {
		return s
	}
	depth := 0
	for i := len(s) - 1; i >= 0; i-- {
		switch s[i] {
		case ')':
			depth++
		case '(':
			depth--
			if depth == 0 {
				if i == 0 {
					return s
				}
				return strings.TrimRight(s[:i], " ")
			}
		}
	}
	return s
}

// parseGDB parses the output of gdb's "thread apply all bt" into KindNative
// threads. Inlined frames (no address) are kept as frames.
func parseGDB(text []byte) []Thread {
	var threads []Thread
	var cur *Thread
	for raw := range bytes.SplitSeq(text, []byte("\n")) {
		line := strings.TrimRight(string(raw), "\r")
		if m := gdbThreadHeader.FindStringSubmatch(line); m != nil {
			t := Thread{Kind: KindNative}
			if l := gdbLWP.FindStringSubmatch(m[1]); l != nil {
				t.ID, _ = strconv.ParseUint(l[1], 10, 64)
			}
			if n := gdbThreadName.FindStringSubmatch(m[1]); n != nil {
				t.Name = n[1]
			}
			threads = append(threads, t)
			cur = &threads[len(threads)-1]
			continue
		}
		if cur == nil || !strings.HasPrefix(line, "#") {
			continue
		}
		rest := strings.TrimLeft(line[1:], "0123456789")
		if len(rest) == len(line)-1 {
			continue // "#" not followed by a frame number
		}
		rest = strings.TrimSpace(rest)
		if strings.HasPrefix(rest, "0x") {
			addr, after, ok := strings.Cut(rest, " in ")
			if !ok || strings.ContainsAny(addr, " ") {
				cur.Frames = append(cur.Frames, Frame{Func: "??"})
				continue
			}
			rest = after
		}
		var f Frame
		if m := gdbAt.FindStringSubmatch(rest); m != nil {
			rest, f.File = m[1], m[2]
			f.Line, _ = strconv.Atoi(m[3])
		} else if m := gdbFrom.FindStringSubmatch(rest); m != nil {
			rest, f.File = m[1], m[2]
		}
		f.Func = stripArgs(rest)
		if f.Func == "" {
			f.Func = "??"
		}
		cur.Frames = append(cur.Frames, f)
	}
	return threads
}

// parseEUStack parses the output of `eu-stack -p <pid> -i -s -m` into
// KindNative threads.
func parseEUStack(text []byte) []Thread {
	var threads []Thread
	var cur *Thread
	for raw := range bytes.SplitSeq(text, []byte("\n")) {
		line := strings.TrimRight(string(raw), "\r")
		if m := euThreadHeader.FindStringSubmatch(line); m != nil {
			id, _ := strconv.ParseUint(m[1], 10, 64)
			threads = append(threads, Thread{Kind: KindNative, ID: id})
			cur = &threads[len(threads)-1]
			continue
		}
		if cur == nil {
			continue
		}
		if m := euFrame.FindStringSubmatch(line); m != nil {
			// "<func> - <module>", "- <module>" or "<func>" or nothing.
			var f Frame
			rest := strings.TrimSpace(m[1])
			if mod, ok := strings.CutPrefix(rest, "- "); ok {
				f.File = strings.TrimSpace(mod)
			} else if i := strings.LastIndex(rest, " - "); i >= 0 {
				f.Func, f.File = strings.TrimSpace(rest[:i]), strings.TrimSpace(rest[i+3:])
			} else {
				f.Func = rest
			}
			if f.Func == "" {
				f.Func = "??"
			}
			cur.Frames = append(cur.Frames, f)
			continue
		}
		if m := euSource.FindStringSubmatch(line); m != nil && len(cur.Frames) > 0 {
			last := &cur.Frames[len(cur.Frames)-1]
			last.File = m[1]
			last.Line, _ = strconv.Atoi(m[2])
		}
	}
	return threads
}
