"""What a training loop's checkpoint holds, saved and loaded without pickle:
every torch.optim.lr_scheduler, GradScaler, RNG states, numpy, config; and
what needs allow_pickle, or cannot be saved at all."""

import collections
import dataclasses
import enum
import functools
import json
import math
import os
import pickle
import random
import unittest
import warnings
import weakref
from unittest import mock

import torch
import torch.optim.lr_scheduler as L

import faultline
import faultline.torch as ft

from helpers import FakeAgent, newest_half
from test_checkpoint import bits, model_and_optimizer

try:
    import numpy as np
except ImportError:  # python3-torch does not bring numpy on every system
    np = None


class Lambda:
    """An lr_lambda with state: LambdaLR's state_dict keeps its __dict__."""

    def __init__(self, rate):
        self.rate = rate

    def __call__(self, epoch):
        return self.rate ** epoch


def module_function(x):
    return x


@dataclasses.dataclass
class Config:
    name: str
    weights: torch.Tensor


UNPICKLED = []


def record(what):
    UNPICKLED.append(what)


class Trap:
    """Records that it was unpickled."""

    def __reduce__(self):
        return (record, ("unpickled",))


# Each lr_scheduler of torch 1.13 (CyclicLR in each mode, OneCycleLR in
# each annealing), made on an SGD optimizer with momentum.
SCHEDULERS = {
    "LambdaLR": lambda o: L.LambdaLR(o, Lambda(0.9)),
    "LambdaLR/function": lambda o: L.LambdaLR(o, lambda e: 0.95 ** e),
    "MultiplicativeLR": lambda o: L.MultiplicativeLR(o, Lambda(0.8)),
    "StepLR": lambda o: L.StepLR(o, 3, gamma=0.5),
    "MultiStepLR": lambda o: L.MultiStepLR(o, [2, 4, 4, 7], gamma=0.5),
    "ConstantLR": lambda o: L.ConstantLR(o, factor=0.5, total_iters=4),
    "LinearLR": lambda o: L.LinearLR(o, start_factor=0.25, total_iters=5),
    "ExponentialLR": lambda o: L.ExponentialLR(o, 0.9),
    "SequentialLR": lambda o: L.SequentialLR(
        o, [L.ConstantLR(o, 0.5, 3), L.ExponentialLR(o, 0.9)], [3]),
    "PolynomialLR": lambda o: L.PolynomialLR(o, total_iters=8, power=2.0),
    "CosineAnnealingLR": lambda o: L.CosineAnnealingLR(o, 6, eta_min=1e-3),
    "ChainedScheduler": lambda o: L.ChainedScheduler(
        [L.ConstantLR(o, 0.5, 3), L.ExponentialLR(o, 0.9)]),
    "ReduceLROnPlateau": lambda o: L.ReduceLROnPlateau(o, patience=1,
                                                       factor=0.5),
    "CyclicLR": lambda o: L.CyclicLR(o, 0.01, 0.1, step_size_up=3),
    "CyclicLR/triangular2": lambda o: L.CyclicLR(o, 0.01, 0.1, 2,
                                                 mode="triangular2"),
    "CyclicLR/exp_range": lambda o: L.CyclicLR(o, 0.01, 0.1, 2,
                                               mode="exp_range", gamma=0.9),
    "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(
        o, 3, T_mult=2),
    "OneCycleLR": lambda o: L.OneCycleLR(o, 0.1, total_steps=50),
    "OneCycleLR/linear": lambda o: L.OneCycleLR(o, 0.1, total_steps=50,
                                                anneal_strategy="linear"),
}


class Base(unittest.TestCase):
    def setUp(self):
        self.agent = FakeAgent()
        os.environ["FAULTLINE_AGENT"] = self.agent.sock
        faultline._reset()
        self.ckpt = ft.Checkpointer(os.path.join(self.agent.dir, "ckpt"))

    def tearDown(self):
        del os.environ["FAULTLINE_AGENT"]
        faultline._reset()
        self.agent.close()

    def roundtrip(self, state, **kw):
        self.assertTrue(self.ckpt.save_checkpoint(1, state, **kw))
        got = self.ckpt.load_checkpoint(**kw)
        self.assertEqual(bits(got), bits(state))
        return got

    def meta(self):
        seg = self.ckpt._seg
        off, size = seg.read(newest_half(seg.path)[0]).blobs["meta"]
        return json.loads(bytes(seg.mv[off:off + size]))


