"""The producer side of the dotting ring.

Each rank maps its ring file (FAULTLINE_RING, created by the node agent) and
is its only producer; the agent is its only consumer. The layout, which the
agent's consumer reads, is:

    header, 4096 bytes, little-endian
      0  8 magic "FLTRING\\0"   8 4 version 1   12 4 header size 4096
     16  8 capacity (a power of two, >= 64 KiB; data at offset 4096)
     24  4 switch: bit k = trace kind k on (written by the agent, live)
     28  4 flags: bit 0 = time collectives (written by the agent)
     32  8 dropped (producer)  40 8 pid (producer, at attach)
     64  8 write index (producer)  128 8 read index (consumer)

    record, 8-byte aligned, never straddling the end of the data area
      0 4 len   4 1 type   5 1 domain   6 2 name_len   8 8 time (unix ns)
     16 8 id   24 4 tid   28 4 aux   32 name, zero-padded to a multiple of 8

A record that does not fit before the end of the data area follows a
padding record (type 0) that fills up to the end. A record that does not fit
in the free space is dropped and counted: the training loop never waits.

Ranges are dotted per domain, as MindCluster's switch goes: the default
domain is on while any of the bits of Step, FP, DataLoader and
SaveCheckpoint is, the communication domain while CommunicationOperator's
is. Collective records are written whenever the flags ask for them.

Everything on the hot path is prepared ahead: a name is encoded once into a
struct.Struct that packs a range's two records in one call, and the switch
is read through a memoryview over the mapping. A range costs one
reservation, one pack and one store of the write index, at its end.
"""

import json
import mmap
import os
import struct
import sys
import threading
import time

HEADER_SIZE = 4096
MAGIC = b"FLTRING\x00"
VERSION = 1
MIN_CAPACITY = 64 << 10

# Record types.
PADDING = 0
RANGE_START = 1
RANGE_END = 2
MARK = 3
COLLECTIVE_START = 4
COLLECTIVE_END = 5
COLLECTIVE_ERROR = 6

# Domains.
DEFAULT = 0
COMMUNICATION = 1

# Switch bits: trace.Kind k is bit k.
STEP = 1 << 0
FP = 1 << 1
DATALOADER = 1 << 2
SAVE_CHECKPOINT = 1 << 3
COMMUNICATION_OPERATOR = 1 << 4
DEFAULT_KINDS = STEP | FP | DATALOADER | SAVE_CHECKPOINT

# Flag bits.
TIME_COLLECTIVES = 1

# Open ranges per thread beyond which new ones are dropped and counted.
MAX_OPEN = 1024
# Longest name a range may carry, in UTF-8 bytes.
MAX_NAME = 4096
# Longest error text of a collective, in UTF-8 bytes.
MAX_ERROR = 1024
# Longest wait for the ring's lock (without the GIL's guarantees), seconds.
_LOCK_WAIT = 0.005
# Names cached with their encoded records.
_MAX_CACHED = 4096

# Word indexes into the header viewed as u32 (_W) and u64 (_Q).
_W_SWITCH = 6
_W_FLAGS = 7
_Q_DROPPED = 4
_Q_PID = 5
_Q_WRITE = 8
_Q_READ = 16

# A record's fixed part: head (see _head), time, id, tid | aux << 32. In
# native mode, where a C long has 8 bytes, struct converts these ints about
# twice as fast as in standard mode; the bytes are the same on a
# little-endian machine.
_RECORD = ("@LlLL" if sys.byteorder == "little" and struct.calcsize("@L") == 8
           else "<QqQQ")
_RECORD_SIZE = 32
_END = struct.Struct(_RECORD + "0s")
_PAD = struct.Struct("<IB")
_HEAD = struct.Struct("<8sIIQ")


class RingError(ValueError):
    """A ring file that cannot be attached: its path and what is wrong."""


