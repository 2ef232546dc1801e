// Command libtaskd is faultline's control plane and dotting for training
// processes written in Python or C: built as a shared library,
//
//	go build -buildmode=c-shared -o libtaskd.so ./examples/libtaskd
//
// it exports a C ABI (the generated libtaskd.h declares it) and comes with
// faultline_taskd.py, a ctypes module offering MindCluster TaskD's Python
// names, so that a TaskD user changes one import:
//
//	from faultline_taskd import init_taskd_worker, start_taskd_worker
//
//	init_taskd_worker(rank_id=int(os.environ["RANK"]), upper_limit_of_disk_in_mb=5000, framework="pt")
//	start_taskd_worker()
//	for step in range(steps):
//	    with span(f"step {step}"):
//	        with span("dataloader"):
//	            batch = next(loader)
//	        with span("forward"):
//	            loss = model(batch)
//
// # Worker
//
// taskd_init_worker(rank, disk_limit_mb, framework, options_json, &handle)
// builds a trace.Recorder writing <root>/<job>/<rank>/ (root default
// /user/cluster-info/profiling) and a taskd.Worker; taskd_start_worker
// connects it. Every profiling switch the manager fans out is applied to
// the recorder, to the marker source of the accelerator's profiling library
// when one loads (libmspti.so through package npu; without it ranges come
// from taskd_range_start and taskd_range_end), and then to the trainer's
// profiling-switch callback. On the node's local rank 0 an Ager keeps the
// root within disk_limit_mb.
//
// What the options leave out comes from the environment:
//
//	MINDX_TASK_ID          job id (required)
//	NODE_RANK, GROUP_RANK  node rank (default 0)
//	LOCAL_RANK             local rank: device id in records, ager on 0
//	TASKD_UPSTREAM         the node's proxy or the manager (default 127.0.0.1:9602)
//	TASKD_TLS_DIR          ca.crt, tls.crt, tls.key for mutual TLS
//	TASKD_TOKEN            shared token
//	TASKD_INSECURE         1 allows plaintext
//	TASKD_PROFILING_ROOT   dotting root
//	TASKD_MARKER_LIBRARY   profiling library to load, or "off"
//	TASKD_LOG_LEVEL        debug, info, warn (default) or error; logs go to stderr
//
// Option keys (JSON): job, node, local_rank, device, upstream, tls_dir,
// token, token_file, insecure, root, ager ("auto", "on", "off"),
// marker_library, flush_interval ("5s"), log_level.
//
// Ranges: taskd_range_start(handle, name, domain) returns a positive id,
// 0 when the kind is switched off (nothing recorded; ending 0 is a no-op),
// or a negative error code. Names in domain "default" are "step <n>",
// "forward", "dataloader" and "save_checkpoint"; domain "communication"
// takes a communication op as JSON. taskd_mark records an instant.
//
// Callbacks: taskd_register_callback(handle, TASKD_EVENT_*, fn, user).
// Pause, resume, stop and switch-link requests come from the manager's
// recovery orchestration; a request with no callback registered fails, so
// that the manager never believes a trainer paused that cannot.
//
// # Manager and proxy
//
// taskd_init_manager(json, &handle) and taskd_start_manager run a job's
// taskd.Manager in the calling process; keys: job (or MindCluster's
// job_id), listen (":9601"), nodes (node_nums), procs_per_node
// (proc_per_node), tls_dir, token, token_file, insecure, state_dir,
// collect_dir, switch_file, heartbeat_interval, heartbeat_deadline,
// log_level. taskd_set_switch sets the job's profiling switch.
// taskd_init_proxy and taskd_start_proxy run a node's proxy; keys: job,
// node, upstream (default $TASKD_MANAGER_ADDR, else $MASTER_ADDR:9601),
// listen ("127.0.0.1:9602"), tls_dir, token, token_file, insecure,
// dotting_root, stack_root, log_level. taskd_addr copies the address one
// listens on.
//
// # Rules of the ABI
//
// Every function is thread-safe and returns TASKD_OK or a negative
// TASKD_E* code, the calling thread's taskd_last_error() saying why (as
// errno). Handles are integers; a destroyed or foreign handle gives
// TASKD_EHANDLE, never a crash. Strings are read during the call and
// copied when kept; no Go pointer is handed to C. Callbacks run on the
// library's threads through small C trampolines; a ctypes callback takes
// the GIL itself. taskd_destroy stops what a handle runs and, for a worker,
// flushes and syncs its records.
//
// The Go runtime does not survive fork: faultline_taskd turns itself off in
// a forked child (a DataLoader worker), where every call does nothing.
// Built without cgo, the command only says that it needs cgo.
//
// # Tests
//
// The tests build libtaskd.so into a temporary folder once per run, start a
// real manager on loopback, and run python3 processes that load the
// library through faultline_taskd, record ranges while the test flips the
// switch, and answer recovery requests; the files are then read back with
// trace.OpenRankReader. They skip when python3 or a C compiler is missing.
package main