class SchedulerTest(Base):
    def test_every_scheduler_class_is_tested(self):
        classes = {n for n, c in vars(L).items() if isinstance(c, type)
                   and c.__module__ == L.__name__ and not n.startswith("_")
                   and n != "LRScheduler"}  # torch 2's public base class
        self.assertEqual(classes, {n.split("/")[0] for n in SCHEDULERS})

    def test_every_scheduler_resumes_where_it_was(self):
        for name, make in SCHEDULERS.items():
            with self.subTest(name):
                self.check_scheduler(make)

    def check_scheduler(self, make):
        def fresh():
            p = torch.nn.Parameter(torch.ones(3))
            o = torch.optim.SGD([p], lr=0.1, momentum=0.9)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return o, make(o)

        def step(o, s, i):
            o.step()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # SequentialLR's deprecated
                if isinstance(s, L.ReduceLROnPlateau):
                    s.step([3.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0][i % 7])
                else:
                    s.step()
            return [(g["lr"], g["momentum"]) for g in o.param_groups]

        o, s = fresh()
        for i in range(5):
            step(o, s, i)
        self.assertTrue(self.ckpt.save_checkpoint(
            5, {"scheduler": s.state_dict(), "optimizer": o.state_dict()}))
        got = self.ckpt.load_checkpoint()
        self.assertEqual(bits(got["scheduler"]), bits(s.state_dict()))
        o2, s2 = fresh()
        o2.load_state_dict(got["optimizer"])
        s2.load_state_dict(got["scheduler"])
        for i in range(5, 40):
            self.assertEqual(step(o2, s2, i), step(o, s, i), i)

    def test_methods_are_saved_by_name(self):
        o = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1,
                            momentum=0.9)
        s = L.CyclicLR(o, 0.01, 0.1, mode="exp_range", gamma=0.5)
        one = L.OneCycleLR(o, 0.1, total_steps=10)
        self.assertTrue(self.ckpt.save_checkpoint(
            1, {"cyclic": s.state_dict(), "one": one.state_dict()}))
        tree = dict(self.meta()["tree"]["d"])
        self.assertIn(["_scale_fn_ref", {
            "wm": "torch.optim.lr_scheduler:CyclicLR._exp_range_scale_fn"}],
            tree["cyclic"]["d"])
        self.assertIn(["anneal_func", {
            "m": "torch.optim.lr_scheduler:OneCycleLR._annealing_cos"}],
            tree["one"]["d"])
        # Bound to an object of the class with the state_dict's entries.
        got = self.ckpt.load_checkpoint()
        ref = got["cyclic"]["_scale_fn_ref"]
        self.assertIsInstance(ref, weakref.WeakMethod)
        self.assertEqual(ref()(3), 0.5 ** 3)
        self.assertEqual(ref().__self__.gamma, 0.5)
        f = got["one"]["anneal_func"]
        self.assertEqual(f(1.0, 0.0, 0.5), one.anneal_func(1.0, 0.0, 0.5))

    def test_a_lambda_cannot_be_saved(self):
        o = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1,
                            momentum=0.9)
        s = L.CyclicLR(o, 0.01, 0.1, scale_fn=lambda x: 0.5)
        self.assertTrue(self.ckpt.save_checkpoint(1, {"w": torch.ones(2)}))
        for allow in (False, True):
            with self.assertRaises(TypeError) as cm:
                self.ckpt.save_checkpoint(2, {"scheduler": s.state_dict()},
                                          allow_pickle=allow)
            msg = str(cm.exception)
            self.assertIn('state_dict["scheduler"]["_scale_fn_custom"]', msg)
            self.assertIn("lambda", msg)
        # Left out, the scheduler made again with it takes the rest.
        sd = s.state_dict()
        del sd["_scale_fn_custom"]
        self.assertTrue(self.ckpt.save_checkpoint(2, {"scheduler": sd}))
        s2 = L.CyclicLR(o, 0.01, 0.1, scale_fn=lambda x: 0.5)
        s2.load_state_dict(self.ckpt.load_checkpoint()["scheduler"])
        self.assertEqual(s2.get_last_lr(), s.get_last_lr())
        self.assertEqual(s2.scale_fn(3), 0.5)