# Producing without a lock needs CPython 3.11 or later with the GIL: there,
# the interpreter switches threads and runs signal handlers and finalizers
# only after calls and at backward jumps, never between the plain bytecodes
# of a reservation (reading and advancing w) and the end of the pack_into
# call that follows it. Every reservation is therefore written whole before
# any thread can publish past it, and publishing w after one's own pack is
# always safe. Elsewhere a lock does the same.
_ATOMIC = (sys.implementation.name == "cpython" and sys.version_info >= (3, 11)
           and getattr(sys, "_is_gil_enabled", lambda: True)())


class _Producer:
    """The mapping of one ring file and the producer's state."""

    __slots__ = ("path", "_mm", "words", "index", "data", "cap", "mask",
                 "w", "limit", "base", "lock")

    def __init__(self, path):
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise RingError(f"ring {path}: {size} bytes, shorter than "
                                f"its {HEADER_SIZE}-byte header")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, version, header, cap = _HEAD.unpack_from(mm, 0)
        problem = None
        if magic != MAGIC:
            problem = f"magic {magic!r}, want {MAGIC!r}"
        elif version != VERSION:
            problem = f"version {version}, want {VERSION}"
        elif header != HEADER_SIZE:
            problem = f"header size {header}, want {HEADER_SIZE}"
        elif cap < MIN_CAPACITY or cap & (cap - 1):
            problem = (f"capacity {cap}: want a power of two of at least "
                       f"{MIN_CAPACITY}")
        elif size < HEADER_SIZE + cap:
            problem = (f"capacity {cap} but the file has {size} bytes, "
                       f"fewer than {HEADER_SIZE + cap}")
        mv = memoryview(mm)
        index = mv[:HEADER_SIZE].cast("Q")
        if problem is None:
            w, r = index[_Q_WRITE], index[_Q_READ]
            if w & 7 or r > w or w - r > cap:
                problem = f"write index {w} and read index {r} disagree"
        if problem is not None:
            index.release()
            mv.release()
            mm.close()
            raise RingError(f"ring {path}: {problem}")
        self._mm = mm
        self.words = mv[:HEADER_SIZE].cast("I")
        self.index = index
        self.data = mv[HEADER_SIZE:HEADER_SIZE + cap]
        self.cap = cap
        self.mask = cap - 1
        self.w = index[_Q_WRITE]
        self.limit = index[_Q_READ] + cap
        # Ids are base + the record's position: unique in this process and,
        # the base being the time of attach, across restarts of the rank.
        self.base = time.time_ns()
        self.lock = None if _ATOMIC else threading.Lock()
        index[_Q_PID] = os.getpid()

    def put(self, s, size, head, tid, name, rid=0):
        """Writes one record packed by s, stamped now, and publishes it.

        head packs len, type, domain and name_len (see _head); rid 0 gives
        the record a new id. Returns the id, or 0 when the record was
        dropped.
        """
        if self.lock is not None:
            return self._locked(self._put, s, size, head, tid, name, rid)
        return self._put(s, size, head, tid, name, rid)

    def _put(self, s, size, head, tid, name, rid):
        t = _time_ns()
        # No call from here to the end of pack_into (see _ATOMIC).
        w = self.w
        off = w & self.mask
        if self.cap - off < size:
            if not self.pad(size):
                return 0
            w = self.w
            off = w & self.mask
            if self.cap - off < size:
                self.index[_Q_DROPPED] += 1
                return 0
        end = w + size
        if end > self.limit:
            # Only now look at how far the consumer has read.
            r = self.index[_Q_READ]
            self.limit = (r if r <= w else w) + self.cap
            if end > self.limit:
                self.index[_Q_DROPPED] += 1
                return 0
        self.w = end
        if not rid:
            rid = self.base + w
        s.pack_into(self.data, off, head, t, rid, tid, name)
        self.index[_Q_WRITE] = self.w
        return rid

    def pad(self, size):
        """Fills the data area up to its end with a padding record, so that
        a record of size starts at the beginning; False (and counted) when
        the padding and the record do not fit."""
        # No call from here to the end of pack_into (see _ATOMIC).
        w = self.w
        off = w & self.mask
        room = self.cap - off
        if room >= size:
            return True  # another thread wrapped around meanwhile
        if w + room + size > self.limit:
            r = self.index[_Q_READ]
            self.limit = (r if r <= w else w) + self.cap
            if w + room + size > self.limit:
                self.index[_Q_DROPPED] += 1
                return False
        self.w = w + room
        _PAD.pack_into(self.data, off, room, PADDING)
        self.index[_Q_WRITE] = self.w
        return True

    def drop(self):
        """Counts a record that was not written."""
        self.index[_Q_DROPPED] += 1

    def _locked(self, fn, *args):
        # A signal handler or a finalizer that dots while this thread holds
        # the lock drops its record rather than wait for itself.
        if not self.lock.acquire(True, _LOCK_WAIT):
            self.drop()
            return 0
        try:
            return fn(*args)
        finally:
            self.lock.release()


