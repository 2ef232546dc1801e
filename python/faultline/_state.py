"""The tree of a state_dict, as the "meta" blob of a checkpoint holds it
(python/doc.go, "Checkpoints", documents it byte for byte).

flatten turns a state into a JSON tree, a table of its tensors and numpy
arrays and the list of them; pack places their bytes in the data blobs;
unflatten builds the state back. What a checkpoint holds without pickle
(the allow-list, as torch.load(weights_only=True) has one):

    tensors (dense; one at several key paths, tied weights, is stored once),
    numpy arrays and scalars of bool, int, uint, float, complex, datetime,
    timedelta and string dtypes, dict, collections.OrderedDict (with its
    _metadata), Counter and defaultdict (of a builtin factory), list, tuple,
    set, frozenset, None, bool, int, float, complex, str, bytes, bytearray,
    torch.Size, torch.dtype, torch.device, the functions of
    torch.optim.lr_scheduler by name, and its methods bound to the object
    whose state_dict holds them (OneCycleLR.anneal_func, CyclicLR's
    WeakMethod _scale_fn_ref), which load bound to an object of that class
    holding the state_dict's entries.

Anything else is a TypeError naming the key path, raised before anything is
written, unless the save passes allow_pickle: then it is pickled (its
tensors stay in the data blobs), and a load unpickles it only when it
passes allow_pickle too. Lambdas and local functions cannot be saved at all,
as with torch.save: pickle holds a function by its importable name.
"""

import base64
import collections
import importlib
import io
import json
import math
import pickle
import re
import sys
import types
import weakref

import torch

FORMAT = "faultline.state/2"
FORMAT_V1 = "faultline.state/1"

# The dtypes of tensors a checkpoint stores, by the name the table gives
# them, and their sizes in bytes.
DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32",
          "int16", "int8", "uint8", "bool", "complex64", "complex128")
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
            "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
            "bool": 1, "complex64": 8, "complex128": 16}

# Deepest nesting accepted (a cycle would otherwise recurse forever).
MAX_DEPTH = 200

# The blobs of one step, meta included (ckpt/layout.MaxBlobs).
MAX_BLOBS = 1 << 16

# A data blob takes tensors until it would pass PACK bytes (or 1/16384 of
# the state, when that is more): small tensors share blobs, so that no
# state reaches MAX_BLOBS, and large ones fill a blob each.
PACK = 64 << 20

# Where a tensor starts in its data blob (blobs start at multiples of 64).
ALIGN = 64

# Modules whose functions, and methods of whose classes, are saved by name
# and resolved on load without pickle.
SAFE_MODULES = ("torch.optim.lr_scheduler",)

# The default_factory values of a defaultdict saved without pickle.
FACTORIES = {f.__name__: f for f in (int, float, complex, str, bytes, bool,
                                     list, tuple, dict, set, frozenset)}

# numpy dtypes saved without pickle: kinds, and the form of dtype.str.
_NP_KINDS = "biufcmMSU"
_NP_DTYPE = re.compile(
    r"[<>|=][biufcmMSU][0-9]{1,5}(\[[0-9]*[a-zA-Z]{1,2}\])?")

_KINDS = ("tensors, numpy arrays and scalars, dict, OrderedDict, Counter, "
          "defaultdict, list, tuple, set, frozenset, None, bool, int, float, "
          "complex, str, bytes, bytearray, torch.Size, torch.dtype, "
          "torch.device, functions and methods of torch.optim.lr_scheduler")

_PICKLE_HINT = ("pass allow_pickle=True to save_checkpoint to store it "
                "pickled, and to load_checkpoint to load it (which runs code "
                "the checkpoint names: only for checkpoints you trust)")


def path_str(path):
    """Renders a key path as Python indexes it: state_dict["a"][0]."""
    return "state_dict" + "".join(
        f"[{json.dumps(k, ensure_ascii=False)}]" if isinstance(k, str)
        else f"[{k!r}]" for k in path)


