"""faultline's TaskD for Python training processes, through libtaskd.so.

The functions carry MindCluster TaskD's names and arguments, so that a TaskD
user changes one import:

    from faultline_taskd import init_taskd_worker, start_taskd_worker, span

    init_taskd_worker(rank_id=int(os.environ["RANK"]), upper_limit_of_disk_in_mb=5000, framework="pt")
    start_taskd_worker()
    for step in range(steps):
        with span(f"step {step}"):
            with span("dataloader"):
                batch = next(loader)
            with span("forward"):
                loss = model(batch)

For online recovery and link failover, register the trainer's callbacks
between init_taskd_worker and start_taskd_worker; StepGate gives a training
loop the pause point that pause, resume and stop need:

    gate = StepGate(on_resume=lambda req: load_checkpoint(req["step"]) if req["step"] >= 0 else None)
    gate.register()
    register_switch_link_callback(lambda req: move_links(req["devices"], req["target"]))
    start_taskd_worker()
    step = -1
    while gate.wait(step):
        train(step + 1)
        step += 1

The library is found through $FAULTLINE_LIBTASKD (a path), else beside this
file, else by the dynamic loader's search for libtaskd.so. Only the standard
library is used. The TaskD functions return True on success and False on
failure (last_error() says why, and it is logged); range_start, range_end,
mark and span raise ValueError for a name or id they cannot take.

After os.fork (a DataLoader worker) the child does nothing: the library's
runtime does not survive a fork. Ranges cost one foreign call each and
nothing at all before init_taskd_worker or after destroy_taskd_worker.
"""

import atexit
import ctypes
import json
import logging
import os
import threading

__all__ = [
    "init_taskd_worker",
    "start_taskd_worker",
    "destroy_taskd_worker",
    "init_taskd_manager",
    "start_taskd_manager",
    "destroy_taskd_manager",
    "init_taskd_proxy",
    "destroy_taskd_proxy",
    "set_profiling_switch",
    "manager_address",
    "proxy_address",
    "range_start",
    "range_end",
    "mark",
    "span",
    "flush",
    "register_pause_callback",
    "register_resume_callback",
    "register_stop_callback",
    "register_switch_link_callback",
    "register_profiling_switch_callback",
    "register_strategies_callback",
    "register_retry_step_callback",
    "register_stress_test_callback",
    "StepGate",
    "last_error",
    "TaskdError",
    "Unsupported",
]

_log = logging.getLogger("faultline_taskd")

# The C ABI's codes and events (libtaskd.h).
_OK = 0
_EHANDLE = -3
_EUNSUPPORTED = -7
_EVENT_PAUSE = 1
_EVENT_RESUME = 2
_EVENT_STOP = 3
_EVENT_SWITCH_LINK = 4
_EVENT_STRATEGIES = 5
_EVENT_RETRY_STEP = 6
_EVENT_STRESS_TEST = 7
_EVENT_PROFILING_SWITCH = 8

_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t)


class Unsupported(Exception):
    """Raised by a callback for a request the trainer cannot carry out;
    recovery then takes its next strategy. NotImplementedError counts too."""


