"""faultline.torch.init: the agent's hello, collective records, the DDP
hook, process groups and the stack dump, in a world of one gloo rank here
and of two in child processes."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest
import warnings

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

    def test_ddp_hook_all_reduces_each_gradient(self):
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

    def test_a_user_hook_runs_under_ours(self):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
        calls = []

        def hook(state, bucket):
            calls.append(bucket.index())
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, hook)
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


class TwoRanksTest(unittest.TestCase):
    """Two gloo ranks in child processes: the per-gradient DDP hook keeps
    the result of each all-reduce independent of the bucket layout, and the
    second rank's records and groups come out right."""

    def test_two_ranks(self):
        d = tempfile.mkdtemp(prefix="faultline-two-")
        agent = FakeAgent()
        try:
            script = os.path.join(d, "rank.py")
            with open(script, "w") as f:
                f.write(textwrap.dedent(RANK_SCRIPT))
            procs = []
            for rank in (0, 1):
                ring = make_ring(os.path.join(d, f"ring-{rank}"), 1 << 20)
                env = dict(os.environ, PYTHONPATH=PACKAGE + os.pathsep + HERE,
                           RANK=str(rank), WORLD_SIZE="2",
                           FAULTLINE_AGENT=agent.sock, FAULTLINE_RING=ring,
                           STORE=os.path.join(d, "store"), OUT=d)
                procs.append(subprocess.Popen([sys.executable, script],
                                              env=env))
            for p in procs:
                self.assertEqual(p.wait(timeout=120), 0)
            outs = []
            for r in (0, 1):
                with open(os.path.join(d, f"out-{r}.json")) as f:
                    outs.append(json.load(f))
            self.assertEqual(outs[0]["grads"], outs[1]["grads"])
            self.assertEqual(outs[0]["weights"], outs[1]["weights"])
            for r, out in enumerate(outs):
                self.assertEqual(out["ops"][:2], ["allreduce", "allreduce"])
                self.assertGreater(out["hook_buckets"], 0)
                self.assertEqual(out["groups"]["default_pg"]["global_ranks"],
                                 [0, 1])
                self.assertEqual(out["groups"]["default_pg"]["group_rank"], r)
                self.assertEqual(out["pair"]["global_ranks"], [0, 1])
            groups = [r["groups"] for r in agent.requests
                      if r["op"] == "groups"]
            self.assertTrue(any(len(g) == 2 for g in groups))
        finally:
            agent.close()
            shutil.rmtree(d)


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


if __name__ == "__main__":
    unittest.main()
