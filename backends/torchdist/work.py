"""The Work of a torch backend's operation (:class:`TorchWork`): torch's work objects,
waited for in slices so that a peer's death on this host (or an abort) ends the wait
(:class:`~backends.torchdist.failures.Failures`), plus what remains to do once they
finished.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence

from collectives.buffers import HostBuffer
from collectives.errors import CollectiveError, CollectiveTimeout
from collectives.work import Work


class TorchWork(Work):
    """One operation on a torch group: torch's work object plus what remains to do once
    it finished (AVG's division, int16's narrowing, writing staged results back).

    ``wait(timeout)`` raises :class:`CollectiveTimeout` when the operation is still
    running after ``timeout`` seconds (it goes on; wait again later).

    A send or receive cannot be polled: gloo's ``is_completed()`` of one stays false until
    someone waited on it, and a ``wait(timeout)`` that times out closes the connection
    (torch 2.13: "Application timeout caused pair closure"). So such a Work is finished
    by one plain ``wait()``, on a thread of its own once somebody polls it.
    """

    def __init__(self, group: Any, op: str, seq: int, works: Sequence[Any],
                 thens: Sequence[Callable[[], None]] = (),
                 buffers: Sequence[HostBuffer] = (), keep: Sequence[Any] = (),
                 peer: int = -1) -> None:
        self._group = group
        self._op, self._seq, self._peer = op, seq, peer
        self._works = list(works)
        self._thens = list(thens)
        self._buffers = list(buffers)
        self._keep = list(keep)  # the tensors torch's work reads and writes
        self._spans: list = []  # the memory of its arguments (see TorchGroup._run)
        self._lock = threading.Lock()
        self._finished = False
        self._error: Optional[BaseException] = None
        self._p2p = seq < 0 and peer >= 0
        self._waiter: Optional[threading.Thread] = None

    def wait(self, timeout: Optional[float] = None) -> None:
        if not self._finished:
            if timeout is not None:
                self._poll(timeout)
            self._finish()
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        if self._p2p:
            self._start_waiter()
        elif not self._finished and all(w.is_completed() for w in self._works):
            self._finish()
        return self._finished

    def _start_waiter(self) -> None:
        with self._lock:
            if self._waiter is None and not self._finished:
                self._waiter = threading.Thread(target=self._finish, daemon=True,
                                                name=f"collectives-gloo-{self._op}")
                self._waiter.start()

    def _poll(self, timeout: float) -> None:
        if self._p2p:
            self._start_waiter()
            waiter = self._waiter
            if waiter is not None:
                waiter.join(timeout)
                if waiter.is_alive():
                    raise CollectiveTimeout(
                        f"{self._group.describe_call(self._op, self._seq)}: still running "
                        f"after Work.wait(timeout={timeout})", op=self._op, seq=self._seq,
                        missing=(self._peer,))
            return
        deadline = time.monotonic() + timeout
        delay = 20e-6
        while not all(w.is_completed() for w in self._works):
            if self._group.aborted:
                raise CollectiveError(f"{self._group.describe_call(self._op, self._seq)}: "
                                      f"the group was aborted")
            now = time.monotonic()
            if now >= deadline:
                raise CollectiveTimeout(
                    f"{self._group.describe_call(self._op, self._seq)}: still running after "
                    f"Work.wait(timeout={timeout})", op=self._op, seq=self._seq,
                    missing=(self._peer,) if self._peer >= 0 else ())
            time.sleep(min(delay, deadline - now))
            delay = min(2 * delay, 2e-3)

    def _finish(self) -> None:
        with self._lock:
            if self._finished:
                return
            try:
                for w in self._works:
                    self._group.failures.wait(w, self._op, self._seq, self._peer)
                for then in self._thens:
                    then()
                for b in self._buffers:
                    b.commit()
            except RuntimeError as exc:
                self._error = self._group.failures.translate(exc, self._op, self._seq,
                                                            self._peer)
            except CollectiveError as exc:   # (an abort, or a dead peer: already ours)
                self._error = exc
            finally:
                self._finished = True
                # Drop torch's work objects (and the tensors they hold) here, in a
                # Python thread, never last in one of gloo's threads.
                self._works, self._thens, self._buffers, self._keep = [], [], [], []
                self._spans = []
                self._group.inflight.discard(self)


