"""faultline for PyTorch ranks: collective timers, parallel groups, stack
dumps and flash checkpoints into the node agent's shared memory.

    import torch.distributed as dist
    import faultline.torch as ft

    dist.init_process_group("gloo")
    resume = ft.init()          # -1: nothing agreed, load your own newest
    ckpt = ft.Checkpointer("/mnt/ckpt")
    state = ckpt.load_checkpoint()   # {} when there is none
    ...
    ckpt.save_checkpoint(step, {"model": model.state_dict(),
                                "optim": opt.state_dict()},
                         storage_type=ft.StorageType.DISK)

init() wraps every torch.distributed collective so that the agent's hang
watchdog sees when each starts and ends (and the ones that raise), gives
DistributedDataParallel a gradient hook that all-reduces each gradient on
its own (the summation order then does not depend on DDP's bucket rebuild,
so a resumed run is bitwise the run without the fault), tells the agent
the process groups (its parallel_group.json), and installs the stack dump.

A Checkpointer saves a state_dict (what a training loop's checkpoint
holds: model, optimizer, lr_scheduler, GradScaler, RNG states, config) as
the blobs of one step of the agent's segment: a JSON tree and the tensors'
bytes, copied straight into the mapping. Nothing is unpickled on load unless
asked, and loaded tensors are bitwise the saved ones, on the CPU.
"""

import atexit
import enum
import functools
import inspect
import json
import os
import threading
import warnings
import weakref

import torch
import torch.distributed as dist

import faultline
from faultline import _agent, _ring, _segment, _state

__all__ = ["init", "Checkpointer", "DdpCheckpointer", "StorageType",
           "label_group", "group_name"]

_DTYPES = {getattr(torch, n): n for n in _state.DTYPES}
_BY_NAME = {n: getattr(torch, n) for n in _state.DTYPES}
_ITEMSIZE = {dt: torch.empty(0, dtype=dt).element_size() for dt in _DTYPES}


# ---------------------------------------------------------------- groups

WORLD = "default_pg"

_labels = {}   # process group -> kind ("dp", "tp", ...)
_names = {}    # process group -> communicator name


def _c10d():
    return dist.distributed_c10d


def _world():
    try:
        return _c10d()._get_default_group()
    except (RuntimeError, ValueError, AttributeError):
        return None


def group_name(group=None):
    """The communicator name of a process group, as collective records and
    parallel_group.json give it: "default_pg" for the world group."""
    if group is None or group is _world():
        return WORLD
    try:
        return _names[group]
    except (KeyError, TypeError):
        pass
    c = _c10d()
    names = getattr(c, "_pg_names", None)
    if names is None:
        names = getattr(getattr(c, "_world", None), "pg_names", {})
    n = names.get(group) or f"pg_{len(_names)}"
    if n.isdigit():
        n = f"group_{n}"
    _names[group] = n
    return n


def label_group(group, kind):
    """Says which parallelism a process group serves ("tp", "pp", "dp",
    ...), as the analysis groups peers by it; the world group is "dp"
    unless labelled. Sends the groups to the agent again."""
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"faultline.torch.label_group: kind {kind!r}: want a "
                         "non-empty string such as 'tp' or 'dp'")
    _labels[group if group is not None else _world()] = kind
    _send_groups()


def _groups():
    """Every process group this rank belongs to, by communicator name."""
    if not dist.is_available() or not dist.is_initialized():
        return {}
    c = _c10d()
    ranks = getattr(c, "_pg_group_ranks", None)
    if ranks is None:
        ranks = getattr(getattr(c, "_world", None), "pg_group_ranks", {})
    world = _world()
    out = {}
    for pg, m in list(ranks.items()):
        if pg is None or pg is getattr(dist.GroupMember, "NON_GROUP_MEMBER",
                                       None):
            continue
        try:
            me = dist.get_rank(pg)
        except (RuntimeError, ValueError):
            continue
        if me < 0:
            continue
        members = [g for g, _ in sorted(m.items(), key=lambda kv: kv[1])]
        kind = _labels.get(pg, "dp" if pg is world else "group")
        out[group_name(pg)] = {"group_name": kind, "group_rank": me,
                               "global_ranks": members}
    return out


