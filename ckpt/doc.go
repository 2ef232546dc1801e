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
//	err = w.Persist(ctx, step) // every so many steps
//
// # Disk tier
//
// A persist writes dir/<step>/shard-NNNNN.bin (the blobs one after the
// other) and then shard-NNNNN.json (a layout.ShardManifest: sizes and CRC32C of
// every blob), each by temporary file, fsync, rename and directory fsync.
// The data file is written back to disk 8 MiB at a time as it is written
// and its pages leave the page cache, so that a persist neither leaves the
// final fsync a gigabyte to flush nor stalls the node's other writers on
// the kernel's dirty-page limits. The Committer learns that the shard is
// durable; only when every shard of the step is does the step get
// committed: dir/<step>/commit.json (a layout.StepManifest binding the CRC of each
// shard's manifest), then the trackers faultline_latest.json (the same
// layout.StepManifest), dlrover_latest.txt and latest_checkpointed_iteration.txt
// (the step in decimal, as DLRover and Megatron-LM write them), each
// written atomically. A crash at any point leaves every tracker naming a
// complete step. A persist of a step committed already reads its disk copy
// back: an intact one is kept, a damaged one is written again from memory,
// and other content under the number is refused. LocalCommitter commits on
// one node (or a shared filesystem); a control plane implements Committer
// across nodes and calls CommitStep on each. Retention keeps the newest N
// committed steps and every K-th; a removed step vanishes by a rename
// before its files go. Commits and retention hold an exclusive flock on
// dir/.faultline-ckpt.lock (layout.LockFile), so that the agents sharing a disk tier (processes of one
// node, or nodes on a shared filesystem) commit and prune one at a time.
//
// # Replicas
//
// A node agent's Run sends each shard's newest sealed step, in the
// background, point to point over TCP to Replicas peers (OwnerConfig.Peers,
// node name to address) chosen by PickPeers: in another failure domain
// (Domains, the ASW a node hangs under) when there is one, so that a lost
// node or switch does not take a shard and its copies together. A save
// never waits for a transfer: the half being sent is pinned only while the
// other half is free for the save, and when a save needs it (the other
// half waits for a persist) the transfer gives way and is given up
// (ErrSuperseded). Steps saved faster than the link carries them are
// skipped, newest first: when a transfer ends, the next one sends the
// newest step, so a peer holds a step at most one transfer and one save
// behind (BenchmarkSaveWithReplicas). A single save during a transfer
// overwrites the step the peers held, and until the newer copy lands no
// step is held both by the shard and by its peers: Run says so, once
// while transfers keep landing after the steps their peers held are gone,
// with the transfer's figures (_replica_saves_behind tells how far). A
// transfer's packets, both ways, are marked as bulk traffic (DSCP CS1 and
// the socket priority that Linux's default queueing sends last), so that
// on a link whose queues honor it the job's collectives do not wait
// behind a replica; a replica fetched for a recovery is not, as the job
// waits for it. The receiver checks the meta checksum and every blob's
// CRC32C as the bytes arrive and writes them
// into the half of its replica segment (ReplicaPath) that does not hold
// its newest copy, or into a new, larger segment that replaces it only
// once whole: a transfer cut short by either side's death, or given up,
// leaves the previous copy intact. A replica of a shard from a node's
// replacement (same name, new address) supersedes the replaced node's as
// any newer save does. Replica segments live in shared memory like the
// shards' own, so an agent that restarts on the node (Close, or SIGKILL,
// then NewOwner) serves the replicas it held; Owner.Replicas lists them,
// what an agent tells the job's manager so that it knows which node holds
// which shard's step. SetPeers changes the peers while Run runs (a node
// replaced on a new address), and Run then sends each shard's newest step
// to the peers it now picks. A copy is served, or restored from, while a
// put into it runs: its reader maps it read-only and pins nothing, so a
// put from a node cut off mid-transfer, which holds the copy until its
// I/O timeout, keeps no restore waiting, and a put that writes over the
// step being read ends that read (ErrSuperseded).
//
// Every transfer starts with a handshake in which each side proves, over
// the other's fresh nonce, that it holds OwnerConfig.ReplicaKey
// (HMAC-SHA256), before any shard byte moves: a peer with another key, or
// none, or of another protocol version, is refused with ErrRefused and an
// error that says which, on both sides.
//
// Owner.Restore makes a shard's segment hold a given step, from memory,
// else a peer's replica (fetched over TCP straight into the segment,
// every CRC checked on arrival), else the disk tier, and reports in
// LoadReport.Refused why each tier before the one that served did not:
// what a replacement node's agent, with empty memory, calls before it
// starts its trainers, which then load the step from memory.
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
// _replica_failures_total, _replica_refused_total,
// _replica_abandoned_total, _replica_saves_behind{shard} (owner). Each Writer and Owner registers its
// collectors in its constructor and unregisters them in Close; two on one
// Registerer collide, which is an error of the second constructor: give
// each a Registerer wrapped with its own label
// (prometheus.WrapRegistererWith). Spans: ckpt.Save, ckpt.LoadMemory,
// ckpt.Seal, ckpt.Persist, ckpt.Replicate, ckpt.Load, ckpt.FetchReplica,
// ckpt.Restore.
//
// # FORMAT
//
// The segment is a documented byte format, so that a trainer in another
// language (Python, with mmap and struct) writes into it directly, and so
// are the disk tier's files: package layout (ckpt/layout) describes them
// byte by byte, parses and encodes them, and holds the reports of
// InspectSegment and InspectDir.
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
// (x-memcpy, x-crc32, x-rawwrite, x-no-replicas: BenchmarkSaveWithReplicas
// times a save whose agent replicates beside one whose agent does not, over
// loopback and, as root, between network namespaces over a link that tc
// shapes to FAULTLINE_CKPT_BENCH_LINK, 1gbit by default). A verified load checksums each MiB of
// shared memory and then copies it from the cache with streaming stores,
// so it moves the bytes memcpy moves; one EPYC core loads at about 0.5x
// memcpy, and LoadMemory's x-memcpy shows how much of a second core and of
// the memory's bandwidth it got (0.8x or more with both cores free).
// Persist writes back 8 MiB at a time as it writes, where the baseline
// leaves everything to one fsync.
package ckpt
