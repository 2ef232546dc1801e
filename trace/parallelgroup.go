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
var ErrParallelGroups = errors.New("invalid parallel groups")

// maxParallelGroupsBytes bounds the file a reader will load.
const maxParallelGroupsBytes = 16 << 20

// ParseParallelGroups parses parallel_group.json. Unknown fields are
// ignored, so files written by other tools load. Each group must have
// non-negative, distinct global ranks and a group rank that indexes them.
// Errors wrap ErrParallelGroups and name the communicator and field.
func ParseParallelGroups(data []byte) (ParallelGroups, error) {
	var g ParallelGroups
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&g); err != nil {
		return nil, fmt.Errorf("trace: parallel groups: %v: %w", err, ErrParallelGroups)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("trace: parallel groups: data after the object: %w", ErrParallelGroups)
	}
	if g == nil {
		return nil, fmt.Errorf("trace: parallel groups: want an object, got null: %w", ErrParallelGroups)
	}
	if err := g.Validate(); err != nil {
		return nil, err
	}
	return g, nil
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
			return fmt.Errorf("trace: parallel groups: %q: field %q: %s: %w", name, field, fmt.Sprintf(msg, args...), ErrParallelGroups)
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
	if err := checkRealDir(rankDir); err != nil {
		return nil, err
	}
	name := filepath.Join(rankDir, ParallelGroupFile)
	f, err := openNoFollow(name)
	if err != nil {
		return nil, fmt.Errorf("trace: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxParallelGroupsBytes+1))
	if err != nil {
		return nil, fmt.Errorf("trace: read %s: %w", name, err)
	}
	if len(b) > maxParallelGroupsBytes {
		return nil, fmt.Errorf("trace: %s: larger than %d bytes: %w", name, maxParallelGroupsBytes, ErrParallelGroups)
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
		return fmt.Errorf("trace: %s is not a folder (a symlink or a file): %w", dir, ErrPath)
	}
	return nil
}
