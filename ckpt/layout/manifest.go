package layout

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strconv"
)

// StepDir is the directory of a step in the disk tier: dir/<step>.
func StepDir(dir string, step int64) string {
	return filepath.Join(dir, strconv.FormatInt(step, 10))
}

// Names of the files of the disk tier.
const (
	// TrackerFile is our tracker: the StepManifest of the newest committed
	// step.
	TrackerFile = "faultline_latest.json"
	// DLRoverTrackerFile holds the newest committed step as DLRover's flash
	// checkpoint writes it.
	DLRoverTrackerFile = "dlrover_latest.txt"
	// MegatronTrackerFile holds the newest committed step as Megatron-LM
	// writes it.
	MegatronTrackerFile = "latest_checkpointed_iteration.txt"
	// CommitFile in a step directory marks the step committed; it holds the
	// StepManifest.
	CommitFile = "commit.json"
	// LockFile in the disk tier is locked (flock, exclusive) by whoever
	// commits a step or applies the retention there, so that the processes
	// sharing a disk tier do so one at a time.
	LockFile = ".faultline-ckpt.lock"
)

// ShardFile is the name of a shard's data file in its step directory.
func ShardFile(shard int) string { return fmt.Sprintf("shard-%05d.bin", shard) }

// ShardManifestFile is the name of a shard's manifest in its step
// directory.
func ShardManifestFile(shard int) string { return fmt.Sprintf("shard-%05d.json", shard) }

// MaxShards bounds the shards of a job.
const MaxShards = 1 << 20

// ShardManifest describes one shard's data file of one step: its blobs,
// stored one after the other from offset 0, with their CRC32C. It is
// written as JSON beside the data file once that file is durable.
type ShardManifest struct {
	Step      int64
	Shard     int
	NumShards int
	Size      int64 // bytes of the data file
	Blobs     []BlobEntry
}

type shardManifestJSON struct {
	Version   int         `json:"version"`
	Step      int64       `json:"step"`
	Shard     int         `json:"shard"`
	NumShards int         `json:"num_shards"`
	File      string      `json:"file"`
	Size      int64       `json:"size"`
	Blobs     []BlobEntry `json:"blobs"`
}

// Marshal encodes m as indented JSON. It fails if m would not parse back.
func (m ShardManifest) Marshal() ([]byte, error) {
	if err := m.check(); err != nil {
		return nil, err
	}
	blobs := m.Blobs
	if blobs == nil {
		blobs = []BlobEntry{}
	}
	b, err := json.MarshalIndent(shardManifestJSON{Version: 1, Step: m.Step, Shard: m.Shard, NumShards: m.NumShards,
		File: ShardFile(m.Shard), Size: m.Size, Blobs: blobs}, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

func (m ShardManifest) check() error {
	switch {
	case m.Step < 0:
		return jsonErr("step", "value %d is negative", m.Step)
	case m.NumShards < 1 || m.NumShards > MaxShards:
		return jsonErr("num_shards", "value %d out of range [1,%d]", m.NumShards, MaxShards)
	case m.Shard < 0 || m.Shard >= m.NumShards:
		return jsonErr("shard", "value %d out of range [0,%d)", m.Shard, m.NumShards)
	case len(m.Blobs) > MaxBlobs:
		return jsonErr("blobs", "%d blobs exceed %d", len(m.Blobs), MaxBlobs)
	}
	var off int64
	seen := make(map[string]bool, len(m.Blobs))
	for i, e := range m.Blobs {
		f := fmt.Sprintf("blobs[%d]", i)
		if err := checkName(e.Name); err != nil {
			return jsonErr(f+".name", "%v", err)
		}
		if seen[e.Name] {
			return jsonErr(f+".name", "duplicate name %q", e.Name)
		}
		seen[e.Name] = true
		if e.Offset != off {
			return jsonErr(f+".offset", "value %d, want %d (blobs are contiguous)", e.Offset, off)
		}
		if e.Size < 0 || e.Size > m.Size-off {
			return jsonErr(f+".size", "value %d runs past the file of %d bytes", e.Size, m.Size)
		}
		off += e.Size
	}
	if off != m.Size {
		return jsonErr("size", "value %d, blobs end at %d", m.Size, off)
	}
	return nil
}

func jsonErr(field, format string, args ...any) *ParseError {
	return &ParseError{Offset: -1, Field: field, Msg: fmt.Sprintf(format, args...)}
}

// ParseShardManifest decodes a shard manifest. Unknown fields, a version
// other than 1, a file name other than ShardFile(shard) and blobs that do
// not tile the file are errors (*ParseError, wrapping ErrCorrupt).
func ParseShardManifest(b []byte) (ShardManifest, error) {
	var j shardManifestJSON
	if err := decodeStrict(b, &j); err != nil {
		return ShardManifest{}, err
	}
	if j.Version != 1 {
		return ShardManifest{}, jsonErr("version", "value %d, want 1", j.Version)
	}
	m := ShardManifest{Step: j.Step, Shard: j.Shard, NumShards: j.NumShards, Size: j.Size, Blobs: j.Blobs}
	if err := m.check(); err != nil {
		return ShardManifest{}, err
	}
	if want := ShardFile(j.Shard); j.File != want {
		return ShardManifest{}, jsonErr("file", "value %q, want %q", j.File, want)
	}
	if m.Blobs == nil {
		m.Blobs = []BlobEntry{}
	}
	return m, nil
}

func decodeStrict(b []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return jsonErr(te.Field, "wrong type %s", te.Value)
		}
		return jsonErr("", "malformed JSON: %v", err)
	}
	if _, err := d.Token(); err != io.EOF {
		return jsonErr("", "trailing data after the document")
	}
	return nil
}

