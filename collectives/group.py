"""The abstract ProcessGroup: the one interface every strategy in ``parallel/`` is written
against and every transport in ``backends/`` implements.

A backend implements point to point (``_isend``, ``_irecv``) and ``_barrier``; every
collective then works through the send/recv algorithms of ``collectives.algorithms``.
A backend overrides the ``_broadcast``/``_all_reduce``/... hooks it can do natively.

The public methods validate arguments (before any communication, so a bad call leaves
the group usable), convert tensors to host arrays (``collectives.buffers``), number the
collective (every rank numbers its collectives identically: the sequence number names a
collective in errors and keeps the tags of concurrent operations apart) and run it, inline
or on the group's own thread for ``async_op=True``.
"""

from __future__ import annotations

import abc
import concurrent.futures
import datetime
import os
import pickle
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import algorithms, call_check, flight
from .buffers import HostBuffer, host_dtype, is_tensor_like, numel, to_host
from .errors import CollectiveError, where as _where
from .reduce_op import ReduceOp, check_reducible
from .thresholds import SizeThreshold
from .work import FutureWork, Work

#: User tags of send/recv must lie in [0, MAX_USER_TAG).
MAX_USER_TAG = 1 << 31

Tensor = Any  # torch.Tensor or numpy.ndarray


def timeout_seconds(timeout: "float | datetime.timedelta | None", default: float,
                    where: str = "", arg: str = "timeout") -> float:
    """Normalise a timeout given in seconds or as a ``timedelta`` (``None``: ``default``).

    A wrong type is a ``TypeError``, a non-positive (or NaN) number a ``ValueError``;
    ``where`` names the call in the message (``"init_process_group"``), ``arg`` the
    argument.

    >>> timeout_seconds(datetime.timedelta(minutes=1), 300.0)
    60.0
    """
    if timeout is None:
        return default
    prefix = f"{where}: " if where else ""
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{prefix}argument `{arg}` must be a positive number of seconds or "
                        f"a timedelta, got {type(timeout).__name__} {timeout!r}")
    if not timeout > 0:  # also NaN
        raise ValueError(f"{prefix}argument `{arg}` must be a positive number of seconds, "
                         f"got {timeout!r}")
    return float(timeout)


