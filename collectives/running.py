"""Numbering, running and recording a call (mixed into
:class:`~collectives.group.ProcessGroup`).

Every rank numbers its collectives identically: the sequence number names a collective in
errors and keeps the tags of concurrent operations apart. A call runs inline, or on the
group's own thread for ``async_op=True`` (one thread, so every rank's ops keep the order
they were issued in). With ``COLLECTIVES_DEBUG=1`` each collective first checks that all
ranks make the same call (:mod:`collectives.call_check`); the flight recorder
(:mod:`collectives.flight`) keeps the last calls for ``python -m collectives.doctor``.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import call_check, flight
from .buffers import HostBuffer
from .errors import CollectiveError, add_note
from .reduce_op import ReduceOp
from .work import FutureWork, Work


class CallRunner:
    """Run loop of the group; needs the state ``ProcessGroup.__init__`` sets up."""

    def _next_seq(self, op: str) -> int:
        if self._closed:
            raise CollectiveError(f"{self._where(op)}: the group is closed")
        seq = self._seq
        self._seq += 1
        return seq

    def _ensure_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"collectives-{self.backend}-r{self.rank}")
        return self._executor

    #: Whether this backend's collective hooks only *start* their operation and return a
    #: :class:`Work` for it (see :mod:`collectives.hooks`): MPI's and torch's non-blocking
    #: calls. The base class then calls them on the calling thread, also for
    #: ``async_op=True``, and waits on (or hands out) the Work they return.
    hooks_return_work: bool = False
    #: Works in flight that nobody has waited for yet, this many at most before the
    #: completed ones are finished (their memory released).
    TRACK_LIMIT = 64

    def _run(self, op: str, seq: int, fn: Callable[[], Optional[Work]],
             buffers: Sequence[HostBuffer], async_op: bool) -> Optional[Work]:
        """Run ``fn`` (the hook) now, or on the group's thread when ``async_op`` (in issue
        order); for a backend whose hooks return their Work, start it now and wait on it
        or hand it out."""
        if self.hooks_return_work:
            return self._run_started(op, seq, fn, buffers, async_op)
        if not (async_op or self._pending):  # the hot path: nothing queued, run inline
            fn()
            for b in buffers:
                b.commit()
            return None

        def task() -> None:
            try:
                fn()
                for b in buffers:
                    b.commit()
            finally:
                with self._pending_lock:
                    self._pending -= 1

        with self._pending_lock:
            self._pending += 1
        future = self._ensure_executor().submit(task)
        work = FutureWork(future, f"{self._where(op)} (seq {seq})")
        if async_op:
            return work
        work.wait()  # an async op is still queued: keep the order every rank sees
        return None

    def _run_started(self, op: str, seq: int, fn: Callable[[], Optional[Work]],
                     buffers: Sequence[HostBuffer], async_op: bool) -> Optional[Work]:
        self._before_start(async_op)
        try:
            work = fn()
        except Exception as exc:  # the library's own error: ours, naming the call
            error = self._translate(exc, op, seq)
            if error is exc:
                raise
            raise error from exc
        if work is None:  # done already (a world of one)
            for b in buffers:
                b.commit()
            return None
        if async_op:
            self._track(work)
            staged = [b for b in buffers if b.writeback is not None]
            return _CommitOnWait(work, staged) if staged else work
        work.wait()  # the group's timeout; the Work raises the backend's typed errors
        for b in buffers:
            b.commit()
        return None

    def _describe(self, op: str, seq: int) -> str:
        """``[rank r/n] op (seq k)`` for a collective, ``[rank r/n] op`` for point to point
        (``seq`` -1): how errors name a call."""
        return f"{self._where(op)} (seq {seq})" if seq >= 0 else self._where(op)

    def _before_start(self, async_op: bool) -> None:
        """Called before a hook of a ``hooks_return_work`` backend starts its operation
        (the torch backends order it after the async ops in flight whose memory it
        shares)."""

    def _translate(self, exc: BaseException, op: str, seq: int,
                   peer: int = -1) -> BaseException:
        """This library's typed error for a transport library's exception ``exc`` raised
        in ``op`` (``seq``; ``peer`` for point to point); ``exc`` itself when it already
        is one, or when the backend has nothing better to say."""
        return exc

    # ------------------------------------------------------------ works in flight
    def _track(self, work: Work) -> None:
        """Hold ``work`` (started, not yet waited for) until it finishes, so that
        ``close()`` can finish it and its memory outlives the library's use of it."""
        with self._inflight_lock:
            self._inflight[work] = None
            crowded = len(self._inflight) > self.TRACK_LIMIT
        if crowded:  # works nobody waits for: finish the completed ones
            for w in list(self._inflight):
                w.is_completed()

    def _untrack(self, work: Work) -> None:
        with self._inflight_lock:
            self._inflight.pop(work, None)

    def _in_flight(self) -> list:
        with self._inflight_lock:
            return list(self._inflight)

    def _dispatch_collective(
            self, op: str, fn: Callable[[int], None], buffers: Sequence[HostBuffer],
            async_op: bool, shape: Any = None, dtype: Any = None, root: int = -1,
            reduce_op: Optional[ReduceOp] = None,
            counts: Optional[tuple[Sequence[int], Sequence[int]]] = None) -> Optional[Work]:
        """Number the collective, check the call (debug mode), record it, run it.

        ``fn(seq)`` runs the collective hook; ``shape``, ``dtype``, ``root`` and
        ``reduce_op`` describe the call for the flight recorder and the debug check
        (``counts``: all_to_all's elements sent to and received from each rank).
        """
        check_seq = self._next_seq(op) if self._debug else -1
        seq = self._next_seq(op)
        rec = None if self._recorder is None else self._recorder.start(
            seq, op, shape, dtype, root, reduce_op, -1)
        try:
            if check_seq >= 0:
                self._check_same_call(op, check_seq, seq, shape, dtype, root, reduce_op, counts)
            work = self._run(op, seq, lambda: fn(seq), buffers, async_op)
        except BaseException as exc:
            self._record_failure(rec, exc)
            raise
        if rec is not None:
            if work is None:
                flight.Recorder.finish(rec)
            else:
                work = _RecordedWork(work, self, rec)
        return work

    def _check_same_call(self, op: str, check_seq: int, seq: int, shape: Any, dtype: Any,
                         root: int, reduce_op: Optional[ReduceOp],
                         counts: Optional[tuple[Sequence[int], Sequence[int]]]) -> None:
        """The COLLECTIVES_DEBUG exchange: all ranks' descriptions of this call, through
        the backend's own all_gather, compared on every rank."""
        text = call_check.describe(op, shape, dtype, root, reduce_op)
        mine = call_check.encode(text, counts, self.size)
        every = np.empty(self.size * mine.size, np.uint8)
        where = f"{self._where(op)} (seq {seq})"
        out = self._to_host(every, where=where, arg="debug check", write=True)
        inp = self._to_host(mine, where=where, arg="debug check", write=False)
        self._run(op, check_seq, lambda: self._all_gather(out.array, inp.array, check_seq),
                  [out], False)
        call_check.check(every, rank=self.rank, size=self.size, where=where,
                         all_to_all=counts is not None)

    def _record_failure(self, rec: Optional[list], exc: BaseException) -> None:
        """An operation failed: note it in the flight record and, for a communication
        error, write the record out and say where in the error."""
        if rec is None:
            return
        flight.Recorder.finish(rec, exc)
        if not isinstance(exc, CollectiveError) or self._recorder is None:
            return
        try:
            path = self._recorder.dump(rank=self.rank, size=self.size, backend=self.backend,
                                       group=self._flight_name, error=exc)
        except OSError as dump_error:
            add_note(exc, f"[rank {self.rank}] could not write the flight record: {dump_error}")
            return
        add_note(exc, f"[rank {self.rank}] flight record: {path}\n  compare the ranks with: "
                      f"python -m collectives.doctor {os.path.dirname(path)}")


class _RecordedWork(Work):
    """An operation in flight whose end (or failure) goes into the group's flight record."""

    def __init__(self, inner: Work, group: "CallRunner", rec: list) -> None:
        self._inner, self._group, self._rec = inner, group, rec

    def wait(self, timeout: Optional[float] = None) -> None:
        try:
            self._inner.wait(timeout)
        except BaseException as exc:
            self._group._record_failure(self._rec, exc)
            raise
        if self._rec[flight.END] is None:
            flight.Recorder.finish(self._rec)

    def is_completed(self) -> bool:
        return self._inner.is_completed()


class _CommitOnWait(Work):
    """An operation into staged buffers: copy them into the caller's tensors after the
    wait."""

    def __init__(self, inner: Work, bufs: "HostBuffer | Sequence[HostBuffer]") -> None:
        self._inner = inner
        self._bufs: Optional[list] = [bufs] if isinstance(bufs, HostBuffer) else list(bufs)

    def wait(self, timeout: Optional[float] = None) -> None:
        self._inner.wait(timeout)
        if self._bufs is not None:
            bufs, self._bufs = self._bufs, None
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
