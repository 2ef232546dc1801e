"""The job's c10d store, hosted for the whole job by node 0's agent.

    python -c "import faultline.store as s; s.main()"

As torchrun's agent does, faultline-run keeps the store that
init_process_group's env:// rendezvous uses in a process of its own on
MASTER_ADDR:MASTER_PORT, and its ranks connect to it as clients
(TORCHELASTIC_USE_AGENT_STORE=True), keying their rendezvous by their restart
count (TORCHELASTIC_RESTART_COUNT). Restarted ranks then find a live store
at once instead of waiting for a new rank 0 to bind the port.

It prints "ready" once serving, and serves until it is killed.
"""

import os
import signal
import sys
from datetime import timedelta

__all__ = ["main"]


def main():
    """Serves the store; never returns."""
    try:
        host = os.environ["MASTER_ADDR"]
        port = int(os.environ["MASTER_PORT"])
        world = int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError) as e:
        sys.exit(f"faultline.store: MASTER_ADDR, MASTER_PORT and WORLD_SIZE "
                 f"must be set by faultline-run: {e}")
    from torch.distributed import TCPStore
    store = TCPStore(host, port, world, True, timedelta(minutes=30),
                     wait_for_workers=False)
    print("ready", flush=True)
    while True:
        signal.pause()
    del store  # noqa: unreachable; the store lives as long as the process
