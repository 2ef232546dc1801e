"""A training process for libtaskd's tests, driven over stdin and stdout.

python3 trainer.py MODE, with faultline_taskd on PYTHONPATH and the
library in $FAULTLINE_LIBTASKD. The worker's options come as JSON in
$TRAINER_CONFIG and its rank in $TRAINER_RANK. Lines printed to stdout
report progress; lines read from stdin command it.
"""

import ctypes
import json
import os
import sys
import threading
import time

import faultline_taskd as taskd


_say = threading.Lock()


def say(*words):
    # One write per line, under a lock: print writes the words and the
    # newline apart, and the callbacks' threads print too.
    line = " ".join(str(w) for w in words) + "\n"
    with _say:
        sys.stdout.write(line)
        sys.stdout.flush()


def fail(msg):
    print("FAIL", msg, file=sys.stderr, flush=True)
    sys.exit(1)


def init_worker():
    rank = int(os.environ.get("TRAINER_RANK", "0"))
    config = json.loads(os.environ.get("TRAINER_CONFIG", "{}"))
    if not taskd.init_taskd_worker(rank, 100, "pt", config=config):
        fail("init_taskd_worker: " + taskd.last_error())


def start_worker():
    if not taskd.start_taskd_worker():
        fail("start_taskd_worker: " + taskd.last_error())


def one_step(step):
    with taskd.span("step %d" % step):
        with taskd.span("dataloader"):
            time.sleep(0.002)
        with taskd.span("forward"):
            time.sleep(0.003)
    say("step", step)
    time.sleep(0.001)


def mode_loop():
    """Steps until stdin says stop; the test flips the switch meanwhile."""
    init_worker()
    start_worker()
    say("started", os.getpid())
    stop = threading.Event()

    def read():
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=read, daemon=True).start()
    step = 0
    while not stop.is_set():
        one_step(step)
        step += 1
    if not taskd.destroy_taskd_worker():
        fail("destroy: " + taskd.last_error())
    say("done", step)


def mode_recovery():
    """Steps behind a StepGate: the manager pauses, resumes, switches links
    and stops it."""
    init_worker()

    def on_resume(req):
        say("resumed", req.get("step"), req.get("strategy", "-"), json.dumps(req.get("restarted", [])))

    gate = taskd.StepGate(on_resume=on_resume, on_stop=lambda reason: say("stopped", reason))
    if not gate.register():
        fail("register: " + taskd.last_error())

    def switch_link(req):
        if req["target"] == "primary":
            raise RuntimeError("primary link still down")
        say("switch_link", req["node"], json.dumps(req["devices"]), req["target"])

    def stress_test(req):
        raise taskd.Unsupported("no stress test " + req["test"])

    for reg, fn in ((taskd.register_switch_link_callback, switch_link),
                    (taskd.register_stress_test_callback, stress_test)):
        if not reg(fn):
            fail("register: " + taskd.last_error())
    start_worker()
    if not taskd.register_stress_test_callback(stress_test):
        fail("replacing a callback after start: " + taskd.last_error())
    say("started", os.getpid())
    step = -1
    while gate.wait(step):
        one_step(step + 1)
        step += 1
    if not taskd.destroy_taskd_worker():
        fail("destroy: " + taskd.last_error())
    say("done", step)


def mode_errors():
    """Bad input gives errors, never a crash."""
    if taskd.start_taskd_worker():
        fail("start before init succeeded")
    if "handle" not in taskd.last_error():
        fail("start before init: " + taskd.last_error())
    if taskd.init_taskd_worker(-1, 100):
        fail("negative rank accepted")
    if "rank_id" not in taskd.last_error():
        fail("negative rank: " + taskd.last_error())
    if taskd.init_taskd_worker(0, 100, config={"no_such_option": 1}):
        fail("unknown option accepted")
    if "no_such_option" not in taskd.last_error():
        fail("unknown option: " + taskd.last_error())
    if taskd.init_taskd_manager({"job_id": "a", "job": "b", "insecure": True}):
        fail("contradicting job ids accepted")
    if taskd.set_profiling_switch({"Step": "on"}):
        fail("switch without a manager accepted")
    init_worker()
    if taskd.init_taskd_worker(0, 100):
        fail("second init accepted")
    for name, domain in (("backward", "default"), ("step x", "default"), ("forward", "nope"), ("", "communication")):
        try:
            taskd.range_start(name, domain)
            fail("range_start(%r, %r) accepted" % (name, domain))
        except ValueError as e:
            say("refused", name, domain, "|", e)
    try:
        taskd.range_end(12345)
        fail("range_end of an unknown id accepted")
    except ValueError as e:
        say("refused end |", e)
    if taskd.range_start("forward") != 0:
        fail("a range recorded while the switch is off")
    taskd.range_end(0)
    start_worker()
    if taskd.start_taskd_worker():
        fail("second start accepted")
    if "already started" not in taskd.last_error():
        fail("second start: " + taskd.last_error())
    if taskd.register_pause_callback(lambda: 0):
        fail("a pause callback registered after a start without a trainer")
    if "before starting" not in taskd.last_error():
        fail("late pause callback: " + taskd.last_error())
    if not taskd.register_profiling_switch_callback(print):
        fail("profiling switch callback after start: " + taskd.last_error())
    with taskd.span("forward"):
        pid = os.fork()
        if pid == 0:  # a DataLoader worker: everything is a no-op
            ok = (taskd.range_start("step 1") == 0 and not taskd.init_taskd_worker(1, 100)
                  and "forked" in taskd.last_error() and not taskd.start_taskd_worker())
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            fail("the forked child used the library")
    lib = ctypes.CDLL(os.environ["FAULTLINE_LIBTASKD"])
    lib.taskd_destroy.argtypes = [ctypes.c_size_t]
    lib.taskd_last_error.restype = ctypes.c_char_p
    for h in (0, 987654321):
        if lib.taskd_destroy(h) != -3:
            fail("destroy of handle %d" % h)
    handle = taskd._state.worker
    if not taskd.destroy_taskd_worker():
        fail("destroy: " + taskd.last_error())
    if lib.taskd_destroy(handle) != -3 or b"not a live handle" not in lib.taskd_last_error():
        fail("second destroy of the worker")
    if taskd.range_start("forward") != 0:
        fail("a range after destroy")
    say("ok")