def _send_groups():
    c = _agent.client()
    g = _groups()
    if c is not None and g:
        c.call({"op": "groups", "groups": g})


# ----------------------------------------------------------- collectives

# torch.distributed function -> (opName, the parameter whose elements count)
_OPS = {
    "all_reduce": ("allreduce", "tensor"),
    "all_gather": ("allgather", "tensor"),
    "all_gather_into_tensor": ("allgather", "input_tensor"),
    "broadcast": ("broadcast", "tensor"),
    "reduce_scatter": ("reduce_scatter", "output"),
    "reduce_scatter_tensor": ("reduce_scatter", "output"),
    "reduce": ("reduce", "tensor"),
    "all_to_all": ("all_to_all", "input_tensor_list"),
    "all_to_all_single": ("all_to_all", "input"),
    "gather": ("gather", "tensor"),
    "scatter": ("scatter", "tensor"),
    "barrier": ("barrier", None),
    "send": ("send", "tensor"),
    "recv": ("recv", "tensor"),
    "isend": ("send", "tensor"),
    "irecv": ("recv", "tensor"),
}
_ALWAYS_ASYNC = ("isend", "irecv")

_inside = threading.local()   # .on: in a wrapped collective (no nesting)
_originals = {}               # name -> the unwrapped function
_install_lock = threading.Lock()


def _describe(x):
    """The element count and dtype name of a tensor or a list of them."""
    if isinstance(x, torch.Tensor):
        return x.numel(), str(x.dtype).replace("torch.", "")
    if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
        return sum(t.numel() for t in x), str(x[0].dtype).replace("torch.", "")
    return 0, ""


def _arg(args, kwargs, i, name):
    if name in kwargs:
        return kwargs[name]
    if i is not None and i < len(args):
        return args[i]
    return None


def _error_text(e):
    return f"{type(e).__name__}: {e}"


def _timed(work, rid):
    """Writes the end (or error) of an async collective when it completes."""
    def done(fut):
        try:
            fut.wait()
        except Exception as e:  # noqa: BLE001 (recorded, then seen by wait)
            _ring.collective_error(rid, _error_text(e))
        else:
            _ring.collective_end(rid)

    try:
        work.get_future().add_done_callback(done)
        return work
    except (RuntimeError, AttributeError):
        return _TimedWork(work, rid)  # a Work without a future


class _TimedWork:
    """A Work whose wait() (or is_completed() turning true) writes the end
    of its collective."""

    def __init__(self, work, rid):
        self._work, self._rid = work, rid

    def _done(self, err=None):
        rid, self._rid = self._rid, 0
        if rid and err is None:
            _ring.collective_end(rid)
        elif rid:
            _ring.collective_error(rid, _error_text(err))

    def wait(self, *args, **kwargs):
        try:
            r = self._work.wait(*args, **kwargs)
        except Exception as e:
            self._done(e)
            raise
        self._done()
        return r

    def is_completed(self):
        c = self._work.is_completed()
        if c:
            self._done()
        return c

    def __getattr__(self, name):
        return getattr(self._work, name)


def _wrap(name, fn):
    op, data = _OPS[name]
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    ig = params.index("group") if "group" in params else None
    ia = params.index("async_op") if "async_op" in params else None
    idata = params.index(data) if data in params else None
    always_async = name in _ALWAYS_ASYNC

    @functools.wraps(fn)
    def collective(*args, **kwargs):
        if getattr(_inside, "on", False) or not _ring.timing_collectives():
            return fn(*args, **kwargs)
        count, dtype = _describe(_arg(args, kwargs, idata, data))
        rec = _ring.collective(op, group_name(_arg(args, kwargs, ig, "group")),
                               count, dtype)
        rid = _ring.collective_start(rec, count)
        _inside.on = True
        try:
            work = fn(*args, **kwargs)
        except BaseException as e:
            _ring.collective_error(rid, _error_text(e))
            raise
        finally:
            _inside.on = False
        if work is not None and (always_async or _arg(args, kwargs, ia,
                                                      "async_op")):
            return _timed(work, rid)
        _ring.collective_end(rid)
        return work

    collective.__faultline_original__ = fn
    return collective