class TaskdError(RuntimeError):
    """A libtaskd call failed; code is the C ABI's TASKD_E* code."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.lib = None
        self.forked = False
        self.worker = 0
        self.manager = 0
        self.proxy = 0
        self.callbacks = {}  # event -> ctypes callback, kept alive while registered
        self.last_error = ""


_state = _State()


def _forked():
    # The child of a fork has none of the library's threads, so its Go
    # runtime cannot run: forget the handles and never call in again.
    _state.forked = True
    _state.worker = _state.manager = _state.proxy = 0
    _state.lib = None
    _state.callbacks = {}
    _state.lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _library_path():
    env = os.environ.get("FAULTLINE_LIBTASKD")
    if env:
        return env
    beside = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libtaskd.so")
    if os.path.exists(beside):
        return beside
    return "libtaskd.so"


def _load():
    if _state.forked:
        raise TaskdError(-4, "libtaskd cannot be used in a forked child")
    if _state.lib is not None:
        return _state.lib
    lib = ctypes.CDLL(_library_path())
    u, i, i64, s = ctypes.c_size_t, ctypes.c_int, ctypes.c_int64, ctypes.c_char_p
    pu = ctypes.POINTER(ctypes.c_size_t)
    sigs = {
        "taskd_init_worker": (i, [i, i, s, s, pu]),
        "taskd_start_worker": (i, [u]),
        "taskd_range_start": (i64, [u, s, s]),
        "taskd_range_end": (i, [u, i64]),
        "taskd_mark": (i, [u, s, s]),
        "taskd_flush": (i, [u]),
        "taskd_register_callback": (i, [u, i, _CALLBACK, ctypes.c_void_p]),
        "taskd_init_manager": (i, [s, pu]),
        "taskd_start_manager": (i, [u]),
        "taskd_set_switch": (i, [u, s]),
        "taskd_init_proxy": (i, [s, pu]),
        "taskd_start_proxy": (i, [u]),
        "taskd_addr": (i, [u, ctypes.c_char_p, u]),
        "taskd_destroy": (i, [u]),
        "taskd_last_error": (s, []),
    }
    for name, (res, args) in sigs.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    _state.lib = lib
    return lib


def _error(lib, code):
    msg = lib.taskd_last_error().decode("utf-8", "replace")
    _state.last_error = msg
    return TaskdError(code, msg or "libtaskd error %d" % code)


def _check(lib, code):
    if code < 0:
        raise _error(lib, code)
    return code


def _ok(fn, *args):
    """Runs fn under the lock, turning a TaskdError or a load failure into False."""
    if _state.forked:
        _state.last_error = "libtaskd cannot be used in a forked child"
        return False
    with _state.lock:
        try:
            fn(*args)
            return True
        except (OSError, TaskdError, TypeError, ValueError) as e:
            _state.last_error = str(e)
            _log.error("%s", e)
            return False


def _json(config):
    if config is None:
        return b""
    if isinstance(config, (bytes, str)):
        return config.encode() if isinstance(config, str) else config
    return json.dumps(config).encode()


def last_error():
    """Returns why the last TaskD call of this module failed."""
    return _state.last_error


# --- worker -------------------------------------------------------------


def init_taskd_worker(rank_id, upper_limit_of_disk_in_mb=5000, framework="pt", config=None):
    """Prepares this process's worker: the dotting recorder writing
    <root>/<job>/<rank_id>/ within upper_limit_of_disk_in_mb, and the
    control-plane worker. config (a dict, optional) adds libtaskd's worker
    options (job, node, upstream, root, insecure, ...); the environment
    fills in the rest (MINDX_TASK_ID, NODE_RANK, LOCAL_RANK, TASKD_UPSTREAM)."""

    def do():
        if _state.worker:
            raise TaskdError(-4, "init_taskd_worker: already initialised")
        lib = _load()
        h = ctypes.c_size_t()
        _check(lib, lib.taskd_init_worker(int(rank_id), int(upper_limit_of_disk_in_mb),
                                          str(framework).encode(), _json(config), ctypes.byref(h)))
        _state.worker = h.value

    return _ok(do)


def start_taskd_worker():
    """Connects the worker to its proxy or manager; the profiling switch and
    recovery requests flow from then on."""

    def do():
        _check(_load(), _load().taskd_start_worker(_state.worker))

    return _ok(do)


def destroy_taskd_worker():
    """Stops the worker and flushes and syncs its records. Called at exit."""

    def do():
        if _state.worker:
            h, _state.worker = _state.worker, 0
            _check(_load(), _load().taskd_destroy(h))
            _state.callbacks = {}

    return _ok(do)


def flush():
    """Writes the records taken so far to the file."""
    return _ok(lambda: _check(_load(), _load().taskd_flush(_state.worker)))


def range_start(name, domain="default"):
    """Records the start of a range and returns its id; 0 when the kind is
    switched off. name is "step <n>", "forward", "dataloader" or
    "save_checkpoint" in domain "default", or a communication op as JSON in
    domain "communication"."""
    lib, h = _state.lib, _state.worker
    if not h:
        return 0
    r = lib.taskd_range_start(h, name.encode(), None if domain == "default" else domain.encode())
    if r < 0:
        if r == _EHANDLE:  # destroyed meanwhile by another thread
            return 0
        raise ValueError(str(_error(lib, r)))
    return r


def range_end(range_id):
    """Records the end of the range range_start returned; 0 does nothing."""
    lib, h = _state.lib, _state.worker
    if not h or not range_id:
        return
    r = lib.taskd_range_end(h, range_id)
    if r < 0 and r != _EHANDLE:
        raise ValueError(str(_error(lib, r)))


def mark(name, domain="default"):
    """Records an instant."""
    lib, h = _state.lib, _state.worker
    if not h:
        return
    r = lib.taskd_mark(h, name.encode(), None if domain == "default" else domain.encode())
    if r < 0 and r != _EHANDLE:
        raise ValueError(str(_error(lib, r)))


class span:
    """A range around a block: with span("forward"): ... The id is the
    value of the with statement."""

    __slots__ = ("_name", "_domain", "_id")

    def __init__(self, name, domain="default"):
        self._name, self._domain, self._id = name, domain, 0

    def __enter__(self):
        self._id = range_start(self._name, self._domain)
        return self._id

    def __exit__(self, *exc):
        range_end(self._id)
        return False


def _register(event, fn, adapt):
    """Registers fn for event. adapt(fn, arg) calls fn with the decoded
    argument and returns the reply to encode (None for none)."""

    def do():
        lib = _load()
        if fn is None:
            _check(lib, lib.taskd_register_callback(_state.worker, event, _CALLBACK(), None))
            _state.callbacks.pop(event, None)
            return

        def trampoline(_user, arg, out, outlen):
            code, text = _OK, ""
            try:
                raw = arg.decode("utf-8", "replace") if arg else ""
                reply = adapt(fn, json.loads(raw) if raw else {})
                if reply is not None:
                    text = json.dumps(reply)
            except (Unsupported, NotImplementedError) as e:
                code, text = _EUNSUPPORTED, "%s: %s" % (type(e).__name__, e)
            except Exception as e:  # reported to the manager as the trainer's failure
                code, text = 1, "%s: %s" % (type(e).__name__, e)
            if out and outlen:
                b = text.encode("utf-8", "replace")[: outlen - 1]
                ctypes.memmove(out, b, len(b))
                ctypes.memset(out + len(b), 0, 1)
            return code

        cb = _CALLBACK(trampoline)
        _check(lib, lib.taskd_register_callback(_state.worker, event, cb, None))
        _state.callbacks[event] = cb

    return _ok(do)


def _refuse_false(fn, result):
    if result is False:
        raise RuntimeError("%s returned False" % getattr(fn, "__name__", "callback"))


def _pause_adapter(fn, arg):
    step = fn()
    _refuse_false(fn, step)
    return None if step is None else {"step": int(step)}


def _plain_adapter(fn, arg):
    _refuse_false(fn, fn())


def _arg_adapter(fn, arg):
    _refuse_false(fn, fn(arg))


def _stop_adapter(fn, arg):
    _refuse_false(fn, fn(arg.get("reason", "")))


def _strategies_adapter(fn, arg):
    return [str(s) for s in fn(arg)]


def register_pause_callback(fn):
    """fn() stops training at the next step boundary and returns once it
    has stopped, with the last step completed (an int; None: unknown).
    Raising refuses; Unsupported says it cannot pause. None unregisters.
    Orchestration callbacks (pause, resume, stop, switch_link, strategies,
    retry_step, stress_test) are registered between init_taskd_worker and
    start_taskd_worker; a worker that has any begins paused and is resumed
    once registered with the manager (see StepGate)."""
    return _register(_EVENT_PAUSE, fn, _pause_adapter)


def register_resume_callback(fn):
    """fn(request) starts or continues training; request["step"] is the
    checkpoint step to load first, or -1 to continue from where it is;
    request.get("strategy") and request.get("restarted") (ranks whose
    processes were replaced) say what recovery did."""
    return _register(_EVENT_RESUME, fn, _arg_adapter)


def register_stop_callback(fn):
    """fn(reason) ends training for good."""
    return _register(_EVENT_STOP, fn, _stop_adapter)


def register_switch_link_callback(fn):
    """fn(request) moves this rank's traffic on request["devices"] of
    request["node"] to request["target"] ("standby" or "primary")."""
    return _register(_EVENT_SWITCH_LINK, fn, _arg_adapter)


def register_strategies_callback(fn):
    """fn(notice) returns the recovery strategies this rank supports now
    ("retry", "recover-in-place", "recover", "dump", "exit"), given
    notice["faults"]. Without it, those the registered callbacks allow."""
    return _register(_EVENT_STRATEGIES, fn, _strategies_adapter)


def register_retry_step_callback(fn):
    """fn() repairs what a transient fault broke and runs the interrupted
    step again from memory; training stays paused after it."""
    return _register(_EVENT_RETRY_STEP, fn, _plain_adapter)


def register_stress_test_callback(fn):
    """fn(request) runs the online stress test request["test"] on this
    rank's devices and raises if they fail it."""
    return _register(_EVENT_STRESS_TEST, fn, _arg_adapter)


