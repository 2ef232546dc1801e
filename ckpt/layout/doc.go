// Package layout is the byte format of ckpt's flash checkpoints, apart
// from the code that saves and loads them: the shared-memory segment that
// a trainer in any language writes (SegmentHeader, StepMeta), the files of
// the disk tier (ShardManifest, StepManifest and the trackers), and the
// reports in which ckpt.InspectSegment and ckpt.InspectDir say what they
// found. Each format has a Parse and a Marshal that are inverses; parse
// errors are *ParseError, naming the file, the offset and the field, and
// wrap ErrCorrupt.
//
// # The segment
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
//	 40    8 persist_seq  seq of the save the writer asks to persist, 0 none;
//	                      the owner sets it back to 0 once done with it (live)
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
//  2. The half is held if its pin is non-zero (the owner is reading it,
//     say to persist it), or if it holds a complete step whose seq is
//     persist_seq (a persist asked for and not done yet). If it is held
//     and holds a complete step, take the other half instead: the newest
//     step is overwritten while the held one stays as the step a crash
//     leaves, and as the step the owner persists. If the half taken is
//     held too, skip this save.
//  3. Set its state to 1; read pin again, and if it is now non-zero, set
//     the state back and skip; otherwise increment gen.
//  4. Write the blobs, then the table, then bytes [16,64) of the header
//     with seq, step, time, nblobs, table_size, seal 0, seal_crc 0 and
//     meta_crc. The CRC array is left as it is (this package zeroes it).
//  5. Set state to 2, then active to the half. To have the step persisted,
//     wait until persist_seq is 0 (the owner is done with the previous
//     request), then set it to the step's seq: a writer has one request
//     outstanding, and every step it asks for is persisted. (A writer
//     that saves asynchronously waits before step 1 instead.)
//
// The owner persists the save whose seq persist_seq names, that one and
// no other step, and then sets persist_seq from that seq back to 0 with a
// compare-and-swap (a writer may have asked for a newer one meanwhile),
// whether the persist succeeded or failed: the half is a writer's again.
//
// The owner seals each complete step with seal 0 soon after it appears
// (Run polls for them), and before it persists, sends or loads one:
//
//  1. Load gen; check that state is 2, then load seal and check that it
//     is 0 and that meta_crc holds.
//  2. Compute the CRC32C of every blob.
//  3. Increment the half's pin; check that state is still 2 and gen
//     unchanged; otherwise unpin and give up (a writer took the half
//     over: its save is the next to seal).
//  4. Write the CRC array, then seal_crc, then set seal to 1.
//  5. Decrement the pin.
//
// The pin keeps writers off the half while the seal is written: a writer
// checks it after setting its state, and the owner checks state and gen
// after setting the pin, so one of them sees the other; step 3 also
// catches a writer that claimed the half before. The half is not pinned
// while its CRCs are computed, which takes as long as reading the step, so
// that a writer whose other half is held (a persist asked for, a replica
// being sent) takes this one rather than skip its save; the seal then
// gives up. seal is the last word written: a reader that loads it as 1
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
// [16,60) and the table, and there was no CRC array. ckpt.LoadSegment,
// ckpt.InspectSegment and ckpt.Verify read such segments, whose complete
// steps count as sealed; ckpt.NewOwner and ckpt.NewWriter refuse them, naming the file: load its
// step (flashckpt load), then remove it, and the owner creates a version 2
// segment. The replica protocol's version went from 1 to 2 with it.
//
// # The disk tier
//
// A step's files are in StepDir(dir, step): ShardFile(shard), the blobs one
// after the other, and ShardManifestFile(shard), a ShardManifest as
// indented JSON; once every shard is durable, CommitFile, a StepManifest.
// TrackerFile in dir is the StepManifest of the newest committed step;
// DLRoverTrackerFile and MegatronTrackerFile hold that step in decimal, as
// DLRover and Megatron-LM write them (ParseStepText, MarshalStepText).
package layout
