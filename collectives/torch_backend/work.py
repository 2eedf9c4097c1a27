"""Running one group's operations in issue order and handing torch its ``Work``.

torch's backend contract is asynchronous: every method returns a ``Work`` at once, and
``Work.get_future()`` is a ``torch.futures.Future`` that completes with the operation's
output tensors (DDP's communication hooks chain on it). :class:`Runner` gives each group
one thread that runs the collectives one after another, in the order they were issued
(the order every rank sees), and completes each one's future. A blocking call
(``asyncOp=False``, e.g. ``dist.all_reduce(t)``) with nothing queued runs at once in the
caller's thread instead: no thread hop where nothing could overlap anyway.

Point-to-point operations are posted at once through our group's own ``isend``/``irecv``
(never queued behind collectives: a send queued behind a blocking receive on the same
thread would deadlock ``batch_isend_irecv``) and complete in :meth:`PointToPointWork.wait`.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..work import Work as OurWork

#: ``translate(exc, op)``: the exception torch's caller sees (see ``errors.translate``).
Translate = Callable[[BaseException, str], BaseException]


class CollectiveWork(dist._Work):
    """torch's ``Work`` for one queued (or already finished) collective.

    ``wait()`` blocks until the collective ran and re-raises its error (a
    :class:`~collectives.torch_backend.CollectivesBackendError` for a communication
    failure); ``get_future()`` completes with the output tensors. Our group's own timeout
    bounds every wait, so ``wait``'s ``timeout`` argument is not needed and ignored.
    """

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: Any = None) -> bool:
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self.exception() is None and self._future.done()

    def exception(self) -> Optional[BaseException]:
        if not self._future.done():
            return None
        try:
            self._future.wait()
        except Exception as exc:  # noqa: BLE001 - the operation's own error, returned
            return exc
        return None

    def get_future(self) -> torch.futures.Future:
        return self._future


class PointToPointWork(CollectiveWork):
    """torch's ``Work`` for a send or receive posted on our group: ``wait()`` waits for our
    Work and then completes the future (a first ``get_future()`` has a helper thread
    do the waiting, so that a future-only user is not left waiting forever)."""

    def __init__(self, inner: OurWork, result: list, op: str, translate: Translate) -> None:
        super().__init__(torch.futures.Future())
        self._inner, self._result, self._op, self._translate = inner, result, op, translate
        self._lock = threading.Lock()
        self._helper: Optional[threading.Thread] = None

    def wait(self, timeout: Any = None) -> bool:
        with self._lock:
            if not self._future.done():
                try:
                    self._inner.wait()
                except BaseException as exc:
                    self._future.set_exception(self._translate(exc, self._op))
                else:
                    self._future.set_result(self._result)
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        if not self._future.done() and self._inner.is_completed():
            try:
                self.wait()
            except Exception:  # noqa: BLE001 - kept in the future; wait() raises it
                pass
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._helper is None and not self._future.done():
                self._helper = threading.Thread(target=self._wait_quietly, daemon=True,
                                                name=f"collectives-torch-{self._op}")
                self._helper.start()
        return self._future

    def _wait_quietly(self) -> None:
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - kept in the future
            pass


class Runner:
    """One group's collectives, run one at a time in issue order.

    ``submit(op, fn, result, blocking)`` returns a :class:`CollectiveWork` whose future
    gets ``result`` once ``fn()`` returned (or ``fn``'s error, translated). ``fn`` runs on
    the runner's thread, or inline when ``blocking`` and nothing is queued.

    >>> r = Runner("doc", lambda exc, op: exc)
    >>> r.submit("noop", lambda: None, [1], blocking=False).get_future().wait()
    [1]
    >>> r.close()
    """

    def __init__(self, name: str, translate: Translate) -> None:
        self._name = name
        self._translate = translate
        self._queue: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._lock = threading.Lock()   # guards _pending, _thread, _closed
        self._exec = threading.Lock()   # held while an operation runs on our group
        self._pending = 0               # queued or running on the thread
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def submit(self, op: str, fn: Callable[[], None], result: Any,
               blocking: bool) -> CollectiveWork:
        future: torch.futures.Future = torch.futures.Future()
        with self._lock:
            if self._closed:
                raise dist.DistBackendError(f"[collectives backend] {op}: the process group "
                                            f"{self._name} was shut down")
            inline = blocking and self._pending == 0
            if inline:
                # _pending == 0: the thread holds no operation (it lowers _pending only
                # after releasing _exec), so this never waits.
                self._exec.acquire()
            else:
                self._pending += 1
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, daemon=True,
                                                    name=f"collectives-torch-{self._name}")
                    self._thread.start()
                self._queue.put((op, fn, result, future))
        if inline:
            try:
                self._complete(op, fn, result, future)
            finally:
                self._exec.release()
        return CollectiveWork(future)

    def _complete(self, op: str, fn: Callable[[], None], result: Any,
                  future: torch.futures.Future) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - every error goes to the waiter
            future.set_exception(self._translate(exc, op))
        else:
            future.set_result(result)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            with self._exec:
                self._complete(*item)
            with self._lock:
                self._pending -= 1

    def close(self) -> None:
        """Finish what is queued, then stop the thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            if thread is not threading.current_thread():
                thread.join()