def register_profiling_switch_callback(fn):
    """fn(switch) hears every profiling switch the worker applies, as the
    profilingSwitch dict ({"Step": "on", ...})."""
    return _register(_EVENT_PROFILING_SWITCH, fn, _arg_adapter)


class StepGate:
    """The pause point of a training loop, behind the pause, resume and stop
    callbacks. Call wait(last_step) at the top of every iteration (-1
    before the first step); it returns True to go on, blocking while
    training is paused, and False once stopped:

        gate = StepGate(on_resume=load_checkpoint)
        gate.register()          # before start_taskd_worker
        start_taskd_worker()
        step = -1
        while gate.wait(step):
            train_one_step(step + 1)
            step += 1

    Training begins paused, as the manager expects: the worker resumes it
    once registered. on_resume(request) runs before training continues
    (load request["step"] unless it is -1); on_stop(reason) when stopped."""

    def __init__(self, on_resume=None, on_stop=None):
        self._cv = threading.Condition()
        self._paused = True
        self._parked = False
        self._stopped = False
        self._step = -1
        self._on_resume = on_resume
        self._on_stop = on_stop
        self.stop_reason = None

    def register(self):
        """Registers the pause, resume and stop callbacks."""

        def pause(fn, arg):  # waits as long as the manager allows
            ms = arg.get("timeout_ms")
            return {"step": fn(ms / 1000.0 if ms else None)}

        return (_register(_EVENT_PAUSE, self.pause, pause) and register_resume_callback(self.resume)
                and register_stop_callback(self.stop))

    def wait(self, last_step):
        with self._cv:
            self._step = last_step
            while self._paused and not self._stopped:
                self._parked = True
                self._cv.notify_all()
                self._cv.wait()
            self._parked = False
            return not self._stopped

    def pause(self, timeout=None):
        with self._cv:
            self._paused = True
            self._cv.notify_all()
            if not self._cv.wait_for(lambda: self._parked or self._stopped, timeout):
                raise TimeoutError("the training loop did not reach a step boundary")
            return self._step

    def resume(self, request=None):
        if self._on_resume is not None:
            self._on_resume(request or {"step": -1})
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def stop(self, reason=""):
        with self._cv:
            self._stopped = True
            self.stop_reason = reason
            self._cv.notify_all()
        if self._on_stop is not None:
            self._on_stop(reason)