def _install_collectives():
    c = _c10d()
    for name in _OPS:
        fn = getattr(c, name, None)
        if fn is None or hasattr(fn, "__faultline_original__"):
            continue
        _originals[name] = fn
        w = _wrap(name, fn)
        setattr(c, name, w)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, w)
    new_group = getattr(c, "new_group", None)
    if new_group is not None and not hasattr(new_group,
                                             "__faultline_original__"):
        @functools.wraps(new_group)
        def wrapped(*args, **kwargs):
            g = new_group(*args, **kwargs)
            _send_groups()
            return g

        wrapped.__faultline_original__ = new_group
        c.new_group = wrapped
        if dist.new_group is new_group:
            dist.new_group = wrapped


# --------------------------------------------------------------- DDP hook

class _HookState:
    """The state of faultline's DDP hook: the process group, and the
    user's own hook when one is registered after ours."""

    __slots__ = ("group", "user", "__weakref__")

    def __init__(self, group):
        self.group, self.user = group, None


def _all_reduce_each(state, bucket):
    """DDP comm hook: averages the bucket's gradients, each with its own
    all_reduce, and times the bucket as one collective."""
    if state.user is not None:
        return _timed_user_hook(state, bucket)
    group = state.group
    n = dist.get_world_size(group)
    buf = bucket.buffer()
    rid = _ring.collective_start(
        _ring.collective("allreduce", group_name(group), buf.numel(),
                         str(buf.dtype).replace("torch.", "")), buf.numel())
    all_reduce = _originals.get("all_reduce", dist.all_reduce)
    futs = []
    for g in bucket.gradients():
        g.div_(n)
        futs.append(all_reduce(g, group=group, async_op=True).get_future())

    def done(fut):
        try:
            for f in fut.wait():
                f.wait()
        except Exception as e:
            _ring.collective_error(rid, _error_text(e))
            raise
        _ring.collective_end(rid)
        return buf

    return torch.futures.collect_all(futs).then(done)


def _timed_user_hook(state, bucket):
    user_state, hook = state.user
    buf = bucket.buffer()
    rid = _ring.collective_start(
        _ring.collective("allreduce", group_name(state.group), buf.numel(),
                         str(buf.dtype).replace("torch.", "")), buf.numel())
    _inside.on = True  # the hook's own collectives are this one
    try:
        fut = hook(user_state, bucket)
    except Exception as e:
        _ring.collective_error(rid, _error_text(e))
        raise
    finally:
        _inside.on = False

    def done(f):
        try:
            v = f.wait()
        except Exception as e:
            _ring.collective_error(rid, _error_text(e))
            raise
        _ring.collective_end(rid)
        return v

    return fut.then(done)


