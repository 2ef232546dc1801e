package taskd

import (
	"bytes"
	"fmt"
	"net/netip"
	"sort"
	"strings"
)

// HostMapping is the content of host_ips_mapping.txt: which node alias
// stands for which host address in a collection. Collected files are filed
// under the alias, so a collection handed on without this file names no
// host address.
//
// The format is one "alias address" pair a line, in alias order; blank
// lines and lines starting with '#' are ignored:
//
//	node-0 10.0.0.11
//	node-1 10.0.0.12
type HostMapping []HostAlias

// HostAlias is one line of a HostMapping.
type HostAlias struct {
	Alias string
	Addr  netip.Addr
}

// HostMappingError says which line of a host mapping is bad.
type HostMappingError struct {
	Line int
	Msg  string
}

func (e *HostMappingError) Error() string {
	return fmt.Sprintf("%s line %d: %s", HostMappingFile, e.Line, e.Msg)
}

func validAlias(s string) bool {
	if s == "" || len(s) > 64 {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return false
		}
	}
	return true
}

// ParseHostMapping parses a host_ips_mapping.txt document. Each alias may
// appear once. Errors are *HostMappingError.
func ParseHostMapping(data []byte) (HostMapping, error) {
	var out HostMapping
	seen := make(map[string]bool)
	for i, line := range strings.Split(string(data), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || line[0] == '#' {
			continue
		}
		f := strings.Fields(line)
		if len(f) != 2 {
			return nil, &HostMappingError{Line: i + 1, Msg: fmt.Sprintf("want \"alias address\", got %d fields", len(f))}
		}
		if !validAlias(f[0]) {
			return nil, &HostMappingError{Line: i + 1, Msg: fmt.Sprintf("alias %q: want 1 to 64 of [A-Za-z0-9._-]", f[0])}
		}
		if seen[f[0]] {
			return nil, &HostMappingError{Line: i + 1, Msg: fmt.Sprintf("alias %q appears twice", f[0])}
		}
		addr, err := netip.ParseAddr(f[1])
		if err != nil {
			return nil, &HostMappingError{Line: i + 1, Msg: fmt.Sprintf("address %q: %v", f[1], err)}
		}
		seen[f[0]] = true
		out = append(out, HostAlias{Alias: f[0], Addr: addr})
	}
	out.sort()
	return out, nil
}

func (h HostMapping) sort() {
	sort.Slice(h, func(i, j int) bool { return h[i].Alias < h[j].Alias })
}

// With returns h with alias mapped to addr (replacing an earlier mapping of
// alias). An address that does not parse leaves h as it is.
func (h HostMapping) With(alias, addr string) HostMapping {
	a, err := netip.ParseAddr(addr)
	if err != nil || !validAlias(alias) {
		return h
	}
	out := make(HostMapping, 0, len(h)+1)
	for _, e := range h {
		if e.Alias != alias {
			out = append(out, e)
		}
	}
	out = append(out, HostAlias{Alias: alias, Addr: a})
	out.sort()
	return out
}

// Marshal writes h in its file format.
func (h HostMapping) Marshal() []byte {
	var b bytes.Buffer
	b.WriteString("# alias address\n")
	for _, e := range h {
		fmt.Fprintf(&b, "%s %s\n", e.Alias, e.Addr)
	}
	return b.Bytes()
}
