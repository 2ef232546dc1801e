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
DistributedDataParallel a gradient hook that all-reduces and times each of
DDP's buckets, and reduces a process's first step in the buckets DDP
rebuilds after it, as every later one (each gradient is then summed in one
order at every step, so a resumed run is bitwise the run without the
fault), tells the agent the process groups (its parallel_group.json), and
installs the stack dump.

A Checkpointer saves a state_dict (what a training loop's checkpoint
holds: model, optimizer, lr_scheduler, GradScaler, RNG states, config) as
the blobs of one step of the agent's segment: a JSON tree and the tensors'
bytes, copied straight into the mapping. Nothing is unpickled on load unless
asked, and loaded tensors are bitwise the saved ones, on the CPU.
"""

import atexit
import contextlib
import enum
import functools
import inspect
import itertools
import json
import os
import sys
import threading
import time
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

# By weak references: a destroyed group's threads end with it.
_labels = weakref.WeakKeyDictionary()  # process group -> "dp", "tp", ...
_names = weakref.WeakKeyDictionary()   # process group -> communicator name
_unnamed = itertools.count()


def _c10d():
    return dist.distributed_c10d


def _non_member():
    """What new_group gives a rank that is not in the group (torch 1.13: a
    plain object)."""
    return getattr(dist.GroupMember, "NON_GROUP_MEMBER", None)


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
    if group is _non_member():  # None is the world, above
        return "non_group_member"
    try:
        return _names[group]
    except (KeyError, TypeError):
        pass
    c = _c10d()
    names = getattr(c, "_pg_names", None)
    if names is None:
        names = getattr(getattr(c, "_world", None), "pg_names", {})
    n = names.get(group) or f"pg_{next(_unnamed)}"
    if n.isdigit():
        n = f"group_{n}"
    try:
        _names[group] = n
    except TypeError:  # not a process group torch made
        pass
    return n


def label_group(group, kind):
    """Says which parallelism a process group serves ("tp", "pp", "dp",
    ...), as the analysis groups peers by it; the world group is "dp"
    unless labelled. Sends the groups to the agent again; on a rank that is
    not in the group it does nothing."""
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"faultline.torch.label_group: kind {kind!r}: want a "
                         "non-empty string such as 'tp' or 'dp'")
    if group is not None and group is _non_member():
        return  # this rank is none of the group's
    g = group if group is not None else _world()
    if g is None:
        raise RuntimeError("faultline.torch.label_group: torch.distributed "
                           "is not initialised: no world group to label")
    try:
        _labels[g] = kind
    except TypeError:
        raise TypeError(f"faultline.torch.label_group: group {group!r}: want "
                        "a process group") from None
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
        if pg is None or pg is _non_member():
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


# A thread of torch's that asks for the GIL once the interpreter is
# finalizing aborts the process ("terminate called without an active
# exception"): gloo's, as it runs or drops faultline's callback on a
# future that completed (the main thread went on at once: the last step of
# a DDP job, then its exit), or as it retires a collective and frees a
# tensor the main thread let go of (a tensor of Python's). At exit, while
# the interpreter is whole, _threads_at_exit waits for faultline's
# callbacks and, briefly, for threads that are ready to run. Callbacks of
# the user's own are not tracked, nor work started by atexit handlers that
# run after this one (those registered before faultline.torch was
# imported).
#
# _held: the futures faultline attached a callback to, by a weak reference
# to the callback, until torch lets go of it.
_held = {}
_initialised = False  # init() ran: torch.distributed in use
os.register_at_fork(after_in_child=_held.clear)  # no thread of torch's there


def _release(ref):
    _held.pop(ref, None)


def _track(fut, fn):
    _held[weakref.ref(fn, _release)] = fut


def _then(fut, fn):
    """fut.then(fn), fn tracked until torch lets go of it (_held)."""
    child = fut.then(fn)
    _track(fut, fn)
    return child


def _on_done(fut, fn):
    """fut.add_done_callback(fn), fn tracked as _then tracks it."""
    fut.add_done_callback(fn)
    _track(fut, fn)


def _runnable_threads():
    """How many of this process's other threads are running or ready to
    run (Linux: /proc/self/task); 0 where that cannot be read."""
    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0
    n = 0
    for t in tids:
        if t == str(me):
            continue
        try:
            with open(f"/proc/self/task/{t}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # ended
            continue
        if stat[stat.rindex(b")") + 2:][:1] == b"R":  # the state, after comm
            n += 1
    return n


@atexit.register
def _threads_at_exit(timeout=30.0, settle=2.0):
    """Waits for torch's threads to run and let go of faultline's callbacks:
    as long as a collective is in flight (its process group, freed as the
    interpreter finalizes, would wait for it then; the group's timeout
    bounds it), timeout seconds for callbacks of collectives that
    completed. Then, in a process that used torch.distributed, at most
    settle seconds until no other thread is ready to run: one preempted as
    it retired a collective."""
    deadline = time.monotonic() + timeout
    while _held:
        if not all(f.done() for f in list(_held.values())):
            deadline = time.monotonic() + timeout
        elif time.monotonic() > deadline:
            warnings.warn(f"faultline: {len(_held)} callbacks on collectives "
                          f"not let go of {timeout:g} s after they completed, "
                          "at exit: the process may abort as it finalizes",
                          RuntimeWarning)
            break
        time.sleep(0.001)  # lets a thread of torch's take the GIL
    if not (_initialised or dist.is_available() and dist.is_initialized()):
        return
    # Twice in a row: a thread that waits for the GIL, which this one holds
    # as it reads /proc, sleeps; it takes the GIL in the next sleep.
    deadline, quiet = time.monotonic() + settle, 0
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(0.002)  # the GIL and the CPU to whoever waits for them
        quiet = 0 if _runnable_threads() else quiet + 1


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
        _on_done(work.get_future(), done)
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


@contextlib.contextmanager
def _untimed():
    """Runs the collectives within untimed: the agreement of a load, where
    a rank waits for its peers' loads (a restore from disk may take
    minutes), which the agent bounds itself, is no collective that hangs."""
    was = getattr(_inside, "on", False)
    _inside.on = True
    try:
        yield
    finally:
        _inside.on = was


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
    """The state of faultline's DDP comm hook on one DistributedDataParallel:
    its process group, the user's own hook when one is registered after
    ours, and, until DDP has rebuilt its buckets, what it takes to reduce
    each step in the layout of the rebuild.

    DDP (torch 1.13) reduces a process's first iteration in one bucket of
    its parameters in their order, then rebuilds its buckets from the order
    in which their gradients became ready, rank 0's (only
    find_unused_parameters without a static graph keeps its first buckets).
    With gloo's ring all-reduce an element's summation order across ranks
    depends on its place in the bucket, so a rank restarted at step k would
    reduce step k otherwise than the run without the fault. Until the
    rebuild, the hook therefore holds the iteration's buckets and, at its
    last, all-reduces the gradients in the layout that the rebuild makes
    from the order they became ready in this very iteration: every step of
    every process is reduced in the same buckets, and nothing has to
    outlive a restart. Once a step went through DDP's rebuilt buckets, each
    found to be one of the layout's, the hook reduces each bucket as it
    comes, as DDP does.
    """

    __slots__ = ("group", "name", "world", "src", "user", "ddp", "params",
                 "index", "sparse", "caps", "ready", "handles", "layout",
                 "held", "clean", "steady", "warned", "__weakref__")

    def __init__(self, ddp):
        self.group = ddp.process_group
        self.name = group_name(self.group)
        self.world = dist.get_world_size(self.group)
        self.src = (0 if self.group is _world()
                    else dist.distributed_c10d.get_global_rank(self.group, 0))
        self.user = None
        self.ddp = weakref.ref(ddp)
        # The reducer's parameters, in its order, and its bucket caps.
        self.params, self.sparse = ddp._build_params_for_reducer()
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.caps = [dist._DEFAULT_FIRST_BUCKET_BYTES, ddp.bucket_bytes_cap]
        self.layout = None   # the rebuild's buckets: tuples of indices
        self.held = []       # the iteration's buckets held for the layout
        self.clean = True    # no bucket of this iteration was held
        self.steady = False  # each bucket is reduced as it comes
        self.warned = False
        # When each gradient was last ready, by parameter: the order in
        # which the reducer sees them, as a tensor hook runs just before
        # the AccumulateGrad node that runs the reducer's hook.
        self.ready, tick = {}, itertools.count()
        self.handles = [p.register_hook(functools.partial(_ready, self.ready,
                                                          tick, i))
                        for i, p in enumerate(self.params)]

    def settle(self):
        """From now on each bucket is reduced as it comes."""
        self.steady = True
        self.unhook()
        self.params = self.index = self.sparse = None

    def unhook(self):
        for h in self.handles:
            h.remove()
        self.handles = []
        self.ready.clear()

    def in_layout(self, bucket):
        """None when bucket is one of the layout's, to be reduced now; else
        the future of the bucket held until the iteration's last."""
        ddp = self.ddp()
        if ddp is None or (self.layout is None and not (
                ddp.static_graph or not ddp.find_unused_parameters)):
            self.settle()  # DDP keeps the buckets it began with
            return None
        if bucket.index() == 0:
            self.clean, self.held = True, []
        idx = tuple(self.index[id(p)] for p in bucket.parameters())
        if self.layout is not None and idx in self.layout:
            fut = None
        else:
            self.clean = False
            fut = torch.futures.Future()
            self.held.append((bucket.buffer(), idx, bucket.gradients(), fut))
        if bucket.is_last():
            if self.held:
                self.reduce_held()
            if ddp._has_rebuilt_buckets:
                if self.clean:
                    self.settle()
                elif not self.warned:
                    self.warned = True
                    warnings.warn(
                        "faultline: DDP rebuilt its gradient buckets "
                        "otherwise than faultline derived them; each step is "
                        "still reduced in faultline's layout, so that resumes "
                        "stay bitwise, but no longer while backward runs",
                        RuntimeWarning)
        return fut

    def derive(self):
        """The buckets that DDP's rebuild makes from the order in which this
        iteration's gradients became ready (rank 0's, as the rebuild takes
        rank 0's)."""
        order = sorted(self.ready, key=self.ready.get)
        # A static graph's rebuild puts its unused parameters last.
        order += [i for i in range(len(self.params)) if i not in self.ready]
        if self.world > 1:
            t = torch.tensor(order, dtype=torch.int64,
                             device=self.params[0].device)  # NCCL's too
            dist.broadcast(t, src=self.src, group=self.group)
            order = t.tolist()
        small_last = os.environ.get("DDP_SET_LAST_BUCKET_CAP") == "1"
        if small_last:
            order.reverse()
        buckets = dist._compute_bucket_assignment_by_size(
            [self.params[i] for i in order], self.caps, self.sparse, order)
        if isinstance(buckets, tuple):  # with each bucket's size limit
            buckets = buckets[0]
        if small_last:
            buckets.reverse()
        return [tuple(b) for b in buckets]

    def reduce_held(self):
        """All-reduces the held buckets' gradients in the layout's buckets
        and then completes the held futures."""
        held, self.held = self.held, []
        if self.layout is None:
            self.layout = self.derive()
            self.unhook()
        grads, futs = {}, []
        for buf, idx, views, _ in held:
            if buf.is_sparse:  # alone in a bucket, whatever the layout
                futs.append(_all_reduce(self.group, self.name,
                                        buf.div_(self.world)))
            else:
                grads.update(zip(idx, views))
        flats = []
        for b in self.layout:
            if b[0] in grads:  # else reduced already, as a bucket of its own
                flat = torch.cat([grads[i].reshape(-1) for i in b])
                flats.append((b, flat))
                futs.append(_all_reduce(self.group, self.name,
                                        flat.div_(self.world)))

        def done(fut):
            try:
                for f in fut.wait():
                    f.wait()
                for b, flat in flats:
                    off = 0
                    for i in b:
                        g = grads[i]
                        g.copy_(flat[off:off + g.numel()].view_as(g))
                        off += g.numel()
            except Exception as e:  # noqa: BLE001 (DDP's wait raises it)
                # Without its traceback: the futures would hold this frame,
                # and with it done, in a cycle through torch that no
                # collection breaks.
                e = e.with_traceback(None)
                for _, _, _, f in held:
                    f.set_exception(e)
                return
            for buf, _, _, f in held:
                f.set_result(buf)

        _on_done(torch.futures.collect_all(futs), done)


