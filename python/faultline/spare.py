"""A warm spare interpreter, which the node agent keeps per local rank so
that a restarted rank does not pay for importing torch again:

    python -c "import faultline.spare as s; s.main()"

main() imports torch and torch.distributed when they are importable (and
nothing of the user's), tells the agent it is ready and waits. When the
agent hands it a rank, it applies the rank's environment, working folder
and arguments and runs the script as __main__, as python would; when the
agent goes away first, it exits 0.
"""

import importlib
import json
import os
import runpy
import socket
import sys
import traceback

__all__ = ["main"]


def main():
    """Waits for a rank to run and runs it; never returns."""
    path = os.environ.get("FAULTLINE_AGENT")
    if not path:
        sys.exit("faultline.spare: FAULTLINE_AGENT is not set: spares are "
                 "started by faultline-run")
    for name in ("torch", "torch.distributed"):  # the point of a spare
        try:
            importlib.import_module(name)
        except ImportError:
            break
    try:
        local_rank = int(os.environ.get("LOCAL_RANK", "-1"))
    except ValueError:
        sys.exit(f"faultline.spare: LOCAL_RANK={os.environ['LOCAL_RANK']!r} "
                 "is not an integer")
    line = _wait(path, {"op": "spare", "pid": os.getpid(),
                        "local_rank": local_rank})
    if not line:
        sys.exit(0)  # the agent is gone
    env, argv, module, cwd = _parse(line)
    _run(env, argv, module, cwd)
    sys.exit(0)


def _wait(path, request):
    """Sends request and returns the agent's answer line, or b"" when the
    connection breaks first."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        s.sendall(json.dumps(request).encode() + b"\n")
        with s.makefile("rb") as f:
            line = f.readline()
        return line if line.endswith(b"\n") else b""
    except OSError:
        return b""
    finally:
        s.close()


def _parse(line):
    try:
        resp = json.loads(line)
    except ValueError as e:
        sys.exit(f"faultline.spare: the agent's answer is not JSON: {e}")
    if not isinstance(resp, dict) or resp.get("ok") is not True:
        why = resp.get("error") if isinstance(resp, dict) else None
        sys.exit(f"faultline.spare: the agent refused: {why or resp!r}")
    env = resp.get("env") or {}
    argv = resp.get("argv")
    module = resp.get("module", False)
    cwd = resp.get("cwd") or ""
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and (v is None or isinstance(v, str))
            for k, v in env.items()):
        sys.exit(f"faultline.spare: env {env!r}: want an object of strings "
                 "(null unsets)")
    if (not isinstance(argv, list) or not argv
            or not all(isinstance(a, str) for a in argv)):
        sys.exit(f"faultline.spare: argv {argv!r}: want a non-empty list of "
                 "strings")
    if not isinstance(module, bool) or not isinstance(cwd, str):
        sys.exit(f"faultline.spare: module {module!r} or cwd {cwd!r}: want a "
                 "bool and a string")
    return env, argv, module, cwd


def _run(env, argv, module, cwd):
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if cwd:
        os.chdir(cwd)
    import faultline
    faultline._reset()
    sys.argv = list(argv)
    try:
        if module:
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:
        # As python prints it: from the script's first frame on.
        tb = e.__traceback__
        ours = (os.path.realpath(__file__), os.path.realpath(runpy.__file__),
                "<frozen runpy>")
        while tb is not None and (tb.tb_frame.f_code.co_filename in ours or
                                  os.path.realpath(
                                      tb.tb_frame.f_code.co_filename) in ours):
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        sys.stderr.flush()
        sys.exit(1)
