"""Handles for operations started with ``async_op=True`` (and for ``isend``/``irecv``)."""

from __future__ import annotations

import abc
import concurrent.futures
from typing import Callable, Optional

from .errors import CollectiveTimeout


class Work(abc.ABC):
    """An operation in flight.

    ``wait()`` blocks until it finished and re-raises its error, if any; ``wait(timeout)``
    raises :class:`CollectiveTimeout` when it is still running after ``timeout`` seconds
    (the operation itself goes on).

    Two ranks::

        work = pg.all_reduce(t, async_op=True)   # both ranks
        compute_something_else()
        work.wait()                                # t now holds the sum
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


class FutureWork(Work):
    """A Work backed by a ``concurrent.futures.Future`` (an op run by a group's thread).

    ``on_done`` runs once, in the waiting thread, after a successful wait: it is where
    staged results are written back into the caller's tensors.
    """

    def __init__(self, future: "concurrent.futures.Future[object]", description: str,
                 on_done: Optional[Callable[[], None]] = None) -> None:
        self._future = future
        self._description = description
        self._on_done = on_done

    def wait(self, timeout: Optional[float] = None) -> None:
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise CollectiveTimeout(
                f"{self._description}: still running after Work.wait(timeout={timeout})",
                op=self._description) from None
        if self._on_done is not None:
            on_done, self._on_done = self._on_done, None
            on_done()

    def is_completed(self) -> bool:
        return self._future.done()
