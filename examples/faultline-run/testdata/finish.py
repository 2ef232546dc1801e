"""A job for TestFinishedRankRestarted: in its first run, rank 1 finishes
at once and rank 0 fails a moment later; restarted, both ranks meet in a
barrier, which only a restart of both gets through.
"""

import os
import sys
import time

import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"rank {rank} start {restart}", flush=True)
    if restart == 0:
        if rank == 1:
            return
        time.sleep(1)
        sys.exit(3)
    dist.barrier()
    print(f"rank {rank} through the barrier", flush=True)


if __name__ == "__main__":
    main()
