"""DDP's step time with and without faultline.torch.init(), side by side in
one job under faultline-run (BenchmarkDDPHook).

Each rank trains two copies of one model: the first wrapped by DDP before
ft.init() (DDP's own all-reduce), the second after it (faultline's comm
hook), in alternating blocks of steps, the pair's order swapped each
repetition, so that both see the same machine at the same times. Rank 0
prints one line: "ddp-bench " and a JSON object with the median over the
blocks of each side's milliseconds a step, and the median over the
repetitions of faultline's time over plain DDP's (a pair of blocks run
one after the other shares the machine's load of the moment: on a busy
machine, blocks of one step tell a difference of a few percent best).
"""

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import faultline.torch as ft


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=100)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=200, help="blocks on each side")
    p.add_argument("--steps", type=int, default=1, help="steps a block")
    args = p.parse_args()

    dist.init_process_group("gloo")

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width)
                                     for _ in range(args.layers)])

    plain = DDP(model())
    ft.init()
    hooked = DDP(model())
    sides = {"plain": plain, "faultline": hooked}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3)
            for k, m in sides.items()}
    x = torch.randn(args.batch, args.width)

    def block(name, steps):
        ddp, opt = sides[name], opts[name]
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            ddp(x).pow(2).mean().backward()
            opt.step()
        return (time.perf_counter() - t0) / steps * 1e3

    for name in sides:  # the first steps, the bucket rebuild, warm caches
        block(name, 5)
    ms = {name: [] for name in sides}
    for rep in range(args.reps):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for name in order:
            ms[name].append(block(name, args.steps))
    if dist.get_rank() == 0:
        out = {f"{k}_ms": statistics.median(v) for k, v in ms.items()}
        out["ratio"] = statistics.median(
            f / p for f, p in zip(ms["faultline"], ms["plain"]))
        print("ddp-bench " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
