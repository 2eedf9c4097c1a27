"""The coordinator's wire format: one JSON object per line over TCP, a request and its
answer. JSON and not pickle: the coordinator listens on a port, and nothing a peer sends
it may run code. Shared by :mod:`parallel.ft.coordinator` (the server) and
:mod:`parallel.ft.client`.

Two ranks asking for the quorum of their next step::

    ask(("127.0.0.1", 29400), {"op": "quorum", "id": "0:123", "step": 5}, timeout=30.0)
    # -> {"quorum_id": 2, "members": ["0:123", "1:124"], "rank": 0, ...}
"""

from __future__ import annotations

import json
import socket
from typing import Any

__all__ = ["CoordinatorUnreachable", "ask", "read_message", "write_message"]

#: A request or answer longer than this is refused (a line of JSON with a few ids).
MAX_LINE_BYTES = 1 << 20


class CoordinatorUnreachable(ConnectionError):
    """The coordinator did not answer (it is down, or the address is wrong): a
    fault-tolerant job cannot go on without it, so this is not swallowed."""


def write_message(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")


def read_message(stream: Any) -> dict:
    """The next line of ``stream`` (a socket's ``makefile('rb')``) as a dict; EOFError at
    the end, ValueError for a line that is not a JSON object."""
    line = stream.readline(MAX_LINE_BYTES + 1)
    if not line:
        raise EOFError("connection closed")
    if len(line) > MAX_LINE_BYTES:
        raise ValueError(f"message longer than {MAX_LINE_BYTES} bytes")
    value = json.loads(line)
    if not isinstance(value, dict):
        raise ValueError(f"message is not a JSON object: {line[:80]!r}")
    return value


def ask(address: tuple[str, int], request: dict, timeout: float) -> dict:
    """Send ``request`` to the coordinator at ``address`` on a connection of its own and
    return its answer; at most ``timeout`` seconds, else :class:`CoordinatorUnreachable`
    naming the request and the address."""
    try:
        with socket.create_connection(address, timeout=timeout) as sock:
            sock.settimeout(timeout)
            write_message(sock, request)
            with sock.makefile("rb") as stream:
                answer = read_message(stream)
    except (OSError, EOFError, ValueError) as exc:
        raise CoordinatorUnreachable(
            f"parallel.ft: the coordinator at {address[0]}:{address[1]} did not answer "
            f"{request.get('op')!r} within {timeout:g} s: {exc}") from None
    if "error" in answer:
        raise ValueError(f"parallel.ft: the coordinator refused {request.get('op')!r}: "
                         f"{answer['error']}")
    return answer