def mode_all_in_one():
    """Manager, proxy and worker in one process, the switch set through the
    library."""
    job = os.environ["MINDX_TASK_ID"]
    # The proxies' token: without one the manager takes no proxy.
    proxy_token = "proxies-token-0123456789abcdef"
    if not taskd.init_taskd_manager({"job_id": job, "node_nums": 1, "proc_per_node": 1,
                                     "listen": "127.0.0.1:0", "insecure": True,
                                     "proxy_token": proxy_token}):
        fail("init_taskd_manager: " + taskd.last_error())
    if not taskd.start_taskd_manager():
        fail("start_taskd_manager: " + taskd.last_error())
    if not taskd.init_taskd_proxy({"job_id": job, "node": 0, "upstream": taskd.manager_address(),
                                   "listen": "127.0.0.1:0", "insecure": True,
                                   "upstream_token": proxy_token}):
        fail("init_taskd_proxy: " + taskd.last_error())
    config = json.loads(os.environ["TRAINER_CONFIG"])
    config["upstream"] = taskd.proxy_address()
    if not taskd.init_taskd_worker(0, 100, "pt", config=config):
        fail("init_taskd_worker: " + taskd.last_error())
    applied = threading.Event()
    seen = []

    def on_switch(sw):
        seen.append(sw)
        if sw.get("Step") == "on":
            applied.set()

    taskd.register_profiling_switch_callback(on_switch)
    start_worker()
    # The worker may register after the switch is set: the manager sends it
    # the switch in force on registration.
    if not taskd.set_profiling_switch({"Step": "on", "FP": "off"}):
        fail("set_profiling_switch: " + taskd.last_error())
    if taskd.set_profiling_switch('{"Step": "maybe"}'):
        fail("a bad switch accepted")
    if not applied.wait(30):
        fail("the switch never reached the worker")
    for step in range(5):
        with taskd.span("step %d" % step):
            with taskd.span("forward") as fid:
                if fid != 0:
                    fail("forward recorded while FP is off")
    taskd.mark("save_checkpoint")
    for ok in (taskd.destroy_taskd_worker(), taskd.destroy_taskd_proxy(), taskd.destroy_taskd_manager()):
        if not ok:
            fail("destroy: " + taskd.last_error())
    say("switches", json.dumps(seen[-1], sort_keys=True))
    say("ok")


def mode_mspti():
    """Markers from the profiling library reach the record files."""
    init_worker()
    start_worker()
    fake = ctypes.CDLL(os.environ["FAKE_MSPTI"])
    fake.fake_control.restype = ctypes.c_int64
    fake.fake_control.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                  ctypes.c_char_p, ctypes.c_char_p]
    if fake.fake_control(b"subscribed", 0, 0, 0, None, None) != 1:
        fail("the profiling library was not subscribed")
    say("started", os.getpid())
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "emit":
            # emit N ID NAME DOMAIN: host start and end records
            n, first = int(cmd[1]), int(cmd[2])
            name, domain = cmd[3].encode(), (cmd[4].encode() if len(cmd) > 4 else None)
            fake.fake_control(b"emit", n, 2, first, name, domain)
            fake.fake_control(b"emit", n, 4, first, None, domain)
            say("emitted", fake.fake_control(b"emitted", 0, 0, 0, None, None),
                "filtered", fake.fake_control(b"filtered", 0, 0, 0, None, None))
        elif cmd[0] == "stop":
            break
    taskd.destroy_taskd_worker()
    say("done")


def mode_bench():
    """Times BENCH_N range pairs through the module against two baselines
    measured in the same run: a bare ctypes call into libc, and a ctypes
    call into the library that does no work (taskd_last_error)."""
    n = int(os.environ["BENCH_N"])
    init_worker()  # the options turn every kind on; no manager is needed
    libc = ctypes.CDLL(None)
    libc.abs.argtypes, libc.abs.restype = [ctypes.c_int], ctypes.c_int
    noop = taskd._load().taskd_last_error

    def timed(fn):
        t0 = time.perf_counter_ns()
        fn()
        return (time.perf_counter_ns() - t0) / n

    def bare():
        for _ in range(n):
            libc.abs(-1)

    def into_library():
        for _ in range(n):
            noop()

    def ranges():
        start, end = taskd.range_start, taskd.range_end
        for _ in range(n):
            end(start("forward"))

    def spans():
        for _ in range(n):
            with taskd.span("forward"):
                pass

    def ranges_off():
        start, end = taskd.range_start, taskd.range_end
        for _ in range(n):
            end(start("save_checkpoint"))

    say("bench", json.dumps({"ctypes_libc": timed(bare), "ctypes_libtaskd_noop": timed(into_library),
                             "range_pair": timed(ranges), "span": timed(spans), "range_pair_off": timed(ranges_off)}))
    taskd.destroy_taskd_worker()


if __name__ == "__main__":
    {"loop": mode_loop, "recovery": mode_recovery, "errors": mode_errors,
     "all_in_one": mode_all_in_one, "mspti": mode_mspti, "bench": mode_bench}[sys.argv[1]]()
