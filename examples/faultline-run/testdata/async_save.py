"""Saves every step with blocking=False, as the bug report's loop does;
rank 1 SIGKILLs itself at step 15 of the first run. argv: CKPT_DIR [bn]:
with bn, the model has a BatchNorm, whose running statistics the next
forward changes at once."""

import os
import signal
import sys

import torch
import torch.distributed as dist

import faultline.torch as ft

dist.init_process_group("gloo")
rank = dist.get_rank()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
ft.init()
torch.manual_seed(0)
if sys.argv[2:] == ["bn"]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, 8))
else:
    model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ck = ft.Checkpointer(sys.argv[1])
st = ck.load_checkpoint()
print(f"restart {restart} resumed from {st.get('step') if st else None}", flush=True)
if st:
    model.load_state_dict(st["model"])
for step in range(st["step"] + 1 if st else 0, 20):
    g = torch.Generator().manual_seed(step * 31 + rank)
    opt.zero_grad()
    model(torch.randn(4, 8, generator=g)).sum().backward()
    opt.step()
    if rank == 1 and step == 15 and restart == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    ck.save_checkpoint(step, {"model": model.state_dict(), "step": step}, blocking=False)
    dist.barrier()
print(f"done; abandoned {ck.wait() is False}", flush=True)
dist.destroy_process_group()