def _numpy(x):
    """numpy, if x is a numpy array or scalar (numpy is imported then)."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, (np.ndarray, np.generic)):
        return np
    return None


def _ref(fn):
    """"module:qualname" of a function of SAFE_MODULES, else None."""
    module = getattr(fn, "__module__", None)
    qn = getattr(fn, "__qualname__", None)
    if module not in SAFE_MODULES or not isinstance(qn, str):
        return None
    try:
        return f"{module}:{qn}" if resolve(f"{module}:{qn}")[0] is fn else None
    except ValueError:
        return None


def resolve(ref):
    """Returns (function, its class or None) for "module:qualname" of a
    function of SAFE_MODULES; ValueError for anything else. Nothing is
    imported but the allow-listed modules."""
    module, _, qn = ref.partition(":") if isinstance(ref, str) else ("", "",
                                                                      "")
    parts = qn.split(".")
    if module not in SAFE_MODULES or not all(
            p.isidentifier() and not p.startswith("__") for p in parts):
        raise ValueError(f"{ref!r} is not a function of {SAFE_MODULES}")
    obj, owner = importlib.import_module(module), None
    for p in parts:
        if owner is not None or not isinstance(obj, (type, types.ModuleType)):
            raise ValueError(f"{ref!r} is not a function of {SAFE_MODULES}")
        if isinstance(obj, type):
            owner = obj
        obj = obj.__dict__.get(p)
    if (not isinstance(obj, types.FunctionType) or obj.__module__ != module
            or obj.__qualname__ != qn
            or (owner is not None and owner.__module__ != module)):
        raise ValueError(f"{ref!r} is not a function of {SAFE_MODULES}")
    return obj, owner


class _Encoder:
    def __init__(self, check_tensor, allow_pickle):
        self.check_tensor, self.allow_pickle = check_tensor, allow_pickle
        self.items = []     # unique tensors and numpy arrays, table order
        self.entries = []   # their table entries, less blob and off
        self.nbytes = []
        self.seen = {}      # address of the first element -> index(es)

    def add(self, x, path):
        """Adds tensor or numpy array x (once) and returns its index."""
        if isinstance(x, torch.Tensor):
            dtype = self.check_tensor(x, path)
            shape = x.shape
            n = x.numel()
            ptr = x.data_ptr() if n else None
            entry = {"dtype": dtype, "shape": list(shape)}
            n *= x.element_size()
        else:
            ptr = x.__array_interface__["data"][0] if x.size else None
            entry = {"np": x.dtype.str, "shape": list(x.shape)}
            n = x.nbytes
        if ptr is not None:
            # The same elements of the same memory are one tensor: tied
            # weights are tensors of their own over one storage.
            seen = self.seen.get(ptr)
            if seen is None:
                self.seen[ptr] = len(self.items)
            else:
                seen = [seen] if type(seen) is int else seen
                for k in seen:
                    if _same_view(self.items[k], x):
                        return k
                self.seen[ptr] = seen + [len(self.items)]
        self.items.append(x)
        self.entries.append(entry)
        self.nbytes.append(n)
        return len(self.items) - 1

    def refuse(self, x, path, why=None, hint=True):
        t = type(x)
        if why is None:
            why = (f"a {t.__module__}.{t.__qualname__} is not among the types "
                   f"a checkpoint holds without pickle ({_KINDS})")
        raise TypeError(f"faultline: {path_str(path)}: {why}"
                        + (f": {_PICKLE_HINT}" if hint else ""))

    def pickled(self, x, path, why=None):
        """The node of x pickled, or the TypeError that says why not."""
        if not self.allow_pickle:
            self.refuse(x, path, why)
        enc = self

        class Pickler(pickle.Pickler):
            def persistent_id(self, obj):
                if isinstance(obj, torch.Tensor):
                    return enc.add(obj, path)
                return None

        buf = io.BytesIO()
        try:
            Pickler(buf, protocol=4).dump(x)
        except Exception as e:  # whatever a __reduce__ raises
            raise TypeError(f"faultline: {path_str(path)}: pickle cannot hold "
                            f"a {type(x).__qualname__} ({e})") from None
        return {"pickle": base64.b64encode(buf.getvalue()).decode()}

    def function(self, x, path):
        ref = _ref(x)
        if ref is not None:
            return {"fn": ref}
        qn = getattr(x, "__qualname__", "") or ""
        if "<lambda>" in qn or "<locals>" in qn:
            raise TypeError(
                f"faultline: {path_str(path)}: {qn} is a lambda or a local "
                "function, which no checkpoint can hold (pickle, and so "
                "torch.save, stores a function by its importable name): "
                "leave it out of the state and set it again after loading")
        module = getattr(x, "__module__", "?")
        return self.pickled(x, path, f"function {module}.{qn} is not one of "
                            f"{', '.join(SAFE_MODULES)}")

    def method(self, m, path, owner, weak):
        """A method bound to the object whose state_dict owner is: by name
        when that object's class is of SAFE_MODULES."""
        ref = _ref(m.__func__)
        if ref is not None and owner is not None and isinstance(
                m.__self__, resolve(ref)[1] or ()):
            attrs = getattr(m.__self__, "__dict__", None)
            if (isinstance(attrs, dict) and all(isinstance(k, str)
                                                for k in owner)
                    and set(owner) <= set(attrs)):
                return {"wm" if weak else "m": ref}
        if weak:
            raise TypeError(
                f"faultline: {path_str(path)}: a WeakMethod of "
                f"{m.__qualname__}, which a checkpoint holds only as an entry "
                "of the state_dict of the object it is bound to, when its "
                f"class is of {', '.join(SAFE_MODULES)} (pickle cannot hold "
                "a weak reference)")
        return self.pickled(m, path, f"a method {m.__qualname__}, which a "
                            "checkpoint holds without pickle only as an entry "
                            "of the state_dict of the object it is bound to, "
                            f"when its class is of {', '.join(SAFE_MODULES)}")

    def items_of(self, d, path):
        out = []
        for k, v in d.items():
            if type(k) is str:
                key = _utf8(k, path, "key")
            else:
                key = self.node(k, path, key=True)
            out.append([key, self.node(v, path + [k], owner=d)])
        return out

    def node(self, x, path, key=False, owner=None):
        if isinstance(x, torch.Tensor):  # first: most of a state's nodes
            if key:
                self.refuse(x, path, "a tensor as a key", hint=False)
            return {"t": self.add(x, path)}
        t = type(x)
        if x is None or t is bool or t is int:
            return {"v": x}
        if t is str:
            return {"v": _utf8(x, path, "string")}
        if t is float:
            if math.isnan(x):
                return {"f": "nan"}
            if math.isinf(x):
                return {"f": "inf" if x > 0 else "-inf"}
            return {"v": x}
        if t is bytes:
            return {"b": base64.b64encode(x).decode()}
        if t is complex:
            return {"c": [self.node(x.real, path), self.node(x.imag, path)]}
        if t is torch.Size:
            return {"sz": list(x)}
        if t is torch.dtype:
            return {"dt": str(x)[len("torch."):]}
        if t is torch.device:
            return {"dev": str(x)}
        np = _numpy(x)
        if np is not None:
            dt = x.dtype
            if dt.kind not in _NP_KINDS or dt.fields is not None \
                    or dt.subdtype is not None \
                    or not _NP_DTYPE.fullmatch(dt.str) \
                    or (t is not np.ndarray and not isinstance(x, np.generic)):
                if key:
                    self.refuse(x, path, f"a {t.__qualname__} key", hint=False)
                return self.pickled(x, path, f"a numpy {t.__qualname__} of "
                                    f"dtype {dt}, which a checkpoint holds "
                                    "only pickled")
            if isinstance(x, np.generic):
                return {"ns": dt.str,
                        "bytes": base64.b64encode(x.tobytes()).decode()}
            if key:
                self.refuse(x, path, "a numpy array as a key", hint=False)
            return {"t": self.add(x, path)}
        if len(path) >= MAX_DEPTH:
            raise TypeError(f"faultline: {path_str(path)}: nested deeper than "
                            f"{MAX_DEPTH} levels (a cycle?)")
        if t is frozenset or t is tuple:
            items = [self.node(v, path + [i], key=key)
                     for i, v in enumerate(x)]
            return {"fs" if t is frozenset else "tu": items}
        if key:
            self.refuse(x, path, f"a {t.__qualname__} key {x!r}; a "
                        "checkpoint holds keys of plain values and tuples "
                        "of them", hint=False)
        if t is dict:
            return {"d": self.items_of(x, path)}
        if t is collections.OrderedDict:
            n = {"od": self.items_of(x, path)}
            extra = set(vars(x)) - {"_metadata"}
            if extra:
                return self.pickled(x, path, "an OrderedDict with attributes "
                                    f"{sorted(extra)} (a checkpoint holds "
                                    "its _metadata alone)")
            if "_metadata" in vars(x):
                n["md"] = self.node(x._metadata, path + ["_metadata"])
            return n
        if t is collections.Counter:
            return {"ctr": self.items_of(x, path)}
        if t is collections.defaultdict:
            f = x.default_factory
            if f is not None and FACTORIES.get(getattr(f, "__name__",
                                                       "")) is not f:
                return self.pickled(x, path, f"a defaultdict whose "
                                    f"default_factory is {f!r}, not one of "
                                    f"{', '.join(FACTORIES)}")
            return {"dd": self.items_of(x, path),
                    "factory": None if f is None else f.__name__}
        if t is list or t is set:
            items = [self.node(v, path + [i]) for i, v in enumerate(x)]
            return {"l" if t is list else "set": items}
        if t is bytearray:
            return {"ba": base64.b64encode(x).decode()}
        if t is types.FunctionType:
            return self.function(x, path)
        if t is types.MethodType:
            return self.method(x, path, owner, weak=False)
        if t is weakref.WeakMethod or t is _KeptMethod:
            m = x()
            if m is None:
                raise TypeError(f"faultline: {path_str(path)}: a WeakMethod "
                                "whose object is gone")
            return self.method(m, path, owner, weak=True)
        return self.pickled(x, path)


