"""What the manager's Admin API serves, read through the node agent.

    import faultline.admin
    for m in faultline.admin.members():
        ...

Each function returns the manager's answer decoded from JSON. It needs the
node agent of faultline-run (FAULTLINE_AGENT); without it, RuntimeError.
"""

import json

from faultline import _agent

__all__ = ["members", "switch_status", "faults", "orchestrations"]


def _admin(what, fn):
    c = _agent.require(f"faultline.admin.{fn}()",
                       "the agent relays the manager's Admin API")
    r = _agent_call(c, what)
    if isinstance(r, (str, bytes)):
        try:
            return json.loads(r)
        except ValueError as e:
            raise _agent.AgentError(f"faultline agent: op admin {what}: "
                                    f"result is not JSON: {e}") from None
    return r


def _agent_call(c, what):
    return c.call({"op": "admin", "what": what}).get("result")


def members():
    """The members of the job (workers, proxies) the manager knows."""
    return _admin("members", "members")


def switch_status():
    """The profiling switch in force and each worker's state of it."""
    return _admin("switch", "switch_status")


def faults():
    """The faults the manager has recorded."""
    return _admin("faults", "faults")


def orchestrations():
    """The recovery orchestrations, running and past."""
    return _admin("orchestrations", "orchestrations")