def _head(size, rtype, dom, nlen):
    """The first 8 bytes of a record: len, type, domain, name_len."""
    return size | rtype << 32 | dom << 40 | nlen << 48


class _Local(threading.local):
    """Per thread: [open ranges, native thread id, start times...]."""

    def __init__(self):
        self.st = [0, threading.get_native_id() & 0xFFFFFFFF]


_OFF_WORDS = memoryview(bytearray(64)).cast("I")

_producer = None
_sw = _OFF_WORDS  # header words: [_W_SWITCH] the switch, [_W_FLAGS] the flags
_tls = _Local()
_time_ns = time.time_ns


class _Range:
    """A named range: span() returns it while its kind is on.

    A range is written when it ends: its start record (stamped with the
    time __enter__ took) and its end record together, reserved and packed
    in one go, which halves what a range costs. A range's records are
    therefore published at its end, after those of the ranges it encloses.
    """

    __slots__ = ("_s", "_size", "_name", "_pair", "_psize", "_start",
                 "_end", "_dom", "mask", "text")

    def __init__(self, text, dom, mask):
        name = text.encode()
        size = _RECORD_SIZE + (len(name) + 7) // 8 * 8
        self.text = text
        self._name = name
        self._size = size
        self._s = struct.Struct(f"{_RECORD}{size - _RECORD_SIZE}s")
        self._pair = struct.Struct(
            f"{_RECORD}{size - _RECORD_SIZE}s{_RECORD[1:]}")
        self._psize = size + _RECORD_SIZE
        self._start = _head(size, RANGE_START, dom, len(name))
        self._end = _head(_RECORD_SIZE, RANGE_END, dom, 0)
        self._dom = dom
        self.mask = mask

    def head(self, rtype):
        """The head word of this name's record of type rtype."""
        return _head(self._size, rtype, self._dom, len(self._name))

    def __enter__(self):
        st = _tls.st
        d = st[0] + 1
        st[0] = d
        if d <= MAX_OPEN:
            st.append(_time_ns())
        else:
            p = _producer
            if p is not None:
                p.drop()
        return self

    def __exit__(self, exc_type, exc, tb):
        st = _tls.st
        d = st[0]
        if d > MAX_OPEN:
            st[0] = d - 1
            return None
        if d <= 0:
            return None  # an exit without its enter
        st[0] = d - 1
        t0 = st.pop()
        p = _producer
        if p is None:
            return None
        # _write, inlined: no call from reading w to the end of pack_into.
        t1 = _time_ns()
        size = self._psize
        w = p.w
        off = w & p.mask
        if p.cap - off < size:
            return self._write(p, t0, st[1], t1)
        end = w + size
        if end > p.limit:
            r = p.index[_Q_READ]
            p.limit = (r if r <= w else w) + p.cap
            if end > p.limit:
                p.index[_Q_DROPPED] += 1
                return None
        p.w = end
        rid = p.base + w
        tid = st[1]
        self._pair.pack_into(p.data, off, self._start, t0, rid, tid,
                             self._name, self._end, t1, rid, tid)
        p.index[_Q_WRITE] = p.w
        return None

    def _write(self, p, t0, tid, t1=None):
        """Writes the start and end records of a range that began at t0."""
        if t1 is None:
            t1 = _time_ns()
        size = self._psize
        # No call from here to the end of pack_into (see _ATOMIC), but for
        # the padding, which ends the data area in a step of its own.
        w = p.w
        off = w & p.mask
        if p.cap - off < size:
            if not p.pad(size):
                return None
            w = p.w
            off = w & p.mask
            if p.cap - off < size:
                p.index[_Q_DROPPED] += 1
                return None
        end = w + size
        if end > p.limit:
            r = p.index[_Q_READ]
            p.limit = (r if r <= w else w) + p.cap
            if end > p.limit:
                p.index[_Q_DROPPED] += 1
                return None
        p.w = end
        rid = p.base + w
        self._pair.pack_into(p.data, off, self._start, t0, rid, tid,
                             self._name, self._end, t1, rid, tid)
        p.index[_Q_WRITE] = p.w
        return None

    def __repr__(self):
        return f"<faultline range {self.text!r}>"