def _same_view(a, b):
    """Reports whether a and b, tensors or numpy arrays at one address,
    are views of the same elements."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and a.stride() == b.stride()
                and a.device == b.device and a.is_conj() == b.is_conj()
                and a.is_neg() == b.is_neg())
    return (not isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and a.strides == b.strides)


def _utf8(s, path, what):
    try:
        s.encode()
    except UnicodeEncodeError as e:
        raise TypeError(f"faultline: {path_str(path)}: {what} {s!r} is not "
                        f"valid UTF-8 ({e})") from None
    return s


def flatten(state, check_tensor, allow_pickle=False):
    """Returns (tree, entries, items, nbytes) for state: the tree, the
    table entries (dtype or np, and shape; pack adds blob and off) of its
    tensors and numpy arrays, those, and their sizes in bytes.

    check_tensor(t, path) returns the dtype name of tensor t or raises
    TypeError naming the path.
    """
    enc = _Encoder(check_tensor, allow_pickle)
    tree = enc.node(state, [])
    return tree, enc.entries, enc.items, enc.nbytes


def _align(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack(nbytes):
    """Places items of these sizes in data blobs, in order: returns the
    blobs' sizes and, per item, (blob, offset in the blob)."""
    limit = max(PACK, -(-sum(nbytes) // (MAX_BLOBS // 4)))
    sizes, places = [], []
    for n in nbytes:
        off = _align(sizes[-1]) if sizes else 0
        if not sizes or (sizes[-1] and off + n > limit):
            sizes.append(0)
            off = 0
        places.append((len(sizes) - 1, off))
        sizes[-1] = off + n
    return sizes, places


class TreeError(ValueError):
    """A meta blob whose tree is not one flatten writes."""


class _KeptMethod(weakref.WeakMethod):
    """A WeakMethod that keeps its object: the one a load made for it,
    which nothing else holds."""

    __slots__ = ("_kept",)

    def __new__(cls, meth):
        self = super().__new__(cls, meth)
        self._kept = meth.__self__
        return self

    def __init__(self, meth):
        super().__init__(meth)


class _Unbound:
    """A method of a "m" or "wm" node, bound once its dict is built."""

    __slots__ = ("fn", "cls", "weak")

    def __init__(self, fn, cls, weak):
        self.fn, self.cls, self.weak = fn, cls, weak


_NODE_KINDS = frozenset(("v", "f", "b", "ba", "c", "d", "od", "ctr", "dd",
                         "l", "tu", "set", "fs", "t", "ns", "sz", "dt", "dev",
                         "fn", "m", "wm", "pickle"))
_V1_KINDS = frozenset(("v", "f", "b", "d", "l", "tu", "t"))


def unflatten(tree, tensor, version=2, allow_pickle=False):
    """Builds the state back from tree (of FORMAT, or FORMAT_V1 with
    version 1). tensor(k, path, node) returns tensor (or numpy array) k of
    the table, with path None inside a pickle. A pickle node is loaded only
    with allow_pickle; without, pickle.UnpicklingError names its path."""

    allowed = _V1_KINDS if version == 1 else _NODE_KINDS

    def bad(path, msg):
        raise TreeError(f"faultline: checkpoint meta: {path_str(path)}: {msg}")

    def b64(n, key, path):
        try:
            return base64.b64decode(n[key], validate=True)
        except (ValueError, TypeError) as e:
            bad(path, f"{key} is not base64: {e}")

    def hashable(x, path):
        try:
            hash(x)
        except TypeError:
            bad(path, f"{x!r} is not hashable")
        return x

    def seq(n, key, path, key_mode=False):
        items = n[key]
        if not isinstance(items, list):
            bad(path, f"{key} is not a list")
        return [node(v, path + [i], key_mode) for i, v in enumerate(items)]

    def items(n, kind, path, out):
        if not isinstance(n[kind], list):
            bad(path, f"{kind} is not a list")
        methods = []
        for item in n[kind]:
            if type(item) is not list or len(item) != 2:
                bad(path, f"dict item {item!r} is not a [key, node] pair")
            k = item[0]
            if type(k) is str:
                pass
            elif version == 1 and isinstance(k, dict) and \
                    isinstance(k.get("i"), int) and len(k) == 1:
                k = k["i"]
            elif version >= 2 and isinstance(k, dict):
                k = hashable(node(k, path, True), path)
            else:
                bad(path, f"key {k!r} is neither a string nor a key node")
            v = node(item[1], path + [k], in_dict=True)
            if type(v) is _Unbound:
                methods.append(k)
            out[k] = v
        if methods:
            # The object the methods were bound to: its class, with the
            # entries of the dict (its state_dict) as attributes.
            if not all(isinstance(k, str) for k in out):
                bad(path, "methods in a dict with keys other than strings")
            objs = {}
            for k in methods:
                u = out[k]
                obj = objs.get(u.cls)
                if obj is None:
                    obj = objs[u.cls] = object.__new__(u.cls)
                m = types.MethodType(u.fn, obj)
                out[k] = _KeptMethod(m) if u.weak else m
            for obj in objs.values():
                obj.__dict__.update(out)
        return out

    def node(n, path, key_mode=False, in_dict=False):
        if type(n) is not dict:
            bad(path, f"node {n!r} is not an object")
        kinds = [k for k in n if k in allowed] if len(n) > 1 else list(n)
        if len(kinds) != 1 or kinds[0] not in allowed:
            bad(path, f"node {n!r} has not exactly one known key")
        kind = kinds[0]
        if len(path) > MAX_DEPTH:
            bad(path, f"nested deeper than {MAX_DEPTH} levels")
        if kind in ("d", "od", "ctr", "dd", "l", "set", "ba", "t", "fn", "m",
                    "wm", "pickle") and key_mode:
            bad(path, f"a {kind} node as a key")
        if kind == "v":
            v = n["v"]
            if v is not None and not isinstance(v, (bool, int, float, str)):
                bad(path, f"v is {v!r}, not a plain value")
            return v
        if kind == "f":
            if n["f"] not in ("inf", "-inf", "nan"):
                bad(path, f"f is {n['f']!r}, want inf, -inf or nan")
            return float(n["f"])
        if kind == "b":
            return b64(n, "b", path)
        if kind == "ba":
            return bytearray(b64(n, "ba", path))
        if kind == "c":
            parts = seq(n, "c", path)
            if len(parts) != 2 or not all(type(p) in (int, float)
                                          for p in parts):
                bad(path, f"c is {n['c']!r}, want [real, imag]")
            return complex(*parts)
        if kind == "d":
            return items(n, "d", path, {})
        if kind == "od":
            out = items(n, "od", path, collections.OrderedDict())
            if "md" in n:
                out._metadata = node(n["md"], path + ["_metadata"])
            return out
        if kind == "ctr":
            return items(n, "ctr", path, collections.Counter())
        if kind == "dd":
            f = n.get("factory")
            if f is not None and f not in FACTORIES:
                bad(path, f"factory {f!r} is not one of {sorted(FACTORIES)}")
            return items(n, "dd", path, collections.defaultdict(
                None if f is None else FACTORIES[f]))
        if kind == "l":
            return seq(n, "l", path)
        if kind == "tu":
            return tuple(seq(n, "tu", path, key_mode))
        if kind == "set":
            return {hashable(v, path) for v in seq(n, "set", path)}
        if kind == "fs":
            return frozenset(hashable(v, path)
                             for v in seq(n, "fs", path, key_mode))
        if kind == "t":
            if type(n["t"]) is not int:
                bad(path, f"tensor node {n!r} is malformed")
            return tensor(n["t"], path, n)
        if kind == "ns":
            dt = numpy_dtype(n["ns"], path)
            np = sys.modules["numpy"]
            raw = b64(n, "bytes", path) if "bytes" in n else None
            if raw is None or len(raw) != dt.itemsize:
                bad(path, f"numpy scalar {n!r} is malformed")
            return np.frombuffer(raw, dtype=dt)[0]
        if kind == "sz":
            dims = n["sz"]
            if not isinstance(dims, list) or not all(
                    type(d) is int for d in dims):
                bad(path, f"sz is {dims!r}, want a list of ints")
            return torch.Size(dims)
        if kind == "dt":
            # torch's namespace, not getattr: nothing is imported.
            dt = vars(torch).get(n["dt"]) if isinstance(n["dt"], str) \
                else None
            if not isinstance(dt, torch.dtype):
                bad(path, f"dt {n['dt']!r} is not a torch dtype")
            return dt
        if kind == "dev":
            try:
                return torch.device(n["dev"])
            except (RuntimeError, TypeError) as e:
                bad(path, f"dev {n['dev']!r}: {e}")
        if kind in ("fn", "m", "wm"):
            try:
                fn, cls = resolve(n[kind])
            except ValueError as e:
                bad(path, str(e))
            if kind == "fn":
                return fn
            if cls is None or not in_dict:
                bad(path, f"{kind} node {n!r} is not an entry of a dict of "
                    "its class's state")
            return _Unbound(fn, cls, kind == "wm")
        # kind == "pickle"
        if not allow_pickle:
            raise pickle.UnpicklingError(
                f"faultline: {path_str(path)} was saved pickled (with "
                "allow_pickle=True); loading it runs code the checkpoint "
                "names: pass allow_pickle=True to load_checkpoint only if "
                "you trust this checkpoint")
        raw = b64(n, "pickle", path)

        class Unpickler(pickle.Unpickler):
            def persistent_load(self, pid):
                if type(pid) is not int:
                    bad(path, f"pickle's persistent id {pid!r} is not an int")
                return tensor(pid, None, None)

        return Unpickler(io.BytesIO(raw)).load()

    return node(tree, [])


def numpy_dtype(s, path):
    """The numpy dtype of dtype.str s, one flatten saves."""
    if not isinstance(s, str) or not _NP_DTYPE.fullmatch(s):
        raise TreeError(f"faultline: checkpoint meta: {path_str(path)}: "
                        f"numpy dtype {s!r} is not one a checkpoint holds")
    try:
        np = importlib.import_module("numpy")
    except ImportError:
        raise ValueError(f"faultline: {path_str(path)}: a numpy array or "
                         "scalar, and numpy is not installed") from None
    return np.dtype(s)


def entry(e, k):
    """Checks table entry k; returns (blob, off, dtype name or numpy dtype,
    shape, nbytes)."""
    def bad(msg):
        raise TreeError(f"faultline: checkpoint meta: tensors[{k}]: {msg}")

    if type(e) is not dict:
        bad(f"{e!r} is not an object")
    blob, off, shape = e.get("blob"), e.get("off"), e.get("shape")
    if type(blob) is not str or type(off) is not int or off < 0 \
            or type(shape) is not list:
        bad(f"{e!r} is malformed")
    dtype = e.get("dtype")
    if ("np" in e) == (dtype is not None):
        bad(f"{e!r} has not one of dtype and np")
    if dtype is not None:
        n = ITEMSIZE.get(dtype) if type(dtype) is str else None
        if n is None:
            bad(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    else:
        dtype = numpy_dtype(e["np"], [])
        n = dtype.itemsize
    for d in shape:
        if type(d) is not int or d < 0:
            bad(f"{e!r} is malformed")
        n *= d
    return blob, off, dtype, shape, n
