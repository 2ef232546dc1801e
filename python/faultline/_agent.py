"""The connection to the node agent: newline-delimited JSON over the unix
stream socket named by FAULTLINE_AGENT.

The rank sends one request object and reads one response object, in order,
on one connection per process, opened when first needed and kept. A broken
connection is reopened once per call. Every response carries "ok"; on false,
"error" says why.
"""

import json
import os
import socket
import threading

ENV = "FAULTLINE_AGENT"

# Longest response line read, in bytes.
_MAX_LINE = 64 << 20


class AgentError(RuntimeError):
    """The node agent refused a request or could not be reached."""


class Client:
    """A connection to the node agent at path."""

    def __init__(self, path, timeout=60.0):
        self.path = path
        self.timeout = timeout
        self._lock = threading.Lock()
        self._sock = None
        self._file = None

    def call(self, request, timeout=None):
        """Sends request (a dict with "op") and returns the response dict.

        Raises AgentError naming the agent's socket and the op when the agent
        cannot be reached, does not answer within timeout seconds (default
        self.timeout), or answers ok false (with its reason).
        """
        op = request.get("op", "?")
        data = json.dumps(request, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            line = None
            for attempt in (1, 2):
                try:
                    if self._sock is None:
                        self._connect()
                    self._sock.settimeout(timeout or self.timeout)
                    self._sock.sendall(data)
                    line = self._file.readline(_MAX_LINE)
                    if not line.endswith(b"\n"):
                        raise ConnectionError("the agent closed the connection"
                                              if not line else
                                              "response line cut short")
                    break
                except socket.timeout:
                    # A late answer would pass for the next call's.
                    self._close()
                    raise AgentError(
                        f"faultline agent {ENV}={self.path}: op {op}: no "
                        f"answer within {timeout or self.timeout:g} s") \
                        from None
                except OSError as e:
                    self._close()
                    if attempt == 2:
                        raise AgentError(
                            f"faultline agent {ENV}={self.path}: op {op}: "
                            f"{e}") from None
        try:
            resp = json.loads(line)
        except ValueError as e:
            self.close()
            raise AgentError(f"faultline agent {ENV}={self.path}: op {op}: "
                             f"response is not JSON: {e}") from None
        if not isinstance(resp, dict):
            raise AgentError(f"faultline agent {ENV}={self.path}: op {op}: "
                             f"response {resp!r} is not an object")
        if resp.get("ok") is not True:
            why = resp.get("error") or "refused, no reason given"
            raise AgentError(f"faultline agent: op {op}: {why}")
        return resp

    def _connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(self.timeout)
            s.connect(self.path)
        except OSError:
            s.close()
            raise
        self._sock = s
        self._file = s.makefile("rb")

    def _close(self):
        if self._file is not None:
            self._file.close()
        if self._sock is not None:
            self._sock.close()
        self._sock = self._file = None

    def close(self):
        """Closes the connection; the next call opens a new one."""
        with self._lock:
            self._close()


_client = None
_client_lock = threading.Lock()


def client():
    """Returns this process's connection to the agent named by
    FAULTLINE_AGENT, or None when the variable is not set."""
    global _client
    path = os.environ.get(ENV)
    if not path:
        return None
    with _client_lock:
        if _client is None or _client.path != path:
            if _client is not None:
                _client.close()
            _client = Client(path)
        return _client


def require(what, why):
    """Returns the agent's connection, or raises RuntimeError saying that
    what needs faultline-run's agent, and why."""
    c = client()
    if c is None:
        raise RuntimeError(
            f"{what} needs the node agent of faultline-run and {ENV} is not "
            f"set: start the job with faultline-run ({why})")
    return c


def reset():
    """Forgets the connection (after a fork, or in a spare handed a rank)."""
    global _client
    with _client_lock:
        c, _client = _client, None
    if c is not None:
        c.close()


def _after_fork():
    # The child must not share its parent's connection.
    global _client, _client_lock
    _client = None
    _client_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
