"""The Python half of TestCrossLanguageCheckpoint.

usage: xlang_ckpt.py save DIR OUT.json | load DIR
save: saves step 1 (memory), step 2 (disk) and step 3 (memory, with a tensor
of 2 MiB and 70001 small ones more, for which the agent grows the segment)
of the state below through the agent at FAULTLINE_AGENT and writes, for the
Go side, the meta blob's JSON and the SHA-256 of each blob of steps 2 and 3.
load: loads the newest step back and exits 0 when it is bitwise step 3's
state, its types included.
"""

import hashlib
import json
import math
import random
import struct
import sys
import types
import weakref

import torch
import torch.optim.lr_scheduler as L

import faultline.torch as ft

try:
    import numpy as np
except ImportError:
    np = None

DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32",
          "int16", "int8", "uint8", "bool", "complex64", "complex128")


KEEP = []


def state(step):
    torch.manual_seed(11)
    random.seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
    opt = torch.optim.Adam(model.parameters())
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 6)).sum().backward()
        opt.step()
    g = torch.Generator().manual_seed(step)
    tensors = {}
    for name in DTYPES:
        dt = getattr(torch, name)
        if dt.is_floating_point or dt.is_complex:
            tensors[name] = torch.randn(4, 3, generator=g, dtype=dt)
        elif dt == torch.bool:
            tensors[name] = torch.rand(4, 3, generator=g) > 0.5
        else:
            tensors[name] = torch.randint(0, 100, (4, 3), generator=g,
                                          dtype=dt)
    big = {"big": torch.arange(1 << 19, dtype=torch.float32),
           "experts": {f"{i}.w": torch.full((i % 3 + 1,), i, dtype=torch.int32)
                       for i in range(70001)}} if step == 3 else {}
    emb = torch.nn.Embedding(4, 2)
    tied = torch.nn.Sequential(emb, torch.nn.Linear(2, 4, bias=False))
    tied[1].weight = emb.weight
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheds = {"one_cycle": L.OneCycleLR(sgd, 0.1, total_steps=10),
              "cyclic": L.CyclicLR(sgd, 0.01, 0.1, mode="exp_range"),
              "multistep": L.MultiStepLR(sgd, [2, 2, 5])}
    KEEP.append(scheds)  # a WeakMethod in CyclicLR's state names it
    extra = {}
    if np is not None:
        np.random.seed(11)
        extra["numpy"] = {"rng": np.random.get_state(),
                          "u16": np.arange(6, dtype=np.uint16).reshape(2, 3),
                          "scalar": np.float32(0.25)}
    return {
        **big, **extra,
        "tied": tied.state_dict(),
        "schedulers": {k: v.state_dict() for k, v in scheds.items()},
        "config": {"set": {"a", "b"}, "size": torch.Size([2, 3]),
                   "dtype": torch.bfloat16, (1, "k"): 1j},
        "model": model.state_dict(), "optimizer": opt.state_dict(),
        "tensors": tensors, "step": step,
        "empty": torch.empty(0, 2), "zero_d": torch.tensor(2.5),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "plain": [None, True, 1 << 65, -0.0, math.inf, "é", b"\x00\x01",
                  (1, [2]), {3: "three"}],
    }


def bits(x):
    t = type(x)
    if isinstance(x, torch.Tensor):
        c = x.contiguous()
        return (str(c.dtype), tuple(c.shape),
                bytes(c.reshape(-1).view(torch.uint8).numpy()))
    if t.__module__ == "numpy":
        a = np.ascontiguousarray(x)
        return (t.__name__, a.dtype.str, a.shape, a.tobytes())
    if isinstance(x, dict):
        return (t.__name__, [(bits(k), bits(v)) for k, v in x.items()],
                bits(getattr(x, "_metadata", None)))
    if isinstance(x, (list, tuple)):
        return (t.__name__, [bits(v) for v in x])
    if isinstance(x, (set, frozenset)):
        return (t.__name__, sorted(bits(v) for v in x))
    if t is float:
        return ("float", x.hex())
    if t is complex:
        return ("complex", struct.pack("<dd", x.real, x.imag))
    if t is types.MethodType:
        return ("method", x.__func__.__qualname__, type(x.__self__).__name__)
    if isinstance(x, weakref.WeakMethod):
        return ("weakmethod", bits(x()))
    return (t.__name__, repr(x))


def main():
    mode, ckpt = sys.argv[1], ft.Checkpointer(sys.argv[2])
    if mode == "save":
        out = {}
        for step in (1, 2, 3):
            kind = ft.StorageType.DISK if step == 2 else ft.StorageType.MEMORY
            assert ckpt.save_checkpoint(step, state(step), storage_type=kind)
            if step == 2:
                assert ckpt.wait_latest_checkpoint(30)
            seg = ckpt._seg
            half = seg.read(seg.target() ^ 1)
            off, size = half.blobs["meta"]
            meta = json.loads(bytes(seg.mv[off:off + size]))
            sums = {name: hashlib.sha256(bytes(seg.mv[o:o + n])).hexdigest()
                    for name, (o, n) in half.blobs.items()}
            out[step] = {"meta": meta, "sha256": sums,
                         "half_size": seg.half_size}
        with open(sys.argv[3], "w") as f:
            json.dump(out, f)
        return 0
    got = ckpt.load_checkpoint()
    if bits(got) != bits(state(3)):
        print("loaded state differs from the saved one", file=sys.stderr)
        return 1
    if got["tied"]["0.weight"] is not got["tied"]["1.weight"]:
        print("tied weights loaded as two tensors", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
