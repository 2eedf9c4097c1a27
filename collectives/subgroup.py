"""The default sub-group: a backend that is a view over its parent backend's point to
point, with its own tag space.

Backends with a native way to make a communicator (MPI, torch.distributed, shm, zmq)
return one from ``Backend.new_group``; for every other backend (``new_group`` returns
None) ``ProcessGroup.new_group`` runs the sub-group over this view, so sub-groups come
for free.
"""

from __future__ import annotations

import threading
import time
import zlib
from typing import NoReturn, Optional

import numpy as np

from .backend import Backend
from .errors import (CollectiveError, CollectiveTimeout, PeerError, raise_lifted,
                     renumbered)
from .work import Work

#: Tags of a sub-group carry its id above this bit; tags below it are the sub-group's own.
GROUP_ID_SHIFT = 40
_GROUP_ID_BITS = 21


class SubGroup(Backend):
    """Ranks ``ranks`` of ``parent`` as a backend of their own.

    Rank 2 of a four-rank world: ``SubGroup(world_backend, (2, 3), 0).rank == 0``.
    """

    def __init__(self, parent: Backend, ranks: tuple[int, ...], instance: int) -> None:
        # A sub-group of a sub-group is a sub-group of the root: one level of tag mapping.
        while isinstance(parent, SubGroup):
            ranks = tuple(parent.ranks[r] for r in ranks)
            parent = parent.parent
        super().__init__(ranks.index(parent.rank), len(ranks), parent.timeout)
        self.name = parent.name
        #: The backend whose point to point this view runs on, and the members' ranks there.
        self.parent = parent
        self.ranks = ranks
        digest = zlib.crc32(repr((ranks, instance)).encode())
        self._tag_offset = ((digest % ((1 << _GROUP_ID_BITS) - 1)) + 1) << GROUP_ID_SHIFT
        self.aborted = threading.Event()

    def isend(self, array: np.ndarray, dst: int, tag: int) -> Work:
        self._check()
        try:
            work = self.parent.isend(array, self.ranks[dst], self._tag_offset | tag)
        except CollectiveError as exc:
            self.reraise(exc, "send")
        return _ViewWork(work, self, "send")

    def irecv(self, array: np.ndarray, src: int, tag: int) -> Work:
        self._check()
        try:
            work = self.parent.irecv(array, self.ranks[src], self._tag_offset | tag)
        except CollectiveError as exc:
            self.reraise(exc, "recv")
        return _ViewWork(work, self, "recv")

    def lift(self, exc: CollectiveError, op: str) -> CollectiveError:
        """The parent's error ``exc`` of this view's ``op``, the ranks it names
        (``PeerError.peer``, ``CollectiveTimeout.missing``) in this view's numbering
        (:func:`~collectives.errors.renumbered`); other errors as they are."""
        if not isinstance(exc, (PeerError, CollectiveTimeout)):
            return exc
        head = f"{self.where(op)}: in the parent (ranks {', '.join(map(str, self.ranks))})"
        return renumbered(exc, head,
                          lambda r: self.ranks.index(r) if r in self.ranks else -1)

    def reraise(self, exc: CollectiveError, op: str) -> NoReturn:
        """Raise :meth:`lift` of ``exc`` (see :func:`~collectives.errors.raise_lifted`)."""
        raise_lifted(exc, self.lift(exc, op))

    def _check(self) -> None:
        if self.aborted.is_set():
            raise CollectiveError(f"{self.where('point to point')}: the sub-group was aborted")

    def close(self) -> None:
        """Nothing of its own to release: the parent's transport stays open."""

    def abort(self) -> None:
        """End this view's waits (within a slice of :data:`ABORT_SLICE_S`); the parent
        and its other groups go on."""
        self.aborted.set()


#: How often a wait of a sub-group view looks whether the view was aborted.
ABORT_SLICE_S = 0.1


class _ViewWork(Work):
    """A parent's Work, waited for in slices so that an abort of the view ends the wait
    (a Work's ``wait(timeout)`` may be resumed: the operation goes on)."""

    __slots__ = ("_inner", "_view", "_op")

    def __init__(self, inner: Work, view: SubGroup, op: str) -> None:
        self._inner, self._view, self._op = inner, view, op

    def wait(self, timeout: Optional[float] = None) -> None:
        limit = self._view.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            if self._view.aborted.is_set():
                raise CollectiveError(f"{self._view.where(self._op)}: the sub-group was aborted")
            left = deadline - time.monotonic()
            try:
                self._inner.wait(max(1e-6, min(ABORT_SLICE_S, left)))
                return
            except CollectiveTimeout as exc:
                if time.monotonic() >= deadline:
                    raise self._view.lift(CollectiveTimeout(
                        f"{exc} (after {limit:g} s in all)", op=exc.op, seq=exc.seq,
                        missing=exc.missing), self._op) from None
            except CollectiveError as exc:
                self._view.reraise(exc, self._op)

    def is_completed(self) -> bool:
        return self._inner.is_completed()
