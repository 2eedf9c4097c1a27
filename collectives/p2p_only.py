"""Run any backend with the default send/recv algorithms only (backend name ``p2p:NAME``).

This proves the algorithms of ``collectives.algorithms`` on a real transport, and lets a
backend author compare their native collectives with the defaults in one test run.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .group import ProcessGroup
from .work import Work


class P2POnlyGroup(ProcessGroup):
    """Every collective of ``inner`` through the send/recv defaults; only its point to
    point and barrier are used."""

    def __init__(self, inner: ProcessGroup) -> None:
        super().__init__(inner.rank, inner.size, timeout=inner.timeout)
        self.backend = f"p2p:{inner.backend}"
        self._inner = inner

    def _isend(self, array: np.ndarray, dst: int, tag: int) -> Work:
        return self._inner._isend(array, dst, tag)

    def _irecv(self, array: np.ndarray, src: int, tag: int) -> Work:
        return self._inner._irecv(array, src, tag)

    def _barrier(self, seq: int) -> None:
        work = self._inner._barrier(seq)  # a Work where the inner's hooks return one
        if work is not None:
            work.wait()

    def _close(self) -> None:
        self._inner.close()


def wrap_factory(inner: Callable[..., ProcessGroup]) -> Callable[..., ProcessGroup]:
    """A factory that builds ``inner``'s group and wraps it in :class:`P2POnlyGroup`."""

    def factory(*args: Any, **kwargs: Any) -> ProcessGroup:
        return P2POnlyGroup(inner(*args, **kwargs))

    return factory
