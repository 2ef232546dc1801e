"""Saves a state of MIB MiB a rank (blocking, MEMORY) at steps 0..5 and
loads it back after each save, as a rollback without a restart would.
argv: CKPT_DIR MIB."""

import sys

import torch
import torch.distributed as dist

import faultline.torch as ft

dist.init_process_group("gloo")
rank = dist.get_rank()
ft.init()
ckpt_dir, mib = sys.argv[1], int(sys.argv[2])
w = torch.zeros(mib << 18)
ck = ft.Checkpointer(ckpt_dir)
print(f"first load: {ck.load_checkpoint()}", flush=True)
for step in range(6):
    w.fill_(step * 10 + rank)
    ck.save_checkpoint(step, {"w": w, "step": step})
    got = ck.load_checkpoint()
    ok = got and got["step"] == step and bool(torch.all(got["w"] == step * 10 + rank))
    print(f"after save {step}: loaded {got.get('step') if got else got} {'ok' if ok else 'WRONG'}", flush=True)
dist.barrier()
