"""Every collective written over point to point only.

Every :class:`~collectives.backend.Backend` runs these unless it has a collective of its
own, so a backend that implements only ``isend``/``irecv`` is complete. Each function
takes a :class:`Links` (send/recv with this call's tags) and the buffers a backend's
collective receives: flat, C-contiguous host arrays, outputs written in place (the
contract is in :mod:`collectives.backend`).
"""

from .links import Links, PointToPoint, wait_all
from .dispatch import (all_gather, all_reduce, all_to_all, barrier, broadcast, gather,
                       reduce, reduce_scatter, scatter)

__all__ = ["Links", "PointToPoint", "wait_all", "all_gather", "all_reduce", "all_to_all",
           "barrier", "broadcast", "gather", "reduce", "reduce_scatter", "scatter"]
