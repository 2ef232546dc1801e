"""A data-parallel PyTorch training job for faultline-run.

    go run ./examples/faultline-run --standalone --nproc-per-node 4 examples/faultline-run/train.py

Each rank trains a small MLP on batches drawn from a generator seeded by
(step, rank), so that a run is bitwise reproducible on CPU; DDP's gradient
all-reduce goes through faultline's comm hook, which reduces a process's
first step in the buckets DDP rebuilds after it, as every later step, so
that a restarted rank sums each gradient in the order the run without the
fault did. --bucket-cap-mb sets DDP's bucket size, its first bucket's too
(0.0002 puts the model in three buckets). Every step is checkpointed to
the node agent's memory (every --disk-every steps also to disk) and a
restarted job resumes from the newest step every rank holds.

Faults to show recovery and diagnosis: --kill-rank R --kill-step S (the
rank SIGKILLs itself at step S of the first run), --hang-rank R
--hang-step S (the rank blocks before the step's all-reduce), --slow-rank R
(its forward takes --slow-ms longer). --weights FILE has rank 0 write the
final weights' SHA-256 there. --exit-at-once has each rank exit right after
it: no barrier, no destroy_process_group, its exit hooks run and the
interpreter's finalization skipped (os._exit), so that it is gone a
moment after its last save.

--init FILE starts from a state that torch.save wrote (the dict the job
checkpoints: model, optimizer, step), as from a pretrained checkpoint,
instead of the newest step the job holds; --save-state FILE has rank 0
write the final state so. A job run in parts with them, each on as many
ranks as a job that changed its world had in that part, is the
reference of an elastic run.

--baseline trains without faultline, checkpointing with torch.save every
--disk-every steps, as a torchrun job would: the side-by-side comparison of
recovery times runs it under torch.distributed.run.
"""

import argparse
import atexit
import hashlib
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-ms", type=float, default=0, help="extra time per step, to watch a job")
    p.add_argument("--ckpt", default="faultline-out/ckpt", help="checkpoint folder")
    p.add_argument("--disk-every", type=int, default=10)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--hang-step", type=int, default=-1)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=50)
    p.add_argument("--weights", default="")
    p.add_argument("--exit-at-once", action="store_true")
    p.add_argument("--init", default="", help="start from this torch.save'd state instead of the job's newest step")
    p.add_argument("--save-state", default="", help="rank 0 torch.saves the final state here")
    p.add_argument("--bucket-cap-mb", type=float, default=0, help="DDP's bucket size, its first bucket's too")
    p.add_argument("--baseline", action="store_true")
    p.add_argument("--state-mb", type=float, default=0, help="a buffer of this size saved with the state, as a large model's")
    return p.parse_args()


def batch(step, rank):
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(64, 32, generator=g)
    y = (x.sum(dim=1, keepdim=True) > 0).float()
    return x, y


def main():
    args = parse()
    # Before the rendezvous: a start in a world that is not the job's
    # shows here even if it never gets past init_process_group.
    print(f"starting rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}", flush=True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    buckets = {}
    if args.bucket_cap_mb:
        dist._DEFAULT_FIRST_BUCKET_BYTES = int(args.bucket_cap_mb * 1024 * 1024)
        buckets["bucket_cap_mb"] = args.bucket_cap_mb
    if args.baseline:
        span = _nospan
        ddp = DDP(model, **buckets)
        ckpt = TorchSaveCheckpointer(args.ckpt, rank)
    else:
        import faultline
        import faultline.torch as ft
        span = faultline.span
        ft.init()
        ddp = DDP(model, **buckets)
        ckpt = ft.Checkpointer(args.ckpt)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    ballast = torch.zeros(int(args.state_mb * (1 << 18))) if args.state_mb else None

    start = 0
    state = torch.load(args.init) if args.init else ckpt.load_checkpoint()
    if state:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"] + 1
        print(f"resumed from step {state['step']}", flush=True)

    for step in range(start, args.steps):
        with span(f"step {step}"):
            with span("dataloader"):
                if rank == args.hang_rank and step == args.hang_step and restart == 0:
                    print(f"blocking in get_batch at step {step}", flush=True)
                    get_batch_forever()
                x, y = batch(step, rank)
            with span("forward"):
                if rank == args.slow_rank:
                    time.sleep(args.slow_ms / 1000)
                loss = loss_fn(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if args.step_ms:
                time.sleep(args.step_ms / 1000)
            if rank == args.kill_rank and step == args.kill_step and restart == 0:
                print(f"killing myself at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            with span("save_checkpoint"):
                state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
                if ballast is not None:
                    ballast[step % len(ballast)] = step
                    state["ballast"] = ballast
                if args.baseline:
                    if (step + 1) % args.disk_every == 0:
                        ckpt.save_checkpoint(step, state)
                else:
                    disk = (step + 1) % args.disk_every == 0
                    ckpt.save_checkpoint(step, state, storage_type=ft.StorageType.DISK if disk else ft.StorageType.MEMORY)
        print(f"step {step} loss {loss.item():.6f}", flush=True)

    if rank == 0 and args.save_state:
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": args.steps - 1}
        torch.save(state, args.save_state + ".tmp")
        os.replace(args.save_state + ".tmp", args.save_state)
    if rank == 0 and args.weights:
        h = hashlib.sha256()
        for name, t in model.state_dict().items():
            h.update(name.encode())
            h.update(t.detach().contiguous().numpy().tobytes())
        with open(args.weights, "w") as f:
            f.write(h.hexdigest() + "\n")
    if args.exit_at_once:
        atexit._run_exitfuncs()
        os._exit(0)
    dist.barrier()
    dist.destroy_process_group()


def get_batch_forever():
    while True:
        time.sleep(3600)


class _nospan:
    def __init__(self, name):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class TorchSaveCheckpointer:
    """What a torchrun job does: torch.save to a file, torch.load of the newest."""

    def __init__(self, folder, rank):
        self.folder, self.rank = folder, rank
        os.makedirs(folder, exist_ok=True)

    def save_checkpoint(self, step, state):
        path = os.path.join(self.folder, f"step-{step}-rank-{self.rank}.pt")
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        dist.barrier()
        if self.rank == 0:
            with open(os.path.join(self.folder, "latest.tmp"), "w") as f:
                f.write(str(step))
            os.replace(os.path.join(self.folder, "latest.tmp"), os.path.join(self.folder, "latest"))

    def load_checkpoint(self):
        try:
            with open(os.path.join(self.folder, "latest")) as f:
                step = int(f.read())
        except FileNotFoundError:
            return {}
        path = os.path.join(self.folder, f"step-{step}-rank-{self.rank}.pt")
        if not os.path.exists(path):
            # A rank the job did not have when it saved (it grew since):
            # a data-parallel job's every rank holds the model.
            path = os.path.join(self.folder, f"step-{step}-rank-0.pt")
        return torch.load(path)


if __name__ == "__main__":
    sys.exit(main())
