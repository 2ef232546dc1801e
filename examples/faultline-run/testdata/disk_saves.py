"""Loads the newest checkpoint and says which step it holds, then saves
a state of MIB MiB a rank with StorageType.DISK every EVERY steps (and
MEMORY between) for STEPS steps, then exits at once.
argv: CKPT_DIR MIB STEPS EVERY."""

import sys

import torch
import torch.distributed as dist

import faultline.torch as ft

dist.init_process_group("gloo")
rank = dist.get_rank()
ft.init()
ckpt_dir, mib, steps, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
w = torch.zeros(mib << 18)  # float32: MIB MiB
ck = ft.Checkpointer(ckpt_dir)
st = ck.load_checkpoint()
print(f"resumed from {st['step'] if st else None}", flush=True)
for step in range(steps):
    w.fill_(step * 10 + rank)
    disk = (step + 1) % every == 0
    ck.save_checkpoint(step, {"w": w, "step": step},
                       storage_type=ft.StorageType.DISK if disk else ft.StorageType.MEMORY)
    print(f"saved {step}{' disk' if disk else ''}", flush=True)
dist.barrier()
