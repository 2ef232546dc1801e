"""A job for TestRootCause: rank 1 closes its connections and, 300 ms
later, exits 7; rank 0's next all-reduce fails first, on its connection
to rank 1 (gloo: "Connection closed by peer [ADDR]:PORT").
"""

import mmap
import os
import struct
import time

import torch
import torch.distributed as dist

import faultline.torch as ft


def wait_drained():
    """Waits until the agent has read all this rank wrote to its dotting
    ring (the ring's write index is at byte 64, its read index at byte
    128): it has then noted the connections of its first all-reduce."""
    with open(os.environ["FAULTLINE_RING"], "rb") as f:
        m = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)
    written = struct.unpack_from("<Q", m, 64)[0]
    while struct.unpack_from("<Q", m, 128)[0] < written:
        time.sleep(0.01)
    m.close()


def main():
    dist.init_process_group("gloo")
    ft.init()
    rank = dist.get_rank()
    t = torch.ones(4)
    dist.all_reduce(t)
    wait_drained()
    dist.barrier()
    if rank == 1:
        dist.destroy_process_group()
        time.sleep(0.3)
        os._exit(7)
    time.sleep(0.1)
    dist.all_reduce(t)


if __name__ == "__main__":
    main()
