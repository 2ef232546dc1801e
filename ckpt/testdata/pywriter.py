#!/usr/bin/env python3
"""Saves a step into a faultline ckpt segment with mmap and struct only,
following the FORMAT section of the package documentation.

usage: pywriter.py SEGMENT STEP [--persist] [--hold]
It saves blobs "model" (1000 bytes of the step's low byte) and
"optimizer" (3 bytes "py\\n" repeated 700 times) and prints the half it wrote
and the segment's half_size. With --hold it maps the segment, prints
"mapped HALF_SIZE" and waits for a line on stdin before it saves, as a
trainer that mapped the segment long ago does: the segment may have grown
meanwhile.

A writer computes no CRC of the blobs: the owner seals the step after the
save. The only checksums here cover the small headers and the table, which
pure Python computes fast enough.
"""
import fcntl
import mmap
import os
import struct
import sys
import time

_TABLE = []
for i in range(256):
    c = i
    for _ in range(8):
        c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    _TABLE.append(c)


def crc32c(data, crc=0):
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


assert crc32c(b"123456789") == 0xE3069283

VERSION, HEADER_SIZE, STEP_HEADER, ENTRY, ALIGN = 2, 4096, 64, 24, 64
EMPTY, WRITING, COMPLETE = 0, 1, 2


def align(n, a):
    return (n + a - 1) // a * a


def open_segment(path):
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, os.fstat(fd).st_size)
    magic, version, header_size, half_size, shard, flags, header_crc = struct.unpack_from("<8sIIQIII", m, 0)
    assert magic == b"FLTCKPT\x00" and version == VERSION and header_size == HEADER_SIZE
    assert header_crc == crc32c(m[0:32]), "header checksum"
    return fd, m, half_size


def main():
    path, step = sys.argv[1], int(sys.argv[2])
    blobs = [("model", bytes([step & 0xFF]) * 1000), ("optimizer", b"py\n" * 700)]
    fd, m, half_size = open_segment(path)
    if "--hold" in sys.argv:
        print("mapped", half_size, flush=True)
        sys.stdin.readline()
    # Growing: hold the shared lock for the save, on the file the path
    # names; one grown meanwhile is mapped anew.
    while True:
        fcntl.flock(fd, fcntl.LOCK_SH)
        st, fst = os.stat(path), os.fstat(fd)
        if (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino):
            break
        fcntl.flock(fd, fcntl.LOCK_UN)
        m.close()
        os.close(fd)
        fd, m, half_size = open_segment(path)

    def base(i):
        return HEADER_SIZE + i * half_size

    def meta(i):
        # Complete with a valid meta_crc, which covers bytes [16,48) and the
        # table, not the seal words nor the CRC array that the owner writes.
        b = base(i)
        state, pin, gen, seq = struct.unpack_from("<IIQQ", m, b)
        nblobs, table_size = struct.unpack_from("<II", m, b + 40)
        ok = state == COMPLETE and table_size <= half_size - STEP_HEADER
        if ok:
            (meta_crc,) = struct.unpack_from("<I", m, b + 60)
            ok = meta_crc == crc32c(m[b + 16:b + 48] + m[b + STEP_HEADER:b + STEP_HEADER + table_size])
        return ok, seq

    # 1. The target half does not hold the newest complete step.
    (active,) = struct.unpack_from("<I", m, 36)
    halves = [meta(0), meta(1)]
    complete = [i for i in (0, 1) if halves[i][0]]
    if complete:
        newest = max(complete, key=lambda i: halves[i][1])
        t = 1 - newest
    else:
        t = 1 - (active & 1)
    b = base(t)
    # 2. A pinned half holding a complete step stays: write over the newest
    # step instead. 2-3. Skip a pinned half; claim it; bump gen.
    (pin, state) = struct.unpack_from("<II", m, b + 4)[0], struct.unpack_from("<I", m, b)[0]
    if pin and state == COMPLETE and complete:
        t = 1 - t
        b = base(t)
    (pin,) = struct.unpack_from("<I", m, b + 4)
    if pin:
        fcntl.flock(fd, fcntl.LOCK_UN)
        print("busy")
        return 3
    (prev,) = struct.unpack_from("<I", m, b)
    struct.pack_into("<I", m, b, WRITING)
    (pin,) = struct.unpack_from("<I", m, b + 4)
    if pin:
        struct.pack_into("<I", m, b, prev)
        fcntl.flock(fd, fcntl.LOCK_UN)
        print("busy")
        return 3
    (gen,) = struct.unpack_from("<Q", m, b + 8)
    struct.pack_into("<Q", m, b + 8, gen + 1)
    # 4. Blobs, table (the CRC array after it stays zero), header with
    # seal 0 and seal_crc 0.
    table = b""
    table_size = sum(ENTRY + align(len(n.encode()), 8) for n, _ in blobs)
    crc_array = 4 * len(blobs)
    off = align(STEP_HEADER + table_size + crc_array, ALIGN)
    for name, data in blobs:
        m[b + off:b + off + len(data)] = data
        nb = name.encode()
        table += struct.pack("<QQIHH", off, len(data), 0, len(nb), 0) + nb + b"\0" * (align(len(nb), 8) - len(nb))
        off = align(off + len(data), ALIGN)
    end = b + STEP_HEADER + table_size
    m[b + STEP_HEADER:end] = table
    m[end:end + crc_array] = bytes(crc_array)
    seq = max(halves[0][1], halves[1][1]) + 1
    head = struct.pack("<QqqII", seq, step, time.time_ns(), len(blobs), len(table))
    m[b + 16:b + 48] = head
    m[b + 48:b + 60] = bytes(12)
    struct.pack_into("<I", m, b + 60, crc32c(head + table))
    # 5. Complete, flip, ask for a persist.
    struct.pack_into("<I", m, b, COMPLETE)
    struct.pack_into("<I", m, 36, t)
    if "--persist" in sys.argv:
        struct.pack_into("<Q", m, 40, seq)
    m.flush()
    fcntl.flock(fd, fcntl.LOCK_UN)
    print("half", t, "seq", seq, "half_size", half_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
