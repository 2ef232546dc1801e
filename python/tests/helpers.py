"""Test helpers: ring files and segments made and read the way the node
agent does, and a node agent on a unix socket that serves the rank's
requests from them.

The real agent is Go (faultline-run); python_test.go and xlang_test.go in
the Go package python run these tests and check the same files from Go.
"""

import fcntl
import json
import os
import shutil
import socketserver
import struct
import tempfile
import threading

from faultline import _ring, _segment
from faultline._crc32c import crc32c

RING_HEAD = struct.Struct("<8sIIQII")


def make_ring(path, capacity=1 << 16, switch=0x1F, flags=1):
    """Creates a ring file as the agent does."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(RING_HEAD.pack(_ring.MAGIC, _ring.VERSION, _ring.HEADER_SIZE,
                               capacity, switch, flags))
        f.truncate(_ring.HEADER_SIZE + capacity)
    return path


class RingReader:
    """The consumer side of a ring, for tests: reads what was published."""

    REC = struct.Struct("<IBBHqQII")

    def __init__(self, path):
        self.f = open(path, "r+b", buffering=0)
        head = self.f.read(_ring.HEADER_SIZE)
        self.cap = struct.unpack_from("<Q", head, 16)[0]

    def close(self):
        self.f.close()

    def _q(self, off):
        self.f.seek(off)
        return struct.unpack("<Q", self.f.read(8))[0]

    def set_word(self, off, value):
        self.f.seek(off)
        self.f.write(struct.pack("<I", value))
        self.f.flush()

    @property
    def dropped(self):
        return self._q(32)

    @property
    def pid(self):
        return self._q(40)

    def read(self, keep_padding=False):
        """Returns the records published since the last read, as dicts."""
        w, r = self._q(64), self._q(128)
        out = []
        while r < w:
            off = r % self.cap
            self.f.seek(_ring.HEADER_SIZE + off)
            head = self.f.read(8)
            n, typ, dom, nlen = struct.unpack("<IBBH", head)
            assert n >= 8 and n % 8 == 0 and off + n <= self.cap, (r, n)
            if typ == _ring.PADDING:
                assert off + n == self.cap, "padding must end the data area"
                if keep_padding:
                    out.append({"type": 0, "len": n})
                r += n
                continue
            self.f.seek(_ring.HEADER_SIZE + off)
            raw = self.f.read(n)
            n, typ, dom, nlen, t, rid, tid, aux = self.REC.unpack_from(raw)
            assert nlen <= n - 32
            out.append({"type": typ, "domain": dom, "time": t, "id": rid,
                        "tid": tid, "aux": aux, "len": n,
                        "name": raw[32:32 + nlen].decode()})
            r += n
        self.f.seek(128)
        self.f.write(struct.pack("<Q", r))
        self.f.flush()
        return out


def make_segment(path, half_size, shard=0):
    """Creates an empty segment file as the agent's ckpt.Owner does."""
    head = struct.pack("<8sIIQII", _segment.MAGIC, _segment.VERSION,
                       _segment.HEADER_SIZE, half_size, shard, 0)
    head += struct.pack("<I", crc32c(head))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(head)
        f.truncate(_segment.HEADER_SIZE + 2 * half_size)
    return path


def newest_half(path):
    """The half of the newest complete step whose meta_crc holds, or None."""
    s = _segment.Segment(path)
    try:
        best = None
        for i in (0, 1):
            ok, seq = s._meta_ok(i)
            if ok and (best is None or seq > best[1]):
                best = (i, seq, s.read(i).step)
        return best
    finally:
        s.close()


def held_steps(path):
    """(half, step) of each complete step whose meta_crc holds, newest
    first."""
    s = _segment.Segment(path)
    try:
        held = []
        for i in (0, 1):
            ok, seq = s._meta_ok(i)
            if ok:
                held.append((seq, i, s.read(i).step))
        return [(i, step) for _, i, step in sorted(held, reverse=True)]
    finally:
        s.close()


