"""Faultline inside a training process.

Dotting of the phases of a step, which the node agent turns into the trace
files its slow-rank analysis reads:

    import faultline

    for n, batch in enumerate(loader):
        with faultline.step(n):
            with faultline.span("forward"):
                loss = model(batch)

Under faultline-run, the launcher and node agent, a rank also registers
with the agent (faultline.init(), or faultline.torch.init() for PyTorch,
which also times every collective for the hang watchdog), saves flash
checkpoints into the agent's shared memory (faultline.torch.Checkpointer)
and reads the control plane (faultline.admin). Everything comes from the
standard library; torch is imported by faultline.torch alone.

Without the agent (plain python or torchrun) span() is off unless
FAULTLINE_RING names a ring, init() says once what that turns off, and
nothing else changes.
"""

import faulthandler
import os
import sys
import warnings

from faultline import _agent, _ring
from faultline._agent import AgentError
from faultline._ring import RingError, comm_span, mark, span, step

__all__ = ["span", "mark", "step", "comm_span", "init", "dropped",
           "AgentError", "RingError"]

__version__ = "0.1.0"

_hello = None        # the agent's answer to hello
_resume = None       # what init() returned
_stack_file = None   # the file faulthandler dumps into
_stack_signal = None
_warned = False


def dropped():
    """Dotting records dropped so far (a full ring or too many open ranges)."""
    return _ring.dropped()


def _env_int(name, default):
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"faultline: {name}={v!r} is not an integer") \
            from None


def warn_no_agent():
    """Says once that no node agent was found and what that turns off."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"faultline: no node agent ({_agent.ENV} is not set): "
            "collectives are not timed, so hangs are not detected; stacks "
            "are not dumped; Checkpointer cannot save to memory. Start the "
            "job with faultline-run to have them.", RuntimeWarning,
            stacklevel=3)


def init():
    """Registers this process with its node agent and installs the stack
    dump; returns the step the job resumes from (-1: none agreed, load your
    own newest).

    Without FAULTLINE_AGENT it warns once and returns FAULTLINE_RESUME_STEP
    (default -1). Calling it again returns the first answer.
    """
    global _hello, _resume
    if _resume is not None:
        return _resume
    resume = _env_int("FAULTLINE_RESUME_STEP", -1)
    c = _agent.client()
    if c is None:
        warn_no_agent()
        _install_stacks(None)
        _resume = resume
        return resume
    rank = _env_int("RANK", 0)
    resp = c.call({"op": "hello", "rank": rank, "pid": os.getpid()})
    r = resp.get("resume_step", resume)
    if isinstance(r, bool) or not isinstance(r, int):
        raise AgentError(f"faultline agent: op hello: resume_step {r!r} is "
                         "not an integer")
    _install_stacks(resp.get("stack_signal"))
    _hello = resp
    _resume = r
    return r


def _install_stacks(agent_signal):
    """faulthandler dumps every thread's stack into FAULTLINE_STACK_FILE on
    FAULTLINE_STACK_SIGNAL (or the agent's stack_signal): it runs in the C
    signal handler, so it works while the rank is blocked in a collective."""
    global _stack_file, _stack_signal
    path = os.environ.get("FAULTLINE_STACK_FILE")
    if not path or _stack_file is not None:
        return
    sig = _env_int("FAULTLINE_STACK_SIGNAL", 0) or agent_signal
    if isinstance(sig, bool) or not isinstance(sig, int) or sig <= 0:
        warnings.warn(f"faultline: FAULTLINE_STACK_FILE={path} is set but no "
                      "signal is (FAULTLINE_STACK_SIGNAL): stacks are not "
                      "dumped", RuntimeWarning, stacklevel=3)
        return
    try:
        f = open(path, "a")
    except OSError as e:
        warnings.warn(f"faultline: FAULTLINE_STACK_FILE={path}: {e}: stacks "
                      "are not dumped", RuntimeWarning, stacklevel=3)
        return
    try:
        faulthandler.register(sig, file=f, all_threads=True, chain=False)
    except (ValueError, RuntimeError, OSError) as e:
        f.close()
        warnings.warn(f"faultline: FAULTLINE_STACK_SIGNAL={sig}: {e}: stacks "
                      "are not dumped", RuntimeWarning, stacklevel=3)
        return
    _stack_file, _stack_signal = f, sig


def _attach_ring():
    path = os.environ.get("FAULTLINE_RING")
    if not path:
        return
    try:
        _ring.attach(path)
    except (OSError, ValueError) as e:
        warnings.warn(f"faultline: FAULTLINE_RING={path}: {e}: dotting is off",
                      RuntimeWarning, stacklevel=2)


def _reset():
    """Forgets everything this process cached from its environment (the
    agent's connection, the ring, init()'s answer, the stack dump) and
    attaches the ring the environment names now: a warm spare calls it when
    it is handed a rank."""
    global _hello, _resume, _stack_file, _stack_signal, _warned
    _agent.reset()
    _ring.detach()
    if _stack_signal is not None:
        faulthandler.unregister(_stack_signal)
    if _stack_file is not None:
        _stack_file.close()
    _hello = _resume = _stack_file = _stack_signal = None
    _warned = False
    ft = sys.modules.get("faultline.torch")
    if ft is not None:
        ft._loaded = False  # the next load is the rank's first
    _attach_ring()


_attach_ring()
