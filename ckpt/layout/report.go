package layout

// HalfReport is what ckpt.InspectSegment found in one half.
type HalfReport struct {
	State uint32
	Meta  StepMeta // when the table is valid; Meta.Sealed says whether the CRCs are known
	// Err says why the half holds no intact step; nil when it does: a
	// sealed step whose every CRC holds, or a complete step not sealed yet,
	// which has nothing to check.
	Err error
	// Corrupt is set when the half claims a complete step that fails a
	// check: a flipped bit, not an interrupted save.
	Corrupt bool
}

// SegmentReport is what ckpt.InspectSegment found in a segment.
type SegmentReport struct {
	Path       string
	Header     SegmentHeader // with the live words as read
	Halves     [2]HalfReport
	NewestHalf int // the half a load would serve, -1 if none
}

// ShardReport is the state of one shard file of a step on disk.
type ShardReport struct {
	Shard  int
	Size   int64
	Blobs  int
	Absent bool  // neither data nor manifest here (another node's shard)
	Err    error // nil when every check holds
}

// StepReport is the state of one step directory.
type StepReport struct {
	Step      int64
	Committed bool
	Err       error // why the CommitFile of a committed step fails a check; nil when it holds
	Shards    []ShardReport
}

// TrackerReport is the state of one tracker file.
type TrackerReport struct {
	File string
	Step int64 // -1 when absent or unreadable
	Err  error
}

// DirReport is what ckpt.InspectDir found in a disk tier.
type DirReport struct {
	Dir string
	// Absent says that Dir does not exist: nothing is on disk yet (a
	// memory-only job, or none persisted). That is no problem.
	Absent   bool
	Trackers []TrackerReport
	Steps    []StepReport // newest first
	// Problems are the corruptions found, each wrapping ErrCorrupt:
	// trackers naming a step that is not committed, committed shards that
	// fail a check or whose files are gone. Uncommitted step directories
	// (persists in progress or cut short) are none.
	Problems []error
}
