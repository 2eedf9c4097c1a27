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
import pickle
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import algorithms
from .buffers import HostBuffer, host_dtype, is_tensor_like, numel, to_host
from .errors import CollectiveError, CollectiveTimeout, where as _where
from .reduce_op import ReduceOp, check_reducible
from .work import CompletedWork, FutureWork, Work

#: User tags of send/recv must lie in [0, MAX_USER_TAG).
MAX_USER_TAG = 1 << 31

Tensor = Any  # torch.Tensor or numpy.ndarray


def timeout_seconds(timeout: "float | datetime.timedelta | None", default: float) -> float:
    """Normalise a timeout given in seconds or as a ``timedelta``."""
    if timeout is None:
        return default
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or a timedelta, "
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
        return _where(self.rank, self.size, op)

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

    # ------------------------------------------------------------------- point to point
    def isend(self, tensor: Tensor, dst: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` to ``dst``; the returned Work completes when the
        buffer may be reused.

        Rank 0: ``pg.isend(t, dst=1).wait()``; rank 1: ``pg.recv(t, src=0)``.
        """
        w = self._where("isend")
        self._check_tensor(tensor, "tensor", w)
        dst = self._check_rank(dst, "dst", w, allow_self=False)
        tag = self._check_tag(tag, w)
        buf = self._to_host(tensor, where=w, arg="tensor", write=False)
        return self._isend(buf.array, dst, tag)

    def irecv(self, tensor: Tensor, src: int, tag: int = 0) -> Work:
        """Start receiving into ``tensor`` from ``src``; wait on the Work before use.

        Rank 0: ``pg.send(t, dst=1)``; rank 1: ``w = pg.irecv(t, src=0); w.wait()``.
        """
        w = self._where("irecv")
        self._check_tensor(tensor, "tensor", w)
        src = self._check_rank(src, "src", w, allow_self=False)
        tag = self._check_tag(tag, w)
        buf = self._to_host(tensor, where=w, arg="tensor", write=True)
        inner = self._irecv(buf.array, src, tag)
        if buf.writeback is None:
            return inner
        return _CommitOnWait(inner, buf)

    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to ``dst`` and return when its buffer may be reused.

        Rank 0: ``pg.send(t, dst=1)``; rank 1: ``pg.recv(t, src=0)``.
        """
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: Tensor, src: int, tag: int = 0) -> None:
        """Receive into ``tensor`` (same shape and dtype as the sender's) from ``src``."""
        self.irecv(tensor, src, tag).wait()

    # ---------------------------------------------------------------------- collectives
    def barrier(self, *, async_op: bool = False) -> Optional[Work]:
        """Return once every rank of the group called ``barrier``."""
        seq = self._next_seq("barrier")
        return self._run("barrier", seq, lambda: self._barrier(seq), [], async_op)

    def broadcast(self, tensor: Tensor, src: int = 0, *, async_op: bool = False) -> Optional[Work]:
        """Copy ``tensor`` of rank ``src`` into ``tensor`` of every rank.

        Both ranks: ``t = np.full(2, pg.rank, np.int64); pg.broadcast(t, src=1)`` ->
        ``[1, 1]`` everywhere.
        """
        w = self._where("broadcast")
        self._check_tensor(tensor, "tensor", w)
        src = self._check_rank(src, "src", w)
        buf = self._to_host(tensor, where=w, arg="tensor", write=self.rank != src)
        seq = self._next_seq("broadcast")
        return self._run("broadcast", seq, lambda: self._broadcast(buf.array, src, seq),
                         [buf], async_op)

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
        seq = self._next_seq("all_reduce")
        return self._run("all_reduce", seq, lambda: self._all_reduce(buf.array, op, seq),
                         [buf], async_op)

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
        seq = self._next_seq("reduce")
        return self._run("reduce", seq, lambda: self._reduce(buf.array, dst, op, seq),
                         [buf], async_op)

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
        seq = self._next_seq("all_gather")
        return self._run("all_gather", seq,
                         lambda: self._all_gather(out.array.reshape(-1),
                                                  inp.array.reshape(-1), seq),
                         [out], async_op)

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
        inp = self._to_host(input, where=w, arg="input", write=False)
        out = None
        if self.rank == dst:
            if output is None:
                raise ValueError(f"{w}: argument `output` must be given on the "
                                 f"destination rank {dst}")
            self._check_tensor(output, "output", w)
            self._check_same_dtype(output, input, ("output", "input"), w)
            self._check_multiple(output, input, ("output", "input"), w)
            out = self._to_host(output, where=w, arg="output", write=True)
        seq = self._next_seq("gather")
        return self._run("gather", seq,
                         lambda: self._gather(inp.array.reshape(-1),
                                              None if out is None else out.array.reshape(-1),
                                              dst, seq),
                         [out] if out else [], async_op)

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
        seq = self._next_seq("scatter")
        return self._run("scatter", seq,
                         lambda: self._scatter(out.array.reshape(-1),
                                               None if inp is None else inp.array.reshape(-1),
                                               src, seq),
                         [out], async_op)

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
        op = check_reducible(op, host_dtype(input), w)
        self._check_multiple(input, output, ("input", "output"), w)
        out = self._to_host(output, where=w, arg="output", write=True)
        inp = self._to_host(input, where=w, arg="input", write=False)
        seq = self._next_seq("reduce_scatter")
        return self._run("reduce_scatter", seq,
                         lambda: self._reduce_scatter(out.array.reshape(-1),
                                                      inp.array.reshape(-1), op, seq),
                         [out], async_op)

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
        seq = self._next_seq("all_to_all")
        return self._run("all_to_all", seq,
                         lambda: self._all_to_all(out.array.reshape(-1), inp.array.reshape(-1),
                                                  out_counts, in_counts, seq),
                         [out], async_op)

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
        payload = self._encode_object(obj) if self.rank == src else None
        length = np.array([0 if payload is None else payload.size], np.int64)
        self.broadcast(length, src)
        data = payload if payload is not None else np.empty(int(length[0]), np.uint8)
        self.broadcast(data, src)
        return obj if self.rank == src else self._decode_object(data, src)

    def all_gather_object(self, obj: Any) -> list:
        """Return the list of every rank's ``obj`` in rank order (pickled).

        Both ranks: ``pg.all_gather_object(pg.rank)`` -> ``[0, 1]``.
        """
        payload = self._encode_object(obj)
        lengths = np.empty(self.size, np.int64)
        self.all_gather(lengths, np.array([payload.size], np.int64))
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
        return self._new_group(key, instance)

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
