"""``ProcessGroup``: the one interface every strategy in ``parallel/`` is written against.

One concrete class that holds a :class:`~collectives.backend.Backend` (its
``transport``): the group checks arguments, stages tensors, numbers collectives, runs
them inline or on its thread, keeps the flight record and takes the fast path; the
backend moves bytes. Each of those jobs is a module of its own, called from here:

- :mod:`collectives.validation`: the argument checks (before any message moves, so a bad
  call leaves the group usable);
- :mod:`collectives.running`: numbering, running inline or on the group's thread, the
  debug call check, the flight record and what an abort turns errors into;
- :mod:`collectives.fast_path`: blocking calls on contiguous host memory in about a
  microsecond;
- :mod:`collectives.persistent`: ``all_reduce_init`` and the other persistent requests;
- :mod:`collectives.objects`: ``broadcast_object`` and ``all_gather_object``;
- :mod:`collectives.symmetric`: ``alloc_symmetric``, buffers the peers may read;
- :mod:`collectives.subgroup`: sub-groups of backends without their own;
- :mod:`collectives.regroup`: ``shrink``, ``grow`` and ``reform``, meeting again as a
  new group after a rank died or before new processes join.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import weakref
from typing import Any, Optional, Sequence

import numpy as np

from . import (flight, flight_signals, logs, objects, persistent, regroup, running, settings,
               symmetric, trace)
from .backend import Backend
from .buffers import HostBuffer, host_dtype, to_host
from .errors import GroupAborted
from .errors import where as where_text
from .fast_path import HostViews, fast_collective, fast_all_to_all, fast_p2p, \
    fast_pair, fast_rooted
from .launch import Rendezvous
from .reduce_op import ReduceOp, check_reducible
from .subgroup import SubGroup
from .thresholds import SizeThreshold
from .validation import Arguments, MAX_USER_TAG, timeout_seconds
from .work import Work

__all__ = ["MAX_USER_TAG", "ProcessGroup", "timeout_seconds"]

Tensor = Any  # torch.Tensor or numpy.ndarray

_log = logs.get_logger("group")


class ProcessGroup:
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

    ``ProcessGroup(backend)`` wraps any :class:`~collectives.backend.Backend`;
    ``init_process_group`` does it for the registered ones.
    """

    def __init__(self, backend: Backend, *, name: str = "world") -> None:
        if not isinstance(backend, Backend):
            raise TypeError(f"ProcessGroup: expected a collectives.Backend, got "
                            f"{type(backend).__name__} (a backend factory returns a Backend)")
        #: The :class:`~collectives.backend.Backend` this group runs on.
        self.transport = backend
        self.rank: int = backend.rank
        self.size: int = backend.size
        #: The registry name of the backend (``"shm"``, ``"zmq"``, ...).
        self.backend: str = backend.name
        caps = backend.capabilities
        self._returns_work = caps.returns_work
        # What the backend's collective methods receive for a tensor argument.
        self._stage = to_host if caps.memory == "host" else backend.stage
        self._seq = 0
        self._closed = False
        self._aborted: Optional[str] = None   # why, once abort() was called
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._subgroup_counts: dict[tuple[int, ...], int] = {}
        self._children: "weakref.WeakSet[ProcessGroup]" = weakref.WeakSet()
        self._args = Arguments(self.rank, self.size)
        self._where_text: dict[str, str] = {}
        # COLLECTIVES_DEBUG=1: every collective first checks that all ranks make the same
        # call (collectives.call_check); the flight recorder keeps the last calls for
        # `python -m collectives.doctor` (collectives.flight).
        self._debug: bool = settings.DEBUG.get()
        capacity = settings.FLIGHT_RECORDER.get()
        self._recorder: Optional[flight.Recorder] = flight.Recorder(capacity) if capacity \
            else None
        self._flight_name = name
        # The fast path (collectives.fast_path) for blocking calls on contiguous host
        # memory: not where the debug check must run, nor for a backend whose methods
        # return Works or take something else than host arrays.
        self._host_views = HostViews()
        self._fast = not self._debug and not caps.returns_work and caps.memory == "host"
        if _log.isEnabledFor(logging.DEBUG):   # (the path table costs a few calls)
            _log.debug("new group: %s", self.describe())
        #: The rendezvous of the job's world (set by ``init_process_group``, kept by
        #: re-forming and ``join_group``; None for a group made from a Backend by hand):
        #: what ``shrink``, ``grow`` and ``reform`` meet again from (every generation's
        #: port and segment are derived from it, so all members derive the same).
        self.origin: Optional[Rendezvous] = None
        #: 0 for a launcher's world, k for a group re-formed as generation k.
        self.generation: int = 0
        # SIGTERM and SIGUSR1 write the records of the open groups (flight_signals); a
        # traced process (COLLECTIVES_TRACE, trace.tracing) traces every group it makes.
        flight_signals.register(self)
        trace.group_created(self)

    @property
    def timeout(self) -> float:
        """Seconds any blocking wait of this group lasts before ``CollectiveTimeout`` (the
        backend's: setting it here sets it there)."""
        return self.transport.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self.transport.timeout = seconds

    def _where(self, op: str) -> str:
        """``[rank r/n] op``, the location every message of a call starts with (kept per
        op: a rank's rank and size never change)."""
        try:
            return self._where_text[op]
        except KeyError:
            text = self._where_text[op] = where_text(self.rank, self.size, op)
            return text

    # ---------------------------------------------------------------- point to point
    def isend(self, tensor: Tensor, dst: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` to ``dst``; the returned Work completes when the
        buffer may be reused.

        Rank 0: ``pg.isend(t, dst=1).wait()``; rank 1: ``pg.recv(t, src=0)``.
        """
        return running.start_p2p(self, "isend", tensor, dst, tag, send=True)

    def irecv(self, tensor: Tensor, src: int, tag: int = 0) -> Work:
        """Start receiving into ``tensor`` from ``src``; wait on the Work before use.

        Rank 0: ``pg.send(t, dst=1)``; rank 1: ``w = pg.irecv(t, src=0); w.wait()``.
        """
        return running.start_p2p(self, "irecv", tensor, src, tag, send=False)

    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to ``dst`` and return when its buffer may be reused.

        Rank 0: ``pg.send(t, dst=1)``; rank 1: ``pg.recv(t, src=0)``.
        """
        if not (self._fast and fast_p2p(self, "send", self.transport.send_now, tensor, dst,
                                        tag)):
            running.start_p2p(self, "send", tensor, dst, tag, send=True).wait()

    def recv(self, tensor: Tensor, src: int, tag: int = 0) -> None:
        """Receive into ``tensor`` (same shape and dtype as the sender's) from ``src``."""
        if not (self._fast and fast_p2p(self, "recv", self.transport.recv_now, tensor, src,
                                        tag)):
            running.start_p2p(self, "recv", tensor, src, tag, send=False).wait()

    # --------------------------------------------------------------------- collectives
    def barrier(self, *, async_op: bool = False) -> Optional[Work]:
        """Return once every rank of the group called ``barrier``.

        Both ranks: ``pg.barrier()`` returns on each once the other called it too.
        """
        if self._fast and not async_op and not self._pending:   # (collectives.fast_path)
            running.check_open(self, "barrier")
            running.run_numbered(self, "barrier", self.transport.barrier, (), None, None, -1,
                                 None)
            return None
        return running.dispatch(self, "barrier", self.transport.barrier, (), [], async_op)

    def broadcast(self, tensor: Tensor, src: int = 0, *,
                  async_op: bool = False) -> Optional[Work]:
        """Copy ``tensor`` of rank ``src`` into ``tensor`` of every rank.

        Both ranks: ``t = np.full(2, pg.rank, np.int64); pg.broadcast(t, src=1)`` ->
        ``[1, 1]`` everywhere.
        """
        if (self._fast and not async_op and not self._pending and type(src) is int
                and 0 <= src < self.size
                and fast_collective(self, "broadcast", self.transport.broadcast, tensor, src,
                                    src, None)):
            return None
        w = self._where("broadcast")
        self._args.tensor(tensor, "tensor", w)
        src = self._args.rank_of(src, "src", w)
        buf = self._stage(tensor, where=w, arg="tensor", write=self.rank != src)
        return running.dispatch(self, "broadcast", self.transport.broadcast,
                                (_flat(buf), src), [buf], async_op, buf.array.shape,
                                buf.array.dtype, src)

    def all_reduce(self, tensor: Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   async_op: bool = False) -> Optional[Work]:
        """Reduce ``tensor`` over all ranks, in place; every rank gets bitwise-identical
        values.

        Both ranks: ``t = np.full(2, pg.rank + 1.0); pg.all_reduce(t)`` -> ``[3., 3.]``.
        """
        if (self._fast and not async_op and not self._pending and op is not None
                and fast_collective(self, "all_reduce", self.transport.all_reduce, tensor,
                                    op, -1, op)):
            return None
        w = self._where("all_reduce")
        self._args.tensor(tensor, "tensor", w)
        op = check_reducible(op, host_dtype(tensor), w)
        buf = self._stage(tensor, where=w, arg="tensor", write=True)
        return running.dispatch(self, "all_reduce", self.transport.all_reduce,
                                (_flat(buf), op), [buf], async_op, buf.array.shape,
                                buf.array.dtype, -1, op)

    def reduce(self, tensor: Tensor, dst: int = 0, op: ReduceOp = ReduceOp.SUM, *,
               async_op: bool = False) -> Optional[Work]:
        """Reduce ``tensor`` over all ranks into ``tensor`` of rank ``dst``; the other
        ranks' tensors are left unchanged.

        Both ranks: ``t = np.full(2, pg.rank + 1.0); pg.reduce(t, dst=0)`` -> rank 0 holds
        ``[3., 3.]``, rank 1 still ``[2., 2.]``.
        """
        if (self._fast and not async_op and not self._pending and op is not None
                and type(dst) is int and 0 <= dst < self.size):   # (collectives.fast_path)
            found = self._host_views.lookup(tensor)
            if found is not None and id(op) in found[2]:
                running.check_open(self, "reduce")
                running.run_numbered(self, "reduce", self.transport.reduce,
                                     (found[0], dst, op), found[1], found[3], dst, op)
                return None
        w = self._where("reduce")
        self._args.tensor(tensor, "tensor", w)
        dst = self._args.rank_of(dst, "dst", w)
        op = check_reducible(op, host_dtype(tensor), w)
        buf = self._stage(tensor, where=w, arg="tensor", write=self.rank == dst)
        return running.dispatch(self, "reduce", self.transport.reduce, (_flat(buf), dst, op),
                                [buf], async_op, buf.array.shape, buf.array.dtype, dst, op)

    def all_gather(self, output: Tensor, input: Tensor, *,
                   async_op: bool = False) -> Optional[Work]:
        """Concatenate every rank's ``input`` along dim 0 into ``output`` (size x input).

        Both ranks: ``out = np.empty(4); pg.all_gather(out, np.full(2, pg.rank * 1.0))`` ->
        ``[0, 0, 1, 1]``.
        """
        if self._fast and not async_op and not self._pending:   # (collectives.fast_path)
            pair = fast_pair(self, "all_gather", output, input, None)
            if pair is not None:
                (out, *_), (inp, shape, _, dtype) = pair
                running.run_numbered(self, "all_gather", self.transport.all_gather,
                                     (out, inp), shape, dtype, -1, None)
                return None
        w = self._where("all_gather")
        self._args.pair(output, input, ("output", "input"), w)
        out = self._stage(output, where=w, arg="output", write=True)
        inp = self._stage(input, where=w, arg="input", write=False)
        return running.dispatch(self, "all_gather", self.transport.all_gather,
                                (_flat(out), _flat(inp)), [out], async_op, inp.array.shape,
                                inp.array.dtype)

    def gather(self, input: Tensor, output: Optional[Tensor] = None, dst: int = 0, *,
               async_op: bool = False) -> Optional[Work]:
        """Concatenate every rank's ``input`` along dim 0 into ``output`` on rank ``dst``
        (``output`` is ignored, and may be None, elsewhere).

        Rank 0: ``pg.gather(np.zeros(2), out := np.empty(4), dst=0)``; rank 1:
        ``pg.gather(np.ones(2), None, dst=0)`` -> rank 0's out is ``[0, 0, 1, 1]``.
        """
        if (self._fast and not async_op and not self._pending
                and fast_rooted(self, "gather", self.transport.gather, input, output, dst)):
            return None
        w = self._where("gather")
        self._args.tensor(input, "input", w)
        dst = self._args.rank_of(dst, "dst", w)
        out = None
        if self.rank == dst:
            if output is None:
                raise ValueError(f"{w}: argument `output` must be given on the "
                                 f"destination rank {dst}")
            self._args.pair(output, input, ("output", "input"), w)
            out = self._stage(output, where=w, arg="output", write=True)
        # staged after every check: a backend's stage() may note what it staged
        inp = self._stage(input, where=w, arg="input", write=False)
        return running.dispatch(self, "gather", self.transport.gather,
                                (_flat(inp), None if out is None else _flat(out), dst),
                                [out] if out else [], async_op, inp.array.shape,
                                inp.array.dtype, dst)

    def scatter(self, output: Tensor, input: Optional[Tensor] = None, src: int = 0, *,
                async_op: bool = False) -> Optional[Work]:
        """Split ``input`` of rank ``src`` into ``size`` equal parts along dim 0; rank i
        receives part i in ``output`` (``input`` is ignored, and may be None, elsewhere).

        Rank 0: ``pg.scatter(out := np.empty(2), np.arange(4.0), src=0)``; rank 1:
        ``pg.scatter(out := np.empty(2), None, src=0)`` -> ``[0, 1]`` and ``[2, 3]``.
        """
        if (self._fast and not async_op and not self._pending
                and fast_rooted(self, "scatter", self.transport.scatter, output, input, src)):
            return None
        w = self._where("scatter")
        self._args.tensor(output, "output", w)
        src = self._args.rank_of(src, "src", w)
        inp = None
        if self.rank == src:
            if input is None:
                raise ValueError(f"{w}: argument `input` must be given on the source rank {src}")
            self._args.tensor(input, "input", w)
            self._args.same_dtype(output, input, ("output", "input"), w)
            self._args.multiple(input, output, ("input", "output"), w)
            inp = self._stage(input, where=w, arg="input", write=False)
        out = self._stage(output, where=w, arg="output", write=True)
        return running.dispatch(self, "scatter", self.transport.scatter,
                                (_flat(out), None if inp is None else _flat(inp), src),
                                [out], async_op, out.array.shape, out.array.dtype, src)

    def reduce_scatter(self, output: Tensor, input: Tensor, op: ReduceOp = ReduceOp.SUM, *,
                       async_op: bool = False) -> Optional[Work]:
        """Reduce ``input`` (size x output) over all ranks; rank i receives part i.

        Both ranks: ``pg.reduce_scatter(out := np.empty(1), np.array([1.0, 2.0]))`` ->
        rank 0 ``[2.]``, rank 1 ``[4.]``.
        """
        if (self._fast and not async_op and not self._pending
                and op is not None):   # (collectives.fast_path)
            pair = fast_pair(self, "reduce_scatter", input, output, op)
            if pair is not None:
                (inp, *_), (out, shape, _, dtype) = pair
                running.run_numbered(self, "reduce_scatter", self.transport.reduce_scatter,
                                     (out, inp, op), shape, dtype, -1, op)
                return None
        w = self._where("reduce_scatter")
        self._args.tensor(output, "output", w)
        self._args.tensor(input, "input", w)
        self._args.same_dtype(output, input, ("output", "input"), w)
        op = check_reducible(op, host_dtype(input), w, "input")
        self._args.multiple(input, output, ("input", "output"), w)
        out = self._stage(output, where=w, arg="output", write=True)
        inp = self._stage(input, where=w, arg="input", write=False)
        return running.dispatch(self, "reduce_scatter", self.transport.reduce_scatter,
                                (_flat(out), _flat(inp), op), [out], async_op,
                                out.array.shape, out.array.dtype, -1, op)

    def all_to_all(self, output: Tensor, input: Tensor, *,
                   output_split_sizes: Optional[Sequence[int]] = None,
                   input_split_sizes: Optional[Sequence[int]] = None,
                   async_op: bool = False) -> Optional[Work]:
        """Rank i sends part j of ``input`` (dim 0) to rank j, which stores it as part i of
        ``output``. Parts are equal unless split sizes (rows along dim 0) are given.

        Both ranks: ``pg.all_to_all(out := np.empty(2), np.array([10.0 * pg.rank, 10.0 * pg.rank + 1]))``
        -> rank 0 ``[0., 10.]``, rank 1 ``[1., 11.]``.
        """
        if (self._fast and not async_op and not self._pending
                and fast_all_to_all(self, output, input, output_split_sizes,
                                    input_split_sizes)):   # (collectives.fast_path)
            return None
        w = self._where("all_to_all")
        self._args.tensor(output, "output", w)
        self._args.tensor(input, "input", w)
        self._args.same_dtype(output, input, ("output", "input"), w)
        out_counts = self._args.split_counts(output, output_split_sizes, "output", w)
        in_counts = self._args.split_counts(input, input_split_sizes, "input", w)
        out = self._stage(output, where=w, arg="output", write=True)
        inp = self._stage(input, where=w, arg="input", write=False)
        return running.dispatch(self, "all_to_all", self.transport.all_to_all,
                                (_flat(out), _flat(inp), out_counts, in_counts), [out],
                                async_op, None, inp.array.dtype,
                                counts=(out_counts, in_counts))

    # ----------------------------------------------------------- persistent requests
    def all_reduce_init(self, tensor: Tensor,
                        op: ReduceOp = ReduceOp.SUM) -> "persistent.PersistentRequest":
        """A persistent ``all_reduce(tensor, op)``: checked now, run by each
        ``start()``/``wait()`` (see :mod:`collectives.persistent`).

        Both ranks: ``req = pg.all_reduce_init(t := np.ones(2)); req.start(); req.wait()``
        -> ``t == [2., 2.]``.
        """
        return persistent.all_reduce_init(self, tensor, op)

    def all_gather_init(self, output: Tensor,
                        input: Tensor) -> "persistent.PersistentRequest":
        """A persistent ``all_gather(output, input)`` (output holds size x input).

        Both ranks: ``req = pg.all_gather_init(out := np.empty(2), np.full(1, pg.rank * 1.0))``;
        ``req.start(); req.wait()`` -> ``out == [0., 1.]``.
        """
        return persistent.all_gather_init(self, output, input)

    def reduce_scatter_init(self, output: Tensor, input: Tensor,
                            op: ReduceOp = ReduceOp.SUM) -> "persistent.PersistentRequest":
        """A persistent ``reduce_scatter(output, input, op)`` (input holds size x output).

        Both ranks: ``req = pg.reduce_scatter_init(out := np.empty(1), np.array([1.0, 2.0]))``;
        ``req.start(); req.wait()`` -> rank 0 ``[2.]``, rank 1 ``[4.]``.
        """
        return persistent.reduce_scatter_init(self, output, input, op)

    # ---------------------------------------------------------------- other calls
    def alloc_symmetric(self, nbytes: int) -> np.ndarray:
        """A zero-filled ``uint8`` array of ``nbytes`` that the backend may share with the
        peers (collective: same order and ``nbytes`` on every rank; see
        :mod:`collectives.symmetric`).

        Both ranks: ``buf = pg.alloc_symmetric(16)``; ``a = buf.view(np.float32)``;
        ``a[:] = pg.rank``; ``pg.all_reduce(a)`` -> ``a == [1., 1., 1., 1.]``.
        """
        return symmetric.alloc_symmetric(self, nbytes)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Return rank ``src``'s ``obj`` on every rank (pickled; for set-up metadata).

        Both ranks: ``cfg = pg.broadcast_object({"lr": 0.1} if pg.rank == 0 else None)``.
        """
        return objects.broadcast_object(self, obj, src)

    def all_gather_object(self, obj: Any) -> list:
        """Return the list of every rank's ``obj`` in rank order (pickled).

        Both ranks: ``pg.all_gather_object(pg.rank)`` -> ``[0, 1]``.
        """
        return objects.all_gather_object(self, obj)

    def size_thresholds(self) -> tuple[SizeThreshold, ...]:
        """The message sizes at which this group's collectives change path: every line
        of the backend's path table (:mod:`collectives.paths`); the conformance suite
        crosses each from both sides.

        Two ranks: ``[t.name for t in pg.size_thresholds()]`` ->
        ``['algorithms.ALL_REDUCE_RING_BYTES', ...]`` (on a backend using the defaults).
        """
        return self.transport.paths().thresholds()

    def describe(self) -> str:
        """What this group runs, as text: the backend, its state, and which path each
        collective takes by message size (the backend's path table).

        Two ranks: ``print(pg.describe())`` ->
        ``ProcessGroup 'world' on shm, rank 0 of 2`` and the table below it.
        """
        head = [f"ProcessGroup {self._flight_name!r} on {self.backend}, rank {self.rank} "
                f"of {self.size}, timeout {self.timeout:g} s"]
        head += [f"  {line}" for line in self.transport.describe()]
        table = self.transport.paths().describe(self.size)
        return "\n".join(head + ([table] if table else []))

    # ------------------------------------------------------------------- sub-groups
    def new_group(self, ranks: Sequence[int]) -> "ProcessGroup":
        """A group over ``ranks`` (ranks of this group). Call it on every member rank,
        in the same order relative to other new_group calls; the caller's rank in the
        new group is its index in ``sorted(ranks)``.

        With four ranks: ``pair = pg.new_group([0, 1]) if pg.rank < 2 else pg.new_group([2, 3])``.
        """
        w = self._where("new_group")
        running.check_open(self, "new_group")
        key = self._args.members(ranks, w)
        instance = self._subgroup_counts.get(key, 0)
        self._subgroup_counts[key] = instance + 1
        backend = self.transport.new_group(key, instance)
        if backend is None:
            backend = SubGroup(self.transport, key, instance)
        # Named by the path from the world group, so every member's flight files agree.
        name = (f"{self._flight_name}.{'-'.join(map(str, key))}"
                + (f"#{instance}" if instance else ""))
        group = ProcessGroup(backend, name=name)
        self._children.add(group)
        return group

    # ------------------------------------------------------------- re-forming groups
    def shrink(self, exclude: Sequence[int], *, port: Optional[int] = None) -> "ProcessGroup":
        """The group of this group's ranks except ``exclude`` (dead or stopped ones),
        renumbered in order, made without restarting anyone; this group is aborted.
        Every survivor calls it with the same ``exclude``; it meets under generation
        ``self.generation + 1`` (``port``: where a network backend meets; default the
        world's port plus the generation). See :mod:`collectives.regroup`.

        Three ranks, rank 1 SIGKILLed: ranks 0 and 2 call ``small = pg.shrink([1])`` ->
        rank 2 is ``small.rank == 1`` of ``small.size == 2``; ``small.all_reduce(t)``.
        On ``mpi``: ``NotImplementedError`` naming ULFM.
        """
        return regroup.shrink(self, exclude, port)

    def grow(self, world_size: int, *, port: Optional[int] = None) -> "ProcessGroup":
        """A group of ``world_size`` ranks: this group's members keep their ranks, new
        processes take ranks ``self.size .. world_size-1`` by calling
        ``collectives.join_group(rank=r, world_size=world_size,
        generation=pg.generation + 1)``; this group is aborted.

        Two survivors and one new process: both survivors call ``big = pg.grow(3)``;
        the new one ``big = collectives.join_group(rank=2, world_size=3,
        generation=1)``; then ``big.all_reduce(t)`` on all three.
        """
        return regroup.grow(self, world_size, port)

    def reform(self, rank: int, size: int, generation: int, *,
               port: Optional[int] = None) -> "ProcessGroup":
        """Abort this group and meet again as rank ``rank`` of ``size`` in ``generation``
        (greater than this group's; the same on every member, new processes joining with
        ``collectives.join_group``). What ``shrink`` and ``grow`` call; ``parallel.ft``
        calls it with the quorum its coordinator decided. Every wait is bounded by this
        group's timeout. Call it once every member has returned from its last
        collective on this group (an agreement outside the group, as parallel.ft's
        coordinator gives): the abort fails a peer's call still in flight. A refused
        call (``NotImplementedError`` on a transport that cannot re-form, ``ValueError``
        for a bad argument) leaves this group usable.

        Two ranks that lost a third: rank 0 calls ``pg.reform(0, 2, 1)``, rank 2
        ``pg.reform(1, 2, 1)``.
        """
        return regroup.reform(self, rank, size, generation, port)

    # --------------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Finish queued async work, then release the transport, and the same for every
        sub-group made from this group (a sub-group does not outlive its world).
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        flight_signals.unregister(self)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        for child in list(self._children):
            child.close()
        self.transport.close()

    def abort(self, reason: str = "abort() was called") -> None:
        """End this group now, from any thread: every call pending on it (and on its
        sub-groups), in any thread, raises :class:`~collectives.errors.GroupAborted`
        within a second, every later call raises it too, and the transport's resources
        are released, without waiting for any peer (a dead or stopped one included).
        The peers see this rank leave: their calls over it fail. Idempotent.

        Rank 0, while rank 1 hangs: ``threading.Timer(5, pg.abort).start();
        pg.all_reduce(t)`` -> ``GroupAborted: [rank 0/2] all_reduce (seq 3): the group
        was aborted (abort() was called)``.
        """
        if self._aborted is not None:
            return
        _log.warning("group %r (rank %d of %d) aborted: %s", self._flight_name, self.rank,
                     self.size, reason)
        self._aborted = reason
        self._closed = True
        flight_signals.unregister(self)
        for child in list(self._children):
            child.abort(reason)
        try:
            self.transport.abort()
        finally:
            executor, self._executor = self._executor, None
            if executor is not None:   # its task ends with the backend's waits
                executor.shutdown(wait=False, cancel_futures=True)

    def aborted_error(self, op: str, seq: int = -1) -> GroupAborted:
        """The error every call of an aborted group raises (naming ``op`` and the rank)."""
        where = self._where(op) + (f" (seq {seq})" if seq >= 0 else "")
        return GroupAborted(f"{where}: the group was aborted ({self._aborted})", op=op,
                            reason=self._aborted or "")

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ProcessGroup backend={self.backend} rank={self.rank}/{self.size}>"


def _flat(buf: HostBuffer) -> Any:
    """The flat buffer a backend method receives for a staged argument."""
    return buf.array.reshape(-1)

