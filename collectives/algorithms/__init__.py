"""Every collective written over point to point only.

The base :class:`~collectives.group.ProcessGroup` uses these unless a backend overrides a
hook, so a backend that implements only ``_isend``/``_irecv``/``_barrier`` is complete.
Each function takes a :class:`Links` (send/recv with this call's tags) and the hook's
buffers: flat, C-contiguous host arrays, outputs written in place (the contract is in
:mod:`collectives.hooks`).
"""

from .links import Links, PointToPoint, wait_all
from .dispatch import (all_gather, all_reduce, all_to_all, barrier, broadcast, gather,
                       reduce, reduce_scatter, scatter)

__all__ = ["Links", "PointToPoint", "wait_all", "all_gather", "all_reduce", "all_to_all",
           "barrier", "broadcast", "gather", "reduce", "reduce_scatter", "scatter"]