def _install_ddp_hook():
    DDP = torch.nn.parallel.DistributedDataParallel
    if hasattr(DDP.__init__, "__faultline_original__"):
        return
    init, register = DDP.__init__, DDP.register_comm_hook
    builtin = getattr(DDP, "_register_builtin_comm_hook", None)

    @functools.wraps(init)
    def ddp_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        state = _HookState(self.process_group)
        register(self, state, _all_reduce_each)
        self._faultline_hook = state

    @functools.wraps(register)
    def ddp_register(self, state, hook):
        ours = getattr(self, "_faultline_hook", None)
        if ours is None:
            return register(self, state, hook)
        if ours.user is not None:
            raise RuntimeError("register_comm_hook or "
                               "register_builtin_comm_hook can only be called "
                               "once")
        ours.user = (state, hook)  # the reducer keeps ours, which calls it
        return None

    ddp_init.__faultline_original__ = init
    DDP.__init__ = ddp_init
    DDP.register_comm_hook = ddp_register
    if builtin is not None:
        @functools.wraps(builtin)
        def ddp_builtin(self, comm_hook_type):
            ours = getattr(self, "_faultline_hook", None)
            if ours is None:
                return builtin(self, comm_hook_type)
            from torch.distributed.algorithms.ddp_comm_hooks import \
                default_hooks
            hooks = {"ALLREDUCE": default_hooks.allreduce_hook,
                     "FP16_COMPRESS": default_hooks.fp16_compress_hook}
            hook = hooks.get(getattr(comm_hook_type, "name", ""))
            if hook is None:
                raise ValueError(f"faultline: DDP builtin comm hook "
                                 f"{comm_hook_type!r} has no Python "
                                 "equivalent to run under faultline's hook")
            return ddp_register(self, self.process_group, hook)

        DDP._register_builtin_comm_hook = ddp_builtin


# ------------------------------------------------------------------ init

def init():
    """Registers this rank with its node agent, times every
    torch.distributed collective and DDP's gradient all-reduce, tells the
    agent the process groups and installs the stack dump. Call it after
    dist.init_process_group. Returns the step the job resumes from (-1:
    none agreed, load your own newest).

    Without FAULTLINE_AGENT it installs nothing, says once what that turns
    off, and returns FAULTLINE_RESUME_STEP (default -1).
    """
    resume = faultline.init()
    if _agent.client() is None:
        return resume
    with _install_lock:
        if dist.is_available():
            _install_collectives()
            _install_ddp_hook()
    if dist.is_available():
        _send_groups()
    return resume


# ----------------------------------------------------------- checkpoints

class StorageType(enum.Enum):
    """Where save_checkpoint puts a step: MEMORY (the agent's shared
    memory) or DISK (memory, and the agent persists it)."""

    MEMORY = "memory"
    DISK = "disk"


# Pinned staging per device-to-host copy, bytes (two such buffers).
_STAGE = 32 << 20

# The padding between tensors in a data blob.
_ZEROS = memoryview(bytes(_state.ALIGN))


def _check_tensor(t, path):
    name = _DTYPES.get(t.dtype)
    if (name is not None and t.layout == torch.strided and not t.is_meta
            and not getattr(t, "is_nested", False)):
        return name
    where = _state.path_str(path)
    if t.layout != torch.strided:
        raise TypeError(f"faultline: {where}: a {t.layout} tensor; a "
                        "checkpoint holds strided (dense) tensors")
    if t.is_quantized:
        raise TypeError(f"faultline: {where}: a quantized tensor "
                        f"({t.dtype}); a checkpoint holds "
                        f"{', '.join(_state.DTYPES)}")
    if getattr(t, "is_nested", False):
        raise TypeError(f"faultline: {where}: a nested tensor; a checkpoint "
                        "holds strided (dense) tensors")
    if t.device.type == "meta":
        raise TypeError(f"faultline: {where}: a tensor on the meta device "
                        "has no data to save")
    raise TypeError(f"faultline: {where}: dtype {t.dtype} cannot be "
                    "stored; a checkpoint holds "
                    f"{', '.join(_state.DTYPES)}")


def _chunked_copy(dst, src, bufs, copy_in, ready):
    """Copies the uint8 tensor src into dst through the staging buffers
    bufs, in turn: copy_in(buf, part) starts filling buf (asynchronously,
    from the device) and returns a token; ready(token) waits for it. While
    one buffer is copied out to dst, the other fills."""
    n, size = src.numel(), bufs[0].numel()
    pending = []
    for i, off in enumerate(range(0, n, size)):
        k = min(size, n - off)
        if len(pending) == len(bufs):
            tok, buf, o, m = pending.pop(0)
            ready(tok)
            dst[o:o + m].copy_(buf[:m])
        buf = bufs[i % len(bufs)]
        pending.append((copy_in(buf[:k], src[off:off + k]), buf, off, k))
    for tok, buf, o, m in pending:
        ready(tok)
        dst[o:o + m].copy_(buf[:m])


