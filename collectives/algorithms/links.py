"""Point to point as seen by one collective algorithm: the group's ranks plus tags that
belong to this one call.

Tag layout (the transports carry ints below 2**63):
    bits 0..11   the algorithm's step (so one call can keep several messages apart)
    bits 12..35  the collective's sequence number on the group (mod 2**24)
    bit  39      set: a collective's internal message (user tags are below 2**31)
    bits 40..60  the sub-group id (``collectives.subgroup``), 0 on a backend's own groups
"""

from __future__ import annotations

from typing import Iterable, Protocol

import numpy as np

from ..work import Work

COLLECTIVE_TAG_BIT = 1 << 39
MAX_STEPS = 1 << 12


class PointToPoint(Protocol):
    """What an algorithm needs of a transport: its ranks and non-blocking send/recv on raw
    tags (a :class:`collectives.Backend` is one)."""

    rank: int
    size: int

    def isend(self, array: np.ndarray, dst: int, tag: int) -> Work: ...

    def irecv(self, array: np.ndarray, src: int, tag: int) -> Work: ...


class Links:
    """Send/recv between group ranks inside collective number ``seq``.

    ``p2p`` is a :class:`collectives.Backend` (what a backend's own collectives pass), or
    a :class:`collectives.ProcessGroup`, whose backend's point to point is then used.
    ``step`` (0..4095) separates the messages of one call; a pair of ranks that exchange
    several messages with the same step receives them in order.

    Two ranks, both: ``ring.all_reduce(Links(pg, seq=0), a, ReduceOp.SUM)``.
    """

    def __init__(self, p2p: PointToPoint, seq: int) -> None:
        p2p = getattr(p2p, "transport", p2p)   # a ProcessGroup: its backend's point to point
        self.rank = p2p.rank
        self.size = p2p.size
        #: The transport this call's messages go through (a backend may offer more than
        #: point to point on it: zmq's received parts, read where they arrived).
        self.p2p = p2p
        self._base = COLLECTIVE_TAG_BIT | ((seq & 0xFFFFFF) << 12)

    def tag(self, step: int) -> int:
        """The transport tag of ``step`` of this collective (for a backend that posts a
        message of the algorithm through its own, faster path)."""
        if not 0 <= step < MAX_STEPS:
            raise ValueError(f"algorithm step {step} out of range 0..{MAX_STEPS - 1}")
        return self._base | step

    def isend(self, array: np.ndarray, dst: int, step: int = 0) -> Work:
        return self.p2p.isend(array, dst, self.tag(step))

    def irecv(self, array: np.ndarray, src: int, step: int = 0) -> Work:
        return self.p2p.irecv(array, src, self.tag(step))

    def send(self, array: np.ndarray, dst: int, step: int = 0) -> None:
        self.isend(array, dst, step).wait()

    def recv(self, array: np.ndarray, src: int, step: int = 0) -> None:
        self.irecv(array, src, step).wait()

    def sendrecv(self, send: np.ndarray, dst: int, recv: np.ndarray, src: int,
                 step: int = 0) -> None:
        """Send and receive at once (never deadlocks on a ring, whatever the sizes)."""
        wait_all([self.irecv(recv, src, step), self.isend(send, dst, step)])


def wait_all(works: Iterable[Work]) -> None:
    """Wait for every Work; the first error is raised after all were waited for."""
    error = None
    for w in works:
        try:
            w.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            error = error or exc
    if error is not None:
        raise error


def fold_tag(tag: int, bits: int) -> int:
    """A tag below ``2**bits`` for a tag of this library (>= 2**31: the collective bit,
    the sequence number, a sub-group's id), for transports whose tags are narrower
    (MPI's ``TAG_UB``, a C int in c10d). The algorithm step (bits 0..11) is kept as is;
    the sequence bits above it are XORed with a hash of everything above ``bits``, so
    one group's consecutive collectives never share a tag within ``2**(bits-12)`` and
    sub-groups are spread apart.

    >>> fold_tag((1 << 39) | (5 << 12) | 3, 29) & 0xFFF
    3
    """
    mask = (1 << (bits - 12)) - 1
    high = (tag >> bits) * 0x9E3779B1 & mask
    return ((((tag >> 12) & mask) ^ high) << 12) | (tag & 0xFFF)
