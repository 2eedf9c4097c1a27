"""Dissemination barrier over point to point (any number of ranks).

Reference: D. Hensgen, R. Finkel and U. Manber, "Two algorithms for barrier
synchronization", Int. J. Parallel Programming 17(1), 1988.
"""

from __future__ import annotations

import numpy as np

from .links import Links


def barrier(links: Links, *, step: int = 0) -> None:
    """Return once every rank entered the barrier.

    Idea: in round ``k`` rank ``r`` signals ``r + 2**k`` and waits for ``r - 2**k``
    (mod ``n``); after ``ceil(log2 n)`` rounds every rank has heard, directly or
    transitively, from every other.
    Cost: ``ceil(log2 n) alpha`` (one-byte messages). Uses steps ``step .. step + L - 1``.
    Reference: Hensgen, Finkel and Manber, IJPP 17(1), 1988.
    """
    n, r = links.size, links.rank
    token, heard = np.zeros(1, np.uint8), np.empty(1, np.uint8)
    k, dist = 0, 1
    while dist < n:
        links.sendrecv(token, (r + dist) % n, heard, (r - dist) % n, step + k)
        k, dist = k + 1, dist * 2
