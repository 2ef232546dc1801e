"""A checkpoint segment of the node agent, written and read as the FORMAT
section of faultline's ckpt package lays it out (layout version 2).

The file is a 4096-byte header and two halves of half_size bytes; a save
writes the half that does not hold the newest complete step, then flips
the active word. The writer computes only meta_crc (over bytes [16,48) of
the half and its blob table); the agent seals the step (the CRCs of the
blobs) after the save. A segment grows by being replaced under its name
by a larger file; a save holds a shared flock on the file it maps and
maps the path anew when it no longer names that file.
"""

import fcntl
import mmap
import os
import struct
import time

from faultline._crc32c import crc32c

MAGIC = b"FLTCKPT\x00"
VERSION = 2
HEADER_SIZE = 4096
STEP_HEADER = 64
ENTRY = 24
ALIGN = 64
PAGE = 4096
MAX_NAME = 1024

EMPTY, WRITING, COMPLETE = 0, 1, 2

_HEADER = struct.Struct("<8sIIQIII")  # magic .. header_crc
_STEP = struct.Struct("<QqqII")   # seq, step, time, nblobs, table_size
_ENTRY = struct.Struct("<QQIHH")  # offset, size, 0, name_len, 0


class SegmentError(ValueError):
    """A segment file that is not one this package can use."""


class TooSmall(SegmentError):
    """A step that does not fit in the segment's halves."""


class PersistTimeout(RuntimeError):
    """The agent did not finish the persist asked for before in time."""


def _align(n, a):
    return (n + a - 1) // a * a


def layout(names, sizes):
    """Returns (table_size, offsets, end) of a step of these blobs: each
    blob starts at the next multiple of ALIGN after the CRC array, and end
    is where the last one ends, as ckpt lays a step out."""
    table = 0
    for n in names:
        table += ENTRY + _align(len(n.encode()), 8)
    off = _align(STEP_HEADER + table + 4 * len(names), ALIGN)
    end = off
    offsets = []
    for size in sizes:
        offsets.append(off)
        end = off + size
        off = _align(end, ALIGN)
    return table, offsets, end


def step_size(names, sizes):
    """The half size that holds a step of these blobs (layout.StepSize)."""
    return _align(layout(names, sizes)[2], PAGE)


class Half:
    """A complete step read from one half: its step, seq, gen and blobs
    (name -> (offset from the start of the file, size))."""

    __slots__ = ("index", "step", "seq", "gen", "blobs")

    def __init__(self, index, step, seq, gen, blobs):
        self.index, self.step, self.seq, self.gen, self.blobs = (
            index, step, seq, gen, blobs)


