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

import atexit
import queue
import threading
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..work import Work as OurWork

#: ``translate(exc, op)``: the exception torch's caller sees (see ``errors.translate``).
Translate = Callable[[BaseException, str], BaseException]


def new_future(result: Any) -> torch.futures.Future:
    """A future for ``result``: one that knows the CUDA devices of its tensors (torch
    refuses to complete a device-less future with CUDA tensors), else a plain one."""
    found = _tensors_of(result)
    devices = sorted({t.device for t in found if t.is_cuda}, key=str)
    return torch.futures.Future(devices=devices) if devices else torch.futures.Future()


def _tensors_of(result: Any) -> list:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (list, tuple)):
        return [t for item in result for t in _tensors_of(item)]
    return []


class _Failed:
    """What the inner future holds when the operation failed (see CollectiveWork)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _unwrap(inner: torch.futures.Future) -> Any:
    value = inner.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class CollectiveWork(dist._Work):
    """torch's ``Work`` for one queued (or already finished) collective.

    ``wait()`` blocks until the collective ran and re-raises its error as it is (a
    :class:`~collectives.torch_backend.CollectivesBackendError` for a communication
    failure); ``get_future()`` completes with the output tensors, or fails with the
    error's text. Our group's own timeout bounds every wait, so ``wait``'s ``timeout``
    argument is not needed and ignored.

    Two futures: torch's ``Future.set_exception`` stores the exception as a *value*
    (C++ consumers such as DDP's reducer would read it as tensors), so the inner one is
    completed with the result or a failure marker, and the future handed out is chained
    on it with a callback that raises: that marks it failed for C++ and Python alike.
    """

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._inner = new_future(result)
        self._future = self._inner.then(_unwrap)
        self._error: Optional[BaseException] = None

    def _finish(self, result: Any, error: Optional[BaseException]) -> None:
        if error is None:
            self._inner.set_result(result)
        else:
            self._error = error  # before the inner future completes: wait() reads it
            self._inner.set_result(_Failed(error))

    def wait(self, timeout: Any = None) -> bool:
        # The outer future, not the inner one: it completes after the inner one's
        # callbacks ran, so that get_future().value() is ready once wait() returned.
        try:
            self._future.wait()
        except Exception:  # noqa: BLE001 - ours, raised below as it is
            if self._error is None:
                raise
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def get_future(self) -> torch.futures.Future:
        return self._future


class PointToPointWork(CollectiveWork):
    """torch's ``Work`` for a send or receive posted on our group: ``wait()`` waits for our
    Work and then completes the future (a first ``get_future()`` has a helper thread
    do the waiting, so that a future-only user is not left waiting forever)."""

    def __init__(self, inner: OurWork, result: list, op: str, translate: Translate) -> None:
        super().__init__(result)
        self._ours, self._result, self._op, self._translate = inner, result, op, translate
        self._lock = threading.Lock()
        self._helper: Optional[threading.Thread] = None

    def wait(self, timeout: Any = None) -> bool:
        with self._lock:
            if not self._inner.done():
                try:
                    self._ours.wait()
                except BaseException as exc:  # noqa: BLE001 - goes to every waiter
                    self._finish(None, self._translate(exc, self._op))
                else:
                    self._finish(self._result, None)
        return super().wait()

    def is_completed(self) -> bool:
        if not self._inner.done() and self._ours.is_completed():
            try:
                self.wait()
            except Exception:  # noqa: BLE001 - kept; wait() raises it
                pass
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._helper is None and not self._inner.done():
                self._helper = threading.Thread(target=self._wait_quietly, daemon=True,
                                                name=f"collectives-torch-{self._op}")
                self._helper.start()
        return self._future

    def _wait_quietly(self) -> None:
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - kept; wait() raises it
            pass


#: Seconds a runner's thread is given at interpreter exit to finish (after ``abort``).
EXIT_JOIN_S = 10.0

#: Runners whose thread was started and not yet stopped.
_RUNNING: "weakref.WeakSet[Runner]" = weakref.WeakSet()


@atexit.register
def _stop_runners_at_exit() -> None:
    """Stop every runner's thread before Python finalises. A thread still running then
    (completing a future: torch's C++ runs its callbacks, DDP's among them) is ended by
    the interpreter from inside C++ frames, which aborts the process ("terminate called
    without an active exception"); a job whose group broke (a dead peer) and that exits
    without ``destroy_process_group`` left such a thread behind."""
    for runner in list(_RUNNING):
        runner.stop_at_exit()


class Runner:
    """One group's collectives, run one at a time in issue order.

    ``submit(op, fn, result, blocking)`` returns a :class:`CollectiveWork` whose future
    gets ``result`` once ``fn()`` returned (or ``fn``'s error, translated). ``fn`` runs on
    the runner's thread, or inline when ``blocking`` and nothing is queued. ``abort``
    ends the group's calls in flight; at interpreter exit a runner with calls still
    queued calls it, so that its thread ends at once.

    >>> r = Runner("doc", lambda exc, op: exc)
    >>> r.submit("noop", lambda: None, [1], blocking=False).get_future().wait()
    [1]
    >>> r.close()
    """

    def __init__(self, name: str, translate: Translate,
                 abort: Optional[Callable[[], None]] = None) -> None:
        self._name = name
        self._translate = translate
        self._abort = abort
        self._queue: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._lock = threading.Lock()   # guards _pending, _thread, _closed
        self._exec = threading.Lock()   # held while an operation runs on our group
        self._pending = 0               # queued or running on the thread
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def submit(self, op: str, fn: Callable[[], None], result: Any,
               blocking: bool) -> CollectiveWork:
        work = CollectiveWork(result)
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
                    _RUNNING.add(self)
                self._queue.put((op, fn, result, work))
        if inline:
            try:
                self._complete(op, fn, result, work)
            finally:
                self._exec.release()
        return work

    def _complete(self, op: str, fn: Callable[[], None], result: Any,
                  work: CollectiveWork) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - every error goes to the waiter
            work._finish(None, self._translate(exc, op))
        else:
            work._finish(result, None)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            with self._exec:
                self._complete(*item)
            with self._lock:
                self._pending -= 1

    def close(self, timeout: Optional[float] = None) -> None:
        """Finish what is queued, then stop the thread (waiting ``timeout`` seconds at
        most; None: until it stopped). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        _RUNNING.discard(self)
        if thread is not None:
            self._queue.put(None)
            if thread is not threading.current_thread():
                thread.join(timeout)

    def stop_at_exit(self) -> None:
        """At interpreter exit: fail what is still queued or running (``abort``) rather
        than wait for peers that may never come, and stop the thread."""
        with self._lock:
            busy = self._pending > 0 and not self._closed
        if busy and self._abort is not None:
            try:
                self._abort()
            except Exception:  # noqa: BLE001 - exiting anyway; the join is bounded
                pass
        self.close(EXIT_JOIN_S)
