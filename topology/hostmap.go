package topology

import (
	"bytes"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// HostMapping is the host_ips_mapping.txt file that MindSpore's cluster
// profiling keeps beside a rank table so that reports show a number instead
// of a real host address: one "<host> <n>" line per host, numbered from 1 in
// rank-table order.
type HostMapping []HostAlias

// HostAlias maps one host (usually its IP) to its anonymous number.
type HostAlias struct {
	Host string
	ID   int
}

const hostMappingFormat = "host_ips_mapping.txt"

// NewHostMapping numbers hosts 1, 2, ... in the given order. A host that is
// empty, holds a blank or is listed twice is an error.
func NewHostMapping(hosts []string) (HostMapping, error) {
	m := make(HostMapping, len(hosts))
	for i, h := range hosts {
		m[i] = HostAlias{Host: h, ID: i + 1}
	}
	if err := m.Validate(); err != nil {
		return nil, err
	}
	return m, nil
}

// HostMapping returns the mapping for the servers of rt, numbered in table
// order.
func (rt *RankTable) HostMapping() (HostMapping, error) {
	return NewHostMapping(rt.ServerIDs())
}

// ParseHostMapping reads a host_ips_mapping.txt. Blank lines are ignored;
// every other line is exactly "<host> <n>" with n a positive decimal. A host
// or a number listed twice is an error. Errors are *ParseError naming the
// line.
func ParseHostMapping(data []byte) (HostMapping, error) {
	var m HostMapping
	hosts := make(map[string]int)
	ids := make(map[int]int)
	for lineNo := 1; len(data) > 0; lineNo++ {
		var line []byte
		line, data, _ = bytes.Cut(data, []byte{'\n'})
		f := bytes.Fields(line)
		if len(f) == 0 {
			continue
		}
		bad := func(field, value, msg string) error {
			return &ParseError{Format: hostMappingFormat, Line: lineNo, Field: field, Value: value, Msg: msg}
		}
		if len(f) != 2 {
			return nil, bad("", "", fmt.Sprintf("want 2 fields (host number), got %d", len(f)))
		}
		a := HostAlias{Host: string(f[0])}
		if !utf8.Valid(f[0]) {
			return nil, bad("host", a.Host, "must be UTF-8")
		}
		id, err := strconv.Atoi(string(f[1]))
		if err != nil || id < 1 || f[1][0] == '+' {
			return nil, bad("number", string(f[1]), "want a positive decimal number")
		}
		a.ID = id
		if prev, dup := hosts[a.Host]; dup {
			return nil, bad("host", a.Host, fmt.Sprintf("listed twice (first on line %d)", prev))
		}
		if prev, dup := ids[a.ID]; dup {
			return nil, bad("number", string(f[1]), fmt.Sprintf("used twice (first on line %d)", prev))
		}
		hosts[a.Host], ids[a.ID] = lineNo, lineNo
		m = append(m, a)
	}
	return m, nil
}

// Validate checks what ParseHostMapping checks: hosts are non-empty UTF-8
// without blanks, numbers are positive, and neither repeats. The position
// of an alias (1-based) stands for its line in errors.
func (m HostMapping) Validate() error {
	hosts := make(map[string]bool, len(m))
	ids := make(map[int]bool, len(m))
	for i, a := range m {
		bad := func(field, value, msg string) error {
			return &ParseError{Format: hostMappingFormat, Line: i + 1, Field: field, Value: value, Msg: msg}
		}
		if w := strings.Fields(a.Host); len(w) != 1 || w[0] != a.Host || !utf8.ValidString(a.Host) {
			return bad("host", a.Host, "want a non-empty UTF-8 name without blanks")
		}
		if a.ID < 1 {
			return bad("number", strconv.Itoa(a.ID), "want a positive number")
		}
		if hosts[a.Host] {
			return bad("host", a.Host, "listed twice")
		}
		if ids[a.ID] {
			return bad("number", strconv.Itoa(a.ID), "used twice")
		}
		hosts[a.Host], ids[a.ID] = true, true
	}
	return nil
}

// Marshal returns the file: one "<host> <n>" line per alias, in order.
func (m HostMapping) Marshal() []byte {
	var b []byte
	for _, a := range m {
		b = append(b, a.Host...)
		b = append(b, ' ')
		b = strconv.AppendInt(b, int64(a.ID), 10)
		b = append(b, '\n')
	}
	return b
}

// ID returns the number of host.
func (m HostMapping) ID(host string) (int, bool) {
	for _, a := range m {
		if a.Host == host {
			return a.ID, true
		}
	}
	return 0, false
}
