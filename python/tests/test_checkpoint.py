"""Checkpointer: state_dicts saved into a segment in the ckpt FORMAT and
loaded back bitwise, and the inputs it refuses."""

import collections
import contextlib
import functools
import io
import json
import math
import os
import random
import struct
import threading
import time
import types
import unittest
import warnings
import weakref

import torch

import faultline
import faultline.torch as ft
from faultline import _segment, _state

from helpers import FakeAgent, newest_half


def bits(x):
    """A comparable form of a state, types exact: tensors and numpy arrays
    by dtype, shape and bytes, floats by their bits, dicts with their
    attributes, methods by function and the class they are bound to."""
    t = type(x)
    if isinstance(x, torch.Tensor):
        c = x.resolve_conj().contiguous()
        return ("tensor", str(c.dtype), tuple(c.shape),
                bytes(c.reshape(-1).view(torch.uint8).numpy()) if c.numel()
                else b"")
    if t.__module__ == "numpy":
        import numpy as np
        a = np.ascontiguousarray(x)
        return (t.__name__, a.dtype.str, a.shape, a.tobytes())
    if isinstance(x, dict):
        extra = (sorted(vars(x).items()) if t is collections.OrderedDict
                 else x.default_factory if t is collections.defaultdict
                 else None)
        return (t.__name__, [(bits(k), bits(v)) for k, v in x.items()],
                bits(extra))
    if isinstance(x, (list, tuple)):
        return (t.__name__, [bits(v) for v in x])
    if isinstance(x, (set, frozenset)):
        return (t.__name__, sorted((bits(v) for v in x), key=repr))
    if t is float:
        return ("float", struct.pack("<d", x))
    if t is complex:
        return ("complex", struct.pack("<dd", x.real, x.imag))
    if t is types.MethodType:
        return ("method", x.__func__, type(x.__self__))
    if isinstance(x, weakref.WeakMethod):
        return ("weakmethod", bits(x()))
    return (t.__name__, x)


def every_dtype():
    g = torch.Generator().manual_seed(7)
    out = {}
    for name in _state.DTYPES:
        dt = getattr(torch, name)
        if dt.is_floating_point or dt.is_complex:
            t = torch.randn(5, 3, generator=g, dtype=dt)
        elif dt == torch.bool:
            t = torch.rand(5, 3, generator=g) > 0.5
        else:
            t = torch.randint(-100 if name != "uint8" else 0, 100, (5, 3),
                              generator=g, dtype=dt)
        out[name] = t
    out["float32_special"] = torch.tensor([math.inf, -math.inf, math.nan,
                                           -0.0, 1e-45])
    return out


def model_and_optimizer():
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16),
                                torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    return model, opt