class _LockedRange(_Range):
    """A _Range for interpreters where writing needs the producer's lock."""

    __slots__ = ()

    def __exit__(self, exc_type, exc, tb):
        st = _tls.st
        d = st[0]
        if d > MAX_OPEN:
            st[0] = d - 1
            return None
        if d <= 0:
            return None
        st[0] = d - 1
        t0 = st.pop()
        p = _producer
        if p is not None:
            p._locked(self._write, p, t0, st[1])
        return None


_RANGE = _Range if _ATOMIC else _LockedRange


def _use_lock(on):
    """Makes ranges and producers attached from now on take the lock (on)
    or rely on the GIL (off); for tests of both ways."""
    global _ATOMIC, _RANGE
    _ATOMIC = not on
    _RANGE = _LockedRange if on else _Range
    _names.clear()
    _comms.clear()


class _Off:
    """What span() returns while its kind is off: does nothing."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        return None

    def __repr__(self):
        return "<faultline range (off)>"


_OFF = _Off()
_names = {}   # default-domain name -> _Range
_comms = {}   # communication name (str or key tuple) -> _Range


def _check_name(name, what):
    if not isinstance(name, str):
        raise TypeError(f"{what}: name {name!r} is a {type(name).__name__}, "
                        "want a str")
    if "\x00" in name:
        raise ValueError(f"{what}: name {name!r} contains a NUL character")
    try:
        n = len(name.encode())
    except UnicodeEncodeError as e:
        raise ValueError(f"{what}: name {name!r} is not valid UTF-8: {e}") \
            from None
    if n > MAX_NAME:
        raise ValueError(f"{what}: name of {n} bytes, longer than {MAX_NAME}")


def _default_range(name, what):
    _check_name(name, what)
    if name.startswith("step "):
        return _RANGE(name, DEFAULT, DEFAULT_KINDS)  # one per step: not cached
    r = _RANGE(name, DEFAULT, DEFAULT_KINDS)
    if len(_names) < _MAX_CACHED:
        _names[name] = r
    return r


_COMM_KEYS = "opName, groupName, count, dataType"


def comm_name(op_name, group_name, count=0, data_type=""):
    """Returns the CommOp JSON of a communication operator."""
    return json.dumps({"opName": op_name, "groupName": group_name,
                       "count": str(count), "dataType": data_type},
                      separators=(",", ":"), ensure_ascii=False)


def _comm_op(name, what):
    """Checks a communication name and returns it as CommOp JSON."""
    if isinstance(name, str):
        try:
            op = json.loads(name)
        except ValueError:
            op = None
        if not isinstance(op, dict):
            raise ValueError(
                f"{what}: communication name {name!r} is not a CommOp: want "
                f"a JSON object with the keys {_COMM_KEYS} (opName and "
                "groupName required), or a dict of them, or comm_span()")
    elif isinstance(name, dict):
        op = name
    else:
        raise TypeError(f"{what}: communication name {name!r} is a "
                        f"{type(name).__name__}, want a dict with the keys "
                        f"{_COMM_KEYS} or its JSON")
    for key in ("opName", "groupName"):
        v = op.get(key)
        if not isinstance(v, str) or (key == "opName" and not v):
            raise ValueError(f"{what}: communication name {name!r}: key {key} "
                             f"is {v!r}, want a non-empty string (keys: "
                             f"{_COMM_KEYS})")
    count = op.get("count", 0)
    if isinstance(count, str) and count.isdigit():
        count = int(count)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"{what}: communication name {name!r}: key count is "
                         f"{count!r}, want a non-negative integer")
    dtype = op.get("dataType", "")
    if not isinstance(dtype, str):
        raise ValueError(f"{what}: communication name {name!r}: key dataType "
                         f"is {dtype!r}, want a string")
    if isinstance(name, str):
        text = name
    else:
        extra = {k: v for k, v in op.items()
                 if k not in ("opName", "groupName", "count", "dataType")}
        body = {"opName": op["opName"], "groupName": op["groupName"],
                "count": str(count), "dataType": dtype}
        body.update(extra)
        text = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    _check_name(text, what)
    return text


def _comm_range(name, what):
    if isinstance(name, str):
        r = _comms.get(name)
        if r is None:
            r = _RANGE(_comm_op(name, what), COMMUNICATION,
                       COMMUNICATION_OPERATOR)
            if len(_comms) < _MAX_CACHED:
                _comms[name] = r
        return r
    return _RANGE(_comm_op(name, what), COMMUNICATION, COMMUNICATION_OPERATOR)


def span(name, domain="default"):
    """Returns a context manager that dots the range `name`.

    Domain "default" takes the names the analysis keys on: "step <n>" (see
    step()), "forward", "dataloader" and "save_checkpoint". Domain
    "communication" takes a communication operator: a dict with the keys
    opName, groupName and optionally count and dataType, or its JSON (see
    also comm_span()); anything else raises ValueError naming the keys.

    The range is written only while its domain is switched on; with it off
    the call costs a dictionary lookup and a test. Call span() in each with
    statement: the object it returns reflects the switch at the time of the
    call. Never raises for a full ring or too many open ranges: the range is
    dropped and counted.
    """
    if domain == "default":
        try:
            r = _names[name]
        except (KeyError, TypeError):
            r = _default_range(name, "faultline.span")
        if _sw[_W_SWITCH] & r.mask:
            return r
        return _OFF
    if domain == "communication":
        r = _comm_range(name, "faultline.span")
        if _sw[_W_SWITCH] & COMMUNICATION_OPERATOR:
            return r
        return _OFF
    raise ValueError(f"faultline.span: domain {domain!r}: want 'default' or "
                     "'communication'")


def step(n):
    """Returns a context manager that dots training step n ("step <n>")."""
    if type(n) is not int:
        if isinstance(n, bool) or not hasattr(n, "__index__"):
            raise TypeError(f"faultline.step: step {n!r} is a "
                            f"{type(n).__name__}, want an int")
        n = n.__index__()
    if n < 0:
        raise ValueError(f"faultline.step: step {n} is negative")
    if _sw[_W_SWITCH] & DEFAULT_KINDS:
        return _RANGE(f"step {n}", DEFAULT, DEFAULT_KINDS)
    return _OFF


def comm_span(op_name, group_name, count=0, data_type=""):
    """Returns a context manager that dots a communication operator.

    It is span() in the communication domain with the CommOp JSON
    {"opName":op_name,"groupName":group_name,"count":"<count>",
    "dataType":data_type}; op_name must be non-empty.
    """
    key = (op_name, group_name, count, data_type)
    try:
        r = _comms[key]
    except (KeyError, TypeError):
        if not isinstance(op_name, str) or not op_name:
            raise ValueError(f"faultline.comm_span: op_name {op_name!r}: want "
                             "a non-empty string") from None
        if not isinstance(group_name, str):
            raise ValueError(f"faultline.comm_span: group_name {group_name!r}:"
                             " want a string") from None
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"faultline.comm_span: count {count!r}: want a "
                             "non-negative int") from None
        if not isinstance(data_type, str):
            raise ValueError(f"faultline.comm_span: data_type {data_type!r}: "
                             "want a string") from None
        r = collective(op_name, group_name, count, data_type)
    if _sw[_W_SWITCH] & COMMUNICATION_OPERATOR:
        return r
    return _OFF


def mark(name, domain="default"):
    """Dots an instant mark `name`, if its domain is switched on."""
    if domain == "default":
        try:
            r = _names[name]
        except (KeyError, TypeError):
            r = _default_range(name, "faultline.mark")
        on = _sw[_W_SWITCH] & r.mask
    elif domain == "communication":
        r = _comm_range(name, "faultline.mark")
        on = _sw[_W_SWITCH] & COMMUNICATION_OPERATOR
    else:
        raise ValueError(f"faultline.mark: domain {domain!r}: want 'default' "
                         "or 'communication'")
    p = _producer
    if on and p is not None:
        p.put(r._s, r._size, r.head(MARK), _tls.st[1], r._name)


def collective(op_name, group_name, count, data_type):
    """Returns the cached record of a collective's CommOp name."""
    key = (op_name, group_name, count, data_type)
    r = _comms.get(key)
    if r is None:
        r = _RANGE(comm_name(op_name, group_name, count, data_type),
                   COMMUNICATION, COMMUNICATION_OPERATOR)
        if len(_comms) < _MAX_CACHED:
            _comms[key] = r
    return r


