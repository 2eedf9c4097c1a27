"""Point to point for the algorithms, where an empty message is never posted.

Both ends of every message of an algorithm derive its size from arguments all ranks share
(the message length, the world size, the split sizes), so when it is empty both skip it:
a collective on empty tensors sends nothing, and a ring over a message shorter than the
world moves only the non-empty chunks. (A call whose ranks disagree on a size then waits
for the missing message and times out, naming the peer, instead of failing on a size
check.) Each function returns the started ``Work``s as a list, for ``wait_all``.
"""

from __future__ import annotations

import numpy as np

from ..work import Work
from .links import Links, wait_all


def isend(links: Links, array: np.ndarray, dst: int, step: int) -> list[Work]:
    """Start sending ``array`` to ``dst`` unless it is empty."""
    return [links.isend(array, dst, step)] if array.size else []


def irecv(links: Links, array: np.ndarray, src: int, step: int) -> list[Work]:
    """Start receiving into ``array`` from ``src`` unless it is empty."""
    return [links.irecv(array, src, step)] if array.size else []


def send(links: Links, array: np.ndarray, dst: int, step: int) -> None:
    wait_all(isend(links, array, dst, step))


def recv(links: Links, array: np.ndarray, src: int, step: int) -> None:
    wait_all(irecv(links, array, src, step))


def exchange(links: Links, out: np.ndarray, dst: int, into: np.ndarray, src: int,
             step: int) -> None:
    """Send ``out`` to ``dst`` while receiving ``into`` from ``src``; both posted before
    either is waited for, so a ring of exchanges never deadlocks, whatever the sizes."""
    wait_all(irecv(links, into, src, step) + isend(links, out, dst, step))
