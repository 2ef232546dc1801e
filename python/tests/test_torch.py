"""faultline.torch.init: the agent's hello, collective records, the DDP
hook, process groups and the stack dump, in a world of one gloo rank here
and of two in child processes."""

import gc
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import unittest
import warnings
import weakref

import torch
import torch.distributed as dist

import faultline
import faultline.torch as ft
from faultline import _ring

from helpers import FakeAgent, RingReader, make_ring

HERE = os.path.dirname(os.path.abspath(__file__))
# The folder the faultline under test was imported from.
PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(
    faultline.__file__)))

CSTART, CEND, CERR = (_ring.COLLECTIVE_START, _ring.COLLECTIVE_END,
                      _ring.COLLECTIVE_ERROR)


class NoAgentTest(unittest.TestCase):
    def test_init_warns_once_and_installs_nothing(self):
        os.environ.pop("FAULTLINE_AGENT", None)
        os.environ["FAULTLINE_RESUME_STEP"] = "7"
        try:
            faultline._reset()
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                self.assertEqual(ft.init(), 7)
                faultline._resume = None
                self.assertEqual(ft.init(), 7)
            msgs = [str(x.message) for x in w]
            self.assertEqual(len(msgs), 1, msgs)
            self.assertIn("FAULTLINE_AGENT", msgs[0])
            self.assertIn("faultline-run", msgs[0])
            self.assertFalse(hasattr(dist.all_reduce, "__faultline_original__")
                             and not ft._originals)
        finally:
            del os.environ["FAULTLINE_RESUME_STEP"]
            faultline._reset()


class TorchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="faultline-torch-")
        cls.agent = FakeAgent()
        cls.agent.hello["resume_step"] = 41
        cls.ring = make_ring(os.path.join(cls.dir, "ring"), 1 << 20)
        cls.stacks = os.path.join(cls.dir, "stacks")
        os.environ.update(FAULTLINE_AGENT=cls.agent.sock,
                          FAULTLINE_RING=cls.ring,
                          FAULTLINE_STACK_FILE=cls.stacks,
                          FAULTLINE_STACK_SIGNAL=str(signal.SIGRTMIN + 3),
                          RANK="0")
        faultline._reset()
        dist.init_process_group(
            "gloo", init_method=f"file://{cls.dir}/store", rank=0,
            world_size=1)
        cls.resume = ft.init()
        cls.r = RingReader(cls.ring)

    @classmethod
    def tearDownClass(cls):
        dist.destroy_process_group()
        for k in ("FAULTLINE_AGENT", "FAULTLINE_RING", "FAULTLINE_STACK_FILE",
                  "FAULTLINE_STACK_SIGNAL", "RANK"):
            os.environ.pop(k, None)
        faultline._reset()
        cls.r.close()
        cls.agent.close()
        shutil.rmtree(cls.dir)

    def setUp(self):
        self.r.read()

    def test_hello_and_resume_step(self):
        self.assertEqual(self.resume, 41)
        hello = [r for r in self.agent.requests if r["op"] == "hello"]
        self.assertEqual(hello[0], {"op": "hello", "rank": 0,
                                    "pid": os.getpid()})
        self.assertEqual(ft.init(), 41)

    def test_groups(self):
        g = [r for r in self.agent.requests if r["op"] == "groups"]
        self.assertEqual(g[0]["groups"], {"default_pg": {
            "group_name": "dp", "group_rank": 0, "global_ranks": [0]}})
        pg = dist.new_group([0])
        name = ft.group_name(pg)
        self.assertNotEqual(name, "default_pg")
        g = [r for r in self.agent.requests if r["op"] == "groups"][-1]
        self.assertIn(name, g["groups"])
        ft.label_group(pg, "tp")
        g = [r for r in self.agent.requests if r["op"] == "groups"][-1]
        self.assertEqual(g["groups"][name]["group_name"], "tp")
        dist.all_reduce(torch.ones(2), group=pg)
        recs = self.r.read()
        self.assertEqual(json.loads(recs[0]["name"])["groupName"], name)
        with self.assertRaisesRegex(TypeError, "want a process group"):
            ft.label_group("tp", "tp")
        # What new_group gives a rank outside the group: one name, no label.
        other = dist.GroupMember.NON_GROUP_MEMBER
        ft.label_group(other, "tp")
        self.assertEqual({ft.group_name(other) for _ in range(3)},
                         {"non_group_member"})
        # faultline keeps no destroyed group, nor its threads, alive.
        ref = weakref.ref(pg)
        dist.destroy_process_group(pg)
        del pg
        gc.collect()
        self.assertIsNone(ref())

    def test_exit_waits_for_threads_ready_to_run(self):
        # A thread that works without the GIL (pbkdf2), as one of gloo's
        # does as it retires a collective, is waited for, settle at most.
        def work(n, out):
            hashlib.pbkdf2_hmac("sha256", b"key", b"salt", n)
            out.append(time.monotonic())

        for settle, n in ((60, 1_000_000), (0.05, 4_000_000)):
            out = []
            t = threading.Thread(target=work, args=(n, out))
            t.start()
            self.addCleanup(t.join)
            deadline = time.monotonic() + 10
            while not ft._runnable_threads():
                self.assertLess(time.monotonic(), deadline)
                time.sleep(0.001)
            ft._threads_at_exit(timeout=1, settle=settle)
            returned = time.monotonic()
            if settle == 60:
                t.join()
                self.assertLess(out[0], returned)
            else:
                self.assertTrue(t.is_alive())

    def test_exit_waits_for_collectives_in_flight(self):
        # Past the timeout, which bounds only callbacks of completed ones.
        fut = torch.futures.Future()
        ft._on_done(fut, lambda f: None)
        threading.Timer(0.3, fut.set_result, (None,)).start()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            ft._threads_at_exit(timeout=0.05, settle=0)
        self.assertTrue(fut.done())
        self.assertEqual([str(x.message) for x in w], [])

    def test_exit_says_which_callbacks_it_left(self):
        ft._threads_at_exit(settle=0)  # the other tests' callbacks gone
        fut = torch.futures.Future()
        fut.set_result(None)

        def kept(f):  # a callback torch let go of, kept alive here
            pass

        ft._on_done(fut, kept)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            ft._threads_at_exit(timeout=0.05, settle=0)
        del kept
        self.assertFalse(any(v is fut for v in list(ft._held.values())))
        self.assertEqual(len(w), 1)
        self.assertIn("1 callbacks on collectives not let go of 0.05 s after "
                      "they completed", str(w[0].message))

    def test_callbacks_are_tracked_until_released(self):
        fut = torch.futures.Future()
        ft._on_done(fut, lambda f: None)

        def tracked():
            return any(v is fut for v in list(ft._held.values()))

        self.assertTrue(tracked())
        pid = os.fork()
        if pid == 0:  # a child has no thread of torch's to wait for
            os._exit(int(tracked()))
        self.assertEqual(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), 0)
        self.assertTrue(tracked())
        fut.set_result(None)  # runs the callback here, and drops it
        self.assertFalse(tracked())

    def test_collectives_are_timed(self):
        t = torch.arange(6, dtype=torch.float32)
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
        dist.all_gather([torch.empty(6)], t)
        dist.reduce(t, dst=0)
        dist.barrier()
        dist.all_to_all_single(torch.empty(6), t)
        recs = self.r.read()
        starts = [x for x in recs if x["type"] == CSTART]
        ends = [x for x in recs if x["type"] == CEND]
        self.assertEqual([json.loads(x["name"])["opName"] for x in starts],
                         ["allreduce", "broadcast", "allgather", "reduce",
                          "barrier", "all_to_all"])
        self.assertEqual([x["id"] for x in starts], [x["id"] for x in ends])
        op = json.loads(starts[0]["name"])
        self.assertEqual(op, {"opName": "allreduce", "groupName": "default_pg",
                              "count": "6", "dataType": "float32"})
        self.assertEqual(starts[0]["aux"], 6)
        self.assertTrue(all(x["domain"] == 1 for x in recs))
        self.assertEqual(json.loads(starts[4]["name"])["count"], "0")

    def test_a_loads_agreement_is_untimed(self):
        # A rank in it waits for its peers' loads, not for a collective.
        with ft._untimed():
            dist.all_gather_object([None], 41)
            dist.barrier()
        self.assertEqual(self.r.read(), [])
        dist.barrier()
        self.assertEqual([x["type"] for x in self.r.read()], [CSTART, CEND])

    def test_async_collectives_end_when_done(self):
        w = dist.all_reduce(torch.ones(3), async_op=True)
        w.wait()
        deadline = time.time() + 10
        recs = []
        while len(recs) < 2 and time.time() < deadline:
            recs += self.r.read()
            time.sleep(0.001)
        self.assertEqual([x["type"] for x in recs], [CSTART, CEND])

    def test_a_collective_that_raises_is_an_error_record(self):
        with self.assertRaises(Exception) as cm:
            dist.broadcast(torch.ones(2), src=5)
        recs = self.r.read()
        self.assertEqual([x["type"] for x in recs], [CSTART, CERR])
        self.assertIn(str(cm.exception)[:40], recs[1]["name"])

    def test_ddp_hook_times_the_bucket(self):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8),
                                    torch.nn.Linear(8, 2))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        x = torch.randn(5, 4)
        ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        ref.load_state_dict(model.state_dict())
        ddp(x).sum().backward()
        ref(x).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            self.assertTrue(torch.equal(p.grad, q.grad))
        recs = self.r.read()
        starts = [x for x in recs if x["type"] == CSTART]
        self.assertEqual(len(starts), 1)  # one bucket, timed as one
        self.assertEqual(json.loads(starts[0]["name"])["count"], str(
            sum(p.numel() for p in model.parameters())))
        self.assertEqual([x["type"] for x in recs], [CSTART, CEND])

    def small_buckets(self, layers):
        """A DDP of layers Linear(16, 16) in buckets of 1 KiB, one layer's
        weight and bias in each, and the model beside it undistributed."""
        first = dist._DEFAULT_FIRST_BUCKET_BYTES
        dist._DEFAULT_FIRST_BUCKET_BYTES = 1024
        self.addCleanup(setattr, dist, "_DEFAULT_FIRST_BUCKET_BYTES", first)
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(16, 16)
                                      for _ in range(layers)])
        ref = torch.nn.Sequential(*[torch.nn.Linear(16, 16)
                                    for _ in range(layers)])
        ref.load_state_dict(model.state_dict())
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=1024 / 2 ** 20)
        return ddp, model, ref

    def step(self, ddp, model, ref):
        x = torch.randn(5, 16)
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        ddp(x).sum().backward()
        ref(x).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            self.assertTrue(torch.equal(p.grad, q.grad))
        return self.r.read()

    def test_ddp_hook_times_each_bucket_of_the_rebuilt_layout(self):
        ddp, model, ref = self.small_buckets(3)
        state = ddp._faultline_hook
        for it in range(3):
            recs = self.step(ddp, model, ref)
            starts = [x for x in recs if x["type"] == CSTART]
            # The first iteration too: three buckets, last layer first.
            self.assertEqual([json.loads(x["name"])["count"] for x in starts],
                             ["272"] * 3, it)
            self.assertEqual(sorted(x["id"] for x in starts), sorted(
                x["id"] for x in recs if x["type"] == CEND))
            self.assertEqual(state.steady, it > 0, it)
        self.assertEqual(state.layout, [(5, 4), (3, 2), (1, 0)])  # bias first
        # Settled: no tensor hook left to cost a step anything.
        for p in model.parameters():
            self.assertFalse(p._backward_hooks)

    def test_a_rebuild_unlike_the_layout_keeps_the_layout(self):
        ddp, model, ref = self.small_buckets(2)
        state = ddp._faultline_hook
        self.step(ddp, model, ref)
        # DDP's rebuild now puts the small bucket last: [b1], [b0, W1],
        # [W0] instead of the [b1, W1], [b0, W0] derived.
        os.environ["DDP_SET_LAST_BUCKET_CAP"] = "1"
        self.addCleanup(os.environ.pop, "DDP_SET_LAST_BUCKET_CAP")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(3):
                recs = self.step(ddp, model, ref)
        msgs = [str(x.message) for x in w if "faultline" in str(x.message)]
        self.assertEqual(len(msgs), 1, msgs)
        self.assertIn("otherwise than faultline derived", msgs[0])
        self.assertFalse(state.steady)
        starts = [x for x in recs if x["type"] == CSTART]
        self.assertEqual([json.loads(x["name"])["count"] for x in starts],
                         ["272"] * 2)

    def test_a_user_hook_runs_under_ours(self):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
        calls = []

        def hook(state, bucket):
            calls.append(bucket.index())
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
        self.assertFalse(ddp.module.weight._backward_hooks)
        ddp(torch.randn(2, 3)).sum().backward()
        self.assertEqual(calls, [0])
        with self.assertRaises(RuntimeError):
            ddp.register_comm_hook(None, hook)
        self.assertEqual([x["type"] for x in self.r.read()], [CSTART, CEND])

    def test_stack_dump_on_the_signal(self):
        open(self.stacks, "w").close()
        os.kill(os.getpid(), int(os.environ["FAULTLINE_STACK_SIGNAL"]))
        deadline = time.time() + 10
        text = ""
        while "test_stack_dump_on_the_signal" not in text:
            self.assertLess(time.time(), deadline, text)
            time.sleep(0.01)
            with open(self.stacks) as f:
                text = f.read()
        self.assertIn("Current thread", text)
        self.assertIn("test_torch.py", text)


