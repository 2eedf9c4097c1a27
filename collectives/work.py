"""Handles for operations started with ``async_op=True`` (and for ``isend``/``irecv``)."""

from __future__ import annotations

import abc
import threading
from typing import Callable, Optional

from .errors import CollectiveError, raise_lifted


class Work(abc.ABC):
    """An operation in flight.

    ``wait()`` blocks until it finished and re-raises its error, if any; ``wait(timeout)``
    raises :class:`CollectiveTimeout` when it is still running after ``timeout`` seconds
    (the operation itself goes on).

    Two ranks:

    >>> import numpy as np, collectives
    >>> def overlap():
    ...     pg = collectives.init_process_group()
    ...     t = np.full(3, pg.rank + 1.0)
    ...     work = pg.all_reduce(t, async_op=True)   # both ranks
    ...     squares = [i * i for i in range(1000)]   # computed while it runs
    ...     work.wait()                              # t now holds the sum
    ...     pg.close()
    ...     return t.tolist()
    >>> collectives.spawn(overlap, 2)
    [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]]
    """

    @abc.abstractmethod
    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until done; re-raise the operation's error."""

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True once the operation finished (successfully or not)."""


class CompletedWork(Work):
    """A Work that is already done (the result of a synchronous call, or an error)."""

    def __init__(self, error: Optional[BaseException] = None) -> None:
        self._error = error

    def wait(self, timeout: Optional[float] = None) -> None:
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        return True


class LiftedWork(Work):
    """``work``, with the library's error it fails with raised as ``lift(error)``: how a
    backend made of groups of its own (hier's host group) gives its part's errors its
    own numbering and call."""

    __slots__ = ("_work", "_lift")

    def __init__(self, work: Work,
                 lift: Callable[[CollectiveError], CollectiveError]) -> None:
        self._work = work
        self._lift = lift

    def wait(self, timeout: Optional[float] = None) -> None:
        try:
            self._work.wait(timeout)
        except CollectiveError as exc:
            raise_lifted(exc, self._lift(exc))

    def is_completed(self) -> bool:
        return self._work.is_completed()


class InFlight:
    """The Works a backend started and nobody finished yet, so that ``close()`` can
    finish them and their memory outlives the library's use of it (MPI's and torch's
    non-blocking calls). A Work leaves with :meth:`discard` once it finished; past
    ``limit`` entries the completed ones are asked to finish (those nobody waits for).

    >>> live = InFlight(); live.add(w := CompletedWork()); len(live.snapshot())
    1
    """

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._works: dict = {}
        self._lock = threading.Lock()

    def add(self, work: Work) -> None:
        with self._lock:
            self._works[work] = None
            crowded = len(self._works) > self.limit
        if crowded:  # works nobody waits for: finish the completed ones
            for w in self.snapshot():
                w.is_completed()

    def discard(self, work: Work) -> None:
        with self._lock:
            self._works.pop(work, None)

    def snapshot(self) -> list:
        with self._lock:
            return list(self._works)

    def take_all(self) -> list:
        """Every Work still held (and forget them)."""
        with self._lock:
            works, self._works = list(self._works), {}
        return works

    def __bool__(self) -> bool:
        return bool(self._works)
