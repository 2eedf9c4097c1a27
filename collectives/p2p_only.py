"""Run any backend with the default send/recv algorithms only (backend name ``p2p:NAME``).

This proves the algorithms of ``collectives.algorithms`` on a real transport, and lets a
backend author compare their native collectives with the defaults in one test run.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .backend import Backend
from .work import Work


class P2POnly(Backend):
    """Every collective of ``inner`` through the send/recv defaults; only its point to
    point and barrier are used.

    Two ranks: ``collectives.init_process_group("p2p:shm")`` -> a group whose all_reduce
    is recursive doubling over shm's rings.
    """

    def __init__(self, inner: Backend) -> None:
        super().__init__(inner.rank, inner.size, inner.timeout)
        self.name = f"p2p:{inner.name}"
        self.inner = inner

    def isend(self, array: np.ndarray, dst: int, tag: int) -> Work:
        return self.inner.isend(array, dst, tag)

    def irecv(self, array: np.ndarray, src: int, tag: int) -> Work:
        return self.inner.irecv(array, src, tag)

    def barrier(self, seq: int) -> None:
        work = self.inner.barrier(seq)  # a Work where the inner's methods return one
        if work is not None:
            work.wait()

    def describe(self) -> list[str]:
        return [f"the collectives of collectives.algorithms over {self.inner.name}'s "
                f"point to point"] + self.inner.describe()

    def close(self) -> None:
        self.inner.close()

    def abort(self) -> None:
        self.inner.abort()


def wrap_factory(inner: Callable[..., Backend]) -> Callable[..., Backend]:
    """A factory that builds ``inner``'s backend and wraps it in :class:`P2POnly`."""

    def factory(*args: Any, **kwargs: Any) -> Backend:
        return P2POnly(inner(*args, **kwargs))

    return factory