def run_ranks(test, script, world, timeout, **env):
    """Runs script as world gloo ranks in child processes, in a folder of
    their own with their rings (ring-RANK) and a FakeAgent, both removed
    when test ends; returns the folder, the agent, the ranks' exit codes
    and what they wrote to stderr."""
    d = tempfile.mkdtemp(prefix="faultline-ranks-")
    test.addCleanup(shutil.rmtree, d)
    agent = FakeAgent()
    test.addCleanup(agent.close)
    path = os.path.join(d, "rank.py")
    with open(path, "w") as f:
        f.write(textwrap.dedent(script))
    procs = []
    for rank in range(world):
        ring = make_ring(os.path.join(d, f"ring-{rank}"), 1 << 20)
        with open(os.path.join(d, f"stderr-{rank}"), "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, path], stderr=err, env=dict(
                    os.environ, PYTHONPATH=PACKAGE + os.pathsep + HERE,
                    RANK=str(rank), WORLD_SIZE=str(world),
                    FAULTLINE_AGENT=agent.sock, FAULTLINE_RING=ring,
                    STORE=os.path.join(d, "store"), OUT=d, **env)))
    rcs = [p.wait(timeout=timeout) for p in procs]
    errs = []
    for rank in range(world):
        with open(os.path.join(d, f"stderr-{rank}")) as f:
            errs.append(f.read())
    return d, agent, rcs, errs


