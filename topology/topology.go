package topology

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"strings"

	"github.com/faultline-ml/faultline/internal/parseerr"
)

// Node is one host of the cluster and the switches it hangs from.
type Node struct {
	IP  string // canonical form of the host's address (netip.Addr.String)
	ASW string // access (leaf) switch
	PSW string // pod (spine) switch above the ASW
}

// Topology is a parsed node-topology-config: which ASW and PSW each node
// hangs from. It is immutable once built; use the methods to query it.
type Topology struct {
	nodes  []Node
	byIP   map[string]int32 // canonical IP -> index in nodes
	asw    []int32          // ASW number of each node, numbered in file order
	aswPSW []int32          // PSW number of each ASW, numbered in file order
}

// ErrInvalid is wrapped by every error that reports bad input: a
// node-topology-config, a rank table or a host mapping.
var ErrInvalid = errors.New("topology: invalid input")

// ParseError says where and why input was rejected. It has the shape of
// every parse error of this module: what was parsed, where, the field and
// value at fault, and what is wrong.
type ParseError struct {
	Format string // "node-topology-config", "hccl.json" or "host_ips_mapping.txt"
	File   string // the file; "" when parsing bytes
	Line   int    // 1-based line; 0 when unknown
	Field  string // the offending field; "" when the line or document is malformed
	Value  string // the offending value, if any
	Msg    string // what is wrong
	Err    error  // what it wraps; nil means ErrInvalid
}

// Error returns "topology: <format>: <file>:<line>: field <f>: value
// <v>: <msg>", leaving out what is unknown.
func (e *ParseError) Error() string {
	return parseerr.Text{Pkg: "topology", Format: e.Format, File: e.File, Line: e.Line,
		Field: e.Field, Value: e.Value, Msg: e.Msg}.String()
}

// Unwrap returns Err, or ErrInvalid: errors.Is(err, ErrInvalid) holds.
func (e *ParseError) Unwrap() error { return cmp.Or(e.Err, ErrInvalid) }

const configFormat = "node-topology-config"

// Parse reads DLRover's node-topology-config: one node per line as
// "asw psw ip", separated by blanks. A '#' starts a comment that runs to the
// end of the line; blank lines are ignored. A wrong number of fields, an
// address that is not an IP, an IP listed twice, or an ASW listed under two
// PSWs is an error (*ParseError, wrapping ErrInvalid) naming the line.
func Parse(data []byte) (*Topology, error) {
	b := newBuilder()
	for lineNo := 1; len(data) > 0; lineNo++ {
		var line []byte
		line, data, _ = bytes.Cut(data, []byte{'\n'})
		if i := bytes.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		f := bytes.Fields(line)
		if len(f) == 0 {
			continue
		}
		if len(f) != 3 {
			return nil, &ParseError{Format: configFormat, Line: lineNo,
				Msg: fmt.Sprintf("want 3 fields (asw psw ip), got %d", len(f))}
		}
		if err := b.add(lineNo, string(f[0]), string(f[1]), string(f[2])); err != nil {
			return nil, err
		}
	}
	return b.done(), nil
}

// New builds a Topology from nodes, checked as Parse checks a file; in
// errors, a node's 1-based position in nodes stands for its line.
func New(nodes []Node) (*Topology, error) {
	b := newBuilder()
	for i, n := range nodes {
		for _, f := range [...]struct{ name, v string }{{"asw", n.ASW}, {"psw", n.PSW}} {
			if w := strings.Fields(f.v); len(w) != 1 || w[0] != f.v || strings.Contains(f.v, "#") {
				return nil, &ParseError{Format: configFormat, Line: i + 1, Field: f.name, Value: f.v,
					Msg: "want a non-empty name without blanks or '#'"}
			}
		}
		if err := b.add(i+1, n.ASW, n.PSW, n.IP); err != nil {
			return nil, err
		}
	}
	return b.done(), nil
}

// builder checks nodes as they are added, remembering lines for messages.
type builder struct {
	t        *Topology
	lines    []int          // line of each node
	aswFirst map[string]int // ASW -> index of the first node under it
	pswNum   map[string]int32
}

func newBuilder() *builder {
	return &builder{t: &Topology{byIP: make(map[string]int32)},
		aswFirst: make(map[string]int), pswNum: make(map[string]int32)}
}

// done returns the topology with its addresses packed into one string, so
// that looking up a large world reads one block of memory rather than
// strings scattered over the heap.
func (b *builder) done() *Topology {
	t := b.t
	var all strings.Builder
	for _, n := range t.nodes {
		all.WriteString(n.IP)
	}
	packed := all.String()
	t.byIP = make(map[string]int32, len(t.nodes))
	for i := range t.nodes {
		t.nodes[i].IP, packed = packed[:len(t.nodes[i].IP)], packed[len(t.nodes[i].IP):]
		t.byIP[t.nodes[i].IP] = int32(i)
	}
	return t
}

