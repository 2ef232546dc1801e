"""A small data-parallel PyTorch job (gloo, CPU) that dots its steps in
MindCluster's record format, for the tests of package slownode.

    python3 ddp.py --root DIR --job NAME [--world 4] [--steps 80]
                   [--batch 32] [--width 256] [--device-ms MS]
                   [--slow-rank R --slow-from S --slow-factor F]
                   [--slow-io R --slow-io-from S --slow-io-factor F]

Each rank writes <root>/<job>/<rank>/<10-digit seconds> (JSON Lines, one
mspti marker record a line: "step <n>", "forward" and "dataloader" ranges,
and the gradient all-reduces of DDP's communication hook in domain
"communication") and parallel_group.json beside it. A slow rank takes
--slow-factor times as long in forward and backward from step --slow-from
on, as a throttled device would; a slow loader takes --slow-io-factor
times as long to load each batch, as a throttled disk would. Both scale
with what the batch or the layers took, so that a machine whose load
stretches every rank's figures stretches the slowdown alike.

With --device-ms, the model's compute also runs on a modelled device: its
forward waits MS milliseconds and its backward twice as long, as a host
waits for an accelerator's kernels, which the ranks do not share as they
share this machine's cores; a slow rank's factor then stretches those
waits too.
"""

import argparse
import json
import os
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

GROUP = "group_dp_0"


class Dots:
    """Records of one rank, written to its folder at the end."""

    def __init__(self, rank):
        self.rank = rank
        self.pid = os.getpid()
        self.id = time.time_ns()
        self.lines = []
        self.lock = threading.Lock()  # the hook's end runs on gloo's thread

    def _rec(self, flag, source, rid, name, domain, stream):
        obj = {"Kind": 1, "Flag": flag, "SourceKind": source, "Timestamp": time.time_ns(), "Id": rid,
               "MsptiObjectId": {"Pt": {"ProcessId": self.pid, "ThreadId": self.pid},
                                 "Ds": {"DeviceId": self.rank, "StreamId": stream}},
               "Name": name, "Domain": domain}
        line = json.dumps(obj, separators=(",", ":"))
        with self.lock:
            self.lines.append(line)

    def start(self, name, domain="default", host=False, stream=0):
        with self.lock:
            self.id += 1
            rid = self.id
        # Step, forward and communication ranges carry the device flags,
        # dataloader ranges the host ones, as MindCluster writes them.
        self._rec(2 if host else 16, 0, rid, name, domain, stream)
        return (rid, host, stream)

    def end(self, span):
        rid, host, stream = span
        self._rec(4 if host else 32, 0, rid, "", "", stream)

    def comm(self, op, count):
        name = json.dumps({"opName": op, "groupName": GROUP, "count": str(count), "dataType": "fp32",
                           "streamId": "1"}, separators=(",", ":"))
        return self.start(name, "communication", stream=1)

    def write(self, root, job, world):
        d = os.path.join(root, job, str(self.rank))
        os.makedirs(d, exist_ok=True)
        groups = {GROUP: {"group_name": "dp", "group_rank": self.rank, "global_ranks": list(range(world))}}
        with open(os.path.join(d, "parallel_group.json"), "w") as f:
            json.dump(groups, f)
        with open(os.path.join(d, "%010d" % int(time.time())), "w") as f:
            f.write("\n".join(self.lines) + "\n")


class Samples(torch.utils.data.Dataset):
    """Samples that cost some work to make, as decoding would."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(48, 48, generator=g)
        x = (x @ x.T).flatten()[:256] / 48  # the "decode"
        return x, i % 10


class Slow(torch.autograd.Function):
    """Identity whose forward and backward take the device's time
    (box["device"] seconds, twice that in backward: the kernels of an
    accelerator the host waits for) and, on a slow rank, factor times
    all of it, the layers' work on the cores included (that of backward
    taken as twice forward's): a device that slowed down."""

    @staticmethod
    def forward(ctx, x, box):
        ctx.box = box
        wait = _wait(box)
        if wait > 0:
            time.sleep(wait)
        return x

    @staticmethod
    def backward(ctx, g):
        wait = 2 * _wait(ctx.box)
        if wait > 0:
            time.sleep(wait)
        return g, None


def _wait(box):
    """What a forward waits for beyond its layers' work on the cores."""
    return box["device"] * box["factor"] + box["fwd"] * (box["factor"] - 1)


class Net(torch.nn.Module):
    def __init__(self, box, width):
        super().__init__()
        self.box = box
        self.body = torch.nn.Sequential(
            torch.nn.Linear(256, width), torch.nn.ReLU(),
            torch.nn.Linear(width, width), torch.nn.ReLU(),
            torch.nn.Linear(width, 10))

    def forward(self, x):
        t = time.perf_counter()
        h = self.body(x)
        self.box["fwd"] = time.perf_counter() - t
        return Slow.apply(h, self.box)


def worker(rank, a, store):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=a.world)
    torch.manual_seed(0)
    box = {"factor": 1.0, "fwd": 0.0, "device": a.device_ms / 1000}
    model = DDP(Net(box, a.width), bucket_cap_mb=0.25)
    dots = Dots(rank)

    def hook(state, bucket):
        buf = bucket.buffer()
        span = dots.comm("allreduce", buf.numel())
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(f):
            dots.end(span)
            return f.value()[0].div_(a.world)
        return fut.then(done)

    model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = iter(torch.utils.data.DataLoader(Samples(a.batch * a.steps), batch_size=a.batch))
    for step in range(a.steps):
        slow = rank == a.slow_rank and step >= a.slow_from
        box["factor"] = a.slow_factor if slow else 1.0
        slow_io = rank == a.slow_io and step >= a.slow_io_from
        s = dots.start("step %d" % step)
        d = dots.start("dataloader", host=True)
        t = time.perf_counter()
        x, y = next(loader)
        if slow_io:
            time.sleep((a.slow_io_factor - 1) * (time.perf_counter() - t))
        dots.end(d)
        f = dots.start("forward")
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        dots.end(f)
        opt.zero_grad()
        loss.backward()
        opt.step()
        dots.end(s)
    dots.write(a.root, a.job, a.world)
    dist.barrier()
    # Leave at once: the job's outputs are written, and a process group's
    # teardown has been seen to hang.
    os._exit(0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--device-ms", type=float, default=0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-from", type=int, default=0)
    p.add_argument("--slow-factor", type=float, default=1.0)
    p.add_argument("--slow-io", type=int, default=-1)
    p.add_argument("--slow-io-from", type=int, default=0)
    p.add_argument("--slow-io-factor", type=float, default=1.0)
    a = p.parse_args()
    # A file store: no port to choose and lose to another process.
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(worker, args=(a, os.path.join(d, "store")),
                           nprocs=a.world, start_method="fork")


if __name__ == "__main__":
    main()