class ExitTest(unittest.TestCase):
    """A rank exits whole while a thread of gloo's still runs faultline's
    callbacks on collectives that completed: the main thread, which waited
    for their futures, went on at once, as after a DDP job's last step. A
    thread that asks for the GIL once the interpreter is finalizing aborts
    the process; faultline waits for its callbacks at exit."""

    def test_exit_while_a_callback_runs(self):
        for name, script in EXIT_SCRIPTS.items():
            with self.subTest(name):
                d, _, rcs, errs = run_ranks(self, script, 2, 120)
                self.assertEqual(rcs, [0, 0], errs)
                for rank in (0, 1):
                    self.assertNotIn("faultline:", errs[rank])  # in time
                    r = RingReader(os.path.join(d, f"ring-{rank}"))
                    self.addCleanup(r.close)
                    recs = [x["type"] for x in r.read()]
                    if name == "then":  # an untimed all_reduce
                        with open(os.path.join(d, f"then-{rank}")) as f:
                            self.assertEqual(f.read(), "ran")
                        self.assertEqual(recs, [], rank)
                    else:
                        self.assertEqual(recs, [CSTART, CEND], rank)

    def test_a_failed_first_step_leaves_no_callback(self):
        # Rank 1 is gone after DDP's first broadcast, so rank 0's reduce of
        # the held buckets fails: the error reaches DDP's futures, and the
        # callback that set it is let go of, as every other.
        d, _, rcs, errs = run_ranks(self, FAIL_SCRIPT, 2, 120)
        self.assertEqual(rcs, [0, 3], errs)
        self.assertNotIn("faultline:", errs[0])
        with open(os.path.join(d, "out-0.json")) as f:
            out = json.load(f)
        self.assertTrue(out["raised"])
        self.assertEqual(out["held"], [])


