// Package trace is lightweight dotting of training phases: a recorder on
// the hot path of a training process, switched per kind while training
// runs, that writes per-rank rotating files in the layout and record format
// of MindCluster's profiling data, an ager that keeps those files within a
// disk budget, and a reader that tails them and pairs their records into
// ranges for analysis (see trace/slownode).
//
// # Kinds and the switch
//
// Five kinds can be dotted: Step, FP, DataLoader, SaveCheckpoint and
// CommunicationOperator. A Switch says which are on; its JSON form is
// MindCluster's profilingSwitch document,
//
//	{"CommunicationOperator":"off","Step":"on","SaveCheckpoint":"on","FP":"on","DataLoader":"on"}
//
// parsed strictly: a value other than "on" or "off", an unknown or repeated
// field or malformed JSON is an error naming the field, and the switch in
// force stays. A SwitchWatcher keeps a Recorder in step with a file,
// normally a ConfigMap key mounted at DefaultSwitchPath: it watches the
// folder with inotify, so it follows the kubelet's atomic update (a new
// "..<timestamp>" folder, a "..data_tmp" symlink to it renamed over
// "..data"), and polls every second when it cannot watch. A missing file
// means all off until it appears. Recorder.SetSwitch is the plain Go entry
// for a control plane. Either way a change is in force for every call that
// starts after it, within about a second of the file changing.
//
// # Recording
//
// A Recorder is built once per training process (one rank):
//
//	rec, err := trace.NewRecorder(trace.RecorderConfig{Rank: rank})
//	...
//	go rec.Run(ctx)
//	defer rec.Close()
//	s := rec.StartStep(step, device, stream)
//	f := rec.Start(trace.FP, trace.MarkerForward, device, stream)
//	f.End()
//	c := rec.StartComm(&trace.CommOp{OpName: "HcclAllReduce", GroupName: "tp-0"}, device, stream)
//	c.End()
//	s.End()
//
// With the kind off, a call costs an atomic load and a branch: Start,
// StartStep, StartComm and Span.End inline into the caller. With it on, the call takes a monotonic
// timestamp and claims a slot of a bounded lock-free ring (one CAS and one
// store; no allocation, no lock). Run drains the ring, encodes records and
// writes them; names are encoded there, so a
// step number or a CommOp costs the caller nothing to format. When the
// writer falls behind the ring fills and new records are dropped and
// counted; training never waits. Ids are unique per recorder and, being
// offset by its start time in nanoseconds, across restarts of a rank.
// Timestamps are unix nanoseconds advanced by the monotonic clock.
// Recorder.Record takes records built elsewhere (an accelerator's marker
// activity), filtered by domain as MindCluster does.
//
// # On-disk layout (a contract)
//
//	<root>/<job>/<rank>/<file>
//	<root>/<job>/<rank>/parallel_group.json
//
// root defaults to DefaultRoot (/user/cluster-info/profiling); rank is the
// global rank in decimal; file is the 10-digit unix seconds of the file's
// creation. A new file starts when the current one reaches 10 MiB (a
// writer that rotates faster than once a second takes the next free
// second). Folders have mode 0750 and files 0640, whatever the umask.
// Nothing beneath the root is followed if it is a symlink: folders and
// files are opened one path element at a time with O_NOFOLLOW, and a
// writer never appends to a file it did not create.
//
// job is $MINDX_TASK_ID when set, else default_task_id_<unix seconds>,
// chosen once per launcher: the first process started by a given parent
// process (torchrun's agent, mpirun's orted, slurmstepd, a script) creates
// the job folder and links a claim file naming it into
// <root>/.faultline-jobs/ with exclusive-create semantics; the launcher's
// other processes on the node read the claim (see ResolveJob). Ranks on
// several nodes share a job folder only through MINDX_TASK_ID, which a
// multi-node launcher without a task id should set itself. A job id must
// be one path element: "../../etc" is refused (ErrPath).
//
// Each line of a record file is one JSON object in the mspti marker shape,
// fields in this order, with no spaces:
//
//	{"Kind":1,"Flag":16,"SourceKind":0,"Timestamp":1731000000123456789,"Id":1731000000000000042,
//	 "MsptiObjectId":{"Pt":{"ProcessId":4242,"ThreadId":4242},"Ds":{"DeviceId":3,"StreamId":7}},
//	 "Name":"step 12","Domain":"default"}
//
// (one line in the file). Flag bits: 1 instant, 2 host start, 4 host end,
// 8 device instant, 16 device start, 32 device end; Step, FP and
// CommunicationOperator ranges use the device flags and DataLoader and
// SaveCheckpoint the host ones, as MindCluster does. A range is a start and
// an end record sharing an Id; end records have an empty Name and Domain.
// Names are "step <n>", "forward", "dataloader", "save_checkpoint" in
// domain "default", and a CommOp as JSON (escaped as a JSON string) in
// domain "communication". Buffered records reach the file at least every
// FlushInterval (5 s) and on Close, which also fsyncs; those flushes end
// the file on a complete line. A buffer that fills in between is written
// up to a page boundary of the file (page-aligned writes are much cheaper
// for the kernel), so the file may end inside a line until the next
// flush; readers wait for the rest. A write that fails is cut back to the
// last complete line.
//
// parallel_group.json maps communicator names (CommOp.GroupName) to
// {"group_name", "group_rank", "global_ranks"}; see ParallelGroups.
//
// # Aging
//
// One Ager per node keeps the record files under the root within a byte
// budget (default 5000 MiB): when over, it deletes in each rank folder the
// oldest 20% (by modification time, at least one) of the digit-named
// regular files, keeping at least 3, and repeats until within budget. It
// never deletes anything else and never follows a symlink (a symlinked job
// or rank folder, or a digit-named symlink, is skipped, and whatever it
// points at is untouched).
//
// It does not rescan the tree every minute. It keeps an index of each rank
// folder's files and, at each check, stats every job and rank folder:
// only a folder whose mtime moved (a file was created or deleted in it) is
// listed again, and of the others only the newest file, the one a writer
// appends to, is stat'ed. A check therefore costs one stat per folder and
// per rank instead of one per file. Folder mtimes are trusted only once
// they are a second older than the listing, which covers file systems with
// coarse timestamps, and a full rescan every hour catches anything else.
// inotify is not used: it would need a watch per rank folder and still a
// rescan after an overflow, where the mtimes cost nothing to keep.
//
// # Reading
//
// A RankReader tails one rank folder: files in numeric name order, each
// from the offset where the last Read stopped, moving to the next file once
// a newer one exists. A partial last line waits for the next Read. Lines
// that are not records (garbage, binary, longer than MaxLineBytes, or the
// unfinished last line of a file a crashed writer left) are skipped and
// counted, the last one reported as a *ParseError naming the file and line.
// Files deleted by the ager are skipped cleanly. Readers that tail many
// ranks can share a BufferPool, so that only those reading at a time hold a
// buffer, and take turns with ReadSome, which stops at the end of a buffer
// so that nothing is read twice. A Pairer turns the records into Ranges,
// pairing starts and ends by Id per source kind; MindCluster's files
// (encoding/json field order, -1 in the union half of MsptiObjectId,
// unnamed device records) read the same way.
//
// Lines in the field order both writers use take a fast path that reads
// each byte about once (what repeats the previous line's text, such as
// the object id, is compared rather than read) and allocates nothing for
// names seen before; any
// other order, white space or unknown field goes through encoding/json,
// and the two read every line alike (FuzzParseRecord holds them to it).
// A Pairer finds open starts in an open-addressing table and evicts the
// oldest in O(1); it indexes the names kept for a marker's other source
// only once a record needs one.
//
// # Metrics
//
// With a prometheus.Registerer in the config (registered by the
// constructor, unregistered by Close; two live objects of one type collide
// on one Registerer, which is an error of the second constructor):
//
//	faultline_trace_records_written_total{domain}
//	faultline_trace_records_dropped_total{domain,reason="buffer_full"|"write_error"}
//	faultline_trace_written_bytes_total
//	faultline_trace_files_created_total
//	faultline_trace_write_errors_total
//	faultline_trace_switch_enabled{kind}                      (Recorder)
//	faultline_trace_switch_loads_total{result="ok"|"missing"|"error"}  (SwitchWatcher)
//	faultline_trace_root_bytes, faultline_trace_aged_files_total,
//	faultline_trace_aged_bytes_total, faultline_trace_ager_errors_total,
//	faultline_trace_ager_checks_total{kind="light"|"full"}    (Ager)
//
// # Tests
//
// The tests use real files, real processes (a writer killed with SIGKILL,
// processes that agree on a job folder), the kubelet's update done step by
// step, and small tmpfs mounts for a full disk and a read-only root; the
// last two skip where mounting is not permitted. Fuzz targets:
// FuzzParseSwitch, FuzzParseRecord, FuzzReaderLines and
// FuzzParseParallelGroups.
package trace
