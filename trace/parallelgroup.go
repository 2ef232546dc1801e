package trace

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"

	"golang.org/x/sys/unix"

	"github.com/faultline-ml/faultline/internal/atomicfile"
)

// ParallelGroup says where a rank stands in one communicator.
type ParallelGroup struct {
	GroupName   string `json:"group_name"`   // the parallelism it serves: "tp", "pp", "dp", "cp", ...
	GroupRank   int    `json:"group_rank"`   // this rank's index in GlobalRanks
	GlobalRanks []int  `json:"global_ranks"` // the communicator's members, by global rank
}

// ParallelGroups maps communicator names (the groupName of a CommOp) to
// groups. It is the content of parallel_group.json in a rank folder:
//
//	{"group_name_137": {"group_name": "tp", "group_rank": 1, "global_ranks": [5, 6, 7]}}
type ParallelGroups map[string]ParallelGroup

// ErrParallelGroups is wrapped by every error ParseParallelGroups returns.
var ErrParallelGroups = errors.New("trace: invalid parallel groups")

// maxParallelGroupsBytes bounds the file a reader will load.
const maxParallelGroupsBytes = 16 << 20

// ParseParallelGroups parses parallel_group.json. Unknown fields are
// ignored, so files written by other tools load. Each group must have
// non-negative, distinct global ranks and a group rank that indexes them.
// Errors wrap ErrParallelGroups and name the communicator and field.
func ParseParallelGroups(data []byte) (ParallelGroups, error) {
	g, ok := parseGroupsPlain(data)
	if !ok {
		var err error
		if g, err = parseGroupsJSON(data); err != nil {
			return nil, err
		}
	}
	if err := g.Validate(); err != nil {
		return nil, err
	}
	return g, nil
}

// parseGroupsJSON is ParseParallelGroups' decoding, by encoding/json.
func parseGroupsJSON(data []byte) (ParallelGroups, error) {
	var g ParallelGroups
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&g); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrParallelGroups, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%w: data after the object", ErrParallelGroups)
	}
	if g == nil {
		return nil, fmt.Errorf("%w: want an object, got null", ErrParallelGroups)
	}
	return g, nil
}

// parseGroupsPlain decodes the plain form that Marshal and MindCluster
// write, several times faster than encoding/json, whose reflection over
// arrays of ranks dominates a job's start-up: names without escapes, and
// in each group the three fields, once each, with integers. It reports
// false for anything else, which parseGroupsJSON then decides; where it
// answers, it answers as parseGroupsJSON does (FuzzParseParallelGroups
// checks it).
func parseGroupsPlain(data []byte) (ParallelGroups, bool) {
	p := plainJSON{b: data}
	if !p.byte('{') {
		return nil, false
	}
	g := ParallelGroups{}
	if p.byte('}') {
		return g, p.end()
	}
	for {
		name, ok := p.str()
		if !ok || !p.byte(':') || !p.byte('{') {
			return nil, false
		}
		if _, dup := g[name]; dup {
			return nil, false // encoding/json would merge the two
		}
		var grp ParallelGroup
		var seen uint8
		for {
			field, ok := p.str()
			if !ok || !p.byte(':') {
				return nil, false
			}
			switch field {
			case "group_name":
				grp.GroupName, ok = p.str()
				seen, ok = seen|1, ok && seen&1 == 0
			case "group_rank":
				grp.GroupRank, ok = p.int()
				seen, ok = seen|2, ok && seen&2 == 0
			case "global_ranks":
				grp.GlobalRanks, ok = p.ints()
				seen, ok = seen|4, ok && seen&4 == 0
			default:
				ok = false
			}
			if !ok {
				return nil, false
			}
			if p.byte('}') {
				break
			}
			if !p.byte(',') {
				return nil, false
			}
		}
		if seen != 7 {
			return nil, false
		}
		g[name] = grp
		if p.byte('}') {
			return g, p.end()
		}
		if !p.byte(',') {
			return nil, false
		}
	}
}

// plainJSON reads the few JSON forms parseGroupsPlain takes.
type plainJSON struct {
	b []byte
	i int
}

func (p *plainJSON) space() {
	for p.i < len(p.b) {
		switch p.b[p.i] {
		case ' ', '\t', '\n', '\r':
			p.i++
		default:
			return
		}
	}
}

// byte consumes c, after white space, if it comes next.
func (p *plainJSON) byte(c byte) bool {
	p.space()
	if p.i < len(p.b) && p.b[p.i] == c {
		p.i++
		return true
	}
	return false
}

// end reports whether nothing but white space is left.
func (p *plainJSON) end() bool {
	p.space()
	return p.i == len(p.b)
}

// str reads a string of printable ASCII without escapes.
func (p *plainJSON) str() (string, bool) {
	if !p.byte('"') {
		return "", false
	}
	start := p.i
	for ; p.i < len(p.b); p.i++ {
		switch c := p.b[p.i]; {
		case c == '"':
			s := string(p.b[start:p.i])
			p.i++
			return s, true
		case c == '\\' || c < 0x20 || c >= 0x7F:
			return "", false
		}
	}
	return "", false
}

