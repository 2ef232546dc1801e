"""A job for TestSignal: each rank all-reduces and saves a step to the
agent's memory until SIGTERM, whose handler (the job's own) ends the loop;
the ranks then save a final step to memory, and rank 0 exits
while rank 1 ignores everything and sleeps, for the agent to kill at the
end of its grace period.

    terminate.py CHECKPOINT_DIR
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import faultline.torch as ft

stopping = False


def on_term(sig, frame):
    global stopping
    stopping = True
    # One write of the whole line, past sys.stdout's buffer: the handler
    # may run while the loop's print has written its text and not yet
    # its newline.
    os.write(1, f"rank {dist.get_rank()} got signal {sig}\n".encode())


def main():
    dist.init_process_group("gloo")
    ft.init()
    rank = dist.get_rank()
    signal.signal(signal.SIGTERM, on_term)
    ckpt = ft.Checkpointer(sys.argv[1])
    w = torch.zeros(8)
    step = 0
    while True:
        # The ranks stop at the same step whenever each saw the signal.
        stop = torch.tensor([1 if stopping else 0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            break
        g = torch.ones(8)
        dist.all_reduce(g)
        w += g
        ckpt.save_checkpoint(step, {"w": w, "step": step})
        print(f"step {step}", flush=True)
        step += 1
        time.sleep(0.05)
    ckpt.save_checkpoint(step, {"w": w, "step": step})
    print(f"saved step {step} after the signal", flush=True)
    if rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)
    os._exit(0)


if __name__ == "__main__":
    main()