# --- manager and proxy ----------------------------------------------------


def init_taskd_manager(config):
    """Prepares the job's manager and listens. config: job_id (default
    $MINDX_TASK_ID), node_nums, proc_per_node, listen (":9601"), insecure,
    tls_dir, token, state_dir, switch_file, ..."""

    def do():
        if _state.manager:
            raise TaskdError(-4, "init_taskd_manager: already initialised")
        lib = _load()
        h = ctypes.c_size_t()
        _check(lib, lib.taskd_init_manager(_json(config), ctypes.byref(h)))
        _state.manager = h.value

    return _ok(do)


def start_taskd_manager():
    """Serves the job in the background of this process."""
    return _ok(lambda: _check(_load(), _load().taskd_start_manager(_state.manager)))


def set_profiling_switch(switch):
    """Sets the job's profiling switch (a profilingSwitch dict or JSON) and
    fans it out to every worker, as ClusterD's ModifyTrainingDataTraceSwitch."""
    return _ok(lambda: _check(_load(), _load().taskd_set_switch(_state.manager, _json(switch))))


def destroy_taskd_manager():
    """Stops the manager."""

    def do():
        if _state.manager:
            h, _state.manager = _state.manager, 0
            _check(_load(), _load().taskd_destroy(h))

    return _ok(do)


def init_taskd_proxy(config):
    """Starts this node's proxy. config: job_id, node, upstream (default
    $TASKD_MANAGER_ADDR, else $MASTER_ADDR:9601), listen ("127.0.0.1:9602"),
    insecure, tls_dir, token, dotting_root, ..."""

    def do():
        if _state.proxy:
            raise TaskdError(-4, "init_taskd_proxy: already initialised")
        lib = _load()
        h = ctypes.c_size_t()
        _check(lib, lib.taskd_init_proxy(_json(config), ctypes.byref(h)))
        try:
            _check(lib, lib.taskd_start_proxy(h.value))
        except TaskdError:
            lib.taskd_destroy(h.value)
            raise
        _state.proxy = h.value

    return _ok(do)


def destroy_taskd_proxy():
    """Stops the proxy."""

    def do():
        if _state.proxy:
            h, _state.proxy = _state.proxy, 0
            _check(_load(), _load().taskd_destroy(h))

    return _ok(do)


def _address(handle):
    if not handle or _state.lib is None:
        return None
    buf = ctypes.create_string_buffer(256)
    if _state.lib.taskd_addr(handle, buf, len(buf)) < 0:
        return None
    return buf.value.decode()


def manager_address():
    """The address the manager listens on ("127.0.0.1:9601"), or None."""
    return _address(_state.manager)


def proxy_address():
    """The address the proxy listens on, or None."""
    return _address(_state.proxy)


@atexit.register
def _shutdown():
    if _state.forked:
        return
    destroy_taskd_worker()
    destroy_taskd_proxy()
    destroy_taskd_manager()
