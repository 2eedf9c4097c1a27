"""``MpiWork``: MPI's request(s) of one operation of the mpi backend, plus what remains
to do once they completed (AVG's division, writing staged results back).

Two ranks: ``work = backend.all_reduce(a, ReduceOp.SUM, seq)`` (``MPI_Iallreduce``
started) -> ``work.wait()`` polls it (:mod:`backends.mpi.polling`) until done.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

from collectives.buffers import HostBuffer
from collectives.errors import CollectiveError
from collectives.work import Work

from . import library
from .diagnostics import answer_all_peers
from .polling import poll


__all__ = ["MpiWork"]


class MpiWork(Work):
    """One operation of an :class:`~backends.mpi.backend.MpiBackend`: MPI's request(s) plus what remains to do once
    they completed (AVG's division, writing staged results back).

    ``wait(timeout)`` raises :class:`CollectiveTimeout` when the operation is still
    running after ``timeout`` seconds (the group's timeout when None); the operation goes
    on and may be waited for again.
    """

    __slots__ = ("_group", "_op", "_seq", "_peer", "_requests", "_then", "_buffers", "_keep",
                 "_lock", "_finished", "_error", "_timed_out")

    def __init__(self, group: Any, op: str, seq: int, requests: list,
                 then: Optional[Callable[[], None]] = None,
                 buffers: Sequence[HostBuffer] = (), keep: Any = None,
                 peer: int = -1) -> None:
        self._group = group
        self._op, self._seq, self._peer = op, seq, peer
        self._requests = requests
        self._then = then
        self._buffers = buffers
        self._keep = keep  # the arrays MPI reads and writes, alive until completion
        self._lock = threading.Lock()
        self._finished = False
        self._error: Optional[BaseException] = None
        self._timed_out = False

    def _test(self) -> bool:
        """True once every request completed (or failed: then ``_error`` is set)."""
        with self._lock:
            if self._finished:
                return True
            try:
                reqs = self._requests
                return reqs[0].Test() if len(reqs) == 1 else library.MPI.Request.Testall(reqs)
            except library.MPI.Exception as exc:
                self._error = self._group.diagnostics.translate(exc, self._op, self._seq,
                                                               self._peer)
                return True

    def wait(self, timeout: Optional[float] = None) -> None:
        if not self._finished:
            group = self._group
            limit = group.timeout if timeout is None else float(timeout)
            done = poll(lambda: self._test() or group.aborted, limit, answer_all_peers)
            if group.aborted and not self._finished_now():
                group.keep_alive(self)
                raise CollectiveError(f"{group.describe_call(self._op, self._seq)}: the "
                                      f"group was aborted")
            if not done:
                group.keep_alive(self)
                raise group.diagnostics.timeout_error(self._op, self._seq, self._peer, limit,
                                                      explicit=timeout is not None)
            self._finish()
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        if not self._finished and self._test():
            self._finish()
        return self._finished

    def _finished_now(self) -> bool:
        """One more look (after an abort): whether every request completed anyway."""
        return self._test()

    def _finish(self) -> None:
        with self._lock:
            if self._finished:
                return
            try:
                if self._error is None:
                    if self._then is not None:
                        self._then()
                    for b in self._buffers:
                        b.commit()
            except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
                self._error = exc
            finally:
                self._finished = True
                self._requests, self._then, self._buffers, self._keep = [], None, (), None
        self._group.inflight.discard(self)


