"""A replica's side of the coordinator: requests (:func:`parallel.ft.wire.ask`) and the
heartbeat thread that tells the coordinator this replica is alive.

Two ranks, each::

    client = CoordinatorClient("127.0.0.1:29400", replica_id=f"{rank}:{os.getpid()}")
    client.start_heartbeats(0.2)
    q = client.quorum(step=0, quorum_id=0, broken=False, fresh=True)
    client.close()
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Optional

from .wire import CoordinatorUnreachable, ask, read_message, write_message

__all__ = ["CoordinatorClient", "parse_address"]


def parse_address(text: str) -> tuple[str, int]:
    """``"host:port"`` as ``(host, port)``; ValueError naming the text otherwise.

    >>> parse_address("127.0.0.1:29400")
    ('127.0.0.1', 29400)
    """
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"parallel.ft: the coordinator's address must be 'host:port', "
                         f"got {text!r}")
    return host, int(port)


class CoordinatorClient:
    """Requests of replica ``replica_id`` to the coordinator at ``address``."""

    def __init__(self, address: str, replica_id: str, *, timeout: float = 120.0) -> None:
        self.address = parse_address(address)
        self.replica_id = replica_id
        self.timeout = timeout
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def request(self, op: str, **fields: object) -> dict:
        return ask(self.address, dict(op=op, id=self.replica_id, **fields), self.timeout)

    def quorum(self, *, step: int, quorum_id: int, broken: bool, fresh: bool) -> dict:
        """This round's quorum (asks again when the round closed without this replica)."""
        deadline = time.monotonic() + self.timeout
        while True:
            answer = self.request("quorum", step=step, quorum_id=quorum_id, broken=broken,
                                  fresh=fresh)
            if not answer.get("retry"):
                return answer
            if time.monotonic() > deadline:
                raise CoordinatorUnreachable(f"parallel.ft: replica {self.replica_id} was "
                                             f"left out of every quorum for "
                                             f"{self.timeout:g} s")

    def commit(self, *, quorum_id: int, step: int, ok: bool) -> bool:
        """The coordinator's decision for ``step`` of quorum ``quorum_id``."""
        return bool(self.request("commit", quorum_id=quorum_id, step=step, ok=ok)["commit"])

    def leave(self, finished: bool) -> None:
        try:
            self.request("leave", finished=finished)
        except (CoordinatorUnreachable, ValueError):
            pass   # the job is ending anyway

    # ---------------------------------------------------------------- heartbeats
    def start_heartbeats(self, interval: float) -> None:
        """Send a heartbeat every ``interval`` seconds from a daemon thread, over one
        connection (made again when it breaks), until :meth:`close`."""
        self._thread = threading.Thread(target=self._beat, args=(interval,),
                                        name="ft-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self, interval: float) -> None:
        sock: Optional[socket.socket] = None
        stream = None
        while not self._stop.is_set():
            try:
                if sock is None:
                    sock = socket.create_connection(self.address, timeout=max(1.0, interval * 5))
                    stream = sock.makefile("rb")
                write_message(sock, {"op": "heartbeat", "id": self.replica_id})
                read_message(stream)
            except (OSError, EOFError, ValueError):
                if sock is not None:
                    sock.close()
                sock = stream = None
            self._stop.wait(interval)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        """Stop the heartbeats (within one interval). Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
