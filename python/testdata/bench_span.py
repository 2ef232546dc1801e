"""The Python half of BenchmarkSpan.

usage: bench_span.py RING_ON RING_OFF
Times `with faultline.span("forward"): pass` with the ring's switch on and
off, beside a time.perf_counter_ns() pair and the least a Python span can
cost (a context manager that reads the clock twice; and one that also packs
the two records), in interleaved rounds, and
prints the best round of each in nanoseconds as JSON.
"""

import json
import struct
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


def floor(f=_Floor):
    """Times `with f(): pass`."""
    p = time.perf_counter_ns
    t0 = p()
    for _ in range(N):
        with f():
            pass
    return (p() - t0) / N


_REC = struct.Struct(_ring._RECORD + "8s" + _ring._RECORD[1:])
_BUF = bytearray(_REC.size)


class _FloorWrite:
    """The least a Python span that writes its records can be: a context
    manager that reads time.time_ns on entering and leaving, as span()
    does, and packs a range's two records (constant ids and thread) into a
    buffer, with no ring, reservation or index to keep."""

    __slots__ = ("t",)

    def __enter__(self):
        self.t = time.time_ns()
        return self

    def __exit__(self, *exc):
        _REC.pack_into(_BUF, 0, 1, self.t, 2, 3, b"forward", 4,
                       time.time_ns(), 2, 3)


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
    best = {"pair": [], "on": [], "off": [], "floor": [], "floorwrite": []}
    for _ in range(ROUNDS):
        best["pair"].append(pair())
        best["floor"].append(floor())
        best["floorwrite"].append(floor(_FloorWrite))
        _ring.attach(on)
        best["on"].append(spans())
        _ring.attach(off)
        best["off"].append(spans())
        _ring.detach()
    print(json.dumps({k: min(v) for k, v in best.items()}))


if __name__ == "__main__":
    main()