_COLLECTIVE_END = _head(_RECORD_SIZE, COLLECTIVE_END, COMMUNICATION, 0)


def collective_start(r, count=0):
    """Writes the start of collective r (from collective()) with its element
    count; returns its id, or 0 when collectives are not timed or the record
    was dropped."""
    p = _producer
    if p is None or not _sw[_W_FLAGS] & TIME_COLLECTIVES:
        return 0
    aux = count if 0 <= count <= 0xFFFFFFFF else 0
    return p.put(r._s, r._size, r.head(COLLECTIVE_START),
                 _tls.st[1] | aux << 32, r._name)


def collective_end(rid):
    """Writes the end of the collective whose start returned rid."""
    p = _producer
    if rid and p is not None:
        p.put(_END, _RECORD_SIZE, _COLLECTIVE_END, _tls.st[1], b"", rid)


def collective_error(rid, text):
    """Writes that the collective whose start returned rid raised text."""
    p = _producer
    if not rid or p is None:
        return
    b = str(text).replace("\x00", " ").encode(errors="replace")[:MAX_ERROR]
    b = b.decode(errors="ignore").encode()  # no character cut in two
    size = _RECORD_SIZE + (len(b) + 7) // 8 * 8
    s = struct.Struct(f"{_RECORD}{size - _RECORD_SIZE}s")
    p.put(s, size, _head(size, COLLECTIVE_ERROR, COMMUNICATION, len(b)),
          _tls.st[1], b, rid)


def timing_collectives():
    """Reports whether the agent asks for collective records."""
    return _producer is not None and bool(_sw[_W_FLAGS] & TIME_COLLECTIVES)


def attach(path):
    """Maps the ring at path and becomes its producer.

    Raises RingError (a ValueError) or OSError naming the path when the
    file is not a ring this package can write.
    """
    global _producer, _sw
    p = _Producer(path)
    _producer, _sw = p, p.words


def detach():
    """Stops producing: span() and the collective records are off."""
    global _producer, _sw
    _producer, _sw = None, _OFF_WORDS


def dropped():
    """Records dropped so far because the ring was full or too many ranges
    were open; 0 without a ring."""
    p = _producer
    return p.index[_Q_DROPPED] if p is not None else 0


def _after_fork():
    # A forked child (a DataLoader worker) must not write into its parent's
    # ring: the ring has one producer.
    global _tls
    detach()
    _tls = _Local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
