"""A rank that reads the control plane through its node agent: what the
manager's Admin API serves (members, switch status, faults, orchestrations)."""

import json
import os

import faultline.admin

members = faultline.admin.members()
switch = faultline.admin.switch_status()
faults = faultline.admin.faults()
orchs = faultline.admin.orchestrations()
workers = sorted(m["rank"] for m in members if m["role"] == "worker")
print("admin", os.environ["RANK"], json.dumps({"workers": workers, "switch": switch["Switch"],
                                                "faults": len(faults or []), "history": len(orchs.get("History") or [])}), flush=True)