class FakeAgent:
    """A node agent on a unix socket that answers the rank's requests from
    segments it makes in a temporary folder. requests lists every request
    received; handlers[op] may override an op."""

    def __init__(self, min_half=64 << 10):
        self.dir = tempfile.mkdtemp(prefix="faultline-agent-")
        self.sock = os.path.join(self.dir, "agent.sock")
        self.requests = []
        self.handlers = {}
        self.segments = {}   # checkpoint dir -> (path, half_size)
        self.min_half = min_half
        self.hello = {"job": "job-1", "world": 1, "resume_step": -1,
                      "restart_count": 0, "collective_timeout_s": 0}
        self.committed = -1
        self.persists = True  # clears persist_seq as an owner done with it
        self._n = 0
        agent = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                for line in self.rfile:
                    req = json.loads(line)
                    agent.requests.append(req)
                    try:
                        resp = agent.answer(req, self)
                    except Exception as e:  # noqa: BLE001
                        resp = {"ok": False, "error": f"fake agent: {e}"}
                    if resp is None:
                        return  # hang up
                    try:
                        self.wfile.write(json.dumps(resp).encode() + b"\n")
                    except OSError:
                        return  # the rank went away

        self.server = socketserver.ThreadingUnixStreamServer(self.sock,
                                                             Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       args=(0.02,), daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def ops(self):
        return [r["op"] for r in self.requests]

    def answer(self, req, conn):
        op = req.get("op")
        if op in self.handlers:
            return self.handlers[op](req, conn)
        if op == "hello":
            return dict(ok=True, **self.hello)
        if op == "saved" and req.get("persist") and self.persists:
            # What the owner does once it persisted the step asked for.
            for path, _ in self.segments.values():
                s = _segment.Segment(path)
                s.u64[40 // 8] = 0
                s.close()
            return {"ok": True}
        if op in ("groups", "saved", "abandoned"):
            return {"ok": True}
        if op == "segment":
            return self._segment(req["dir"], req["bytes"])
        if op == "held":
            got = self.segments.get(req["dir"])
            held = held_steps(got[0]) if got else []
            return {"ok": True, "steps": [st for _, st in held],
                    "disk": self.committed}
        if op == "load":
            got = self.segments.get(req["dir"])
            held = held_steps(got[0]) if got else []
            if "step" in req:
                held = [h for h in held if h[1] == req["step"]]
            if not held:
                return {"ok": True, "step": -1, "tier": "none",
                        "reasons": ["no step in memory"]}
            return {"ok": True, "step": held[0][1], "tier": "memory",
                    "path": got[0], "half": held[0][0], "reasons": []}
        if op == "wait":
            if self.committed >= req["step"]:
                return {"ok": True, "step": self.committed}
            return {"ok": False, "error": f"step {req['step']} not committed "
                    f"within timeout_s {req['timeout_s']}"}
        if op == "admin":
            return {"ok": True, "result": {"what": req["what"]}}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def _segment(self, d, need):
        half = max(self.min_half, (need + 4095) // 4096 * 4096)
        old = self.segments.get(d)
        if old is not None and old[1] >= need:
            return {"ok": True, "path": old[0], "half_size": old[1]}
        if old is None:
            self._n += 1
            path = os.path.join(self.dir, f"segment-{self._n}")
            make_segment(path, half)
        else:
            path = old[0]
            self.grow(path, old[1], half)
        self.segments[d] = (path, half)
        return {"ok": True, "path": path, "half_size": half}

    @staticmethod
    def grow(path, old_half, half):
        """Replaces the segment at path by one with larger halves, keeping
        its newest step in half 0, under an exclusive lock (ckpt's
        growing)."""
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            tmp = path + ".grow"
            make_segment(tmp, half)
            best = newest_half(path)
            if best is not None:
                with open(path, "rb") as src, open(tmp, "r+b") as dst:
                    src.seek(_segment.HEADER_SIZE + best[0] * old_half)
                    data = bytearray(src.read(old_half))
                    data[4:8] = bytes(4)  # pin
                    dst.seek(_segment.HEADER_SIZE)
                    dst.write(data)
                    dst.seek(36)
                    dst.write(struct.pack("<I", 0))
            os.rename(tmp, path)
        finally:
            os.close(fd)
