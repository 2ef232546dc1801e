"""The Python half of BenchmarkSpan.

usage: bench_span.py RING_ON RING_OFF
Times `with faultline.span("forward"): pass` with the ring's switch on and
off, beside a time.perf_counter_ns() pair and the least a Python span can
cost (a context manager that reads the clock twice), in interleaved rounds, and
prints the best round of each in nanoseconds as JSON.
"""

import json
import sys
import time

import faultline
from faultline import _ring

N = 20000
ROUNDS = 25


def pair():
    p = time.perf_counter_ns
    t0 = p()
    for _ in range(N):
        time.perf_counter_ns()
        time.perf_counter_ns()
    return (p() - t0) / N


class _Floor:
    """The least a Python span can be: a context manager that reads the
    clock as it enters and as it exits, and keeps nothing."""

    __slots__ = ("t",)

    def __enter__(self):
        self.t = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        time.perf_counter_ns()


def floor():
    p = time.perf_counter_ns
    f = _Floor
    t0 = p()
    for _ in range(N):
        with f():
            pass
    return (p() - t0) / N


def spans():
    p = time.perf_counter_ns
    span = faultline.span
    t0 = p()
    for _ in range(N):
        with span("forward"):
            pass
    return (p() - t0) / N


def main():
    on, off = sys.argv[1], sys.argv[2]
    best = {"pair": [], "on": [], "off": [], "floor": []}
    for _ in range(ROUNDS):
        best["pair"].append(pair())
        best["floor"].append(floor())
        _ring.attach(on)
        best["on"].append(spans())
        _ring.attach(off)
        best["off"].append(spans())
        _ring.detach()
    print(json.dumps({k: min(v) for k, v in best.items()}))


if __name__ == "__main__":
    main()