class TrainingStateTest(Base):
    def test_model_metadata_and_optimizer(self):
        model, opt = model_and_optimizer()
        sd = model.state_dict()
        got = self.roundtrip({"model": sd, "optimizer": opt.state_dict()})
        self.assertIs(type(got["model"]), collections.OrderedDict)
        self.assertEqual(got["model"]._metadata, sd._metadata)
        m2, o2 = model_and_optimizer()
        m2.load_state_dict(got["model"])
        o2.load_state_dict(got["optimizer"])

    def test_grad_scaler(self):
        amp = torch.cuda.amp.grad_scaler
        with mock.patch.object(amp, "amp_definitely_not_available",
                               lambda: False):
            scaler = amp.GradScaler(init_scale=1024.0, growth_interval=7)
            scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
            got = self.roundtrip({"scaler": scaler.state_dict()})
            s2 = amp.GradScaler()
            s2.load_state_dict(got["scaler"])
        self.assertEqual(s2.state_dict(), scaler.state_dict())

    def test_rng_states(self):
        states = lambda: {  # noqa: E731
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all(),
            "python": random.getstate()}
        torch.manual_seed(9)
        random.seed(9)
        got = self.roundtrip(states())
        want = (torch.rand(3), random.random())
        torch.set_rng_state(got["torch"])
        torch.cuda.set_rng_state_all(got["cuda"])
        random.setstate(got["python"])
        self.assertEqual(bits((torch.rand(3), random.random())), bits(want))

    @unittest.skipIf(np is None, "numpy is not installed")
    def test_numpy_rng_states(self):
        np.random.seed(4)
        gen = np.random.default_rng(4)
        state = {"legacy": np.random.get_state(),
                 "dict": np.random.get_state(legacy=False),
                 "generator": gen.bit_generator.state}
        got = self.roundtrip(state)
        want = (np.random.rand(3), gen.random(3))
        np.random.set_state(got["legacy"])
        gen.bit_generator.state = got["generator"]
        self.assertEqual(bits((np.random.rand(3), gen.random(3))), bits(want))
        np.random.set_state(got["dict"])

    @unittest.skipIf(np is None, "numpy is not installed")
    def test_numpy_arrays_and_scalars(self):
        a = np.arange(24, dtype=np.float64).reshape(2, 3, 4)
        state = {
            "dtypes": [(np.arange(6) % 3).astype(d) for d in (
                np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32,
                np.uint32, np.int64, np.uint64, np.float16, np.float32,
                np.float64, np.longdouble, np.complex64, np.complex128)],
            "big_endian": np.arange(3, dtype=">i4"),
            "fortran": np.asfortranarray(a), "strided": a[:, ::2, 1],
            "zero_d": np.array(2.5), "empty": np.zeros((0, 3), np.int16),
            "time": np.array(["2024-01-02", "NaT"], dtype="datetime64[D]"),
            "delta": np.array([5], dtype="timedelta64[ms]"),
            "strings": np.array(["a", "bé"]), "bytes": np.array([b"xy"]),
            "scalars": [np.float32(1.5), np.float64(-0.0), np.int8(-3),
                        np.uint64(1 << 63), np.bool_(True),
                        np.complex64(1 - 2j), np.float16(math.inf),
                        np.datetime64("2024-01-02T03:04"), np.str_("s")],
            (np.int64(3), np.float32(2)): "numpy scalars as a key",
        }
        got = self.roundtrip(state)
        self.assertEqual(got["dtypes"][-1].dtype, np.complex128)
        self.assertTrue(got["fortran"].flags.c_contiguous)
        # An array of objects is pickle's.
        with self.assertRaises(TypeError) as cm:
            self.ckpt.save_checkpoint(2, {"o": np.array([object()])})
        self.assertIn('["o"]', str(cm.exception))
        self.assertIn("allow_pickle=True", str(cm.exception))

    @unittest.skipIf(np is None, "numpy is not installed")
    def test_numpy_arrays_of_an_async_save_are_taken_when_it_begins(self):
        a = np.arange(4.0)
        self.assertTrue(self.ckpt.save_checkpoint(
            1, {"a": a, "w": torch.ones(2)}, blocking=False))
        a[:] = -1  # numpy arrays have no version counter to catch this
        self.assertTrue(self.ckpt.wait())
        self.assertEqual(self.ckpt.load_checkpoint()["a"].tolist(),
                         [0.0, 1.0, 2.0, 3.0])

    def test_plain_config(self):
        state = {
            "set": {1, "two", (3, 4)}, "frozen": frozenset({b"x"}),
            "complex": [1 - 2j, complex(math.inf, math.nan)],
            "keys": {(1, "a"): 1, True: 2, None: 3, 1.5: 4, b"k": 5,
                     frozenset({1}): 6, 1j: 7, torch.float16: 8},
            "size": torch.Size([2, 3]), "dtype": torch.bfloat16,
            "device": torch.device("cuda", 1), "buf": bytearray(b"\x00\xff"),
            "counter": collections.Counter("abracadabra"),
            "default": collections.defaultdict(list, {"a": [1]}),
            "default_none": collections.defaultdict(None, {1: 2}),
            "ordered": collections.OrderedDict([("z", 1), ("a", 2)]),
            "big": -(1 << 100), "inf": -math.inf,
        }
        got = self.roundtrip(state)
        got["default"]["new"].append(1)
        self.assertEqual(got["counter"]["zzz"], 0)

    def test_functions_of_lr_scheduler_by_name(self):
        fn = L.CyclicLR._triangular2_scale_fn
        got = self.roundtrip({"fn": fn})
        self.assertIs(got["fn"], fn)