def _ready(ready, tick, i, grad):
    ready[i] = next(tick)


def _all_reduce(group, name, t):
    """All-reduces t asynchronously, timed as one collective; returns the
    future of t reduced."""
    rid = _ring.collective_start(
        _ring.collective("allreduce", name, t.numel(),
                         str(t.dtype).replace("torch.", "")), t.numel())
    try:
        work = _originals.get("all_reduce", dist.all_reduce)(
            t, group=group, async_op=True)
    except Exception as e:
        _ring.collective_error(rid, _error_text(e))
        raise

    def done(fut):
        try:
            fut.wait()
        except Exception as e:
            _ring.collective_error(rid, _error_text(e))
            raise
        _ring.collective_end(rid)
        return t

    return _then(work.get_future(), done)


def _all_reduce_bucket(state, bucket):
    """DDP comm hook: averages the bucket with one all_reduce, timed as one
    collective, in the layout of DDP's rebuilt buckets from the first step
    of the process on (_HookState)."""
    if state.user is not None:
        return _timed_user_hook(state, bucket)
    if not state.steady:
        fut = state.in_layout(bucket)
        if fut is not None:
            return fut
    return _all_reduce(state.group, state.name,
                       bucket.buffer().div_(state.world))


def _timed_user_hook(state, bucket):
    user_state, hook = state.user
    buf = bucket.buffer()
    rid = _ring.collective_start(
        _ring.collective("allreduce", state.name, buf.numel(),
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

    return _then(fut, done)


def _install_ddp_hook():
    DDP = torch.nn.parallel.DistributedDataParallel
    if hasattr(DDP.__init__, "__faultline_original__"):
        return
    init, register = DDP.__init__, DDP.register_comm_hook
    builtin = getattr(DDP, "_register_builtin_comm_hook", None)

    @functools.wraps(init)
    def ddp_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        state = _HookState(self)
        register(self, state, _all_reduce_bucket)
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
        ours.settle()
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
    global _initialised
    _initialised = True
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


# Whether this process has loaded a checkpoint: its first load is the
# step the job resumes from; later ones agree on the newest.
_loaded = False

# Pinned staging per device-to-host copy, bytes (two such buffers).
_STAGE = 32 << 20

# The padding between tensors in a data blob.
_ZEROS = memoryview(bytes(_state.ALIGN))
# A save with blocking=False copies tensors up to this size before it
# returns, and the larger ones in the background.
_SYNC_BYTES = 64 << 10


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
        # The save in flight and the newest step saved with DISK, which
        # the exit hook ends and waits for: this Checkpointer, a local of
        # the training function, may be gone by then.
        self._out = _Outstanding(self._client)
        self._stages = {}       # device -> pinned staging buffers
        self._skipped = []      # the steps of saves skipped since the last
        atexit.register(_wait_at_exit, self._out)

    @property
    def _pending(self):
        """The save in flight (blocking=False), None when there is none."""
        return self._out.pending

    @_pending.setter
    def _pending(self, a):
        self._out.pending = a

    def save_checkpoint(self, step, state_dict,
                        storage_type=StorageType.MEMORY, blocking=True,
                        allow_pickle=False):
        """Saves state_dict as step; returns True when saved, False when
        skipped because the agent is reading the half this save would write
        (the previous step stays; a save with StorageType.DISK waits for the
        agent instead). At exit the process waits until its newest save
        with StorageType.DISK is committed on disk (every rank's shard of it
        durable), saying so after a second; os._exit skips that wait, so
        call wait_latest_checkpoint before it.

        With blocking=False the call returns as soon as the save began: its
        tensors of up to 64 KiB (BatchNorm's running statistics, an
        optimizer's step counts: what the next forward or step changes
        first) are copied before it returns, the larger ones in a thread of
        their own while training goes on.
        Once the copy is done, the save becomes the newest step at the
        first moment the main thread runs Python code again (a pending
        call: no tensor operation of that thread is in flight then),
        provided no tensor of the state changed since the save began: each
        tensor's version counter is read when the save begins and again
        then, so a save whose tensors an optimizer's step, a BatchNorm's
        running statistics or any in-place operation touched before its
        copy was done is abandoned, never kept torn. An abandoned save is
        said in a RuntimeWarning naming the step (at the next call of this
        Checkpointer) and counted in the agent's
        faultline_agent_async_saves_abandoned_total. Save right after
        optimizer.step() and the copy overlaps the next forward and
        backward. True then means the save began. (numpy arrays, which have
        no version counter, are copied when such a save begins.)

        What the check cannot see: a write through .data, or into the
        storage by another tensor that shares it without sharing its
        version counter (numpy views, from_blob, a C extension), does not
        move _version. Wait for the copy (wait()) before such writes, or
        save with blocking=True. A training loop that saves from a thread
        other than the main thread gets its save kept or abandoned at the
        next call of the Checkpointer instead, since nothing tells when
        that thread runs no operation.

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

        def write(i, off, small=None):
            # small: True writes the meta and the small items alone, False
            # all else, None everything.
            if i == 0:
                if small is not False:
                    seg.mv[off:off + len(meta)] = meta
                return
            end = off
            for o, k in data[i - 1]:
                o += off
                if o > end and small is not True:  # alignment: zeros
                    seg.mv[end:o] = _ZEROS[:o - end]
                x, n = items[k], nbytes[k]
                end = o + n
                if n == 0 or small is not None and small != (n <= _SYNC_BYTES):
                    continue
                dst = seg.tensor[o:end]
                if not isinstance(x, torch.Tensor):
                    dst = dst.numpy().view(x.dtype).reshape(x.shape)
                    dst[...] = x
                elif x.device.type == "cpu":
                    dst.view(x.dtype).view(x.shape).copy_(x)
                else:
                    self._from_device(dst, x)

        with faultline.span("save_checkpoint"), torch.no_grad():
            save = seg.save if blocking else seg.begin
            args = (step, names, sizes, write, persist) if blocking else \
                (step, names, sizes, persist)
            try:
                done = save(*args)
            except _segment.TooSmall:
                # Replaced meanwhile by a segment still too small: ask.
                seg = self._segment(need, grow=True)
                save = seg.save if blocking else seg.begin
                done = save(*args)
            except _segment.PersistTimeout as e:
                warnings.warn(f"faultline: the save of step {step} was "
                              f"skipped: {e}", RuntimeWarning, stacklevel=2)
                return False
            if done is None:
                self._skip(step)
                return False
            self._unskip()
            if not blocking:
                # Small tensors are copied now: BatchNorm's running
                # statistics and the like, which the next forward changes
                # long before a copy in the background would reach them.
                for i, off in enumerate(done.offsets):
                    write(i, done.base + off, small=True)
                large = [x for x, n in zip(items, nbytes)
                         if isinstance(x, torch.Tensor) and n > _SYNC_BYTES]
                self._pending = _AsyncSave(
                    done, lambda i, off: write(i, off, small=False), large,
                    persist)
                return True
        self._saved(step, persist)
        return True

    def wait(self):
        """Ends the save in flight of save_checkpoint(..., blocking=False):
        waits for its copy, then keeps it as the newest step when no tensor
        of its state changed since it began, and abandons it otherwise
        (unless it was kept or abandoned already, as soon as its copy was
        done). Returns True when it was kept, False when abandoned, None
        when no save was in flight."""
        return self._out.end(stacklevel=3)

    def _skip(self, step):
        # Said at the first of a run of skipped saves, and their count
        # when a save goes through again: a loop that ignores the return
        # value learns of them without a line per step.
        if not self._skipped:
            warnings.warn(f"faultline: the save of step {step} was skipped: "
                          "the agent is reading the half it would write (a "
                          "persist to disk or a copy to a replica under "
                          "way); the previous step stays", RuntimeWarning,
                          stacklevel=3)
        self._skipped.append(step)

    def _unskip(self):
        s, self._skipped = self._skipped, []
        if len(s) > 1:
            warnings.warn(f"faultline: {len(s)} saves were skipped, steps "
                          f"{s[0]} to {s[-1]}, while the agent read the "
                          "halves they would write", RuntimeWarning,
                          stacklevel=3)

    def _saved(self, step, persist):
        if self._seg is not None:
            self._out.limit = self._seg.persist_wait
        self._out.saved(step, persist)

    def load_checkpoint(self, into=None, allow_pickle=False):
        """Returns the state_dict of the newest step the job agrees on,
        with tensors on the CPU, bitwise the saved ones; {} when there is
        none. The first call of a process (right after a start or a
        restart) loads the step the agent chose for the whole job to resume
        from; in a job of several ranks every rank must make it, since the
        ranks then check with a collective that they all loaded the same
        step, and, should nodes that each chose on their own disagree (a
        node's disk folder lost, say), all load the newest step every rank
        holds, or start over, with a RuntimeWarning that says so (that
        collective is not timed as a hang: a rank in it waits for the
        others' loads, a restore from disk say). A later call (a rollback
        without a restart, after a loss spike) loads the newest step that
        every rank holds intact, in memory or committed on disk: every rank
        must call it then, since the ranks agree on the step with a
        collective (all_gather_object on the default process group); a job
        of several ranks without torch.distributed initialised gets a
        RuntimeError. A tensor saved at several key paths (tied weights) is
        one tensor at all of them.

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
        global _loaded
        self.wait()
        req = {"op": "load", "dir": self.checkpoint_dir}
        if _loaded:
            step = self._agree()
            if step < 0:
                return self._start_over(req)
            req["step"] = step
        resp = self._client.call(req, timeout=600)
        first, _loaded = not _loaded, True
        got = resp.get("step", -1)
        if resp.get("tier") in (None, "", "none"):
            got = -1
        if first and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size() > 1:
            # Each node's agent answers the first load: make sure every
            # rank of the job got the same step, or the ranks would train
            # on from different ones.
            every = [None] * dist.get_world_size()
            with _untimed():
                dist.all_gather_object(every, got)
            if len(set(every)) > 1:
                step = self._agree()
                warnings.warn(
                    "faultline: the ranks' first loads found different "
                    f"steps ({_steps_by_rank(every)}); "
                    + (f"every rank loads step {step}, the newest all hold"
                       if step >= 0 else "no step is held by every rank, "
                       "so the job starts over"), RuntimeWarning,
                    stacklevel=2)
                if step < 0:
                    return self._start_over(req)
                req["step"] = step
                resp = self._client.call(req, timeout=600)
                got = resp.get("step", -1)
                if resp.get("tier") in (None, "", "none"):
                    got = -1
                if got != step:
                    raise RuntimeError(
                        f"faultline: step {step}, which every rank holds, "
                        f"did not load here: {resp.get('reasons')}")
        if got < 0:
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

    def _start_over(self, req):
        """Tells the agent that this rank starts over, so that what it
        reports of the recovery names no step the rank did not load."""
        self._client.call(dict(req, step=-1), timeout=600)
        return {}

    def _agree(self):
        """The newest step every rank of the job holds intact (in memory,
        or committed on disk), -1 when there is none."""
        resp = self._client.call({"op": "held", "dir": self.checkpoint_dir},
                                 timeout=600)
        mine = set(resp.get("steps") or []) | set(resp.get("committed") or [])
        if resp.get("disk", -1) >= 0:
            mine.add(resp["disk"])
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
            if world > 1:
                every = [None] * world
                with _untimed():
                    dist.all_gather_object(every, sorted(mine))
                mine = set.intersection(*(set(e) for e in every))
        elif world > 1:
            raise RuntimeError(
                "faultline: load_checkpoint called again in this process: "
                "the job's ranks agree on the step to load with a "
                "collective, and torch.distributed is not initialised")
        return max(mine, default=-1)

    def wait_latest_checkpoint(self, timeout=600):
        """Waits until the newest save with StorageType.DISK is committed on
        disk; True when it is (or there was none), False after timeout
        seconds or when the agent reports it failed (with a warning that
        says why)."""
        self.wait()
        if self._out.step is None:
            return True
        try:
            self._out.committed(timeout)
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
        # The agent reserves every page of the segment before it answers:
        # give it time in proportion (100 MB/s at worst).
        resp = self._client.call({"op": "segment",
                                  "dir": self.checkpoint_dir,
                                  "bytes": need + need // 16},
                                 timeout=60 + need / 100e6)
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


def _steps_by_rank(steps):
    """Says which ranks got which step, briefly: "step 19: ranks 0-1;
    none: ranks 2-3"."""
    by = {}
    for r, st in enumerate(steps):
        by.setdefault(st, []).append(r)
    return "; ".join(("none" if st < 0 else f"step {st}") + ": ranks "
                     + ",".join(map(str, rs)) for st, rs in sorted(by.items()))


class _AsyncSave:
    """A save whose tensors a thread of its own copies into the segment
    (Checkpointer.save_checkpoint with blocking=False). It is kept or
    abandoned once: by the main thread as soon as it runs Python code after
    the copy (a pending call), else by end()."""

    def __init__(self, pending, write, tensors, persist):
        self.pending, self.tensors, self.persist = pending, tensors, persist
        self.versions = [t._version for t in tensors]
        self.error = None
        self.why = ""
        self.kept = None  # True kept, False abandoned, None not yet
        self._lock = threading.Lock()
        self._settle_in_main = (threading.current_thread()
                                is threading.main_thread())
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
        if self._settle_in_main:
            _in_main_thread(self._settle_pending)

    def _settle_pending(self):
        # A pending call may land inside end() on the same thread: then
        # end() settles it.
        if self._lock.acquire(blocking=False):
            try:
                self._settle()
            finally:
                self._lock.release()

    def _settle(self):
        """Keeps the save when no tensor changed since it began, else
        abandons it; the caller runs no tensor operation meanwhile."""
        if self.kept is not None:
            return
        changed = [i for i, (t, v) in enumerate(zip(self.tensors,
                                                    self.versions))
                   if t._version != v]
        if self.error is not None or changed:
            self.pending.abort()
            self.kept = False
            if self.error is not None:
                self.why = f"its copy failed: {self.error}"
            else:
                self.why = (f"{len(changed)} of its {len(self.tensors)} "
                            "tensors changed before its copy was done (an "
                            "optimizer step or another in-place update "
                            "while it copied): a save copied then would be "
                            "torn")
        else:
            self.pending.finish(self.persist)
            self.kept = True
        self.tensors = None

    def end(self):
        """Waits for the copy and settles the save, if the main thread has
        not yet. Returns whether it was kept."""
        self.thread.join()
        with self._lock:
            self._settle()
        return self.kept


# Pending calls: a function run by the main thread at its next bytecode.
_PENDING = None
_pending_refs = {}  # id -> callback: alive until called


def _in_main_thread(fn):
    """Has the main thread call fn as soon as it runs Python code (between
    two bytecodes, when no operation it started is in flight). Returns
    False when that cannot be arranged (no CPython pending calls, or their
    queue full): the caller settles later."""
    global _PENDING
    try:
        import ctypes
        if _PENDING is None:
            _PENDING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
            ctypes.pythonapi.Py_AddPendingCall.argtypes = [_PENDING,
                                                           ctypes.c_void_p]
            ctypes.pythonapi.Py_AddPendingCall.restype = ctypes.c_int

        def call(_):
            _pending_refs.pop(key, None)
            try:
                fn()
            except BaseException:  # noqa: BLE001 (never raised into the loop)
                pass
            return 0

        cb = _PENDING(call)
        key = id(cb)
        _pending_refs[key] = cb
        if ctypes.pythonapi.Py_AddPendingCall(cb, None) != 0:
            _pending_refs.pop(key, None)
            return False
        return True
    except Exception:  # noqa: BLE001 (no pending calls: settled later)
        return False


class _Outstanding:
    """What a Checkpointer leaves for the process's exit: its save in
    flight (blocking=False) and the newest step it saved with
    StorageType.DISK (None: none), with its agent."""

    def __init__(self, client):
        self.client, self.pending, self.step = client, None, None
        self.limit = 600.0  # the segment's persist_wait
        self.pid = os.getpid()

    def saved(self, step, persist):
        self.client.call({"op": "saved", "step": step, "persist": persist})
        if persist:
            self.step = step

    def committed(self, timeout):
        """Waits up to timeout seconds for the agent to have step
        committed on disk; AgentError when it is not."""
        self.client.call({"op": "wait", "step": self.step,
                          "timeout_s": timeout}, timeout=timeout + 30)

    def end(self, stacklevel):
        """Checkpointer.wait."""
        a, self.pending = self.pending, None
        if a is None:
            return None
        kept = a.end()
        if kept:
            self.saved(a.pending.step, a.persist)
        else:
            warnings.warn(f"faultline: the save of step {a.pending.step} "
                          f"(blocking=False) was abandoned: {a.why}",
                          RuntimeWarning, stacklevel=stacklevel)
            self.client.call({"op": "abandoned", "step": a.pending.step,
                              "what": a.why})
        return kept


def _wait_at_exit(out):
    """Ends the save in flight, then waits until the newest save with
    StorageType.DISK is committed: the agent persists it after the save
    returned, and in a job of several nodes with a folder each, the nodes
    commit a step once every node's shards of it are durable, which a
    node whose ranks all left hears of no more. It says so when that takes
    over a second, and gives up after the segment's persist_wait, as a
    save waits for a persist before it, or as soon as the agent says this
    node's persist of it failed."""
    if os.getpid() != out.pid:
        return  # a forked child's exit: the parent's saves are its own
    try:
        out.end(stacklevel=2)
        if out.step is None:
            return
        try:
            out.committed(1)
            return
        except _agent.AgentError as e:
            if "not committed" not in str(e):
                raise  # the agent gone, or this node's persist failed
        print(f"faultline: waiting up to {out.limit:g} s at exit for step "
              f"{out.step}, saved with StorageType.DISK, to be committed on "
              "disk (every rank's shard of it durable)", file=sys.stderr,
              flush=True)
        out.committed(out.limit)
    except KeyboardInterrupt:
        print(f"faultline: interrupted at exit: step {out.step} may not be "
              "committed on disk", file=sys.stderr, flush=True)
    except Exception as e:  # the agent may be gone as the process exits
        what = "" if out.step is None else \
            f", step {out.step} may not be committed on disk"
        print(f"faultline: at exit{what}: {e}", file=sys.stderr, flush=True)


DdpCheckpointer = Checkpointer