class ProcessGroup(abc.ABC):
    """A set of ranks that communicate. Ranks are local to the group: ``0 .. size-1``.

    Two ranks, each running::

        import numpy as np, collectives
        pg = collectives.init_process_group()          # rank and size from the launcher
        t = np.full(4, pg.rank + 1.0, np.float32)
        pg.all_reduce(t)                               # both ranks: [3, 3, 3, 3]
        if pg.rank == 0:
            pg.send(t, dst=1)
        else:
            pg.recv(t, src=0)
        pg.close()
    """

    #: The registry name of the backend (``"shm"``, ``"zmq"``, ...).
    backend: str = "abstract"

    def __init__(self, rank: int, size: int, *, timeout: float) -> None:
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self._seq = 0
        self._closed = False
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._subgroup_counts: dict[tuple[int, ...], int] = {}
        self._where_text: dict[str, str] = {}
        # COLLECTIVES_DEBUG=1: every collective first checks that all ranks make the same
        # call (collectives.call_check); the flight recorder keeps the last calls for
        # `python -m collectives.doctor` (collectives.flight).
        self._debug = call_check.debug_enabled()
        capacity = flight.capacity_from_env()
        self._recorder: Optional[flight.Recorder] = flight.Recorder(capacity) if capacity else None
        self._flight_name = "world"

    # ------------------------------------------------------------------ transport hooks
    @abc.abstractmethod
    def _isend(self, array: np.ndarray, dst: int, tag: int) -> Work:
        """Start sending the C-contiguous ``array`` to group rank ``dst`` with ``tag``.

        Tags are non-negative ints below 2**63 (user tags are below 2**31; collectives
        use higher ones). Messages between one pair with one tag arrive in order. Must be
        safe to call from the group's async thread while the user thread does the same,
        and must complete even if the receiver posts its receive later.
        """

    @abc.abstractmethod
    def _irecv(self, array: np.ndarray, src: int, tag: int) -> Work:
        """Start receiving into the C-contiguous ``array`` from ``src`` with ``tag``."""

    @abc.abstractmethod
    def _barrier(self, seq: int) -> None:
        """Return once every rank of the group entered the barrier."""

    def _close(self) -> None:
        """Release the transport's resources (sockets, shared memory, threads)."""

    def _new_group(self, ranks: tuple[int, ...], instance: int) -> "ProcessGroup":
        """A group over ``ranks`` (sorted group ranks, this rank among them).

        ``instance`` counts earlier groups over the same ranks, identically on every
        member, so that members can agree on names. The default is a view that runs over
        this group's point to point with its own tag space.
        """
        from .subgroup import SubGroup
        return SubGroup(self, ranks, instance)

    def size_thresholds(self) -> "tuple[SizeThreshold, ...]":
        """The message sizes at which this group's collectives change path (see
        :mod:`collectives.thresholds`): the conformance suite crosses each from both
        sides. The default is the send/recv algorithms'; a backend with collectives of its
        own lists its own lines instead (none, where a library such as MPI decides).

        Two ranks: ``[t.name for t in pg.size_thresholds()]`` ->
        ``['algorithms.ALL_REDUCE_RING_BYTES', ...]`` (on a backend using the defaults).
        """
        return algorithms.dispatch.THRESHOLDS

    def _to_host(self, obj: Any, *, where: str, arg: str, write: bool) -> HostBuffer:
        """The memory the collective hooks run on for argument ``arg`` (see
        :func:`collectives.buffers.to_host`, the default: host arrays). A backend whose
        library takes tensors or device memory (torch's gloo, NCCL) overrides it to hand
        its own hooks those instead."""
        return to_host(obj, where=where, arg=arg, write=write)

    # ------------------------------------------------------- collective hooks (host arrays)
    def _links(self, seq: int) -> "algorithms.Links":
        return algorithms.Links(self, seq)

    def _broadcast(self, a: np.ndarray, src: int, seq: int) -> None:
        algorithms.broadcast(self._links(seq), a, src)

    def _all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> None:
        algorithms.all_reduce(self._links(seq), a, op)

    def _reduce(self, a: np.ndarray, dst: int, op: ReduceOp, seq: int) -> None:
        algorithms.reduce(self._links(seq), a, dst, op)

    def _all_gather(self, out: np.ndarray, inp: np.ndarray, seq: int) -> None:
        algorithms.all_gather(self._links(seq), out, inp)

    def _gather(self, inp: np.ndarray, out: Optional[np.ndarray], dst: int, seq: int) -> None:
        algorithms.gather(self._links(seq), inp, out, dst)

    def _scatter(self, out: np.ndarray, inp: Optional[np.ndarray], src: int, seq: int) -> None:
        algorithms.scatter(self._links(seq), out, inp, src)

    def _reduce_scatter(self, out: np.ndarray, inp: np.ndarray, op: ReduceOp, seq: int) -> None:
        algorithms.reduce_scatter(self._links(seq), out, inp, op)

    def _all_to_all(self, out: np.ndarray, inp: np.ndarray, out_counts: Sequence[int],
                    in_counts: Sequence[int], seq: int) -> None:
        algorithms.all_to_all(self._links(seq), out, inp, out_counts, in_counts)

    # ------------------------------------------------------------------------ plumbing
    def _where(self, op: str) -> str:
        # Every call formats its location for the messages it might raise: keep the text
        # per op instead of formatting it each time (a rank's rank and size never change).
        try:
            return self._where_text[op]
        except KeyError:
            text = self._where_text[op] = _where(self.rank, self.size, op)
            return text

    def _next_seq(self, op: str) -> int:
        if self._closed:
            raise CollectiveError(f"{self._where(op)}: the group is closed")
        seq = self._seq
        self._seq += 1
        return seq

    def _check_rank(self, value: Any, arg: str, where: str, *, allow_self: bool = True) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{where}: argument `{arg}` must be an int rank, got "
                            f"{type(value).__name__}")
        value = int(value)
        if not 0 <= value < self.size:
            raise ValueError(f"{where}: argument `{arg}`={value} is not a rank of this "
                             f"group (0..{self.size - 1})")
        if not allow_self and value == self.rank:
            raise ValueError(f"{where}: argument `{arg}`={value} is this rank itself")
        return value

    def _check_tag(self, tag: Any, where: str) -> int:
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
            raise TypeError(f"{where}: argument `tag` must be an int, got {type(tag).__name__}")
        if not 0 <= int(tag) < MAX_USER_TAG:
            raise ValueError(f"{where}: argument `tag`={tag} must be in [0, 2**31)")
        return int(tag)

    def _check_same_dtype(self, a: Any, b: Any, names: tuple[str, str], where: str) -> None:
        da, db = host_dtype(a), host_dtype(b)
        if da != db:
            raise TypeError(f"{where}: arguments `{names[0]}` ({da}) and `{names[1]}` ({db}) "
                            f"must have the same dtype")

    def _check_multiple(self, big: Any, small: Any, names: tuple[str, str], where: str) -> None:
        nb, ns = numel(big), numel(small)
        if nb != self.size * ns:
            raise ValueError(f"{where}: `{names[0]}` has {nb} elements, expected "
                             f"{self.size} x {ns} = {self.size * ns} (group size x "
                             f"`{names[1]}`)")

    def _check_tensor(self, obj: Any, arg: str, where: str) -> None:
        if not is_tensor_like(obj):
            raise TypeError(f"{where}: argument `{arg}` must be a torch.Tensor or "
                            f"numpy.ndarray, got {type(obj).__name__}")

    def _pickled(self, obj: Any, where: str) -> tuple[Optional[np.ndarray], Optional[TypeError]]:
        """``obj`` pickled (see ``_encode_object``), or the TypeError naming the call that
        the rank raises once it told its peers (so that they raise too, not wait)."""
        try:
            return self._encode_object(obj), None
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            error = TypeError(f"{where}: argument `obj` cannot be pickled "
                              f"({type(exc).__name__}: {exc})")
            error.__cause__ = exc
            return None, error

    def _ensure_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"collectives-{self.backend}-r{self.rank}")
        return self._executor

    def _run(self, op: str, seq: int, fn: Callable[[], None], buffers: Sequence[HostBuffer],
             async_op: bool) -> Optional[Work]:
        """Run ``fn`` now, or on the group's thread when ``async_op`` (in issue order)."""
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
            exc.add_note(f"[rank {self.rank}] could not write the flight record: {dump_error}")
            return
        exc.add_note(f"[rank {self.rank}] flight record: {path}\n  compare the ranks with: "
                     f"python -m collectives.doctor {os.path.dirname(path)}")

    # ------------------------------------------------------------------- point to point
    def isend(self, tensor: Tensor, dst: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` to ``dst``; the returned Work completes when the
        buffer may be reused.

        Rank 0: ``pg.isend(t, dst=1).wait()``; rank 1: ``pg.recv(t, src=0)``.
        """
        return self._start_send("isend", tensor, dst, tag)

    def _start_send(self, op: str, tensor: Tensor, dst: Any, tag: Any) -> Work:
        w = self._where(op)
        self._check_tensor(tensor, "tensor", w)
        dst = self._check_rank(dst, "dst", w, allow_self=False)
        tag = self._check_tag(tag, w)
        buf = self._to_host(tensor, where=w, arg="tensor", write=False)
        return self._post_p2p(op, lambda: self._isend(buf.array, dst, tag), buf, dst)

    def irecv(self, tensor: Tensor, src: int, tag: int = 0) -> Work:
        """Start receiving into ``tensor`` from ``src``; wait on the Work before use.

        Rank 0: ``pg.send(t, dst=1)``; rank 1: ``w = pg.irecv(t, src=0); w.wait()``.
        """
        return self._start_recv("irecv", tensor, src, tag)

    def _start_recv(self, op: str, tensor: Tensor, src: Any, tag: Any) -> Work:
        w = self._where(op)
        self._check_tensor(tensor, "tensor", w)
        src = self._check_rank(src, "src", w, allow_self=False)
        tag = self._check_tag(tag, w)
        buf = self._to_host(tensor, where=w, arg="tensor", write=True)
        return self._post_p2p(op, lambda: self._irecv(buf.array, src, tag), buf, src)

    def _post_p2p(self, op: str, post: Callable[[], Work], buf: HostBuffer, peer: int) -> Work:
        """Post a send or receive; the Work writes a staged receive back and keeps the
        flight record."""
        rec = None if self._recorder is None else self._recorder.start(
            -1, op, buf.array.shape, buf.array.dtype, -1, None, peer)
        try:
            work = post()
        except BaseException as exc:
            self._record_failure(rec, exc)
            raise
        if buf.writeback is not None:
            work = _CommitOnWait(work, buf)
        return work if rec is None else _RecordedWork(work, self, rec)

    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to ``dst`` and return when its buffer may be reused.

        Rank 0: ``pg.send(t, dst=1)``; rank 1: ``pg.recv(t, src=0)``.
        """
        self._start_send("send", tensor, dst, tag).wait()

    def recv(self, tensor: Tensor, src: int, tag: int = 0) -> None:
        """Receive into ``tensor`` (same shape and dtype as the sender's) from ``src``."""
        self._start_recv("recv", tensor, src, tag).wait()

    # ---------------------------------------------------------------------- collectives
    def barrier(self, *, async_op: bool = False) -> Optional[Work]:
        """Return once every rank of the group called ``barrier``."""
        return self._dispatch_collective("barrier", self._barrier, [], async_op)

    def broadcast(self, tensor: Tensor, src: int = 0, *, async_op: bool = False) -> Optional[Work]:
        """Copy ``tensor`` of rank ``src`` into ``tensor`` of every rank.

        Both ranks: ``t = np.full(2, pg.rank, np.int64); pg.broadcast(t, src=1)`` ->
        ``[1, 1]`` everywhere.
        """
        w = self._where("broadcast")
        self._check_tensor(tensor, "tensor", w)
        src = self._check_rank(src, "src", w)
        buf = self._to_host(tensor, where=w, arg="tensor", write=self.rank != src)
        return self._dispatch_collective(
            "broadcast", lambda seq: self._broadcast(buf.array.reshape(-1), src, seq),
            [buf], async_op, buf.array.shape, buf.array.dtype, src)

    def all_reduce(self, tensor: Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False) -> Optional[Work]:
        """Reduce ``tensor`` over all ranks, in place; every rank gets bitwise-identical
        values.

        Both ranks: ``t = np.full(2, pg.rank + 1.0); pg.all_reduce(t)`` -> ``[3., 3.]``.
        """
        w = self._where("all_reduce")
        self._check_tensor(tensor, "tensor", w)
        op = check_reducible(op, host_dtype(tensor), w)
        buf = self._to_host(tensor, where=w, arg="tensor", write=True)
        return self._dispatch_collective(
            "all_reduce", lambda seq: self._all_reduce(buf.array.reshape(-1), op, seq),
            [buf], async_op, buf.array.shape, buf.array.dtype, -1, op)

    def reduce(self, tensor: Tensor, dst: int = 0, op: ReduceOp = ReduceOp.SUM, *,
               async_op: bool = False) -> Optional[Work]:
        """Reduce ``tensor`` over all ranks into ``tensor`` of rank ``dst``; the other
        ranks' tensors are left unchanged.

        Both ranks: ``t = np.full(2, pg.rank + 1.0); pg.reduce(t, dst=0)`` -> rank 0 holds
        ``[3., 3.]``, rank 1 still ``[2., 2.]``.
        """
        w = self._where("reduce")
        self._check_tensor(tensor, "tensor", w)
        dst = self._check_rank(dst, "dst", w)
        op = check_reducible(op, host_dtype(tensor), w)
        buf = self._to_host(tensor, where=w, arg="tensor", write=self.rank == dst)
        return self._dispatch_collective(
            "reduce", lambda seq: self._reduce(buf.array.reshape(-1), dst, op, seq),
            [buf], async_op, buf.array.shape, buf.array.dtype, dst, op)

    def all_gather(self, output: Tensor, input: Tensor, *,
                   async_op: bool = False) -> Optional[Work]:
        """Concatenate every rank's ``input`` along dim 0 into ``output`` (size x input).

        Both ranks: ``out = np.empty(4); pg.all_gather(out, np.full(2, pg.rank * 1.0))`` ->
        ``[0, 0, 1, 1]``.
        """
        w = self._where("all_gather")
        self._check_tensor(output, "output", w)
        self._check_tensor(input, "input", w)
        self._check_same_dtype(output, input, ("output", "input"), w)
        self._check_multiple(output, input, ("output", "input"), w)
        out = self._to_host(output, where=w, arg="output", write=True)
        inp = self._to_host(input, where=w, arg="input", write=False)
        return self._dispatch_collective(
            "all_gather",
            lambda seq: self._all_gather(out.array.reshape(-1),
                                         inp.array.reshape(-1), seq),
            [out], async_op, inp.array.shape, inp.array.dtype)

    def gather(self, input: Tensor, output: Optional[Tensor] = None, dst: int = 0, *,
               async_op: bool = False) -> Optional[Work]:
        """Concatenate every rank's ``input`` along dim 0 into ``output`` on rank ``dst``
        (``output`` is ignored, and may be None, elsewhere).

        Rank 0: ``pg.gather(np.zeros(2), out := np.empty(4), dst=0)``; rank 1:
        ``pg.gather(np.ones(2), None, dst=0)`` -> rank 0's out is ``[0, 0, 1, 1]``.
        """
        w = self._where("gather")
        self._check_tensor(input, "input", w)
        dst = self._check_rank(dst, "dst", w)
        out = None
        if self.rank == dst:
            if output is None:
                raise ValueError(f"{w}: argument `output` must be given on the "
                                 f"destination rank {dst}")
            self._check_tensor(output, "output", w)
            self._check_same_dtype(output, input, ("output", "input"), w)
            self._check_multiple(output, input, ("output", "input"), w)
            out = self._to_host(output, where=w, arg="output", write=True)
        # staged after every check: a backend's _to_host may note what it staged
        inp = self._to_host(input, where=w, arg="input", write=False)
        return self._dispatch_collective(
            "gather",
            lambda seq: self._gather(
                inp.array.reshape(-1),
                None if out is None else out.array.reshape(-1), dst, seq),
            [out] if out else [], async_op, inp.array.shape, inp.array.dtype,
            dst)

    def scatter(self, output: Tensor, input: Optional[Tensor] = None, src: int = 0, *,
                async_op: bool = False) -> Optional[Work]:
        """Split ``input`` of rank ``src`` into ``size`` equal parts along dim 0; rank i
        receives part i in ``output`` (``input`` is ignored, and may be None, elsewhere).

        Rank 0: ``pg.scatter(out := np.empty(2), np.arange(4.0), src=0)``; rank 1:
        ``pg.scatter(out := np.empty(2), None, src=0)`` -> ``[0, 1]`` and ``[2, 3]``.
        """
        w = self._where("scatter")
        self._check_tensor(output, "output", w)
        src = self._check_rank(src, "src", w)
        inp = None
        if self.rank == src:
            if input is None:
                raise ValueError(f"{w}: argument `input` must be given on the source rank {src}")
            self._check_tensor(input, "input", w)
            self._check_same_dtype(output, input, ("output", "input"), w)
            self._check_multiple(input, output, ("input", "output"), w)
            inp = self._to_host(input, where=w, arg="input", write=False)
        out = self._to_host(output, where=w, arg="output", write=True)
        return self._dispatch_collective(
            "scatter",
            lambda seq: self._scatter(
                out.array.reshape(-1),
                None if inp is None else inp.array.reshape(-1), src, seq),
            [out], async_op, out.array.shape, out.array.dtype, src)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp = ReduceOp.SUM, *,
                       async_op: bool = False) -> Optional[Work]:
        """Reduce ``input`` (size x output) over all ranks; rank i receives part i.

        Both ranks: ``pg.reduce_scatter(out := np.empty(1), np.array([1.0, 2.0]))`` ->
        rank 0 ``[2.]``, rank 1 ``[4.]``.
        """
        w = self._where("reduce_scatter")
        self._check_tensor(output, "output", w)
        self._check_tensor(input, "input", w)
        self._check_same_dtype(output, input, ("output", "input"), w)
        op = check_reducible(op, host_dtype(input), w, "input")
        self._check_multiple(input, output, ("input", "output"), w)
        out = self._to_host(output, where=w, arg="output", write=True)
        inp = self._to_host(input, where=w, arg="input", write=False)
        return self._dispatch_collective(
            "reduce_scatter",
            lambda seq: self._reduce_scatter(out.array.reshape(-1),
                                             inp.array.reshape(-1), op, seq),
            [out], async_op, out.array.shape, out.array.dtype, -1, op)

    def all_to_all(self, output: Tensor, input: Tensor, *,
                   output_split_sizes: Optional[Sequence[int]] = None,
                   input_split_sizes: Optional[Sequence[int]] = None,
                   async_op: bool = False) -> Optional[Work]:
        """Rank i sends part j of ``input`` (dim 0) to rank j, which stores it as part i of
        ``output``. Parts are equal unless split sizes (rows along dim 0) are given.

        Both ranks: ``pg.all_to_all(out := np.empty(2), np.array([10.0 * pg.rank, 10.0 * pg.rank + 1]))``
        -> rank 0 ``[0., 10.]``, rank 1 ``[1., 11.]``.
        """
        w = self._where("all_to_all")
        self._check_tensor(output, "output", w)
        self._check_tensor(input, "input", w)
        self._check_same_dtype(output, input, ("output", "input"), w)
        out_counts = self._split_counts(output, output_split_sizes, "output", w)
        in_counts = self._split_counts(input, input_split_sizes, "input", w)
        out = self._to_host(output, where=w, arg="output", write=True)
        inp = self._to_host(input, where=w, arg="input", write=False)
        return self._dispatch_collective(
            "all_to_all",
            lambda seq: self._all_to_all(out.array.reshape(-1),
                                         inp.array.reshape(-1),
                                         out_counts, in_counts, seq),
            [out], async_op, None, inp.array.dtype,
            counts=(out_counts, in_counts))

    def _split_counts(self, t: Any, splits: Optional[Sequence[int]], arg: str,
                      where: str) -> list[int]:
        """Element counts per peer for one all_to_all argument."""
        shape = tuple(t.shape)
        rows = shape[0] if shape else 1
        row_numel = numel(t) // rows if rows else int(np.prod(shape[1:], dtype=np.int64))
        if splits is None:
            if rows % self.size:
                raise ValueError(f"{where}: `{arg}` has {rows} rows along dim 0, not "
                                 f"divisible by the group size {self.size}; pass "
                                 f"`{arg}_split_sizes`")
            return [rows // self.size * row_numel] * self.size
        if isinstance(splits, (str, bytes)) or not hasattr(splits, "__iter__"):
            raise TypeError(f"{where}: argument `{arg}_split_sizes` must be a sequence of "
                            f"{self.size} ints, got {type(splits).__name__}")
        splits = list(splits)
        if len(splits) != self.size or any(
                isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0
                for s in splits):
            raise ValueError(f"{where}: `{arg}_split_sizes` must be {self.size} "
                             f"non-negative ints, got {splits!r}")
        if sum(splits) != rows:
            raise ValueError(f"{where}: `{arg}_split_sizes` {splits} sum to {sum(splits)}, "
                             f"but `{arg}` has {rows} rows along dim 0")
        return [int(s) * row_numel for s in splits]

    # -------------------------------------------------------------------------- objects
    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return rank ``src``'s ``obj`` on every rank (pickled; for set-up metadata).

        Both ranks: ``cfg = pg.broadcast_object({"lr": 0.1} if pg.rank == 0 else None)``.
        """
        w = self._where("broadcast_object")
        src = self._check_rank(src, "src", w)
        payload, error = self._pickled(obj, w) if self.rank == src else (None, None)
        # The length goes first, -1 when `src` could not pickle its object: then every
        # rank raises, instead of the others waiting for bytes that never come.
        length = np.array([-1 if error else 0 if payload is None else payload.size],
                          np.int64)
        self.broadcast(length, src)
        if error is not None:
            raise error
        if length[0] < 0:
            raise CollectiveError(f"{w}: rank {src} could not pickle its object (a "
                                  f"TypeError there says why); nothing was sent")
        data = payload if payload is not None else np.empty(int(length[0]), np.uint8)
        self.broadcast(data, src)
        return obj if self.rank == src else self._decode_object(data, src)

    def all_gather_object(self, obj: Any) -> list:
        """Return the list of every rank's ``obj`` in rank order (pickled).

        Both ranks: ``pg.all_gather_object(pg.rank)`` -> ``[0, 1]``.
        """
        w = self._where("all_gather_object")
        payload, error = self._pickled(obj, w)
        lengths = np.empty(self.size, np.int64)  # -1: that rank could not pickle its object
        self.all_gather(lengths, np.array([-1 if error else payload.size], np.int64))
        if error is not None:
            raise error
        if lengths.min() < 0:
            failed = [r for r in range(self.size) if lengths[r] < 0]
            raise CollectiveError(f"{w}: ranks {failed} could not pickle their objects (a "
                                  f"TypeError there says why); nothing was exchanged")
        longest = int(lengths.max())
        padded = np.zeros(longest, np.uint8)
        padded[:payload.size] = payload
        everything = np.empty(self.size * longest, np.uint8)
        self.all_gather(everything, padded)
        return [obj if r == self.rank else
                self._decode_object(everything[r * longest:r * longest + int(lengths[r])], r)
                for r in range(self.size)]

    def _encode_object(self, obj: Any) -> np.ndarray:
        return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL),
                             np.uint8).copy()

    def _decode_object(self, data: np.ndarray, src: int) -> Any:
        """Unpickle bytes from ``src``. Backends whose peers are not trusted (a network)
        override this (or the object collectives) with an authenticated route."""
        return pickle.loads(data.tobytes())

    # ------------------------------------------------------------------------ sub-groups
    def new_group(self, ranks: Sequence[int]) -> "ProcessGroup":
        """A group over ``ranks`` (ranks of this group). Call it on every member rank,
        in the same order relative to other new_group calls; the caller's rank in the
        new group is its index in ``sorted(ranks)``.

        With four ranks: ``pair = pg.new_group([0, 1]) if pg.rank < 2 else pg.new_group([2, 3])``.
        """
        w = self._where("new_group")
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
            raise TypeError(f"{w}: argument `ranks` must be a sequence of ints, got "
                            f"{type(ranks).__name__}")
        members = [self._check_rank(r, "ranks", w) for r in ranks]
        if len(set(members)) != len(members) or not members:
            raise ValueError(f"{w}: argument `ranks` must be non-empty and without "
                             f"duplicates, got {list(ranks)}")
        if self.rank not in members:
            raise ValueError(f"{w}: this rank ({self.rank}) is not in `ranks` "
                             f"{sorted(members)}; call new_group on member ranks only")
        key = tuple(sorted(members))
        instance = self._subgroup_counts.get(key, 0)
        self._subgroup_counts[key] = instance + 1
        group = self._new_group(key, instance)
        # Named by the path from the world group, so every member's flight files agree.
        group._flight_name = (f"{self._flight_name}.{'-'.join(map(str, key))}"
                              + (f"#{instance}" if instance else ""))
        return group

    # ------------------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Finish queued async work, then release the transport. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._close()

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend={self.backend} rank={self.rank}/{self.size}>"


class _CommitOnWait(Work):
    """An irecv into a staged buffer: copy into the caller's tensor after the wait."""

    def __init__(self, inner: Work, buf: HostBuffer) -> None:
        self._inner, self._buf = inner, buf

    def wait(self, timeout: Optional[float] = None) -> None:
        self._inner.wait(timeout)
        if self._buf is not None:
            buf, self._buf = self._buf, None
            buf.commit()

    def is_completed(self) -> bool:
        return self._inner.is_completed()


class _RecordedWork(Work):
    """An operation in flight whose end (or failure) goes into the group's flight record."""

    def __init__(self, inner: Work, group: ProcessGroup, rec: list) -> None:
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