class Segment:
    """A segment file mapped read-write.

    view(mm), if given, makes an object over each mapping (a tensor) and is
    kept as self.tensor; it is made again when the segment is mapped anew.
    """

    def __init__(self, path, view=None):
        self.path = path
        self._view = view
        self.persist_wait = 600.0  # seconds a save to persist waits
        self.fd = -1
        self.tensor = None
        self._map()

    def _map(self):
        path = self.path
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise SegmentError(f"segment {path}: {size} bytes, shorter "
                                   f"than its {HEADER_SIZE}-byte header")
            mm = mmap.mmap(fd, size)
            try:
                self._check(mm, size)
            except SegmentError:
                mm.close()
                raise
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.mm = mm
        self.mv = memoryview(mm)
        self.u32 = self.mv.cast("I")
        self.u64 = self.mv.cast("Q")
        self._known = {}    # half -> (gen, seq, meta_crc) whose meta_crc holds
        self.tensor = self._view(mm) if self._view is not None else None

    def current(self):
        """Reports whether the path still names the file mapped (a segment
        grows by being replaced under its name)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        fst = os.fstat(self.fd)
        return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)

    def remap(self):
        """Maps the file the path names now."""
        self._unmap()
        self._map()

    def _check(self, mm, size):
        magic, version, header, half, shard, flags, crc = _HEADER.unpack_from(
            mm, 0)
        what = None
        if magic != MAGIC:
            what = f"magic {magic!r}, want {MAGIC!r}"
        elif version != VERSION:
            what = f"version {version}, want {VERSION}"
        elif header != HEADER_SIZE:
            what = f"header_size {header}, want {HEADER_SIZE}"
        elif crc != crc32c(mm[0:32]):
            what = f"header_crc {crc:#010x} does not hold"
        elif half == 0 or half % PAGE:
            what = f"half_size {half}: want a positive multiple of {PAGE}"
        elif size < HEADER_SIZE + 2 * half:
            what = (f"half_size {half} but the file has {size} bytes, fewer "
                    f"than {HEADER_SIZE + 2 * half}")
        if what is not None:
            raise SegmentError(f"segment {self.path}: {what}")
        self.half_size = half
        self.shard = shard

    def _unmap(self):
        self.tensor = None  # it exports mm's buffer
        for v in (self.u32, self.u64, self.mv):
            v.release()
        self.mm.close()
        os.close(self.fd)
        self.fd = -1

    def close(self):
        """Unmaps the segment and closes its file."""
        if self.fd >= 0:
            self._unmap()

    def lock(self):
        """Takes the shared lock a save holds, on the file the path names
        (mapping it anew if it was replaced by a larger one)."""
        while True:
            fcntl.flock(self.fd, fcntl.LOCK_SH)
            if self.current():
                return
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.remap()

    def unlock(self):
        """Releases the lock of lock()."""
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def base(self, i):
        """The file offset of half i."""
        return HEADER_SIZE + i * self.half_size

    def _state(self, i):
        return self.u32[self.base(i) // 4]

    def _seq(self, i):
        return self.u64[(self.base(i) + 16) // 8]

    def _gen(self, i):
        return self.u64[(self.base(i) + 8) // 8]

    def _meta_ok(self, i):
        """Reports whether half i holds a complete step whose meta_crc
        holds, and its seq."""
        b = self.base(i)
        gen = self._gen(i)
        if self._state(i) != COMPLETE:
            return False, 0
        seq, _, _, nblobs, table = _STEP.unpack_from(self.mm, b + 16)
        crc = self.u32[(b + 60) // 4]
        if self._known.get(i) == (gen, seq, crc):
            return True, seq
        if table > self.half_size - STEP_HEADER:
            return False, seq
        ok = crc32c(self.mv[b + STEP_HEADER:b + STEP_HEADER + table],
                    crc32c(self.mv[b + 16:b + 48])) == crc
        if ok and self._gen(i) == gen:
            self._known[i] = (gen, seq, crc)
        return ok, seq

    def target(self):
        """The half a save writes: not the one of the newest complete
        step; with none, 1 - active."""
        ok0, seq0 = self._meta_ok(0)
        ok1, seq1 = self._meta_ok(1)
        if ok0 or ok1:
            newest = 0 if ok0 and (not ok1 or seq0 > seq1) else 1
            return 1 - newest
        return 1 - (self.u32[36 // 4] & 1)

    def save(self, step, names, sizes, write, persist=False):
        """Saves a step of blobs: write(i, offset) writes blob i (names[i],
        sizes[i] bytes) at that file offset. Returns (seq, half), or None
        when the halves it could write are held (pinned by the agent, or
        holding a step to persist): the save is skipped and the previous
        step stays (one to persist waits instead). Raises TooSmall when the
        step does not fit, and PersistTimeout (see begin).

        It holds the shared lock of lock() throughout, so that a grow of
        the segment waits for it and no save lands in a replaced file.
        """
        p = self.begin(step, names, sizes, persist)
        if p is None:
            return None
        try:
            for i, off in enumerate(p.offsets):
                write(i, p.base + off)
        except BaseException:
            p.abort()
            raise
        return p.finish(persist)

    def begin(self, step, names, sizes, persist=False):
        """Claims the half a save of step writes, and returns the save in
        progress (Pending), whose blobs the caller writes at
        pending.base + pending.offsets[i] before it calls finish or abort;
        None when the save is skipped (both halves held; not with persist,
        below). The shared lock of lock() is held until then. Raises
        TooSmall when the step does not fit.

        With persist (the step is to be persisted), it first waits for the
        agent to be done with the persist asked for before, so that every
        step asked for is persisted, then, where both halves are held, for
        one to be free: such a step is one the job is to outlast, and its
        ranks wait at exit for every rank's to commit. PersistTimeout when
        either takes longer than persist_wait seconds."""
        if persist:
            self.wait_persisted()
        wait, deadline = 0.001, time.monotonic() + self.persist_wait
        while True:
            self.lock()
            try:
                p = self._begin(step, names, sizes)
            except BaseException:
                self.unlock()
                raise
            if p is not None:
                return p
            self.unlock()
            if not persist:
                return None
            if time.monotonic() > deadline:
                raise PersistTimeout(
                    f"segment {self.path}: both halves still held by the "
                    f"agent after {self.persist_wait:g} s (a replica copy "
                    "or a restore reading them)")
            time.sleep(wait)
            wait = min(2 * wait, 0.05)

    def _begin(self, step, names, sizes):
        table_size, offsets, end = layout(names, sizes)
        if end > self.half_size:
            raise TooSmall(f"segment {self.path}: a step of {end} bytes "
                           f"does not fit in half_size {self.half_size}")
        t = self.target()
        b = self.base(t)
        if self._held(t) and self.u32[b // 4] == COMPLETE \
                and self._meta_ok(1 - t)[0]:
            # The agent reads that half (a persist), or owes it a persist
            # asked for: write over the newest step instead; the held one
            # is the step a crash leaves.
            t = 1 - t
            b = self.base(t)
        w_state, w_pin, q_gen = b // 4, b // 4 + 1, b // 8 + 1
        if self._held(t):
            return None
        seq = max(self._seq(0), self._seq(1)) + 1
        prev = self.u32[w_state]
        self.u32[w_state] = WRITING
        if self.u32[w_pin]:
            self.u32[w_state] = prev
            return None
        self.u64[q_gen] += 1
        self._known.pop(t, None)
        return Pending(self, t, b, seq, step, names, sizes, offsets,
                       table_size)

    def wait_persisted(self):
        """Waits until the agent is done with the persist asked for last
        (persist_seq is 0), at most persist_wait seconds."""
        wait, deadline = 0.001, time.monotonic() + self.persist_wait
        while self.u64[40 // 8]:
            if time.monotonic() > deadline:
                raise PersistTimeout(
                    f"segment {self.path}: the agent is not done, after "
                    f"{self.persist_wait:g} s, with the persist of save "
                    f"{self.u64[40 // 8]} asked for before this one")
            time.sleep(wait)
            wait = min(2 * wait, 0.05)

    def _held(self, i):
        """Reports whether a save must leave half i alone: the agent pins
        it (it reads it), or it holds the save whose persist was asked for
        (persist_seq, which the agent clears once done)."""
        if self.u32[self.base(i) // 4 + 1]:
            return True
        req = self.u64[40 // 8]
        return req != 0 and self._state(i) == COMPLETE and self._seq(i) == req

    def read(self, i):
        """Reads the table of the complete step in half i."""
        b = self.base(i)
        gen = self._gen(i)
        if self._state(i) != COMPLETE:
            raise SegmentError(f"segment {self.path}: half {i} holds no "
                               "complete step")
        seq, step, _, nblobs, table = _STEP.unpack_from(self.mm, b + 16)
        if table > self.half_size - STEP_HEADER:
            raise SegmentError(f"segment {self.path}: half {i}: table_size "
                               f"{table} exceeds the half")
        crc = crc32c(self.mv[b + STEP_HEADER:b + STEP_HEADER + table],
                     crc32c(self.mv[b + 16:b + 48]))
        if crc != self.u32[(b + 60) // 4]:
            raise SegmentError(f"segment {self.path}: half {i}: meta_crc does "
                               "not hold")
        blobs = {}
        pos, end = b + STEP_HEADER, b + STEP_HEADER + table
        for k in range(nblobs):
            if pos + ENTRY > end:
                raise SegmentError(f"segment {self.path}: half {i}: blob {k} "
                                   "lies past the table")
            off, size, _, nlen, _ = _ENTRY.unpack_from(self.mm, pos)
            name = bytes(self.mv[pos + ENTRY:pos + ENTRY + nlen]).decode(
                errors="replace")
            if not 0 < nlen <= MAX_NAME or off + size > self.half_size:
                raise SegmentError(f"segment {self.path}: half {i}: blob "
                                   f"{name!r}: offset {off} size {size} "
                                   "outside the half")
            blobs[name] = (b + off, size)
            pos += ENTRY + _align(nlen, 8)
        return Half(i, step, seq, gen, blobs)

    def unchanged(self, half):
        """Reports whether half still holds the step read() returned."""
        return (self._state(half.index) == COMPLETE
                and self._gen(half.index) == half.gen)


class Pending:
    """A save in progress into one half of a Segment (Segment.begin): its
    blobs go at base + offsets[i]; finish makes it the newest step, abort
    leaves the half as a save cut short (which no reader takes). Either
    releases the segment's shared lock."""

    def __init__(self, seg, half, base, seq, step, names, sizes, offsets,
                 table_size):
        self.seg, self.half, self.base, self.seq = seg, half, base, seq
        self.step, self.names, self.sizes = step, names, sizes
        self.offsets, self.table_size = offsets, table_size

    def finish(self, persist=False):
        """Writes the table and the step header, marks the half complete
        and active (asking for a persist with persist), and returns
        (seq, half)."""
        seg, b = self.seg, self.base
        try:
            table = bytearray()
            for name, size, off in zip(self.names, self.sizes, self.offsets):
                nb = name.encode()
                table += _ENTRY.pack(off, size, 0, len(nb), 0)
                table += nb + bytes(_align(len(nb), 8) - len(nb))
            crcs = b + STEP_HEADER + self.table_size
            seg.mv[b + STEP_HEADER:crcs] = table
            n = 4 * len(self.names)
            seg.mv[crcs:crcs + n] = bytes(n)
            head = _STEP.pack(self.seq, self.step, time.time_ns(),
                              len(self.names), self.table_size)
            seg.mv[b + 16:b + 48] = head
            seg.mv[b + 48:b + 60] = bytes(12)
            seg.u32[(b + 60) // 4] = crc32c(table, crc32c(head))
            seg.u32[b // 4] = COMPLETE
            seg.u32[36 // 4] = self.half
            if persist:
                seg.u64[40 // 8] = self.seq
            return self.seq, self.half
        finally:
            seg.unlock()

    def abort(self):
        """Leaves the half in the writing state, as a save cut short."""
        self.seg.unlock()
