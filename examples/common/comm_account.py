"""The communication account of a mesh run: bytes per mesh dimension, measured by a wrapper
around each dimension's group, next to what the model's sizes predict.

A call's time is the caller's: from the call to its return, plus (for ``async_op=True``)
the time blocked in ``Work.wait()``; communication hidden behind computation does not
count. A call's bytes are the size of its whole buffer, the same on every rank: the tensor of
``all_reduce`` and ``broadcast``, the gathered ``output`` of ``all_gather``, the ``input``
of ``reduce_scatter`` (the largest array argument of the call). A group of one rank moves
nothing and counts 0. Object collectives (``all_gather_object``...) are not counted: the
strategies use them only at construction, before the account starts.

::

    tp = CountingGroup(mesh["tp"])                  # then give ``tp`` to the layers
    tp.start()                                      # count from here (after set-up)
    ...                                             # train
    tp.bytes / steps, tp.seconds / steps            # per step on the tp dimension
"""

from __future__ import annotations

import time
from typing import Any, Optional

__all__ = ["COUNTED", "COUNTED_INIT", "CountingGroup", "nbytes_of_call"]

#: The collectives the account counts.
COUNTED = frozenset({"all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
                     "reduce_scatter", "all_to_all", "send", "recv", "isend", "irecv"})


#: Persistent requests (collectives.persistent) of the counted collectives: every
#: ``start()`` is one call of the collective, with its bytes, until its ``wait()``.
COUNTED_INIT = frozenset({"all_reduce_init", "all_gather_init", "reduce_scatter_init"})


def nbytes_of_call(args: tuple, kwargs: dict) -> int:
    """The largest array (torch tensor or numpy array) argument's size in bytes."""
    sizes = [a.numel() * a.element_size() if hasattr(a, "numel") else a.nbytes
             for a in list(args) + list(kwargs.values())
             if hasattr(a, "numel") or hasattr(a, "nbytes")]
    return max(sizes, default=0)


class CountingGroup:
    """``group`` with a byte and call counter on its collectives (after :meth:`start`);
    everything else passes through, so strategies take it where they take a group."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self.counting = False
        self.bytes = 0
        self.calls = 0
        self.seconds = 0.0

    def start(self) -> None:
        """Reset the counters and count from now on."""
        self.counting, self.bytes, self.calls, self.seconds = True, 0, 0, 0.0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._group, name)
        if name in COUNTED_INIT:  # a persistent request: each round counts as a call
            return lambda *args, **kwargs: _CountedRequest(attr(*args, **kwargs), self,
                                                           nbytes_of_call(args, kwargs))
        if name not in COUNTED:
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            if not (self.counting and self._group.size > 1):
                return attr(*args, **kwargs)
            self.bytes += nbytes_of_call(args, kwargs)
            self.calls += 1
            start = time.perf_counter()
            result = attr(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            return result if result is None or not hasattr(result, "wait") else \
                _TimedWork(result, self)

        return counted


def _timed_wait(waitable: Any, owner: CountingGroup, timeout: Optional[float]) -> Any:
    """``waitable.wait(timeout)``, the time blocked in it added to ``owner.seconds``."""
    start = time.perf_counter()
    try:
        return waitable.wait(timeout)
    finally:
        owner.seconds += time.perf_counter() - start


class _TimedWork:
    """A Work whose ``wait`` adds the time blocked in it to the group's ``seconds``."""

    def __init__(self, work: Any, owner: CountingGroup) -> None:
        self._work, self._owner = work, owner

    def wait(self, timeout: Optional[float] = None) -> Any:
        return _timed_wait(self._work, self._owner, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _CountedRequest:
    """A persistent request whose rounds count as the plain calls do: bytes and a call
    at ``start()``, time in ``start()`` and blocked in ``wait()``."""

    def __init__(self, request: Any, owner: CountingGroup, nbytes: int) -> None:
        self._request, self._owner, self._nbytes = request, owner, nbytes
        self._counted = False

    def _count(self, call: Any) -> None:
        """``call()`` (a start, or a whole blocking round): one call, its bytes, its time."""
        owner = self._owner
        self._counted = owner.counting and owner._group.size > 1
        if not self._counted:
            call()
            return
        owner.bytes += self._nbytes
        owner.calls += 1
        start = time.perf_counter()
        call()
        owner.seconds += time.perf_counter() - start

    def start(self) -> None:
        self._count(self._request.start)

    def run(self) -> None:
        """A blocking round (start and wait in one): one call, all of its time."""
        self._count(self._request.run)

    def wait(self, timeout: Optional[float] = None) -> Any:
        if not self._counted:
            return self._request.wait(timeout)
        return _timed_wait(self._request, self._owner, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)
