"""The Python half of BenchmarkCheckpoint.

usage: bench_ckpt.py MIB SHM_DIR DISK_DIR [TENSOR_KIB]
Saves and loads a state_dict of MIB MiB of float32 tensors (TENSOR_KIB KiB
each, default 16384)
through the agent at FAULTLINE_AGENT and times, in the same rounds and on
the same bytes: tensor.copy_ into preallocated shared-memory tensors and
back out of them, and torch.save to a new file in DISK_DIR (with and
without fsync). Prints the best round of each, in seconds, as JSON.
"""

import json
import mmap
import os
import sys
import time

import torch

import faultline.torch as ft

ROUNDS = 5


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    mib, shm, disk = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    chunk = (int(sys.argv[4]) if len(sys.argv) > 4 else 16 << 10) << 8
    n = mib * (1 << 20) // 4
    g = torch.Generator().manual_seed(1)
    tensors = [torch.rand(min(chunk, n - i), generator=g)
               for i in range(0, n, chunk)]
    state = {"model": {f"layer{i}.weight": t for i, t in enumerate(tensors)},
             "step": 1}
    nbytes = sum(t.numel() * 4 for t in tensors)

    ckpt = ft.Checkpointer(disk)
    for step in (0, 1):  # the segment mapped, the pages of both halves touched
        assert ckpt.save_checkpoint(step, state)
    ckpt.load_checkpoint()

    # Baseline: the same bytes in preallocated shared-memory tensors.
    path = os.path.join(shm, "bench-copy")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes)
    os.close(fd)
    os.unlink(path)
    flat = torch.frombuffer(mm, dtype=torch.float32)
    dst, off = [], 0
    for t in tensors:
        dst.append(flat[off:off + t.numel()])
        off += t.numel()

    def copy_in():
        for d, t in zip(dst, tensors):
            d.copy_(t)

    def copy_out():
        return [d.clone() for d in dst]

    into = [torch.empty_like(t) for t in tensors]

    def copy_out_prealloc():
        for o, d in zip(into, dst):
            o.copy_(d)

    def torch_save(sync):
        def run():
            f = os.path.join(disk, "torch-save.pt")
            with open(f, "wb") as fh:
                torch.save(state, fh)
                if sync:
                    fh.flush()
                    os.fsync(fh.fileno())
        return run

    copy_in()
    into_state = {"model": {f"layer{i}.weight": o for i, o in enumerate(into)}}
    times = {k: [] for k in ("save", "save_async", "save_async_total",
                             "copy", "load", "load_into", "copy_back",
                             "copy_back_prealloc", "torch_save",
                             "torch_save_fsync")}
    for r in range(ROUNDS):
        times["save"].append(timed(lambda: ckpt.save_checkpoint(2 + r, state)))
        t0 = time.perf_counter()
        assert ckpt.save_checkpoint(100 + r, state, blocking=False)
        t1 = time.perf_counter()
        assert ckpt.wait()
        times["save_async"].append(t1 - t0)
        times["save_async_total"].append(time.perf_counter() - t0)
        times["copy"].append(timed(copy_in))
        times["load"].append(timed(ckpt.load_checkpoint))
        times["load_into"].append(timed(
            lambda: ckpt.load_checkpoint(into=into_state)))
        times["copy_back"].append(timed(copy_out))
        times["copy_back_prealloc"].append(timed(copy_out_prealloc))
        if r < 2:
            for sync in (False, True):
                k = "torch_save_fsync" if sync else "torch_save"
                times[k].append(timed(torch_save(sync)))
                os.unlink(os.path.join(disk, "torch-save.pt"))
    out = {k: min(v) for k, v in times.items()}
    out["bytes"] = nbytes
    print(json.dumps(out))


if __name__ == "__main__":
    main()
