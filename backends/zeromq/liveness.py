"""Which peers of a zmq world are gone, and why: the one record that the sockets
(:mod:`backends.zeromq.connections`: a closed connection), the matching (a receive that
can no longer be served) and the engine (a send or a collective that cannot complete)
all consult. It decides nothing about requests itself; failing them is
:meth:`backends.zeromq.matching.Matcher.peer_down`'s.
"""

from __future__ import annotations

import time

from .calls import CANNOT_COMPLETE, Call

#: After a peer's connection closed: how long to keep reading what it had sent before
#: failing the waits on it.
LOST_GRACE_S = 0.05


class Liveness:
    """Peers whose connection closed (``lost``, not yet given up on) and peers that are
    ``down`` (said BYE, or ``dead``: went without one). ``down`` and ``dead`` change under
    the engine's lock; ``lost`` only in the thread that reads the sockets."""

    def __init__(self) -> None:
        self.down: dict[int, str] = {}   # peer -> why, for error messages
        self.dead: set[int] = set()      # the peers in ``down`` that went without BYE
        self.lost: dict[int, float] = {}  # peer -> when its connection closed

    def connection_closed(self, peer: int) -> None:
        self.lost.setdefault(peer, time.monotonic())

    def overdue(self, now: float) -> list[int]:
        """The peers lost for at least LOST_GRACE_S, no longer counted as lost (the caller
        marks them down)."""
        gone = [p for p, since in self.lost.items() if now - since >= LOST_GRACE_S]
        for p in gone:
            del self.lost[p]
        return gone

    def mark_down(self, peer: int, why: str, died: bool) -> bool:
        """Lock held: record that ``peer`` is gone; False when it was already."""
        if peer in self.down:
            return False
        self.down[peer] = why
        if died:
            self.dead.add(peer)
        return True

    def raise_if_member_dead(self, call: Call) -> None:
        """PeerError naming the first member of ``call``'s group that died (a collective
        over it cannot complete)."""
        for m in call.members:
            if m in self.dead:
                raise call.peer_error(m, f"{self.down[m]}; {CANNOT_COMPLETE}")
