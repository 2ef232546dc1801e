// Package python embeds faultline's Python package, the side of Faultline
// inside a PyTorch rank, so that a launcher can put it on its ranks'
// PYTHONPATH without the user installing anything:
//
//	dir, err := python.Extract(filepath.Join(os.TempDir(), "faultline"))
//	if err != nil {
//		return err
//	}
//	cmd.Env = append(cmd.Env, "PYTHONPATH="+dir)
//
// Package holds the source; Extract writes it once per content into a
// folder of its own and returns it. The package needs the Python standard
// library only (torch is imported by faultline.torch alone); python/ in
// the repository is also a pip-installable project (pyproject.toml).
//
// # What the package does in a rank
//
//   - faultline.span(name), faultline.step(n), faultline.mark(name) and
//     faultline.comm_span(...) dot the phases of a step into the rank's
//     dotting ring, which the node agent drains (agent.Ring) into trace
//     files, per domain as the ring's switch says (MindCluster's rule). A
//     range's two records are written together when it ends. A
//     communication name that is not a CommOp is refused with a ValueError
//     naming its keys; a full ring or too many open ranges (1024 per thread)
//     drops and counts, and never raises in the loop.
//   - faultline.torch.init() registers the rank with the agent (op hello),
//     wraps every torch.distributed collective with collective records for
//     the hang watchdog, gives DistributedDataParallel a gradient hook that
//     all-reduces and times each of DDP's buckets and reduces a process's
//     first step in the buckets DDP rebuilds after it, as every later step
//     (bitwise-deterministic resumes, at DDP's speed),
//     sends the process groups (op groups, the rank's parallel_group.json)
//     and registers faulthandler on FAULTLINE_STACK_SIGNAL, appending to
//     FAULTLINE_STACK_FILE.
//   - faultline.torch.Checkpointer saves state_dicts into the agent's
//     checkpoint segment, in the FORMAT of package ckpt (layout version 2,
//     unsealed: only meta_crc, the agent seals), holding the segment's
//     shared flock and mapping anew one grown under its name, and loads
//     them back.
//   - faultline.admin reads the manager's Admin API; faultline.spare is a
//     warm interpreter that has imported torch and waits for a rank.
//
// Without FAULTLINE_AGENT the package works alone: span is off unless
// FAULTLINE_RING names a ring, init() warns once and installs nothing, and
// Checkpointer raises RuntimeError naming FAULTLINE_AGENT.
//
// # The agent socket
//
// FAULTLINE_AGENT names a unix stream socket. The rank sends one JSON
// object per line and reads one answer per line, in order, on one
// connection per process; every answer has "ok" and, when false, "error".
// The ops: hello {rank, pid} → {job, world, resume_step, restart_count,
// collective_timeout_s, stack_signal}; groups {groups}; segment {dir,
// bytes} → {path, half_size}; saved {step, persist}; wait {step,
// timeout_s} → {step}; load {dir} → {step, tier, path, half, reasons};
// admin {what} → {result}; spare {pid, local_rank} → {env, argv, module,
// cwd}, answered only when the agent hands the spare a rank.
//
// # Checkpoints
//
// A step of a state_dict is the blob "meta", UTF-8 JSON
// {"format":"faultline.state/1","step":s,"tree":T}, and a blob "t<k>" per
// tensor: its bytes, C-contiguous. A node of T is {"d":[[key,T],...]}
// (int keys as {"i":n}), {"l":[...]}, {"tu":[...]}, {"t":k,"dtype":...,
// "shape":[...]}, {"v":x}, {"f":"inf"|"-inf"|"nan"} or {"b":"<base64>"}.
// Stored dtypes: float64, float32, float16, bfloat16, int64, int32, int16,
// int8, uint8, bool, complex64, complex128. Nothing is unpickled on load.
//
// # Tests and benchmarks
//
// The tests run the Python unit tests (python/tests) with /usr/bin/python3
// against the extracted package and, across the languages, save a
// state_dict from Python into a segment of a ckpt.Owner, seal and load it
// here and load it back bitwise in Python. They skip, saying so, without
// /usr/bin/python3 or torch (Debian: python3-torch).
//
// BenchmarkSpan times `with faultline.span("forward")` with the switch on
// and off beside a time.perf_counter_ns() pair (x-pair-on, x-pair-off),
// and BenchmarkCheckpoint a save and a load beside tensor.copy_ of the
// same bytes into preallocated shared-memory tensors (x-copy-save) and out
// of them into new tensors (x-copy-load) or preallocated ones
// (x-prealloc-load), and beside torch.save to a file, without and with
// fsync (x-torchsave, x-torchsave-fsync). FAULTLINE_PY_BENCH_MIB sizes the
// state (default 64; 1024 for the targets).
package python