class AllowPickleTest(Base):
    def test_refused_without_allow_pickle_before_anything_is_written(self):
        self.assertTrue(self.ckpt.save_checkpoint(1, {"w": torch.ones(3)}))
        Point = collections.namedtuple("Point", "x y")

        class Color(enum.IntEnum):
            RED = 1

        class Dict(dict):
            pass

        class Slotted:
            __slots__ = ()

            def method(self):
                return 1

        od = collections.OrderedDict(a=1)
        od.extra = 2
        refused = [
            ({"cfg": Config("x", torch.ones(1))}, '["cfg"]', "Config"),
            ({"f": module_function}, '["f"]', "module_function"),
            ({"p": Point(1, 2)}, '["p"]', "Point"),
            ({"c": [Color.RED]}, '["c"][0]', "Color"),
            ({"d": Dict()}, '["d"]', "Dict"),
            ({"od": od}, '["od"]', "extra"),
            ({"dd": collections.defaultdict(Lambda)}, '["dd"]', "Lambda"),
            ({"m": Slotted().method}, '["m"]', "Slotted.method"),
            ({"p": functools.partial(module_function, 1)}, '["p"]',
             "partial"),
            ({"m": {"g": L.OneCycleLR._annealing_cos.__get__(Slotted())}},
             '["m"]["g"]', "_annealing_cos"),
        ]
        for state, where, what in refused:
            with self.subTest(what):
                with self.assertRaises(TypeError) as cm:
                    self.ckpt.save_checkpoint(2, state)
                msg = str(cm.exception)
                self.assertIn(where, msg)
                self.assertIn(what, msg)
                self.assertIn("allow_pickle=True", msg)
        # Nor can a WeakMethod be saved, pickled or not, unless it is
        # lr_scheduler's own.
        wm = weakref.WeakMethod(Lambda(1).__call__)
        with self.assertRaises(TypeError) as cm:
            self.ckpt.save_checkpoint(2, {"w": wm}, allow_pickle=True)
        self.assertIn('["w"]', str(cm.exception))
        self.assertEqual(self.ckpt.load_checkpoint()["w"].tolist(), [1.0] * 3)
        self.assertEqual(self.agent.ops().count("saved"), 1)

    def test_pickled_state_loads_only_when_allowed(self):
        w = torch.arange(1000, dtype=torch.float32)
        state = {"model": {"w": torch.ones(4)},
                 "cfg": Config("run-1", w), "f": module_function,
                 "trap": Trap()}
        self.assertTrue(self.ckpt.save_checkpoint(1, state,
                                                  allow_pickle=True))
        UNPICKLED.clear()
        into = {"model": {"w": torch.zeros(4)}}
        with self.assertRaises(pickle.UnpicklingError) as cm:
            self.ckpt.load_checkpoint(into=into)
        self.assertIn('state_dict["cfg"]', str(cm.exception))
        self.assertIn("allow_pickle=True", str(cm.exception))
        self.assertEqual(UNPICKLED, [])  # nothing ran
        self.assertEqual(into["model"]["w"].tolist(), [0.0] * 4)  # untouched
        got = self.ckpt.load_checkpoint(into=into, allow_pickle=True)
        self.assertEqual(UNPICKLED, ["unpickled"])
        self.assertEqual(got["cfg"].name, "run-1")
        self.assertEqual(bits(got["cfg"].weights), bits(w))
        self.assertIs(got["f"], module_function)
        self.assertEqual(into["model"]["w"].tolist(), [1.0] * 4)
        # The tensor in the pickle is in a data blob, not in the pickle.
        meta = self.meta()
        self.assertEqual([e["shape"] for e in meta["tensors"]], [[4], [1000]])
        self.assertLess(len(json.dumps(meta)), 1000)


if __name__ == "__main__":
    unittest.main()
