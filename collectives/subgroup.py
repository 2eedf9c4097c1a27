"""The default sub-group: a view over its parent's point to point with its own tag space.

Backends with a native way to make a communicator (MPI, torch.distributed, shm) override
``ProcessGroup._new_group``; every other backend gets sub-groups from this file for free.
"""

from __future__ import annotations

import zlib

import numpy as np

from . import algorithms
from .group import ProcessGroup
from .work import Work

#: Tags of a sub-group carry its id above this bit; tags below it are the sub-group's own.
GROUP_ID_SHIFT = 40
_GROUP_ID_BITS = 21


class SubGroup(ProcessGroup):
    """Ranks ``ranks`` of ``parent`` as a group of their own.

    Rank 2 of a four-rank ``pg``: ``sub = pg.new_group([2, 3])`` -> ``sub.rank == 0``.
    """

    def __init__(self, parent: ProcessGroup, ranks: tuple[int, ...], instance: int) -> None:
        # A sub-group of a sub-group is a sub-group of the root: one level of tag mapping.
        while isinstance(parent, SubGroup):
            ranks = tuple(parent._ranks[r] for r in ranks)
            parent = parent._parent
        super().__init__(ranks.index(parent.rank), len(ranks), timeout=parent.timeout)
        self.backend = parent.backend
        self._parent = parent
        self._ranks = ranks
        digest = zlib.crc32(repr((ranks, instance)).encode())
        self._tag_offset = ((digest % ((1 << _GROUP_ID_BITS) - 1)) + 1) << GROUP_ID_SHIFT

    def _isend(self, array: np.ndarray, dst: int, tag: int) -> Work:
        return self._parent._isend(array, self._ranks[dst], self._tag_offset | tag)

    def _irecv(self, array: np.ndarray, src: int, tag: int) -> Work:
        return self._parent._irecv(array, self._ranks[src], self._tag_offset | tag)

    def _barrier(self, seq: int) -> None:
        algorithms.barrier(self._links(seq))

    def _new_group(self, ranks: tuple[int, ...], instance: int) -> ProcessGroup:
        return SubGroup(self, ranks, instance)
