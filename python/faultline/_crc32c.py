"""CRC-32C (Castagnoli) in pure Python, for the small headers and tables of
a checkpoint segment: CRC32C(b"123456789") == 0xE3069283.

It reads four bytes at a time through four tables ("slicing by 4"), about
twice as fast as a byte at a time in CPython. Blobs are never checksummed
here: the node agent seals them.
"""

import sys

_POLY = 0x82F63B78


def _tables():
    t0 = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        t0.append(c)
    tables = [t0]
    for _ in range(3):
        prev = tables[-1]
        tables.append([(c >> 8) ^ t0[c & 0xFF] for c in prev])
    return tables


_T0, _T1, _T2, _T3 = _tables()


def crc32c(data, crc=0):
    """Returns the CRC-32C of data (bytes-like), continuing from crc."""
    mv = memoryview(data).cast("B")
    crc ^= 0xFFFFFFFF
    n = len(mv) & ~3
    t0, t1, t2, t3 = _T0, _T1, _T2, _T3
    if n:
        words = mv[:n].cast("I")
        if sys.byteorder != "little":
            words = [int.from_bytes(mv[i:i + 4], "little")
                     for i in range(0, n, 4)]
        for w in words:
            crc ^= w
            crc = (t3[crc & 0xFF] ^ t2[(crc >> 8) & 0xFF]
                   ^ t1[(crc >> 16) & 0xFF] ^ t0[crc >> 24])
    for b in mv[n:]:
        crc = t0[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF
