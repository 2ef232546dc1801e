"""A rank that reads the control plane through its node agent: what the
manager's Admin API serves (members, switch status, faults, orchestrations)."""

import json
import os
import time

import torch.distributed as dist

import faultline.admin

dist.init_process_group("gloo")  # so that no rank leaves before the others have read
world = int(os.environ["WORLD_SIZE"])
deadline = time.monotonic() + 30
while True:  # the other ranks' workers register as they start
    members = faultline.admin.members()
    if sum(m["role"] == "worker" for m in members) == world or time.monotonic() > deadline:
        break
    time.sleep(0.05)
switch = faultline.admin.switch_status()
faults = faultline.admin.faults()
orchs = faultline.admin.orchestrations()
workers = sorted(m["rank"] for m in members if m["role"] == "worker")
print("admin", os.environ["RANK"], json.dumps({"workers": workers, "switch": switch["Switch"],
                                                "faults": len(faults or []), "history": len(orchs.get("History") or [])}), flush=True)
dist.barrier()
dist.destroy_process_group()