class Checkpointer:
    """Flash checkpoints of one rank's state_dict for checkpoint_dir, in the
    node agent's shared memory (which outlives the rank) and, on request,
    persisted by the agent to checkpoint_dir with DLRover's and Megatron's
    tracker files.

    It needs faultline-run's agent (FAULTLINE_AGENT): RuntimeError without.
    """

    def __init__(self, checkpoint_dir):
        self._client = _agent.require(
            "faultline.torch.Checkpointer",
            "the memory tier must outlive this process, which only the agent "
            "gives")
        self.checkpoint_dir = (os.path.abspath(os.fspath(checkpoint_dir))
                               if checkpoint_dir else "")
        self._seg = None
        self._persisted = None  # the newest step saved with DISK
        self._stages = {}       # device -> pinned staging buffers
        self._pending = None    # the save in flight (blocking=False)
        atexit.register(_wait_at_exit, weakref.ref(self))

    def save_checkpoint(self, step, state_dict,
                        storage_type=StorageType.MEMORY, blocking=True,
                        allow_pickle=False):
        """Saves state_dict as step; returns True when saved, False when
        skipped because the agent is reading the half this save would write
        (the previous step stays).

        With blocking=False the call returns as soon as the save began: its
        tensors are copied in a thread of their own, while training goes
        on, and the save becomes the newest step at the next call of this
        Checkpointer (or wait(), or when the process exits), provided no
        tensor of the state changed meanwhile: each tensor's version
        counter is read when the save begins and again then, so a tensor
        updated in place before its copy was done (an optimizer's step, a
        BatchNorm's running statistics) abandons the save instead of
        keeping a torn one. Save after optimizer.step() and it is done long
        before the next one in any but the tiniest model. True then means
        the save began. (numpy arrays, which have no version counter, are
        copied when such a save begins.)

        What a state may hold without pickle is an allow-list, as
        torch.load(weights_only=True) has one: tensors, numpy arrays and
        scalars, dicts (OrderedDict with its _metadata, Counter,
        defaultdict), lists, tuples, sets, plain values, torch.Size, dtype
        and device, and the state_dict of every torch.optim.lr_scheduler
        (its methods by name). Anything else is a TypeError naming the key
        path, raised before anything is written, unless allow_pickle=True:
        then it is pickled, and load_checkpoint loads it only with
        allow_pickle=True. Lambdas and local functions cannot be saved at
        all, as with torch.save. A state larger than the segment makes the
        agent grow it first.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"faultline: save_checkpoint: step {step!r}: "
                             "want a non-negative int")
        if not isinstance(storage_type, StorageType):
            raise ValueError(f"faultline: save_checkpoint: storage_type "
                             f"{storage_type!r}: want StorageType.MEMORY or "
                             "StorageType.DISK")
        self.wait()
        tree, entries, items, nbytes = _state.flatten(
            state_dict, _check_tensor, allow_pickle)
        blobs, places = _state.pack(nbytes)
        names = ["meta"] + [f"data{b}" for b in range(len(blobs))]
        data = [[] for _ in blobs]  # per data blob: (offset, item)
        for k, (e, (b, off)) in enumerate(zip(entries, places)):
            e["blob"], e["off"] = names[b + 1], off
            data[b].append((off, k))
            if not blocking and not isinstance(items[k], torch.Tensor):
                items[k] = items[k].copy()  # numpy: no version counter
        meta = json.dumps({"format": _state.FORMAT, "step": step,
                           "tensors": entries, "tree": tree},
                          separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False).encode()
        sizes = [len(meta)] + blobs
        if len(names) > _state.MAX_BLOBS:
            raise ValueError(f"faultline: save_checkpoint: {len(names)} blobs "
                             f"exceed the {_state.MAX_BLOBS} of a step")
        need = _segment.step_size(names, sizes)
        persist = storage_type is StorageType.DISK
        seg = self._segment(need)

        def write(i, off):
            if i == 0:
                seg.mv[off:off + len(meta)] = meta
                return
            end = off
            for o, k in data[i - 1]:
                o += off
                if o > end:  # alignment: zeros, not what was there before
                    seg.mv[end:o] = _ZEROS[:o - end]
                x, n = items[k], nbytes[k]
                end = o + n
                if n == 0:
                    continue
                dst = seg.tensor[o:end]
                if not isinstance(x, torch.Tensor):
                    dst = dst.numpy().view(x.dtype).reshape(x.shape)
                    dst[...] = x
                elif x.device.type == "cpu":
                    dst.view(x.dtype).view(x.shape).copy_(x)
                else:
                    self._from_device(dst, x)

        tensors = [x for x in items if isinstance(x, torch.Tensor)]
        with faultline.span("save_checkpoint"), torch.no_grad():
            save = seg.save if blocking else seg.begin
            args = (step, names, sizes, write, persist) if blocking else \
                (step, names, sizes)
            try:
                done = save(*args)
            except _segment.TooSmall:
                # Replaced meanwhile by a segment still too small: ask.
                seg = self._segment(need, grow=True)
                save = seg.save if blocking else seg.begin
                done = save(*args)
            if done is None:
                return False
            if not blocking:
                self._pending = _AsyncSave(done, write, tensors, persist)
                return True
        self._saved(step, persist)
        return True

    def wait(self):
        """Ends the save in flight of save_checkpoint(..., blocking=False):
        waits for its copy, then keeps it as the newest step when no tensor
        of its state changed since it began, and abandons it otherwise.
        Returns True when it was kept, False when abandoned, None when no
        save was in flight."""
        a, self._pending = self._pending, None
        if a is None:
            return None
        kept = a.end()
        if kept:
            self._saved(a.pending.step, a.persist)
        return kept

    def _saved(self, step, persist):
        self._client.call({"op": "saved", "step": step, "persist": persist})
        if persist:
            self._persisted = step

    def load_checkpoint(self, into=None, allow_pickle=False):
        """Returns the newest state_dict the agent agrees on for this rank
        (the job's resume step, else this rank's newest intact one), with
        tensors on the CPU, bitwise the saved ones; {} when there is none.
        A tensor saved at several key paths (tied weights) is one tensor at
        all of them.

        into, a state of the same shape ({"model": model.state_dict(),
        ...}), has each saved tensor copied into the tensor at its key path
        when that one is a contiguous CPU tensor of the same dtype and shape
        (a model's parameters and buffers take the step in place, with one
        copy); the state returned holds those tensors, and new ones where
        into has none to take it. Nothing is copied into it when the load
        fails.

        Nothing is unpickled unless allow_pickle=True: a step that holds
        what save_checkpoint pickled (allow_pickle=True there) raises
        pickle.UnpicklingError naming its key path otherwise. Pass it only
        for checkpoints you trust, as with torch.load(weights_only=False).
        """
        self.wait()
        resp = self._client.call({"op": "load", "dir": self.checkpoint_dir},
                                 timeout=600)
        if resp.get("tier") in (None, "", "none") or resp.get("step", -1) < 0:
            return {}
        seg = self._map(resp.get("path"))
        half = resp.get("half")
        if half not in (0, 1):
            raise _agent.AgentError(f"faultline agent: op load: half {half!r}"
                                    ": want 0 or 1")
        h = seg.read(half)
        if h.step != resp["step"]:
            raise _agent.AgentError(
                f"faultline agent: op load: step {resp['step']} but half "
                f"{half} of {seg.path} holds step {h.step}")
        state = self._decode(seg, h, into, allow_pickle)
        if not seg.unchanged(h):
            raise RuntimeError(f"faultline: the step in half {half} of "
                               f"{seg.path} was overwritten while it loaded")
        return state

    def wait_latest_checkpoint(self, timeout=600):
        """Waits until the newest save with StorageType.DISK is committed on
        disk; True when it is (or there was none), False after timeout
        seconds or when the agent reports it failed (with a warning that
        says why)."""
        self.wait()
        if self._persisted is None:
            return True
        try:
            self._client.call({"op": "wait", "step": self._persisted,
                               "timeout_s": timeout}, timeout=timeout + 30)
        except _agent.AgentError as e:
            warnings.warn(str(e), RuntimeWarning, stacklevel=2)
            return False
        return True

    def _segment(self, need, grow=False):
        """The segment, with halves of at least need bytes: the agent
        creates or grows it when asked."""
        seg = self._seg
        if seg is not None and not seg.current():
            seg.remap()  # grown under its name
        if seg is not None and seg.half_size >= need and not grow:
            return seg
        resp = self._client.call({"op": "segment",
                                  "dir": self.checkpoint_dir,
                                  "bytes": need + need // 16})
        seg = self._map(resp.get("path"))
        if seg.half_size < need:
            raise _agent.AgentError(
                f"faultline agent: op segment: {seg.path} has halves of "
                f"{seg.half_size} bytes, fewer than the {need} asked for")
        return seg

    def _map(self, path):
        """The segment at path, mapped once and again only when the path
        names another file."""
        if not isinstance(path, str) or not path:
            raise _agent.AgentError(f"faultline agent: segment path {path!r} "
                                    "is not a path")
        seg = self._seg
        if seg is not None and seg.path == path:
            if not seg.current():
                seg.remap()
            return seg
        if seg is not None:
            seg.close()
            self._seg = None
        self._seg = _segment.Segment(
            path, lambda mm: torch.frombuffer(mm, dtype=torch.uint8))
        return self._seg

    def _decode(self, seg, h, into=None, allow_pickle=False):
        meta = h.blobs.get("meta")
        where = f"blob 'meta' of half {h.index} of {seg.path}"
        if meta is None:
            raise ValueError(f"faultline: half {h.index} of {seg.path} has no "
                             "blob 'meta': not a state_dict checkpoint")
        off, size = meta
        try:
            doc = json.loads(bytes(seg.mv[off:off + size]))
        except (ValueError, RecursionError) as e:
            raise ValueError(f"faultline: {where}: {e}") from None
        fmt = doc.get("format") if isinstance(doc, dict) else None
        if fmt not in (_state.FORMAT, _state.FORMAT_V1):
            raise ValueError(f"faultline: {where}: format is {fmt!r}, not "
                             f"{_state.FORMAT} or {_state.FORMAT_V1}")
        table = doc.get("tensors") if fmt == _state.FORMAT else None
        if fmt == _state.FORMAT and not isinstance(table, list):
            raise ValueError(f"faultline: {where}: tensors is not a list")
        u8 = seg.tensor
        loaded = {}   # k -> the tensor (or array) the state holds
        copies = {}   # (k, into tensor's address) -> (into tensor, source)

        def source(k, path, node):
            """Tensor or array k as the segment holds it (a view)."""
            if table is None:  # FORMAT_V1: one blob "t<k>" per tensor
                e = {"blob": f"t{k}", "off": 0, "dtype": node.get("dtype"),
                     "shape": node.get("shape")}
            elif 0 <= k < len(table):
                e = table[k]
            else:
                raise _state.TreeError(
                    f"faultline: {where}: {_state.path_str(path or [])}: "
                    f"tensor {k} of a table of {len(table)}")
            name, o, dtype, shape, n = _state.entry(e, k)
            blob = h.blobs.get(name)
            torch_dtype = _BY_NAME.get(dtype) if type(dtype) is str else None
            item = _ITEMSIZE[torch_dtype] if torch_dtype is not None else 1
            if blob is None or o + n > blob[1] or (blob[0] + o) % item:
                raise ValueError(
                    f"faultline: {_state.path_str(path or [])}: tensor {k} "
                    f"({dtype} {shape}) at offset {o} of blob {name!r} of "
                    f"half {h.index} of {seg.path}, which is "
                    f"{'missing' if blob is None else f'{blob[1]} bytes'}")
            part = u8[blob[0] + o:blob[0] + o + n]
            if torch_dtype is not None:
                return part.view(torch_dtype).view(shape)
            return part.numpy().view(dtype).reshape(shape)

        def tensor(k, path, node):
            src = source(k, path, node)
            dst = _at(into, path) if path is not None else None
            if (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)
                    and dst.device.type == "cpu" and dst.dtype == src.dtype
                    and dst.shape == src.shape and dst.is_contiguous()):
                if src.numel():
                    copies[(k, dst.data_ptr())] = (dst, src)
                loaded.setdefault(k, dst)
                return dst
            x = loaded.get(k)
            if x is None:
                # clone of a typed view: a new tensor, copied at memcpy speed.
                x = loaded[k] = src.clone() if isinstance(
                    src, torch.Tensor) else src.copy()
            return x

        state = _state.unflatten(doc.get("tree"), tensor,
                                 2 if table is not None else 1, allow_pickle)
        # Only now, with the whole step decoded, into takes its tensors.
        with torch.no_grad():
            for dst, src in copies.values():
                dst.copy_(src)
        return state

    def _from_device(self, dst, t):
        """Device to host through pinned staging, two buffers in turn."""
        src = t.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        src = src.reshape(-1).view(torch.uint8)
        bufs = self._stages.get(t.device)
        if bufs is None:
            bufs = [torch.empty(_STAGE, dtype=torch.uint8, pin_memory=True)
                    for _ in range(2)]
            self._stages[t.device] = bufs
        stream = torch.cuda.current_stream(t.device)

        def copy_in(buf, part):
            buf.copy_(part, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            return ev

        _chunked_copy(dst, src, bufs, copy_in, lambda ev: ev.synchronize())


def _at(tree, path):
    """The value at path (keys and indices) in tree, None when there is
    none."""
    for k in path:
        try:
            tree = tree[k]
        except (KeyError, IndexError, TypeError):
            return None
    return tree


class _AsyncSave:
    """A save whose tensors a thread of its own copies into the segment
    (Checkpointer.save_checkpoint with blocking=False)."""

    def __init__(self, pending, write, tensors, persist):
        self.pending, self.tensors, self.persist = pending, tensors, persist
        self.versions = [t._version for t in tensors]
        self.error = None
        self.thread = threading.Thread(target=self._copy, args=(write,),
                                       name="faultline-save", daemon=True)
        self.thread.start()

    def _copy(self, write):
        p = self.pending
        try:
            with torch.no_grad():
                for i, off in enumerate(p.offsets):
                    write(i, p.base + off)
        except BaseException as e:  # reported when the save ends
            self.error = e

    def end(self):
        """Waits for the copy; finishes the save when no tensor changed
        since it began (the caller's thread runs no kernel now, so a change
        made during the copy shows in the version counters), else abandons
        it. Returns whether it was kept."""
        self.thread.join()
        changed = [i for i, (t, v) in enumerate(zip(self.tensors,
                                                    self.versions))
                   if t._version != v]
        if self.error is not None or changed:
            self.pending.abort()
            if self.error is not None:
                warnings.warn(f"faultline: the save of step "
                              f"{self.pending.step} failed and was "
                              f"abandoned: {self.error}", RuntimeWarning)
            return False
        self.pending.finish(self.persist)
        return True


def _wait_at_exit(ref):
    c = ref()
    if c is not None and c._pending is not None:
        try:
            c.wait()
        except Exception as e:  # the agent may be gone as the process exits
            warnings.warn(f"faultline: the save in flight at exit: {e}",
                          RuntimeWarning)


DdpCheckpointer = Checkpointer