// int reads an integer of at most 18 digits, in JSON's form.
func (p *plainJSON) int() (int, bool) {
	p.space()
	neg := p.i < len(p.b) && p.b[p.i] == '-'
	if neg {
		p.i++
	}
	start := p.i
	v := 0
	for ; p.i < len(p.b) && p.b[p.i]-'0' <= 9; p.i++ {
		v = v*10 + int(p.b[p.i]-'0')
	}
	n := p.i - start
	if n == 0 || n > 18 || (n > 1 && p.b[start] == '0') || (neg && v == 0) {
		return 0, false // -0 and the like: encoding/json decides
	}
	if p.i < len(p.b) && (p.b[p.i] == '.' || p.b[p.i] == 'e' || p.b[p.i] == 'E') {
		return 0, false
	}
	if neg {
		v = -v
	}
	return v, true
}

// ints reads an array of integers.
func (p *plainJSON) ints() ([]int, bool) {
	if !p.byte('[') {
		return nil, false
	}
	out := []int{}
	if p.byte(']') {
		return out, true
	}
	for {
		v, ok := p.int()
		if !ok {
			return nil, false
		}
		out = append(out, v)
		if p.byte(']') {
			return out, true
		}
		if !p.byte(',') {
			return nil, false
		}
	}
}

// Validate reports the first group, in name order, that is inconsistent.
func (g ParallelGroups) Validate() error {
	names := make([]string, 0, len(g))
	for name := range g {
		names = append(names, name)
	}
	slices.Sort(names)
	var scratch []int
	for _, name := range names {
		p := g[name]
		bad := func(field, msg string, args ...any) error {
			return fmt.Errorf("%w: %q: field %q: %s", ErrParallelGroups, name, field, fmt.Sprintf(msg, args...))
		}
		if name == "" {
			return bad("", "empty communicator name")
		}
		if !distinctNonNegative(p.GlobalRanks, &scratch) {
			// Name the first rank at fault, in file order.
			seen := make(map[int]bool, len(p.GlobalRanks))
			for _, r := range p.GlobalRanks {
				if r < 0 {
					return bad("global_ranks", "rank %d is negative", r)
				}
				if seen[r] {
					return bad("global_ranks", "rank %d appears twice", r)
				}
				seen[r] = true
			}
		}
		if p.GroupRank < 0 || p.GroupRank >= len(p.GlobalRanks) {
			return bad("group_rank", "%d is outside global_ranks (%d members)", p.GroupRank, len(p.GlobalRanks))
		}
	}
	return nil
}

// distinctNonNegative reports whether ranks holds no negative rank and
// none twice, sorting a copy in *scratch.
func distinctNonNegative(ranks []int, scratch *[]int) bool {
	s := append((*scratch)[:0], ranks...)
	*scratch = s
	slices.Sort(s)
	if len(s) > 0 && s[0] < 0 {
		return false
	}
	for i := 1; i < len(s); i++ {
		if s[i] == s[i-1] {
			return false
		}
	}
	return true
}

// Marshal returns the indented JSON form, communicators in name order.
func (g ParallelGroups) Marshal() ([]byte, error) {
	b, err := json.MarshalIndent(map[string]ParallelGroup(g), "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// WriteParallelGroups atomically writes g as parallel_group.json (mode
// 0640) into rankDir, which must be a folder and not a symlink.
func WriteParallelGroups(rankDir string, g ParallelGroups) error {
	if err := g.Validate(); err != nil {
		return err
	}
	if err := checkRealDir(rankDir); err != nil {
		return err
	}
	b, err := g.Marshal()
	if err != nil {
		return fmt.Errorf("trace: %s: %w", ParallelGroupFile, err)
	}
	return atomicfile.WriteFile(filepath.Join(rankDir, ParallelGroupFile), b, fileMode)
}

// ReadParallelGroups reads parallel_group.json from rankDir. Neither the
// folder nor the file may be a symlink.
func ReadParallelGroups(rankDir string) (ParallelGroups, error) {
	fd, err := unix.Open(rankDir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, dirError(rankDir, err)
	}
	defer unix.Close(fd)
	return readParallelGroupsAt(fd, rankDir)
}

// readParallelGroupsAt is ReadParallelGroups in the folder open as dirfd.
func readParallelGroupsAt(dirfd int, rankDir string) (ParallelGroups, error) {
	b, err := readFileAt(dirfd, rankDir, ParallelGroupFile, maxParallelGroupsBytes+1)
	if err != nil {
		return nil, fmt.Errorf("trace: %w", err)
	}
	name := filepath.Join(rankDir, ParallelGroupFile)
	if len(b) > maxParallelGroupsBytes {
		return nil, fmt.Errorf("%w: %s: larger than %d bytes", ErrParallelGroups, name, maxParallelGroupsBytes)
	}
	g, err := ParseParallelGroups(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return g, nil
}

// checkRealDir reports an error unless dir is a folder (not a symlink).
func checkRealDir(dir string) error {
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("trace: %w", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("%w: %s is not a folder (a symlink or a file)", ErrPath, dir)
	}
	return nil
}