EXIT_HEAD = """
import os, time
import torch, torch.distributed as dist
import faultline.torch as ft
from faultline import _ring

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"],
                        rank=rank, world_size=2)
ft.init()
"""

# Each job a callback of its own, the one waited for at exit: on an async
# collective (Work.get_future().add_done_callback), and a then (the DDP
# hook's).
EXIT_SCRIPTS = {"add_done_callback": EXIT_HEAD + """
end = _ring.collective_end


def slow_end(rid):  # the callback's thread is away, the GIL released
    time.sleep(0.3)
    end(rid)


_ring.collective_end = slow_end
dist.all_reduce(torch.ones(1), async_op=True).get_future().wait()
""", "then": EXIT_HEAD + """
def slow_then(path):  # a closure, as faultline's: torch alone holds it
    def done(fut):
        time.sleep(0.3)
        with open(path, "w") as f:
            f.write("ran")
    return done


fut = ft._originals["all_reduce"](torch.ones(1), async_op=True).get_future()
ft._then(fut, slow_then(os.path.join(os.environ["OUT"], "then-%d" % rank)))
fut.wait()
"""}

FAIL_SCRIPT = """
import datetime, gc, json, os
import torch, torch.distributed as dist
import faultline.torch as ft

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"],
                        rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
ft.init()
if rank == 1:
    ft._all_reduce = lambda *a: os._exit(3)
torch.manual_seed(0)
ddp = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
try:
    ddp(torch.randn(4, 8)).sum().backward()
    raised = False
except RuntimeError:
    raised = True
ft._threads_at_exit(timeout=10)
gc.collect()
with open(os.path.join(os.environ["OUT"], "out-0.json"), "w") as f:
    json.dump({"raised": raised, "held": [
        r().__qualname__ for r in list(ft._held) if r() is not None]}, f)
"""


class TwoRanksTest(unittest.TestCase):
    """Two gloo ranks in child processes: DDP's gradients under faultline's
    hook are the same on both, the first iteration takes rank 0's order of
    ready gradients (a broadcast) before its all-reduces, and the second
    rank's records and groups come out right."""

    def test_two_ranks(self):
        d, agent, rcs, errs = run_ranks(self, RANK_SCRIPT, 2, 120)
        self.assertEqual(rcs, [0, 0], errs)
        outs = []
        for r in (0, 1):
            with open(os.path.join(d, f"out-{r}.json")) as f:
                outs.append(json.load(f))
        self.assertEqual(outs[0]["grads"], outs[1]["grads"])
        self.assertEqual(outs[0]["weights"], outs[1]["weights"])
        for r, out in enumerate(outs):
            self.assertEqual(out["ops"][:2], ["broadcast", "allreduce"])
            self.assertGreater(out["hook_buckets"], 0)
            self.assertEqual(out["groups"]["default_pg"]["global_ranks"],
                             [0, 1])
            self.assertEqual(out["groups"]["default_pg"]["group_rank"], r)
            self.assertEqual(out["pair"]["global_ranks"], [0, 1])
        groups = [r["groups"] for r in agent.requests
                  if r["op"] == "groups"]
        self.assertTrue(any(len(g) == 2 for g in groups))


