// Package ckpt is a flash checkpoint: a trainer saves its state into shared
// memory in the time of a memory copy, and a node agent, which outlives the
// trainer, persists it to disk asynchronously, copies it to peers in another
// failure domain, and loads the newest intact step back after a failure.
//
// Two roles, usually two processes:
//
//   - The Owner is the node agent. It creates one segment per local shard in
//     /dev/shm (checking the free space first and reserving every page, so a
//     small /dev/shm is a clear ErrNoSpace, never a SIGBUS), keeps it across
//     trainer crashes and its own restarts, seals each new save (computes
//     the CRC32C of its blobs, off the trainer's path), persists steps when
//     writers ask (Run) or when the trainer dies (PersistNewest), sends each
//     new save to its peers and holds theirs, and loads by preference (Load).
//   - The Writer is the trainer. Save copies named blobs into the half of
//     the segment that does not hold the newest step and then flips a word:
//     it blocks for the copy only, computes no checksum, never waits for a
//     persist, and a trainer killed mid-save leaves the previous step
//     intact. A step larger than the segment's halves grows the segment
//     first, keeping its newest step. Persist asks the owner to write the
//     step to disk; the trainer does not wait for it.
//
// A node agent:
//
//	o, err := ckpt.NewOwner(ckpt.OwnerConfig{
//		Shards: []int{0, 1}, Capacity: 2 << 30, Dir: "/mnt/ckpt",
//	})
//	if err != nil {
//		return err
//	}
//	defer o.Close()
//	go o.Run(ctx)
//	// ... start the trainers with o.SegmentPath(rank) ...
//	// when a trainer dies:
//	step, err := o.PersistNewest(ctx)
//
// A trainer:
//
//	w, err := ckpt.NewWriter(ckpt.WriterConfig{Path: path})
//	...
//	err = w.Save(ctx, step, ckpt.Blob{Name: "model", Data: weights}, ckpt.Blob{Name: "optim", Data: state})
//	err = w.Persist(step) // every so many steps
//
// # Disk tier
//
// A persist writes dir/<step>/shard-NNNNN.bin (the blobs one after the
// other) and then shard-NNNNN.json (a ShardManifest: sizes and CRC32C of
// every blob), each by temporary file, fsync, rename and directory fsync.
// The data file is written back to disk 8 MiB at a time as it is written
// and its pages leave the page cache, so that a persist neither leaves the
// final fsync a gigabyte to flush nor stalls the node's other writers on
// the kernel's dirty-page limits. The Committer learns that the shard is
// durable; only when every shard of the step is does the step get
// committed: dir/<step>/commit.json (a StepManifest binding the CRC of each
// shard's manifest), then the trackers faultline_latest.json (the same
// StepManifest), dlrover_latest.txt and latest_checkpointed_iteration.txt
// (the step in decimal, as DLRover and Megatron-LM write them), each
// written atomically. A crash at any point leaves every tracker naming a
// complete step. A persist of a step committed already reads its disk copy
// back: an intact one is kept, a damaged one is written again from memory,
// and other content under the number is refused. LocalCommitter commits on
// one node (or a shared filesystem); a control plane implements Committer
// across nodes and calls CommitStep on each. Retention keeps the newest N
// committed steps and every K-th; a removed step vanishes by a rename
// before its files go. Commits and retention hold an exclusive flock on
// dir/LockFile, so that the agents sharing a disk tier (processes of one
// node, or nodes on a shared filesystem) commit and prune one at a time.
//
// # Replicas
//
// Each new save is sent point to point over TCP to Replicas peers chosen
// by PickPeers, in another failure domain (the ASW a node hangs under,
// given by the caller) when there is one. Both ends verify the meta
// checksum and every blob's CRC as the bytes arrive, and the receiver
// writes into the inactive half of a replica segment, so a transfer cut
// short by either side's death leaves the previous copy intact. A replaced
// node (same name) restores its shards from the peers that PickPeers names.
//
// # Loading
//
// Owner.Load serves the newest step that some tier holds intact, and never
// an older step while a newer committed one is intact in another tier; at
// one step it prefers memory (the steps every local shard holds intact),
// then a replica (restored into local memory), then disk. Every CRC is
// verified, and the LoadReport says which tier served, why the others did
// not, and why each newer step was passed over. A memory step its owner
// died before sealing is complete but has no CRCs to check: Load computes
// them as it copies the step, seals it with them, and says so
// (LoadReport.SealedOnLoad, Checkpoint.Unverified). Across nodes a control
// plane picks one step for every shard and calls LoadStep. A restarting
// trainer loads the step its agent chose: from memory (Writer.Load, or
// LoadInto to restore into its own buffers) when memory holds it, which the
// agent made so for a replica, else from disk (LoadDiskStep). Without an
// agent, LoadShard weighs a segment and the disk tier read-only, and
// CommonStep finds the newest step every shard of a job holds intact.
// Verify and InspectSegment/InspectDir check a disk tier and segments
// without disturbing them (the flashckpt command wraps them).
//
// # Observability
//
// Metrics (Registerer; nil is off): faultline_ckpt_save_blocking_seconds,
// _save_bytes_total, _save_skipped_total (writer); _seal_seconds, _persist_seconds,
// _persist_bytes_total, _persist_failures_total, _commits_total,
// _crc_failures_total, _loads_total{tier}, _replica_bytes_total{direction},
// _replica_failures_total (owner). Each Writer and Owner registers its
// collectors in its constructor and unregisters them in Close; two on one
// Registerer collide, which is an error of the second constructor: give
// each a Registerer wrapped with its own label
// (prometheus.WrapRegistererWith). Spans: ckpt.Save, ckpt.LoadMemory,
// ckpt.Seal, ckpt.Persist, ckpt.Replicate, ckpt.Load, ckpt.FetchReplica.
//
// # FORMAT
//
// The segment is a file (by default /dev/shm/faultline-ckpt-<shard>) that
// any process may map and write with plain loads and stores, such as a
// Python trainer with mmap and struct. All integers are little-endian. The
// CRC is CRC-32C (Castagnoli, as in iSCSI, ext4 and google-crc32c) with the
// usual pre- and post-inversion: CRC32C("123456789") = 0xe3069283. A
// writer computes it only over the small headers and the table, never over
// the blobs: the owner does that afterwards ("seals" the step), so that a
// save costs the copy alone and a writer without a fast CRC32C (Python's
// standard library has none) can save gigabytes.
//
// The file is a 4096-byte header followed by two halves of half_size bytes
// each: half i starts at 4096 + i*half_size. Header:
//
//	off size field
//	  0    8 magic        "FLTCKPT\x00"
//	  8    4 version      2 (1: see Version 1 below)
//	 12    4 header_size  4096
//	 16    8 half_size    a multiple of 4096
//	 24    4 shard        the shard the segment holds
//	 28    4 flags        bit 0: a replica of a peer's shard; other bits 0
//	 32    4 header_crc   CRC32C of bytes [0,32)
//	 36    4 active       0 or 1: the half of the newest completed save (live)
//	 40    8 persist_seq  seq of the save the writer asks to persist, 0 none (live)
//	 48   16 reserved     0
//
// A half starts with a 64-byte step header, then its blob table, then the
// CRC array, then the blob data:
//
//	off size field
//	  0    4 state        0 empty, 1 writing, 2 complete (live)
//	  4    4 pin          readers in the owner; a writer leaves a pinned half alone (live)
//	  8    8 gen          incremented by a writer as it starts writing the half (live)
//	 16    8 seq          save sequence: 1 + the larger seq of the two halves
//	 24    8 step         training step, >= 0
//	 32    8 time         unix nanoseconds of the save, 0 if unknown
//	 40    4 nblobs       number of table entries
//	 44    4 table_size   bytes of the table
//	 48    4 seal         0 unsealed: the blob CRCs are not known; 1 sealed (live)
//	 52    4 seal_crc     with seal 1: CRC32C of bytes [16,48), the table and the CRC array
//	 56    4 reserved     0
//	 60    4 meta_crc     CRC32C of bytes [16,48) followed by the table
//	 64      table        nblobs entries, back to back: table_size bytes
//	         crc array    at 64 + table_size: nblobs u32, the CRC32C of each blob
//	                      in table order, meaningful with seal 1 only
//
// A table entry:
//
//	off size field
//	  0    8 offset       of the blob's first byte, from the start of the half
//	  8    8 size         bytes
//	 16    4 reserved     0
//	 20    2 name_len     1..1024
//	 22    2 reserved     0
//	 24      name         UTF-8, no NUL, then zero bytes up to a multiple of 8
//
// Blobs are listed in increasing offset, start at or after the end of the
// CRC array (64 + table_size + 4*nblobs), do not overlap and end within
// the half; names are unique. This package places each blob at the next
// multiple of 64 (DataAlign), the first after the CRC array.
//
// The live words are read and written whole (aligned 4- and 8-byte
// accesses); meta_crc covers none of them, nor seal_crc and the CRC array,
// which the owner writes into a complete step. A writer saves a step so:
//
//  1. Pick the target half: not the one holding the newest complete step
//     (highest seq among complete halves whose meta_crc holds; with none,
//     1 - active).
//  2. If its pin is non-zero (the owner is reading it, say to persist it)
//     and it holds a complete step, take the other half instead: the
//     newest step is overwritten while the pinned one stays as the step a
//     crash leaves. If the half taken is pinned too, skip this save.
//  3. Set its state to 1; read pin again, and if it is now non-zero, set
//     the state back and skip; otherwise increment gen.
//  4. Write the blobs, then the table, then bytes [16,64) of the header
//     with seq, step, time, nblobs, table_size, seal 0, seal_crc 0 and
//     meta_crc. The CRC array is left as it is (this package zeroes it).
//  5. Set state to 2, then active to the half. To have the step persisted,
//     set persist_seq to its seq.
//
// The owner seals each complete step with seal 0 soon after it appears
// (Run polls for them), and before it persists, sends or loads one:
//
//  1. Increment the half's pin; load gen; check that state is 2, then load
//     seal and check that it is 0 and that meta_crc holds.
//  2. Compute the CRC32C of every blob.
//  3. Check that state is still 2 and gen unchanged; otherwise unpin and
//     give up (a writer took the half over: its save is the next to seal).
//  4. Write the CRC array, then seal_crc, then set seal to 1.
//  5. Decrement the pin.
//
// The pin keeps writers off the half from step 1 (a writer checks it after
// setting its state), and steps 1 and 3 catch one that claimed the half
// before. seal is the last word written: a reader that loads it as 1
// finds the whole seal in place, and one that loads 0 ignores the CRC
// array and seal_crc, whatever part of them an owner killed in step 4
// left, which the next seal overwrites. A reader therefore meets two kinds
// of complete steps, never a half-written seal: a sealed one, whose every
// blob it checks against the CRC array, and an unsealed one, which it can
// take only as the save left it (an owner loading one computes the CRCs as
// it copies and seals it with them). seal 1 with a seal_crc that does not
// hold is corruption, like any failed checksum. An owner writing a step
// whose CRCs it holds anyway (a replica it received, checked on arrival)
// writes it sealed: the CRC array, seal_crc and seal 1 in step 4 of a save.
//
// A reader (owner or loader) picks the complete half with the highest seq
// whose meta_crc holds. It loads gen first and only then checks that state
// is 2 (in this order: a save that began before the load of gen shows in
// the state, one that begins after it changes gen), loads seal before it
// reads the CRC array, reads the table again, copies the blobs and checks
// every CRC of a sealed step, then checks that state is still 2 and gen
// unchanged; otherwise it discards what it read, which is then no evidence
// of corruption. The owner also increments pin before reading and
// decrements it after, and resets both pins when it (re)starts. A writer
// dying anywhere leaves its target half in state 1, which no reader
// accepts, and the other half as it was.
//
// Growing: a segment's size never changes in place; one too small for a
// step is replaced by a larger one under its name. Whoever grows it (a
// writer whose step does not fit, or an owner started with a larger
// capacity or asked with Owner.Grow) takes an exclusive flock on the
// segment file and checks that the path still names that file (else another
// process grew it first: map the path anew). It writes a new file in the
// same directory, under a hidden temporary name, with every page reserved
// and the same header but a larger half_size; copies the newest complete
// step into its half 0 as it is: bytes [16,64) of the step header, the
// table, and the CRC array and seal words as the seal word it loaded first
// says (zero when unsealed), then the blobs at the same offsets; sets that
// half's state to 2, active to 0 and persist_seq to the old segment's; and
// renames the file over the path. (An owner that grows a segment copies the
// other complete step into half 1 too.) A writer holds a shared flock on
// the segment file for each save, from step 1 to step 5 above, and once it
// holds the lock checks that the path still names the file it mapped: stat
// of the path and fstat of its descriptor (os.stat and os.fstat in Python)
// give the same st_dev and st_ino. If not, it unlocks, maps the path anew,
// reading half_size from the new header, and starts over. The lock makes a
// grow wait for the save under way, so that no save lands in a file already
// replaced; a writer that takes no lock may lose a save made while the
// segment grows. The owner and a reader check the path the same way before
// each operation.
//
// Version 1, written by earlier releases, had no seal: the writer computed
// every CRC and put it in bytes [16,20) of the blob's table entry, bytes
// [48,60) of the step header were reserved, meta_crc covered bytes
// [16,60) and the table, and there was no CRC array. LoadSegment,
// InspectSegment and Verify read such segments, whose complete steps count
// as sealed; NewOwner and NewWriter refuse them, naming the file: load its
// step (flashckpt load), then remove it, and the owner creates a version 2
// segment. The replica protocol's version went from 1 to 2 with it.
//
// # Tests
//
// The crash tests re-execute the test binary as a trainer or an agent and
// SIGKILL it at random points. FAULTLINE_CKPT_TRIALS sets the number of
// kills of a saving trainer (default 20; 200 for the full run) and, a
// quarter of it (at least 5), of a persisting agent and of an agent in the
// middle of sealing. Tests that mount a small tmpfs
// (a 64 MiB /dev/shm, a full disk) need root and skip without it;
// TestPythonWriter needs python3 and skips without it.
//
// The benchmarks move 256 MiB in 16 blobs by default;
// FAULTLINE_CKPT_BENCH_MIB=1024 gives the 1 GiB in 64 MiB blobs of the
// targets, and FAULTLINE_CKPT_BENCH_DIR puts the disk benchmarks on
// another filesystem. Each reports, beside its own figures, its bandwidth
// as a fraction of its baseline measured in the same iterations
// (x-memcpy, x-crc32, x-rawwrite). A verified load checksums each MiB of
// shared memory and then copies it from the cache with streaming stores,
// so it moves the bytes memcpy moves; one EPYC core loads at about 0.5x
// memcpy, and LoadMemory's x-memcpy shows how much of a second core and of
// the memory's bandwidth it got (0.8x or more with both cores free).
// Persist writes back 8 MiB at a time as it writes, where the baseline
// leaves everything to one fsync.
package ckpt
