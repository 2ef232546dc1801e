package hang

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
)

// pyspyTrace is one element of `py-spy dump --json`: the stack of one
// Python thread, innermost frame first.
type pyspyTrace struct {
	Pid        int          `json:"pid"`
	ThreadID   uint64       `json:"thread_id"`
	ThreadName *string      `json:"thread_name"`
	OSThreadID *uint64      `json:"os_thread_id"`
	Active     bool         `json:"active"`
	OwnsGIL    bool         `json:"owns_gil"`
	Frames     []pyspyFrame `json:"frames"`
}

type pyspyFrame struct {
	Name          string  `json:"name"`
	Filename      string  `json:"filename"`
	Module        *string `json:"module"`
	ShortFilename *string `json:"short_filename"`
	Line          int     `json:"line"`
	// Locals are not kept: they differ between ranks and would only split
	// the merged tree.
}

// ParsePySpyJSON parses the output of `py-spy dump --json`: a JSON list of
// threads, each with thread_id, thread_name, os_thread_id, active,
// owns_gil and frames (name, filename, module, short_filename, line,
// locals), innermost frame first. It returns the threads as KindPython
// and the pid they came from (0 when absent).
//
// A frame's File is its short_filename when py-spy gives one (the path
// below sys.path, the same on every node whatever the install prefix),
// else its filename. A thread's ID is its OS thread id when known.
func ParsePySpyJSON(data []byte) (threads []Thread, pid int, err error) {
	data = bytes.TrimSpace(data)
	if len(data) == 0 || data[0] != '[' {
		return nil, 0, fmt.Errorf("%w: py-spy json: not a JSON list", ErrFormat)
	}
	var traces []pyspyTrace
	if err := json.Unmarshal(data, &traces); err != nil {
		var se *json.SyntaxError
		if errors.As(err, &se) {
			return nil, 0, fmt.Errorf("%w: py-spy json: byte %d: %v", ErrFormat, se.Offset, err)
		}
		return nil, 0, fmt.Errorf("%w: py-spy json: %v", ErrFormat, err)
	}
	for i, t := range traces {
		th := Thread{Kind: KindPython, ID: t.ThreadID, State: pyspyState(t)}
		if t.OSThreadID != nil {
			th.ID = *t.OSThreadID
		}
		if t.ThreadName != nil {
			th.Name = *t.ThreadName
		}
		for j, f := range t.Frames {
			if f.Line < 0 {
				// py-spy writes 0 for an unknown line; anything below is corrupt.
				return nil, 0, fmt.Errorf("%w: py-spy json: thread %d frame %d: line %d", ErrFormat, i, j, f.Line)
			}
			file := f.Filename
			if f.ShortFilename != nil && *f.ShortFilename != "" {
				file = *f.ShortFilename
			}
			th.Frames = append(th.Frames, Frame{Func: f.Name, File: file, Line: f.Line})
		}
		threads = append(threads, th)
		if pid == 0 {
			pid = t.Pid
		}
	}
	return threads, pid, nil
}

// pyspyState is the status py-spy's text dump prints for a thread.
func pyspyState(t pyspyTrace) string {
	switch {
	case !t.Active:
		return "idle"
	case t.OwnsGIL:
		return "active+gil"
	}
	return "active"
}

// ParsePySpyFileName returns the rank a py-spy JSON file's name encodes,
// and its world when the name says it. Accepted: "3.json", "rank3.json",
// "rank-3.json", "py-spy_00003.json", "00003-00008.json" (and the same
// with ".pyspy.json").
func ParsePySpyFileName(name string) (rank, world int, ok bool) {
	base, found := strings.CutSuffix(filepath.Base(name), ".json")
	if !found {
		return 0, 0, false
	}
	base = strings.TrimSuffix(base, ".pyspy")
	if r, w, ok := parseRankWorld(base); ok {
		return r, w, true
	}
	i := len(base)
	for i > 0 && base[i-1] >= '0' && base[i-1] <= '9' {
		i--
	}
	prefix := base[:i]
	if strings.TrimLeft(prefix, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_-.") != "" {
		return 0, 0, false
	}
	r, err := parseRank(base[i:])
	if err != nil {
		return 0, 0, false
	}
	return r, 0, true
}
