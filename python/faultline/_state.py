"""The tree of a state_dict, as the "meta" blob of a checkpoint holds it.

A state_dict is nested dicts (str or int keys), lists, tuples, tensors and
plain values (None, bool, int, float with inf and nan, str, bytes). flatten
turns it into a JSON tree and a list of tensors; unflatten builds it back.
A node of the tree is one of

    {"d": [[key, node], ...]}   a dict, keys in order; an int key is {"i": n}
    {"l": [node, ...]}          a list
    {"tu": [node, ...]}         a tuple
    {"t": k, "dtype": "float32", "shape": [...]}   tensor k, blob "t<k>"
    {"v": x}                    None, bool, int, float, str
    {"f": "inf" | "-inf" | "nan"}
    {"b": "<base64>"}           bytes

Nothing is ever unpickled. Anything else is a TypeError naming the key path,
raised before anything is written.
"""

import base64
import json
import math
import numbers

FORMAT = "faultline.state/1"

# The dtypes a checkpoint stores, by the name the tree gives them.
DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32",
          "int16", "int8", "uint8", "bool", "complex64", "complex128")

# Deepest nesting accepted (a cycle would otherwise recurse forever).
MAX_DEPTH = 200

_KINDS = "tensors, dicts, lists, tuples, None, bool, int, float, str, bytes"


def path_str(path):
    """Renders a key path as Python indexes it: state_dict["a"][0]."""
    return "state_dict" + "".join(
        f"[{json.dumps(k, ensure_ascii=False)}]" if isinstance(k, str)
        else f"[{k!r}]" for k in path)


def flatten(state, tensor_type, check_tensor):
    """Returns (tree, tensors) for state.

    tensor_type is the class of tensors (torch.Tensor); check_tensor(t, path)
    returns the dtype name of t or raises TypeError naming the path.
    """
    tensors = []

    def node(x, path):
        if isinstance(x, tensor_type):
            dtype = check_tensor(x, path)
            tensors.append(x)
            return {"t": len(tensors) - 1, "dtype": dtype,
                    "shape": list(x.shape)}
        if x is None or isinstance(x, (bool, str)):
            if isinstance(x, str):
                try:
                    x.encode()
                except UnicodeEncodeError as e:
                    raise TypeError(f"faultline: {path_str(path)}: string is "
                                    f"not valid UTF-8 ({e})") from None
                x = str(x)
            return {"v": x}
        if isinstance(x, numbers.Integral):
            return {"v": int(x)}
        if isinstance(x, numbers.Real):
            f = float(x)
            if math.isnan(f):
                return {"f": "nan"}
            if math.isinf(f):
                return {"f": "inf" if f > 0 else "-inf"}
            return {"v": f}
        if isinstance(x, (bytes, bytearray, memoryview)):
            return {"b": base64.b64encode(bytes(x)).decode()}
        if len(path) >= MAX_DEPTH:
            raise TypeError(f"faultline: {path_str(path)}: nested deeper than "
                            f"{MAX_DEPTH} levels (a cycle?)")
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise TypeError(
                        f"faultline: {path_str(path)}: key {k!r} is a "
                        f"{type(k).__name__}; a checkpoint holds str and int "
                        "keys")
                if isinstance(k, str):
                    try:
                        k.encode()
                    except UnicodeEncodeError as e:
                        raise TypeError(
                            f"faultline: {path_str(path)}: key {k!r} is not "
                            f"valid UTF-8 ({e})") from None
                key = {"i": int(k)} if isinstance(k, int) else str(k)
                items.append([key, node(v, path + [k])])
            return {"d": items}
        if isinstance(x, list):
            return {"l": [node(v, path + [i]) for i, v in enumerate(x)]}
        if isinstance(x, tuple):
            return {"tu": [node(v, path + [i]) for i, v in enumerate(x)]}
        raise TypeError(f"faultline: {path_str(path)}: a {type(x).__name__}, "
                        f"which a checkpoint cannot hold ({_KINDS})")

    return node(state, []), tensors


class TreeError(ValueError):
    """A meta blob whose tree is not one flatten writes."""


def unflatten(tree, tensor):
    """Builds the state back from tree; tensor(k, dtype, shape, path)
    returns tensor k."""

    def bad(path, msg):
        raise TreeError(f"faultline: checkpoint meta: {path_str(path)}: {msg}")

    def node(n, path):
        if not isinstance(n, dict) or len(n) == 0:
            bad(path, f"node {n!r} is not an object")
        if "v" in n:
            return n["v"]
        if "d" in n:
            out = {}
            if not isinstance(n["d"], list):
                bad(path, "d is not a list")
            for item in n["d"]:
                if not isinstance(item, list) or len(item) != 2:
                    bad(path, f"dict item {item!r} is not a [key, node] pair")
                k = item[0]
                if isinstance(k, dict) and isinstance(k.get("i"), int):
                    k = k["i"]
                elif not isinstance(k, str):
                    bad(path, f"key {k!r} is neither a string nor {{'i': n}}")
                out[k] = node(item[1], path + [k])
            return out
        if "l" in n or "tu" in n:
            items = n.get("l", n.get("tu"))
            if not isinstance(items, list):
                bad(path, "l or tu is not a list")
            vals = [node(v, path + [i]) for i, v in enumerate(items)]
            return vals if "l" in n else tuple(vals)
        if "t" in n:
            k, dtype, shape = n.get("t"), n.get("dtype"), n.get("shape")
            if (not isinstance(k, int) or dtype not in DTYPES
                    or not isinstance(shape, list)
                    or not all(isinstance(d, int) and d >= 0 for d in shape)):
                bad(path, f"tensor node {n!r} is malformed")
            return tensor(k, dtype, shape, path)
        if "f" in n:
            f = n["f"]
            if f not in ("inf", "-inf", "nan"):
                bad(path, f"f is {f!r}, want inf, -inf or nan")
            return float(f)
        if "b" in n:
            try:
                return base64.b64decode(n["b"], validate=True)
            except (ValueError, TypeError) as e:
                bad(path, f"b is not base64: {e}")
        bad(path, f"node {n!r} has no known key")

    return node(tree, [])
