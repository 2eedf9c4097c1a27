"""Numbering, running and recording one call of a :class:`~collectives.ProcessGroup`.

Every rank numbers its collectives identically: the sequence number names a collective in
errors and keeps the tags of concurrent operations apart. A call runs inline, or on the
group's own thread for ``async_op=True`` (one thread, so every rank's ops keep the order
they were issued in); a backend whose methods return their Work
(``Capabilities.returns_work``) starts it on the calling thread instead. With
``COLLECTIVES_DEBUG=1`` each collective first checks that all ranks make the same call
(:mod:`collectives.call_check`); the flight recorder (:mod:`collectives.flight`) keeps the
last calls for ``python -m collectives.doctor``. Once the group is aborted, whatever a
call raises reaches the caller as :class:`~collectives.errors.GroupAborted`.

The functions take the group they run for; the group owns the state they share (its
sequence number, the count of queued async calls, the recorder), because the fast path
reads it on every call.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import call_check, flight, logs
from .buffers import HostBuffer
from .errors import CollectiveError, CollectiveTimeout, GroupAborted, add_note
from .reduce_op import ReduceOp
from .work import Work

_time = time.time
_log = logs.get_logger("group")


# --------------------------------------------------------------------------- state
def check_open(group: Any, op: str) -> None:
    """Raise for a call on a closed group (``GroupAborted`` once it was aborted)."""
    if group._closed:
        if group._aborted is not None:
            raise group.aborted_error(op)
        raise CollectiveError(f"{group._where(op)}: the group is closed")


def next_seq(group: Any, op: str) -> int:
    check_open(group, op)
    seq = group._seq
    group._seq += 1
    return seq


def failed(group: Any, exc: BaseException, op: str, seq: int) -> BaseException:
    """What ``exc`` (raised by the backend during ``op``) reaches the caller as: itself,
    or ``GroupAborted`` once the group was aborted (with ``exc`` as its cause)."""
    if group._aborted is None or isinstance(exc, GroupAborted):
        return exc
    error = group.aborted_error(op, seq)
    error.__cause__ = exc
    return error


def executor(group: Any) -> concurrent.futures.ThreadPoolExecutor:
    if group._executor is None:
        check_open(group, "async operation")
        group._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"collectives-{group.backend}-r{group.rank}")
    return group._executor


# ------------------------------------------------------------------------ running
def run(group: Any, op: str, seq: int, method: Callable[..., Any], args: tuple,
        buffers: Sequence[HostBuffer], async_op: bool) -> Optional[Work]:
    """``method(*args, seq)`` now, or on the group's thread when ``async_op`` (in issue
    order); for a backend whose methods return their Work, start it now and wait on it
    or hand it out."""
    if group._returns_work:
        return run_started(group, op, seq, method, args, buffers, async_op)
    if not (async_op or group._pending):  # the hot path: nothing queued, run inline
        try:
            method(*args, seq)
        except BaseException as exc:
            raise failed(group, exc, op, seq)
        for b in buffers:
            b.commit()
        return None

    def task() -> None:
        try:
            method(*args, seq)
            for b in buffers:
                b.commit()
        except BaseException as exc:
            raise failed(group, exc, op, seq)
        finally:
            with group._pending_lock:
                group._pending -= 1

    with group._pending_lock:
        group._pending += 1
    try:
        future = executor(group).submit(task)
    except BaseException:
        with group._pending_lock:
            group._pending -= 1
        raise
    work = FutureWork(future, group, op, seq)
    if async_op:
        return work
    work.wait()  # an async op is still queued: keep the order every rank sees
    return None


def run_started(group: Any, op: str, seq: int, method: Callable[..., Any], args: tuple,
                 buffers: Sequence[HostBuffer], async_op: bool) -> Optional[Work]:
    backend = group.transport
    backend.before_start(async_op)
    try:
        work = method(*args, seq)
    except Exception as exc:  # the library's own error: ours, naming the call
        error = backend.translate(exc, op, seq)
        raise failed(group, error, op, seq) from (exc if error is not exc else None)
    if work is None:  # done already (a world of one)
        for b in buffers:
            b.commit()
        return None
    if async_op:
        return GroupWork(work, group, op, seq, None,
                         [b for b in buffers if b.writeback is not None])
    try:
        work.wait()  # the group's timeout; the Work raises the backend's typed errors
    except BaseException as exc:
        raise failed(group, exc, op, seq)
    for b in buffers:
        b.commit()
    return None


def dispatch(group: Any, op: str, method: Callable[..., Any], args: tuple,
             buffers: Sequence[HostBuffer], async_op: bool, shape: Any = None,
             dtype: Any = None, root: int = -1, reduce_op: Optional[ReduceOp] = None,
             counts: Optional[tuple[Sequence[int], Sequence[int]]] = None) -> Optional[Work]:
    """Number the collective, check the call (debug mode), record it, run it.

    ``method(*args, seq)`` is the backend's method; ``shape``, ``dtype``, ``root`` and
    ``reduce_op`` describe the call for the flight recorder and the debug check
    (``counts``: all_to_all's elements sent to and received from each rank).
    """
    check_seq = next_seq(group, op) if group._debug else -1
    seq = next_seq(group, op)
    recorder = group._recorder
    rec = None if recorder is None else recorder.start(seq, op, shape, dtype, root,
                                                       reduce_op, -1)
    try:
        if check_seq >= 0:
            check_same_call(group, op, check_seq, seq, shape, dtype, root, reduce_op,
                             counts)
        work = run(group, op, seq, method, args, buffers, async_op)
    except BaseException as exc:
        record_failure(group, rec, exc)
        raise
    if rec is not None:
        if work is None:
            flight.Recorder.finish(rec)
        elif isinstance(work, GroupWork):
            work.rec = rec
        else:
            work = GroupWork(work, group, op, seq, rec, ())
    return work


def run_numbered(group: Any, op: str, method: Callable[..., Any], args: tuple, shape: Any,
                 dtype: Any, root: int, reduce_op: Any) -> None:
    """``method(*args, seq)`` on this thread under the next sequence number, recorded as
    one tuple after it returns: the fast path's run of a blocking call, and a persistent
    request's ``run()``. The caller checked that the group is open, that it may take the
    fast path and that nothing is queued."""
    seq = group._seq
    group._seq = seq + 1
    recorder = group._recorder
    if recorder is None:
        try:
            method(*args, seq)
        except BaseException as exc:
            raise failed(group, exc, op, seq)
        return
    t0 = _time()
    try:
        method(*args, seq)
    except BaseException as exc:
        fast_failed(group, (seq, op, shape, dtype, root, reduce_op, -1, t0), exc)
        raise failed(group, exc, op, seq)
    recorder.append((seq, op, shape, dtype, root, reduce_op, -1, t0, _time(), "ok"))


def fast_failed(group: Any, started: tuple, exc: BaseException) -> None:
    """Record a fast call that raised (``started``: its record up to the start time) as
    the general path would, and dump the ring."""
    rec = [*started, None, "running"]
    group._recorder.append(rec)
    record_failure(group, rec, exc)


# ------------------------------------------------------------------ point to point
def start_p2p(group: Any, op: str, tensor: Any, peer: Any, tag: Any, *, send: bool) -> Work:
    """Check a send's (``dst``) or receive's (``src``) arguments and post it.

    Point to point is not numbered (it is matched by peer and tag, not by order across
    the group); each call still goes into the flight record."""
    w = group._where(op)
    args = group._args
    args.tensor(tensor, "tensor", w)
    peer = args.rank_of(peer, "dst" if send else "src", w, allow_self=False)
    tag = args.tag(tag, w)
    check_open(group, op)
    buf = group._stage(tensor, where=w, arg="tensor", write=not send)
    backend = group.transport
    recorder = group._recorder
    rec = None if recorder is None else recorder.start(-1, op, buf.array.shape,
                                                       buf.array.dtype, -1, None, peer)
    try:
        work = (backend.isend if send else backend.irecv)(buf.array, peer, tag)
    except BaseException as exc:
        if group._returns_work and isinstance(exc, Exception):
            exc = backend.translate(exc, op, -1, peer)
        exc = failed(group, exc, op, -1)
        record_failure(group, rec, exc)
        raise exc
    return GroupWork(work, group, op, -1, rec, (buf,) if buf.writeback is not None else ())


# ------------------------------------------------------------ the debug check
def check_same_call(group: Any, op: str, check_seq: int, seq: int, shape: Any,
                     dtype: Any, root: int, reduce_op: Optional[ReduceOp],
                     counts: Optional[tuple[Sequence[int], Sequence[int]]]) -> None:
    """The COLLECTIVES_DEBUG exchange: all ranks' descriptions of this call, through the
    backend's own all_gather, compared on every rank."""
    text = call_check.describe(op, shape, dtype, root, reduce_op)
    mine = call_check.encode(text, counts, group.size)
    every = np.empty(group.size * mine.size, np.uint8)
    where = f"{group._where(op)} (seq {seq})"
    out = group._stage(every, where=where, arg="debug check", write=True)
    inp = group._stage(mine, where=where, arg="debug check", write=False)
    run(group, op, check_seq, group.transport.all_gather, (out.array, inp.array), [out],
        False)
    call_check.check(every, rank=group.rank, size=group.size, where=where,
                     all_to_all=counts is not None)


# ------------------------------------------------------------ the flight record
def record_failure(group: Any, rec: Optional[list], exc: BaseException) -> None:
    """An operation failed: note it in the flight record and, for a communication
    error, write the record out and say where in the error."""
    if isinstance(exc, CollectiveError):   # (a timeout, a dead peer, a mismatch ...)
        _log.warning("group %r: %s: %s", group._flight_name, type(exc).__name__, exc)
    if rec is None:
        return
    flight.Recorder.finish(rec, exc)
    recorder = group._recorder
    if not isinstance(exc, CollectiveError) or recorder is None:
        return
    try:
        path = recorder.dump(rank=group.rank, size=group.size, backend=group.backend,
                             group=group._flight_name, error=exc)
    except OSError as dump_error:
        add_note(exc, f"[rank {group.rank}] could not write the flight record: {dump_error}")
        return
    _log.warning("group %r: flight record written to %s", group._flight_name, path)
    add_note(exc, f"[rank {group.rank}] flight record: {path}\n  compare the ranks with: "
                  f"python -m collectives.doctor {os.path.dirname(path)}")


# ----------------------------------------------------------------------- works
class GroupWork(Work):
    """What the group hands out for an operation in flight: the backend's Work, whose
    end (or failure) goes into the flight record (``rec``), whose staged results are
    written back into the caller's tensors after the wait (``bufs``), and whose errors
    become ``GroupAborted`` once the group was aborted."""

    __slots__ = ("_inner", "_group", "_op", "_seq", "rec", "_bufs")

    def __init__(self, inner: Work, group: Any, op: str, seq: int, rec: Optional[list],
                 bufs: Sequence[HostBuffer]) -> None:
        self._inner, self._group, self._op, self._seq = inner, group, op, seq
        self.rec = rec
        self._bufs: Optional[Sequence[HostBuffer]] = bufs or None

    def wait(self, timeout: Optional[float] = None) -> None:
        rec = self.rec
        if rec is not None and len(rec) > flight.HOOK:   # traced: the wait is a slice
            t0 = _time()
            try:
                self._wait(timeout)
            finally:
                rec[flight.HOOK].waited(rec, t0, _time())
            return
        self._wait(timeout)

    def _wait(self, timeout: Optional[float]) -> None:
        try:
            self._inner.wait(timeout)
        except BaseException as exc:
            error = failed(self._group, exc, self._op, self._seq)
            if self.rec is not None:
                record_failure(self._group, self.rec, error)
            if error is exc:
                raise
            raise error
        self._done()

    def _done(self) -> None:
        rec = self.rec
        if rec is not None and rec[flight.END] is None:
            flight.Recorder.finish(rec)
        bufs = self._bufs
        if bufs is not None:
            self._bufs = None
            for buf in bufs:
                buf.commit()

    def is_completed(self) -> bool:
        if not self._inner.is_completed():
            return False
        if self._bufs is not None:  # the results are there: the caller may read them now
            bufs, self._bufs = self._bufs, None
            for buf in bufs:
                buf.commit()
        return True


class FutureWork(Work):
    """An operation run by the group's thread (``async_op=True``)."""

    __slots__ = ("_future", "_group", "_op", "_seq")

    def __init__(self, future: "concurrent.futures.Future[object]", group: Any, op: str,
                 seq: int) -> None:
        self._future, self._group, self._op, self._seq = future, group, op, seq

    def wait(self, timeout: Optional[float] = None) -> None:
        try:
            self._future.result(timeout)
        except CollectiveTimeout:
            # The operation's own timeout (naming whom it waited for): since Python 3.11
            # concurrent.futures.TimeoutError is TimeoutError, of which CollectiveTimeout
            # is a subclass, so the clause below would take it for this wait's own.
            raise
        except concurrent.futures.TimeoutError:
            raise CollectiveTimeout(
                f"{self._group._where(self._op)} (seq {self._seq}): still running after "
                f"Work.wait(timeout={timeout})", op=self._op, seq=self._seq) from None
        except concurrent.futures.CancelledError:   # queued when the group was aborted
            raise self._group.aborted_error(self._op, self._seq) from None

    def is_completed(self) -> bool:
        return self._future.done()