// Ref returns m's entry in the StepManifest of its step: what a
// Committer across nodes gathers from each node's ShardDurable to build
// the StepManifest that every node's CommitStep writes. The CRC is that of
// the manifest file the persist wrote, m.Marshal().
func (m ShardManifest) Ref() (ShardRef, error) {
	b, err := m.Marshal()
	if err != nil {
		return ShardRef{}, err
	}
	return ShardRef{Shard: m.Shard, Size: m.Size, ManifestCRC32C: CRC32C(b)}, nil
}

// ShardRef is a StepManifest's entry for one shard: enough to tell that
// the shard's manifest on some node is the one that was committed.
type ShardRef struct {
	Shard          int    `json:"shard"`
	Size           int64  `json:"size"`            // bytes of the data file
	ManifestCRC32C uint32 `json:"manifest_crc32c"` // CRC32C of the shard manifest file
}

// StepManifest describes a committed step: every shard, in order. It is
// the content of CommitFile in the step directory and of TrackerFile.
type StepManifest struct {
	Step   int64
	Shards []ShardRef // Shards[i].Shard == i
}

type stepManifestJSON struct {
	Version   int        `json:"version"`
	Step      int64      `json:"step"`
	NumShards int        `json:"num_shards"`
	Shards    []ShardRef `json:"shards"`
}

// Marshal encodes m as indented JSON. It fails if m would not parse back.
func (m StepManifest) Marshal() ([]byte, error) {
	if err := m.check(); err != nil {
		return nil, err
	}
	b, err := json.MarshalIndent(stepManifestJSON{Version: 1, Step: m.Step, NumShards: len(m.Shards), Shards: m.Shards}, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

func (m StepManifest) check() error {
	switch {
	case m.Step < 0:
		return jsonErr("step", "value %d is negative", m.Step)
	case len(m.Shards) < 1 || len(m.Shards) > MaxShards:
		return jsonErr("num_shards", "value %d out of range [1,%d]", len(m.Shards), MaxShards)
	}
	for i, s := range m.Shards {
		if s.Shard != i {
			return jsonErr(fmt.Sprintf("shards[%d].shard", i), "value %d, want %d", s.Shard, i)
		}
		if s.Size < 0 {
			return jsonErr(fmt.Sprintf("shards[%d].size", i), "value %d is negative", s.Size)
		}
	}
	return nil
}

// ParseStepManifest decodes a step manifest (CommitFile, TrackerFile).
func ParseStepManifest(b []byte) (StepManifest, error) {
	var j stepManifestJSON
	if err := decodeStrict(b, &j); err != nil {
		return StepManifest{}, err
	}
	if j.Version != 1 {
		return StepManifest{}, jsonErr("version", "value %d, want 1", j.Version)
	}
	if j.NumShards != len(j.Shards) {
		return StepManifest{}, jsonErr("num_shards", "value %d, but %d shards listed", j.NumShards, len(j.Shards))
	}
	m := StepManifest{Step: j.Step, Shards: j.Shards}
	if err := m.check(); err != nil {
		return StepManifest{}, err
	}
	return m, nil
}

// ParseStepText decodes a DLRover or Megatron tracker: a decimal step,
// optionally surrounded by white space.
func ParseStepText(b []byte) (int64, error) {
	s := string(bytes.TrimSpace(b))
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 {
		return 0, jsonErr("step", "value %q is not a step number", s)
	}
	return n, nil
}

// MarshalStepText encodes step as DLRover and Megatron write their
// trackers.
func MarshalStepText(step int64) []byte { return strconv.AppendInt(nil, step, 10) }
