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
// A step of a state_dict is the blob "meta" and data blobs "data0",
// "data1", ... in that order. "meta" is UTF-8 JSON (no NaN or Infinity
// literals):
//
//	{"format":"faultline.state/2","step":s,"tensors":[E,...],"tree":T}
//
// An entry E of "tensors" places tensor k (its index in the list) in a data
// blob: {"blob":"data0","off":o,"dtype":D,"shape":[d,...]} for a torch
// tensor, with D one of float64, float32, float16, bfloat16, int64, int32,
// int16, int8, uint8, bool, complex64, complex128; or
// {"blob":...,"off":o,"np":N,"shape":[...]} for a numpy array, with N
// numpy's dtype.str: a byte order (<, >, | or =), a kind (b bool, i int, u
// uint, f float, c complex, m timedelta64, M datetime64, S bytes, U UCS-4
// string) and a size ("<f8", "|b1", "<M8[ns]", "<U5": 5 characters, 20
// bytes). Its bytes are the item size times the dimensions, C order, from
// byte o of the blob; o is a multiple of 64, so that every tensor is
// aligned as its blob is, and the bytes between two tensors are zero. A
// writer fills each data blob in table order until the next tensor would
// end past max(64 MiB, total/16384) bytes, then starts the next: a
// tensor that large fills one alone, and no state reaches the 65536 blobs
// of a step (layout.MaxBlobs); a step over that is refused before it is
// written.
//
// A node of T is one JSON object with exactly one of these keys:
//
//	{"v":x}                      None, bool, int (any size), float, str
//	{"f":"inf"|"-inf"|"nan"}     a float JSON cannot hold
//	{"b":"<base64>"}             bytes; {"ba":"<base64>"} bytearray
//	{"c":[re,im]}                complex: re and im are v or f nodes
//	{"t":k}                      tensor k of the table: a tensor at several
//	                             key paths (tied weights) is one entry, and
//	                             loads as one tensor
//	{"d":[[key,T],...]}          dict, items in order; a str key is a JSON
//	                             string, any other key a node (v, f, b, c,
//	                             tu, fs, ns, dt, dev, sz)
//	{"od":[...],"md":T}          collections.OrderedDict; md, if present, is
//	                             its _metadata (module versions)
//	{"ctr":[...]}                collections.Counter
//	{"dd":[...],"factory":F}     collections.defaultdict; F null or one of
//	                             int, float, complex, str, bytes, bool, list,
//	                             tuple, dict, set, frozenset
//	{"l":[T,...]}                list; {"tu":[...]} tuple; {"set":[...]} set;
//	                             {"fs":[...]} frozenset
//	{"ns":N,"bytes":"<base64>"}  numpy scalar of dtype N: its bytes
//	{"sz":[d,...]}               torch.Size
//	{"dt":"float32"}             torch.dtype, by its name in torch
//	{"dev":"cuda:1"}             torch.device
//	{"fn":"module:qualname"}     a function of torch.optim.lr_scheduler (a
//	                             module function or one of a class): the
//	                             only module whose functions load by name
//	{"m":"module:qualname"}      such a function of a class C, bound: an
//	                             entry of a dict with str keys, the
//	                             state_dict of an object of C (OneCycleLR's
//	                             anneal_func); it loads bound to a new C,
//	                             made without __init__, whose attributes are
//	                             that dict's entries
//	{"wm":"module:qualname"}     the same in a weakref.WeakMethod (CyclicLR's
//	                             _scale_fn_ref), which holds its object
//	{"pickle":"<base64>"}        anything else, saved with allow_pickle=True:
//	                             a pickle (protocol 4) whose persistent ids
//	                             are table indices, for the tensors in it
//
// Nothing is unpickled on load unless the load passes allow_pickle=True;
// without, a pickle node is an error naming its key path. A save without
// allow_pickle refuses, with a TypeError naming the key path and before
// anything is written, what only a pickle holds; lambdas and local
// functions are refused even with it, as torch.save refuses them.
//
// faultline.state/1, written by earlier releases, is still loaded: meta
// {"format":"faultline.state/1","step":s,"tree":T} and a blob "t<k>" per
// tensor, its bytes alone; T has the nodes v, f, b, d, l and tu, int keys
// of d as {"i":n}, and tensor nodes {"t":k,"dtype":D,"shape":[...]}.
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
