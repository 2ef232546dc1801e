"""Saves with blocking=False and updates the state in place at once, so
that the copy is torn and the save abandoned; then waits to be ended.
argv: CKPT_DIR."""

import sys
import time
import warnings

import torch
import torch.distributed as dist

import faultline.torch as ft

dist.init_process_group("gloo")
ft.init()
ck = ft.Checkpointer(sys.argv[1])
w = torch.zeros(16 << 20)  # 64 MiB: its copy takes far longer than issuing the update
ck.save_checkpoint(0, {"w": w})
ck.save_checkpoint(1, {"w": w}, blocking=False)
w.add_(1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    kept = ck.wait()
print(f"kept {kept}; warned: {[str(c.message) for c in caught]}", flush=True)
time.sleep(60)
