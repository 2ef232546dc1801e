// Command libtaskd is faultline's control plane and dotting for training
// processes written in Python or C. Built as a shared library,
//
//	go build -buildmode=c-shared -o libtaskd.so ./examples/libtaskd
//
// it exports a C ABI (declared in the generated libtaskd.h, a build output
// that is not kept in the repository), and faultline_taskd.py, beside this
// file, is a ctypes module (standard library only) offering MindCluster
// TaskD's Python names, so that a TaskD user changes one import:
//
//	from faultline_taskd import init_taskd_worker, start_taskd_worker, span
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
// The module finds the library through $FAULTLINE_LIBTASKD, else beside
// itself, else through the dynamic loader. Its names: init_taskd_worker,
// start_taskd_worker, destroy_taskd_worker, init_taskd_manager,
// start_taskd_manager, destroy_taskd_manager, init_taskd_proxy,
// destroy_taskd_proxy, set_profiling_switch, range_start, range_end, mark,
// span, flush, the register_*_callback functions, StepGate and last_error.
// The TaskD functions return True or False as MindCluster's do.
//
// # Worker
//
// taskd_init_worker(rank, disk_limit_mb, framework, options_json, &handle)
// builds a trace.Recorder writing <root>/<job>/<rank>/ (root default
// /user/cluster-info/profiling); ranges may be recorded from then on.
// taskd_start_worker connects a taskd.Worker to the node's proxy or the
// manager, opens the accelerator's profiling library when one loads
// (libmspti.so through package npu: its markers go to the recorder; without
// it, ranges come from taskd_range_start and taskd_range_end only) and, on
// the node's local rank 0, runs a trace.Ager that keeps the root within
// disk_limit_mb. Every profiling switch the manager fans out is applied to
// the recorder, then to the marker source, then to the trainer's
// profiling-switch callback; it takes effect within the manager's fan-out
// time, well under a second on a live connection. framework ("pt", "ms",
// ...) is accepted for MindCluster's signature and changes nothing.
//
// What the options leave out comes from the environment:
//
//	MINDX_TASK_ID          job id; else TORCHELASTIC_RUN_ID (torchrun's, the same
//	                       on every node); else one claimed once per launcher on
//	                       this node (trace.ResolveJob)
//	NODE_RANK, GROUP_RANK  node rank (default 0)
//	LOCAL_RANK             local rank: device id in records, ager on 0 (default: the rank)
//	TASKD_UPSTREAM         the node's proxy or the manager (default 127.0.0.1:9602 when a
//	                       credential is given; with neither, as under plain torchrun,
//	                       the worker dots into files and joins no control plane)
//	TASKD_TLS_DIR          ca.crt, tls.crt, tls.key for mutual TLS
//	TASKD_TOKEN            shared token
//	TASKD_INSECURE         1 allows plaintext
//	TASKD_PROFILING_ROOT   dotting root
//	TASKD_MARKER_LIBRARY   profiling library to load, or "off"
//	TASKD_LOG_LEVEL        debug, info, warn (default) or error; logs go to stderr
//
// Option keys (a JSON object, each optional): job, node, local_rank,
// device, upstream, tls_dir, token, token_file, insecure, root, ager
// ("auto", "on", "off"), marker_library, flush_interval ("5s"), switch (the
// profiling switch until the manager sends one), log_level. An unknown key,
// a value of the wrong type or a bad value is an error naming the key.
//
// Ranges: taskd_range_start(handle, name, domain) returns a positive id,
// 0 when the kind is switched off (nothing recorded; ending 0 does
// nothing), or a negative error code. Names in domain "default" are
// "step <n>", "forward", "dataloader" and "save_checkpoint"; domain
// "communication" takes a communication op as JSON. taskd_mark records an
// instant. At most 16384 ranges may be open at once.
//
// # Recovery callbacks
//
// taskd_register_callback(handle, TASKD_EVENT_*, fn, user) registers the
// trainer's side of the manager's orchestration (taskd.Trainer): pause,
// resume, stop, switch_link, strategies, retry_step and stress_test, plus
// profiling_switch. A worker started with any orchestration callback is a
// trainer: it begins paused, and its worker resumes it (step -1) once
// registered. Each callback gets the request as a JSON object, with
// "timeout_ms", the manager's deadline for it, added; it returns TASKD_OK
// with an optional JSON reply ({"step": n} for pause, a list of strategy
// names for strategies), TASKD_EUNSUPPORTED for what it cannot do
// (taskd.ErrUnsupported, so recovery takes its next strategy), or another
// code with its reason. A missing callback is unsupported; without a
// strategies callback the strategies offered are those the registered
// callbacks can carry out. Orchestration callbacks are registered before
// taskd_start_worker. In Python, StepGate gives a training loop its pause
// point and registers pause, resume and stop.
//
// # Manager and proxy
//
// taskd_init_manager(json, &handle) and taskd_start_manager run a job's
// taskd.Manager in the calling process; keys: job (or MindCluster's
// job_id), listen (":9601"), nodes (node_nums), procs_per_node
// (proc_per_node), tls_dir, token, token_file, insecure, admin_token or
// admin_token_file (default $TASKD_ADMIN_TOKEN: the operators' token, which
// the Admin and TrainingDataTrace services take, and nothing else),
// proxy_token or proxy_token_file (default $TASKD_PROXY_TOKEN: without it
// no proxy registers), state_dir, collect_dir,
// switch_file, heartbeat_interval, heartbeat_deadline, log_level.
// taskd_set_switch sets the job's profiling switch. taskd_init_proxy and
// taskd_start_proxy run a node's proxy; keys: job, node, upstream
// (default $TASKD_MANAGER_ADDR, else $MASTER_ADDR:9601), listen
// ("127.0.0.1:9602"), tls_dir, token, token_file, insecure,
// upstream_token or upstream_token_file (default $TASKD_PROXY_TOKEN: the
// proxies' token, presented to the manager), dotting_root, stack_root,
// log_level. taskd_addr copies the address one
// listens on.
//
// # Rules of the ABI
//
// Every function is thread-safe and returns TASKD_OK or a negative
// TASKD_E* code, the calling thread's taskd_last_error() saying why (as
// errno). Handles are integers; a destroyed or foreign handle gives
// TASKD_EHANDLE, never a crash. Strings are read during the call and
// copied when kept; no Go pointer is handed to C. Callbacks run on the
// library's threads through small C trampolines, never twice at once for
// one event; a ctypes callback takes the GIL itself. taskd_destroy stops
// what a handle runs and, for a worker, flushes and syncs its records.
// One Go runtime per process: load no other Go c-shared library beside
// this one.
//
// The Go runtime does not survive fork: faultline_taskd turns itself off in
// a forked child (a DataLoader worker), where every call does nothing.
// Built without cgo, the command only says that it needs cgo.
//
// # Tests
//
// The tests build libtaskd.so into a temporary folder once per run (or
// take $LIBTASKD_TEST_LIBRARY), start a real manager on loopback, and run
// python3 processes that load the library through faultline_taskd: one
// records step, forward and dataloader ranges while the test flips the
// switch, one is paused, resumed, switched and stopped by the manager, one
// runs manager, proxy and worker together, one takes markers from npu's
// fake libmspti. The files are read back with trace.OpenRankReader. They
// skip when python3 or a C compiler is missing. The first c-shared build
// compiles every dependency again in shared mode, which takes minutes on
// a cold build cache; later runs link in about 10 s.
package main