RANK_SCRIPT = """
import json, os
import torch, torch.distributed as dist
import faultline.torch as ft
from helpers import RingReader

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"],
                        rank=rank, world_size=2)
ft.init()
pair = dist.new_group([0, 1])
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)])
ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.002)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(1 + rank)
for step in range(3):
    opt.zero_grad()
    ddp(torch.randn(8, 16)).pow(2).sum().backward()
    opt.step()
dist.all_reduce(torch.ones(1), group=pair)
r = RingReader(os.environ["FAULTLINE_RING"])
recs = r.read()
ops = [json.loads(x["name"])["opName"] for x in recs if x["type"] == 4]
out = {
    "grads": [p.grad.double().sum().item() for p in model.parameters()],
    "weights": [p.detach().double().sum().item() for p in model.parameters()],
    "ops": ops, "hook_buckets": ops.count("allreduce"),
    "groups": ft._groups(), "pair": ft._groups()[ft.group_name(pair)],
}
with open(os.path.join(os.environ["OUT"], "out-%d.json" % rank), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""


class ResumeLayoutTest(unittest.TestCase):
    """Four gloo ranks in child processes train a model of several DDP
    buckets, then train it again from the state of a step in the middle
    with a new DDP, as a rank restarted there does: under faultline's hook
    the weights come out bitwise the same, for each way of DDP's that
    rebuilds or keeps its buckets, and faultline's layout is the one DDP
    rebuilt. A hook that reduces the buckets as they come shows that the
    job would tell a different layout apart."""

    def test_a_resumed_step_is_reduced_in_the_rebuilt_layout(self):
        d, _, rcs, errs = run_ranks(self, LAYOUT_SCRIPT, 4, 300,
                                    OMP_NUM_THREADS="1")
        self.assertEqual(rcs, [0] * 4, errs)
        outs = []
        for r in range(4):
            with open(os.path.join(d, f"out-{r}.json")) as f:
                outs.append(json.load(f))
        for r, out in enumerate(outs):
            self.assertEqual(out["warnings"], [], r)
            for name, c in out["configs"].items():
                self.assertEqual(c["whole"], outs[0]["configs"][name]
                                 ["whole"], (r, name))
                self.assertEqual(c["resumed"], c["whole"], (r, name))
                if name == "find_unused_parameters":
                    self.assertIsNone(c["layout"])  # never rebuilt
                else:
                    self.assertGreater(len(c["layout"]), 2, name)
                    self.assertEqual(c["layout"], c["rebuilt"], name)
                self.assertTrue(c["steady"], name)
            control = out["control"]
            self.assertNotEqual(control["resumed"], control["whole"],
                                "the buckets as they come resume "
                                "bitwise too: the test would not tell "
                                "layouts apart")


LAYOUT_SCRIPT = """
import hashlib, json, os, warnings
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import faultline.torch as ft

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"],
                        rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
ft.init()
warnings.simplefilter("always")
# Buckets of 1 KiB, the first one too: a layer's weight and bias in each.
dist._DEFAULT_FIRST_BUCKET_BYTES = 1024
CAP = 1024 / 2 ** 20
STEPS, FAULT = 6, 3


def model():
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def wrap(m, hook, kw):
    ddp = DDP(m, bucket_cap_mb=CAP, **kw)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    return ddp, torch.optim.SGD(m.parameters(), lr=0.1)


def train(ddp, opt, steps):
    for step in steps:
        g = torch.Generator().manual_seed(step * 1009 + rank)
        opt.zero_grad()
        ddp(torch.randn(8, 16, generator=g)).pow(2).sum().backward()
        opt.step()


def digest(m):
    h = hashlib.sha256()
    for t in m.state_dict().values():
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def run(hook=None, **kw):
    m = model()
    ddp, opt = wrap(m, hook, kw)
    train(ddp, opt, range(FAULT))
    snap = {k: v.clone() for k, v in m.state_dict().items()}
    train(ddp, opt, range(FAULT, STEPS))
    again = model()
    again.load_state_dict(snap)
    ddp2, opt2 = wrap(again, hook, kw)  # a new reducer, as a restart's
    train(ddp2, opt2, range(FAULT, STEPS))
    out = {"whole": digest(m), "resumed": digest(again)}
    state = ddp._faultline_hook
    if hook is None:
        params = {id(p): i for i, p in
                  enumerate(ddp._build_params_for_reducer()[0])}
        out["layout"] = state.layout and [list(b) for b in state.layout]
        out["rebuilt"] = [[params[id(p)] for p in b.parameters()]
                          for b in ddp.reducer._get_zeros_like_grad_buckets()]
        out["steady"] = state.steady and ddp2._faultline_hook.steady
    return out


def as_they_come(state, bucket):
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(
        lambda f: buf)


with warnings.catch_warnings(record=True) as w:
    out = {"configs": {
        "default": run(),
        "static_graph": run(static_graph=True),
        "gradient_as_bucket_view": run(gradient_as_bucket_view=True),
        "find_unused_parameters": run(find_unused_parameters=True),
    }, "control": run(as_they_come)}
out["warnings"] = [str(x.message) for x in w
                   if "faultline" in str(x.message)]
with open(os.path.join(os.environ["OUT"], "out-%d.json" % rank), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""


if __name__ == "__main__":
    unittest.main()