func (b *builder) add(line int, asw, psw, ipText string) error {
	bad := func(field, value, msg string) error {
		return &ParseError{Format: configFormat, Line: line, Field: field, Value: value, Msg: msg}
	}
	ip, err := netip.ParseAddr(ipText)
	if err != nil {
		return bad("ip", ipText, "not an IP address")
	}
	n := Node{IP: ip.String(), ASW: asw, PSW: psw}
	if j, dup := b.t.byIP[n.IP]; dup {
		return bad("ip", ipText, fmt.Sprintf("listed twice (first on line %d)", b.lines[j]))
	}
	if j, seen := b.aswFirst[asw]; !seen {
		b.aswFirst[asw] = len(b.t.nodes)
		p, ok := b.pswNum[psw]
		if !ok {
			p = int32(len(b.pswNum))
			b.pswNum[psw] = p
		}
		b.t.asw = append(b.t.asw, int32(len(b.t.aswPSW)))
		b.t.aswPSW = append(b.t.aswPSW, p)
	} else if prev := b.t.nodes[j].PSW; prev != psw {
		return bad("psw", psw, fmt.Sprintf("asw %s is under psw %s on line %d", asw, prev, b.lines[j]))
	} else {
		b.t.asw = append(b.t.asw, b.t.asw[j])
	}
	b.t.byIP[n.IP] = int32(len(b.t.nodes))
	b.t.nodes = append(b.t.nodes, n)
	b.lines = append(b.lines, line)
	return nil
}

// maxConfigBytes bounds the node-topology-config files that ReadFile and
// a Watcher read, so that a wrong path cannot exhaust memory: 100,000
// nodes take about 4 MB.
const maxConfigBytes = 64 << 20

// ReadFile parses the node-topology-config in file name, of at most 64
// MiB; errors name the file.
func ReadFile(name string) (*Topology, error) {
	data, err := readConfig(name)
	if err != nil {
		return nil, err
	}
	return parseConfig(name, data)
}

// readConfig reads the file name, of at most maxConfigBytes.
func readConfig(name string) ([]byte, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, fmt.Errorf("topology: %w", err)
	}
	defer f.Close()
	tooBig := &ParseError{Format: configFormat, File: name, Msg: fmt.Sprintf("larger than %d bytes", maxConfigBytes)}
	if fi, err := f.Stat(); err == nil && fi.Size() > maxConfigBytes {
		return nil, tooBig
	}
	// The bound holds too for a file that grows, or is not regular.
	data, err := io.ReadAll(io.LimitReader(f, maxConfigBytes+1))
	if err != nil {
		return nil, fmt.Errorf("topology: read %s: %w", name, err)
	}
	if len(data) > maxConfigBytes {
		return nil, tooBig
	}
	return data, nil
}

// parseConfig parses data read from the file name, naming it in errors.
func parseConfig(name string, data []byte) (*Topology, error) {
	t, err := Parse(data)
	var pe *ParseError
	if errors.As(err, &pe) {
		pe.File = name
	}
	return t, err
}

// Len returns the number of nodes.
func (t *Topology) Len() int { return len(t.nodes) }

// Nodes returns a copy of the nodes in file order.
func (t *Topology) Nodes() []Node { return append([]Node(nil), t.nodes...) }

// Lookup returns the node with address ip, in any textual form that
// netip.ParseAddr accepts.
func (t *Topology) Lookup(ip string) (Node, bool) {
	i, ok := t.index(ip)
	if !ok {
		return Node{}, false
	}
	return t.nodes[i], true
}

func (t *Topology) index(ip string) (int, bool) {
	if i, ok := t.byIP[ip]; ok { // the common case: already canonical
		return int(i), true
	}
	a, err := netip.ParseAddr(ip)
	if err != nil {
		return 0, false
	}
	i, ok := t.byIP[a.String()]
	return int(i), ok
}

// Marshal returns t as a node-topology-config, one "asw psw ip" line per
// node in file order. Parse(t.Marshal()) equals t.
func (t *Topology) Marshal() []byte { return marshalNodes(t.nodes) }

func marshalNodes(nodes []Node) []byte {
	var b []byte
	for _, n := range nodes {
		b = append(b, n.ASW...)
		b = append(b, ' ')
		b = append(b, n.PSW...)
		b = append(b, ' ')
		b = append(b, n.IP...)
		b = append(b, '\n')
	}
	return b
}