class CheckpointTest(unittest.TestCase):
    def setUp(self):
        self.agent = FakeAgent()
        os.environ["FAULTLINE_AGENT"] = self.agent.sock
        faultline._reset()
        self.ckpt = ft.Checkpointer(os.path.join(self.agent.dir, "ckpt"))

    def tearDown(self):
        del os.environ["FAULTLINE_AGENT"]
        faultline._reset()
        self.agent.close()
        self.ckpt._out.step = None  # for the exit hook: the agent is gone

    def roundtrip(self, state, step=1):
        self.assertTrue(self.ckpt.save_checkpoint(step, state))
        got = self.ckpt.load_checkpoint()
        self.assertEqual(bits(got), bits(state))
        return got

    def test_model_optimizer_rng_and_plain_values(self):
        model, opt = model_and_optimizer()
        state = {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "step": 12,
            "rng": {"torch": torch.get_rng_state(),
                    "python": random.getstate()},
            "plain": [None, True, False, 0, -(1 << 70), 1.5, math.inf,
                      -math.inf, -0.0, "é\n\"", b"\x00\xff", (1, (2, [3])),
                      {}, [], {"nested": {"deeper": [{"x": 1}]}}],
            "int keys": {0: "zero", -5: "minus five", "s": 2},
        }
        got = self.roundtrip(state)
        self.assertTrue(math.isnan(self.ckpt.load_checkpoint()["plain"][6]
                                   - math.inf))
        # The model and the optimizer take the state back.
        m2, o2 = model_and_optimizer()
        m2.load_state_dict(got["model"])
        o2.load_state_dict(got["optimizer"])
        self.assertEqual(bits(m2.state_dict()), bits(model.state_dict()))
        torch.set_rng_state(got["rng"]["torch"])
        random.setstate(got["rng"]["python"])

    def test_every_dtype_empty_and_zero_d(self):
        state = every_dtype()
        state.update({
            "empty": torch.empty(0, 3),
            "empty_int": torch.zeros(2, 0, 5, dtype=torch.int8),
            "zero_d": torch.tensor(3.25), "zero_d_bool": torch.tensor(True),
            "zero_d_complex": torch.tensor(1 + 2j, dtype=torch.complex128),
        })
        got = self.roundtrip(state)
        self.assertEqual(got["zero_d"].shape, torch.Size([]))
        self.assertEqual(got["empty_int"].shape, (2, 0, 5))

    def test_non_contiguous_tensors_are_saved_contiguous(self):
        base = torch.arange(60, dtype=torch.float64).reshape(3, 4, 5)
        state = {"t": base.transpose(0, 2), "s": base[:, ::2, 1],
                 "e": base.expand(2, 3, 4, 5),
                 "c": torch.randn(3, 2, dtype=torch.complex64).conj()}
        got = self.roundtrip(state)
        for k, v in state.items():
            self.assertTrue(got[k].is_contiguous())
            self.assertTrue(torch.equal(got[k], v.resolve_conj()), k)

    def test_requires_grad_and_parameters(self):
        p = torch.nn.Parameter(torch.randn(4))
        got = self.roundtrip({"p": p})
        self.assertFalse(got["p"].requires_grad)

    def test_steps_alternate_halves_and_load_the_newest(self):
        for step in range(1, 5):
            self.assertTrue(self.ckpt.save_checkpoint(step, {"w": torch.full(
                (10,), float(step)), "step": step}))
            got = self.ckpt.load_checkpoint()
            self.assertEqual(got["step"], step)
        path, _ = self.agent.segments[self.ckpt.checkpoint_dir]
        half, seq, step = newest_half(path)
        self.assertEqual((seq, step), (4, 4))
        self.assertEqual(self.agent.ops().count("saved"), 4)
        self.assertEqual(self.agent.ops().count("segment"), 1)

    def test_load_into_a_state_in_place(self):
        model, opt = model_and_optimizer()
        saved = {"model": model.state_dict(), "step": 4}
        want = bits(saved)
        self.assertTrue(self.ckpt.save_checkpoint(4, saved))
        m2, _ = model_and_optimizer()
        m2.apply(lambda m: [p.data.zero_() for p in m.parameters(recurse=False)])
        into = {"model": m2.state_dict(), "step": None}
        got = self.ckpt.load_checkpoint(into=into)
        self.assertEqual(bits(got), want)
        for k, t in m2.state_dict().items():  # the model took the step in place
            self.assertEqual(got["model"][k].data_ptr(), t.data_ptr())
        self.assertEqual(bits(m2.state_dict()), bits(model.state_dict()))
        # A tensor of another shape there is not written over.
        odd = {"model": {k: torch.zeros(1) for k in saved["model"]}}
        got = self.ckpt.load_checkpoint(into=odd)
        self.assertEqual(bits(got), want)
        self.assertTrue(all(t.numel() == 1 for t in odd["model"].values()))

    def test_no_checkpoint_is_an_empty_dict(self):
        self.assertEqual(self.ckpt.load_checkpoint(), {})

    def test_a_start_over_is_told_to_the_agent(self):
        # The agent reports what its ranks resumed from: a rank that
        # starts over, no step being held by every rank, says so with a
        # load of step -1, not leaving the agent with its first answer.
        self.assertEqual(self.ckpt.load_checkpoint(), {})
        self.assertEqual(self.ckpt.load_checkpoint(), {})
        loads = [r for r in self.agent.requests if r["op"] == "load"]
        self.assertEqual([r.get("step") for r in loads], [None, -1])

    def test_refused_before_anything_is_written(self):
        self.assertTrue(self.ckpt.save_checkpoint(1, {"w": torch.ones(3)}))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex32 is experimental
            chalf = torch.ones(2, dtype=torch.complex32)
        bad = [
            ({"a": {"b": [torch.ones(2).to_sparse()]}}, '["a"]["b"][0]'),
            ({"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0,
                                             torch.qint8)}, '["q"]'),
            ({"h": chalf}, '["h"]'),
            ({"o": object()}, '["o"]'),
            ({"k": {(1, object()): 3}}, '["k"]'),
            ({"k": {torch.ones(1): 3}}, '["k"]'),
            ({"m": torch.empty(3, device="meta")}, '["m"]'),
        ]
        for state, where in bad:
            with self.assertRaises(TypeError) as cm:
                self.ckpt.save_checkpoint(2, state)
            self.assertIn(where, str(cm.exception))
        loop = []
        loop.append(loop)
        with self.assertRaises(TypeError):
            self.ckpt.save_checkpoint(2, {"loop": loop})
        for step in (-1, 1.5, True, "3"):
            with self.assertRaises(ValueError):
                self.ckpt.save_checkpoint(step, {})
        with self.assertRaises(ValueError):
            self.ckpt.save_checkpoint(2, {}, storage_type="disk")
        # Nothing reached the segment: step 1 is still the newest.
        self.assertEqual(self.ckpt.load_checkpoint()["w"].tolist(), [1.0] * 3)
        self.assertEqual(self.agent.ops().count("saved"), 1)

    def test_a_larger_state_grows_the_segment(self):
        self.assertTrue(self.ckpt.save_checkpoint(1, {"w": torch.ones(10)}))
        path, _ = self.agent.segments[self.ckpt.checkpoint_dir]
        ino = os.stat(path).st_ino
        big = {"w": torch.arange(200000, dtype=torch.float64)}
        self.assertTrue(self.ckpt.save_checkpoint(2, big))
        self.assertEqual(self.agent.ops().count("segment"), 2)
        self.assertEqual(bits(self.ckpt.load_checkpoint()), bits(big))
        path2, half_size = self.agent.segments[self.ckpt.checkpoint_dir]
        self.assertEqual(path2, path)  # grown under its name
        self.assertNotEqual(os.stat(path).st_ino, ino)
        self.assertGreaterEqual(half_size, 200000 * 8)

    def test_a_segment_grown_by_the_agent_is_mapped_anew(self):
        # The agent may grow the segment on its own (Owner.Grow): the next
        # save finds the path naming a new file and maps it.
        self.assertTrue(self.ckpt.save_checkpoint(1, {"w": torch.ones(10)}))
        path, half = self.agent.segments[self.ckpt.checkpoint_dir]
        self.agent.grow(path, half, 4 * half)
        self.agent.segments[self.ckpt.checkpoint_dir] = (path, 4 * half)
        self.assertEqual(self.ckpt.load_checkpoint()["w"].tolist(), [1.0] * 10)
        self.assertTrue(self.ckpt.save_checkpoint(2, {"w": torch.zeros(10)}))
        self.assertEqual(self.ckpt._seg.half_size, 4 * half)
        self.assertEqual(self.ckpt.load_checkpoint()["w"].tolist(), [0.0] * 10)
        self.assertEqual(self.agent.ops().count("segment"), 1)

    def test_a_save_holds_the_shared_lock(self):
        import fcntl
        self.assertTrue(self.ckpt.save_checkpoint(1, {"w": torch.ones(10)}))
        path, _ = self.agent.segments[self.ckpt.checkpoint_dir]
        held = []

        def probe(i, off, orig=None):
            fd = os.open(path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append(False)
            except BlockingIOError:
                held.append(True)
            finally:
                os.close(fd)

        seg = self.ckpt._seg
        seg.save(2, ["meta"], [1], probe)
        self.assertEqual(held, [True])
        fd = os.open(path, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released after
        os.close(fd)

    def test_a_segment_the_agent_cannot_grow(self):
        self.agent.handlers["segment"] = lambda req, conn: {
            "ok": False, "error": f"segment for {req['dir']}: {req['bytes']} "
            "bytes exceed the free shared memory"}
        with self.assertRaises(faultline.AgentError) as cm:
            self.ckpt.save_checkpoint(1, {"w": torch.ones(10)})
        self.assertIn("free shared memory", str(cm.exception))

    def test_busy_half_skips_the_save(self):
        self.assertTrue(self.ckpt.save_checkpoint(1, {"w": torch.ones(3)}))
        seg = self.ckpt._seg
        t = seg.target()
        pin = (seg.base(t) + 4) // 4
        seg.u32[pin] = 1
        self.assertFalse(self.ckpt.save_checkpoint(2, {"w": torch.zeros(3)}))
        seg.u32[pin] = 0
        self.assertEqual(self.ckpt.load_checkpoint()["w"].tolist(), [1.0] * 3)
        self.assertTrue(self.ckpt.save_checkpoint(2, {"w": torch.zeros(3)}))

    def test_a_disk_save_waits_for_a_busy_half(self):
        # A step asked to outlast the job is not skipped: its save waits
        # for the agent to let go of the half.
        self.assertTrue(self.ckpt.save_checkpoint(1, {"w": torch.ones(3)}))
        seg = self.ckpt._seg
        pin = (seg.base(seg.target()) + 4) // 4
        seg.u32[pin] = 1
        threading.Timer(0.2, seg.u32.__setitem__, (pin, 0)).start()
        t0 = time.monotonic()
        self.assertTrue(self.ckpt.save_checkpoint(
            2, {"w": torch.zeros(3)}, storage_type=ft.StorageType.DISK))
        self.assertGreaterEqual(time.monotonic() - t0, 0.2)
        pins = [(seg.base(i) + 4) // 4 for i in (0, 1)]
        for p in pins:
            seg.u32[p] = 1
        seg.persist_wait = 0.1
        with self.assertWarnsRegex(RuntimeWarning, "both halves still held"):
            self.assertFalse(self.ckpt.save_checkpoint(
                3, {"w": torch.zeros(3)}, storage_type=ft.StorageType.DISK))
        for p in pins:
            seg.u32[p] = 0
        self.assertEqual(self.ckpt.load_checkpoint()["w"].tolist(), [0.0] * 3)

    def test_exit_waits_for_the_last_disk_step(self):
        # At exit a rank waits for its newest DISK step to commit: in a
        # job of several nodes, the last one commits once every node's
        # shards are durable, which a node whose ranks left hears no more.
        # The Checkpointer, a local of the training function, is gone by
        # then: the hook holds what it waits for apart.
        exit_hook = functools.partial(ft._wait_at_exit, self.ckpt._out)
        exit_hook()
        self.assertEqual([r for r in self.agent.requests if r["op"] == "wait"], [])
        self.assertTrue(self.ckpt.save_checkpoint(
            5, {"w": torch.ones(3)}, storage_type=ft.StorageType.DISK))
        self.agent.committed = 5
        exit_hook()
        waits = [r for r in self.agent.requests if r["op"] == "wait"]
        self.assertEqual([(r["step"], r["timeout_s"]) for r in waits], [(5, 1)])
        self.agent.committed = 4
        self.ckpt._seg.persist_wait = 2
        self.assertTrue(self.ckpt.save_checkpoint(
            5, {"w": torch.ones(3)}, storage_type=ft.StorageType.DISK))
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            exit_hook()
        self.assertIn("waiting up to 2 s at exit for step 5", err.getvalue())
        self.assertIn("at exit, step 5 may not be committed on disk: "
                      "faultline agent: op wait: step 5 not committed",
                      err.getvalue())
        waits = [r for r in self.agent.requests if r["op"] == "wait"]
        self.assertEqual([(r["step"], r["timeout_s"]) for r in waits[1:]], [(5, 1), (5, 2)])

    def test_exit_ends_the_save_in_flight(self):
        # A DISK save with blocking=False at the last step, its
        # Checkpointer gone by exit: the hook ends it, tells the agent and
        # waits for that step, not the DISK step before it.
        self.agent.committed = 9
        self.assertTrue(self.ckpt.save_checkpoint(
            9, {"w": torch.ones(3)}, storage_type=ft.StorageType.DISK))
        self.assertTrue(self.ckpt.save_checkpoint(
            19, {"w": torch.ones(1 << 16)}, storage_type=ft.StorageType.DISK,
            blocking=False))
        out = self.ckpt._out
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            ft._wait_at_exit(out)
        saved = [(r["step"], r["persist"]) for r in self.agent.requests if r["op"] == "saved"]
        self.assertEqual(saved, [(9, True), (19, True)])
        waits = [r["step"] for r in self.agent.requests if r["op"] == "wait"]
        self.assertEqual(waits[0], 19)
        self.assertIsNone(out.pending)

    def test_a_forked_child_leaves_the_wait_to_its_parent(self):
        self.assertTrue(self.ckpt.save_checkpoint(
            5, {"w": torch.ones(3)}, storage_type=ft.StorageType.DISK))
        out = self.ckpt._out
        out.pid = -1  # as in a child forked after the save
        ft._wait_at_exit(out)
        self.assertEqual([r for r in self.agent.requests if r["op"] == "wait"], [])

    def test_disk_asks_the_agent_to_persist(self):
        self.agent.persists = False
        self.assertTrue(self.ckpt.wait_latest_checkpoint(1))
        self.assertTrue(self.ckpt.save_checkpoint(
            5, {"w": torch.ones(3)}, storage_type=ft.StorageType.DISK))
        saved = [r for r in self.agent.requests if r["op"] == "saved"]
        self.assertEqual(saved[-1], {"op": "saved", "step": 5,
                                     "persist": True})
        seg = self.ckpt._seg
        self.assertEqual(seg.u64[40 // 8], 1)  # persist_seq = the save's seq
        with self.assertWarns(RuntimeWarning):
            self.assertFalse(self.ckpt.wait_latest_checkpoint(1))
        self.agent.committed = 5
        self.assertTrue(self.ckpt.wait_latest_checkpoint(1))
        self.assertTrue(ft.DdpCheckpointer is ft.Checkpointer)

    def test_the_segment_holds_the_format(self):
        state = {"a": torch.arange(5, dtype=torch.int32), "b": [1, "x"],
                 "c": torch.tensor([1.5, -2.0], dtype=torch.float64)}
        self.assertTrue(self.ckpt.save_checkpoint(9, state))
        seg = self.ckpt._seg
        h = seg.read(newest_half(seg.path)[0])
        self.assertEqual(h.step, 9)
        self.assertEqual(list(h.blobs), ["meta", "data0"])
        off, size = h.blobs["data0"]
        self.assertEqual(off % 64, 0)
        self.assertEqual(bytes(seg.mv[off:off + size]),
                         bytes(torch.arange(5, dtype=torch.int32).numpy())
                         + bytes(44) + struct.pack("<2d", 1.5, -2.0))
        off, size = h.blobs["meta"]
        self.assertEqual(json.loads(bytes(seg.mv[off:off + size])), {
            "format": "faultline.state/2", "step": 9,
            "tensors": [
                {"dtype": "int32", "shape": [5], "blob": "data0", "off": 0},
                {"dtype": "float64", "shape": [2], "blob": "data0",
                 "off": 64}],
            "tree": {"d": [["a", {"t": 0}],
                           ["b", {"l": [{"v": 1}, {"v": "x"}]}],
                           ["c", {"t": 1}]]}})

    def test_a_step_of_format_1_still_loads(self):
        # What earlier releases wrote: a blob "t<k>" per tensor, int keys
        # as {"i": n}, tensor nodes with their dtype and shape.
        meta = json.dumps({"format": "faultline.state/1", "step": 3, "tree": {
            "d": [["w", {"t": 0, "dtype": "float32", "shape": [2, 2]}],
                  [{"i": 7}, {"l": [{"v": None}, {"f": "-inf"},
                                    {"b": "AAE="}, {"tu": [{"v": 1.5}]}]}],
                  ["e", {"t": 1, "dtype": "int8", "shape": [0]}]]}}).encode()
        w = torch.arange(4, dtype=torch.float32).reshape(2, 2)
        self.assertTrue(self.ckpt.save_checkpoint(1, {"w": torch.ones(1)}))
        seg = self.ckpt._seg

        def write(i, off):
            if i == 0:
                seg.mv[off:off + len(meta)] = meta
            elif i == 1:
                seg.mv[off:off + 16] = bytes(w.numpy())

        seg.save(3, ["meta", "t0", "t1"], [len(meta), 16, 0], write)
        got = self.ckpt.load_checkpoint()
        self.assertEqual(bits(got), bits({
            "w": w, 7: [None, -math.inf, b"\x00\x01", (1.5,)],
            "e": torch.zeros(0, dtype=torch.int8)}))

    def test_many_tensors_fit_in_few_blobs(self):
        # A step holds at most 65536 blobs (ckpt/layout.MaxBlobs): MoE
        # experts and their optimizer state pass that in tensors.
        g = torch.Generator().manual_seed(5)
        n = 70001
        experts = {f"experts.{i}.w": torch.randint(0, 1 << 30, (i % 7 + 1,),
                                                   generator=g,
                                                   dtype=torch.int32)
                   for i in range(n)}
        state = {"model": experts, "big": torch.rand(1 << 18, generator=g),
                 "step": torch.tensor(3.0)}
        self.assertTrue(self.ckpt.save_checkpoint(1, state))
        h = self.ckpt._seg.read(newest_half(self.ckpt._seg.path)[0])
        self.assertLessEqual(len(h.blobs), 1 << 16)
        self.assertEqual(bits(self.ckpt.load_checkpoint()), bits(state))

    def test_a_step_of_too_many_blobs_is_refused_at_save(self):
        self.assertTrue(self.ckpt.save_checkpoint(1, {"w": torch.ones(3)}))
        pack = _state.pack
        try:
            _state.pack = lambda nbytes: (list(nbytes), [
                (i, 0) for i in range(len(nbytes))])
            _state.MAX_BLOBS = 4
            with self.assertRaises(ValueError) as cm:
                self.ckpt.save_checkpoint(
                    2, [torch.zeros(1) for _ in range(4)])
            self.assertIn("5 blobs exceed the 4", str(cm.exception))
        finally:
            _state.pack, _state.MAX_BLOBS = pack, 1 << 16
        self.assertEqual(self.ckpt.load_checkpoint()["w"].tolist(), [1.0] * 3)
        self.assertEqual(self.agent.ops().count("saved"), 1)

    def test_tied_weights_are_stored_once_and_load_as_one_tensor(self):
        torch.manual_seed(4)
        emb = torch.nn.Embedding(10, 4)
        head = torch.nn.Linear(4, 10, bias=False)
        head.weight = emb.weight
        model = torch.nn.Sequential(emb, head)
        sd = model.state_dict()
        self.assertIsNot(sd["0.weight"], sd["1.weight"])  # detached twice
        self.assertTrue(self.ckpt.save_checkpoint(1, {"model": sd}))
        h = self.ckpt._seg.read(newest_half(self.ckpt._seg.path)[0])
        off, size = h.blobs["meta"]
        meta = json.loads(bytes(self.ckpt._seg.mv[off:off + size]))
        self.assertEqual(len(meta["tensors"]), 1)
        got = self.ckpt.load_checkpoint()["model"]
        self.assertIs(got["0.weight"], got["1.weight"])
        self.assertTrue(torch.equal(got["0.weight"], emb.weight))
        # In place: the tied parameter of a fresh model takes it.
        fresh = torch.nn.Sequential(torch.nn.Embedding(10, 4),
                                    torch.nn.Linear(4, 10, bias=False))
        fresh[1].weight = fresh[0].weight
        got = self.ckpt.load_checkpoint(into={"model": fresh.state_dict()})
        self.assertEqual(got["model"]["0.weight"].data_ptr(),
                         fresh[0].weight.data_ptr())
        self.assertTrue(torch.equal(fresh[1].weight, emb.weight))

    def test_staged_copy_in_chunks(self):
        src = torch.arange(1000, dtype=torch.int16).view(torch.uint8)
        for stage in (1, 7, 64, 2000, 4000):
            dst = torch.zeros(src.numel(), dtype=torch.uint8)
            bufs = [torch.empty(stage, dtype=torch.uint8) for _ in range(2)]
            copies = []

            def copy_in(buf, part):
                buf.copy_(part)
                copies.append(buf.data_ptr())
                return len(copies)

            ft._chunked_copy(dst, src, bufs, copy_in, lambda tok: None)
            self.assertTrue(torch.equal(dst, src), stage)

    def test_without_agent(self):
        del os.environ["FAULTLINE_AGENT"]
        with self.assertRaises(RuntimeError) as cm:
            ft.Checkpointer("/tmp/x")
        self.assertIn("FAULTLINE_AGENT", str(cm.exception))
        self.assertIn("faultline-run", str(cm.exception))
        os.environ["FAULTLINE_AGENT"] = self.agent.sock


class StateTest(unittest.TestCase):
    def test_bad_trees_are_refused(self):
        for tree in ({}, {"x": 1}, {"d": 3}, {"d": [[1, {"v": 1}]]},
                     {"v": [1]}, {"v": 1, "l": []}, {"f": "huge"},
                     {"b": "!!"}, {"l": {}}, {"t": "0"},
                     {"d": [[{"l": []}, {"v": 1}]]},
                     {"set": [{"l": []}]}, {"c": [{"v": 1}]},
                     {"d": [[{"i": 1}, {"v": 1}]]},
                     {"ns": "|O8", "bytes": ""}, {"dt": "Tensor"},
                     {"dev": "nowhere"}, {"fn": "os:system"},
                     {"fn": "torch.optim.lr_scheduler:__builtins__.eval"},
                     {"m": "torch.optim.lr_scheduler:OneCycleLR._annealing_cos"},
                     {"d": [["f", {"m": "torch.optim.lr_scheduler:"
                                   "OneCycleLR.__init__"}]]},
                     {"od": [], "md": {"x": 1}}, {"dd": [], "factory": "eval"}):
            with self.assertRaises(_state.TreeError, msg=tree):
                _state.unflatten(tree, lambda *a: None)
        for tree in ({"set": []}, {"d": [[{"v": 1}, {"v": 1}]]},
                     {"l": [{"sz": [1]}]}):
            with self.assertRaises(_state.TreeError, msg=tree):
                _state.unflatten(tree, lambda *a: None, version=1)
        for e in ({"blob": "data0", "off": 0, "dtype": "uint16", "shape": []},
                  {"blob": "data0", "off": -1, "dtype": "int8", "shape": []},
                  {"blob": "data0", "off": 0, "shape": [1]},
                  {"blob": "data0", "off": 0, "dtype": "int8", "np": "|i1",
                   "shape": [1]},
                  {"blob": "data0", "off": 0, "np": "|O8", "shape": [1]},
                  {"blob": 0, "off": 0, "dtype": "int8", "shape": [1]},
                  {"blob": "data0", "off": 0, "dtype": "int8",
                   "shape": [-1]}):
            with self.assertRaises(_state.TreeError, msg=e):
                _state.entry(e, 0)

    def test_pack_keeps_below_the_blob_limit(self):
        sizes, places = _state.pack([10, 0, 100, 3])
        self.assertEqual(sizes, [64 + 128 + 3])
        self.assertEqual(places, [(0, 0), (0, 64), (0, 64), (0, 192)])
        sizes, places = _state.pack([_state.PACK, 1, _state.PACK - 64, 1])
        self.assertEqual(sizes, [_state.PACK, _state.PACK, 1])
        self.assertEqual([b for b, _ in places], [0, 1, 1, 2])
        # However large the state, its blobs stay under the limit.
        n = [(1 << 40) + 1] * 40000
        self.assertLess(len(_state.pack(n)[0]), _state.MAX_BLOBS)

    def test_segment_layout_matches_ckpt(self):
        # layout.StepSize: header, table, CRC array, 64-aligned blobs, pages.
        table, offs, end = _segment.layout(["meta", "t0"], [10, 100])
        self.assertEqual(table, 2 * 32)
        self.assertEqual(offs, [192, 256])
        self.assertEqual(end, 356)
        self.assertEqual(_segment.step_size(["meta", "t0"], [10, 100]), 4096)


if __name__ == "__main__":
    unittest.main()
