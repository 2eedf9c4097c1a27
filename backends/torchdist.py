"""torch.distributed's own transports, gloo and NCCL, as backends of this library.

Three registry names: ``gloo`` (CPU, TCP), ``nccl`` (CUDA tensors on ``cuda:LOCAL_RANK``)
and ``torch`` (``nccl`` where CUDA and NCCL are usable, ``gloo`` otherwise).

Each group owns its c10d objects: a ``TCPStore`` (``HashStore`` for a world of one) and a
``ProcessGroupGloo``/``ProcessGroupNCCL`` built directly on it. torch.distributed's global
default group is never touched, so several worlds and their sub-groups coexist, and this
module works next to user code that calls ``torch.distributed.init_process_group`` itself.

Rendezvous: rank 0 serves the store on ``MASTER_ADDR:MASTER_PORT`` (``collectives.spawn``
picks a free port); under torchrun, whose agent already serves that port
(``TORCHELASTIC_USE_AGENT_STORE=True``, the default since torch 2.4), every rank is a
client. Keys live under ``collectives/<restart>/world<k>/``, ``k`` counting the worlds this
process opened on that store, and a sub-group's under its parent's prefix plus its members
and instance number. A store is released when the last group on it closes
(``_Meeting``, :mod:`backends.torch_meeting`: rank 0 stops its server once the other
ranks reported their close, and a rank joining the next world at the same port makes
sure it reached the server of that world). A gloo
group is returned only after a barrier over it, so that no rank can close it (or exit)
while a peer is still finishing its handshake.

Every collective is torch's own (``allreduce``, ``_allgather_base``, ``alltoall_base``,
...) on the caller's memory: a contiguous CPU tensor goes to c10d as it is
(``TorchGroup._to_host``), a numpy array as a zero-copy ``torch.from_numpy`` view, the
rest staged by the base class. gloo runs operations on two worker threads, as torch
configures it; an operation whose memory overlaps that of an async operation still in
flight (one of them writing) first waits for it, so two async all_reduces of one tensor
run in issue order, as on every backend of this library, while disjoint ones (DDP's
buckets) overlap. Where the library lacks something, a small correct step fills in:

- ``ReduceOp.AVG`` runs as SUM, then divides by the group size on every rank (with
  :func:`collectives.reduce_op.finish`, the library's one definition), so the result is
  identical everywhere and old gloo builds without AVG work too.
- ``int16`` (which neither gloo nor NCCL knows) is reduced in ``int32`` and narrowed back,
  which wraps exactly like ``numpy``'s ``int16`` arithmetic; every data-moving collective
  (broadcast, gathers, scatter, all_to_all, send/recv) moves raw bytes, so every dtype
  (``bool``, ``int16``, ``bfloat16``) travels unchanged.
- gloo's ``reduce`` uses the non-root inputs as scratch, so non-root ranks pass a copy.
- ``reduce_scatter`` on gloo is ``allreduce`` of a copy and a slice (gloo's own
  reduce-scatter work cannot be waited for with a timeout: see
  ``TorchGroup._native_reduce_scatter``); NCCL's is ``_reduce_scatter_base``, falling back
  to the same when the build has none.
- send/recv tags: c10d takes a C ``int``; user tags (< 2**31) pass unchanged, the 63-bit
  tags of the library's send/recv algorithms (``p2p:gloo``) are folded into
  [2**30, 2**31), so only those runs share tags with user tags above 2**30.

``async_op=True`` returns a :class:`TorchWork` around torch's work object (no extra
thread). Staged results (non-contiguous or CUDA tensors on gloo, AVG's division, int16's
narrowing) are written when the work is seen to complete: ``wait()``,
``is_completed()`` returning True, or ``close()``.

Shutdown: ``close()`` finishes outstanding work, drops every reference to torch's work
objects and then the c10d group, whose destructor (run with the GIL released) joins
gloo's worker threads. An ``atexit`` hook closes every group still open, before the
interpreter finalises: a gloo worker that drops the last reference to a tensor viewing a
numpy array must take the GIL, and doing that during finalisation aborts the process
("terminate called without an active exception", about 1 run in 10 on torch 2.13 CPU).

The NCCL group and the ``nccl`` and ``torch`` factories are in :mod:`backends.torch_nccl`;
the conversion of arguments to tensors, byte views, c10d options and tags in
:mod:`backends.torch_tensors`; the failure diagnosis (a member on this host that died, the
ranks that never arrived) in :mod:`backends.torch_failures`.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from collectives.buffers import HostBuffer, to_host
from collectives.errors import CollectiveError, CollectiveTimeout
from collectives.errors import where as _where
from collectives.group import ProcessGroup
from collectives.lifetime import close_at_exit, forget_at_exit
from collectives.launch import Rendezvous
from collectives.reduce_op import ReduceOp, finish
from collectives.work import Work

from .torch_failures import _FailureDiagnosis, _keep_forever, _unsupported
from .torch_meeting import _construct, _Meeting, _world_store
from .torch_tensors import (_ALLREDUCE_OPTS, _ALLTOALL_OPTS, _BARRIER_OPTS, _C10D_OP,
                            _REDUCE_SCATTER_OPTS, _TORCH_DTYPES, _WIDEN, _bytes, _conflict,
                            _numpy, _options, _parts, _span, _tensor, _wire_tag)
from .torch_work import TorchWork

__all__ = ["TorchGroup", "TorchWork", "create_gloo"]


# ----------------------------------------------------------------------------- groups
class TorchGroup(_FailureDiagnosis, ProcessGroup):
    """A ProcessGroup over a c10d ``ProcessGroupGloo`` (and base of
    :class:`backends.torch_nccl.NcclGroup`).

    Two ranks, from ``collectives.spawn(main, 2, backend="gloo")`` or
    ``torchrun --nproc-per-node 2 script.py``::

        pg = collectives.init_process_group("gloo")
        t = torch.ones(4) * (pg.rank + 1)
        pg.all_reduce(t)                          # tensor([3., 3., 3., 3.]) on both
        work = pg.all_reduce(t, async_op=True)    # torch's own async work underneath
        work.wait()
        pg.close()
    """

    backend = "gloo"
    hooks_return_work = True  # every hook starts torch's asynchronous c10d call
    #: Use c10d's ``_reduce_scatter_base``; False (or a build without it) runs
    #: all_reduce of a copy and keeps this rank's slice. False on gloo: its
    #: ``_reduce_scatter_base`` (and list ``reduce_scatter``) work ignores
    #: ``wait(timeout)`` and reports ``is_completed()`` only after a plain ``wait()``, so
    #: neither the dead-peer watch of `_wait` nor ``Work.is_completed()``/
    #: ``wait(timeout)`` could see it finish. gloo's all_reduce work can be watched, and
    #: costs the same here (2 and 4 ranks, 4 KiB and 4 MiB per rank: within 10 % of
    #: ``_reduce_scatter_base``, either way round).
    _native_reduce_scatter = False

    def __init__(self, rank: int, size: int, *, timeout: float, c10d: Any,
                 store: "_Meeting", prefix: str) -> None:
        super().__init__(rank, size, timeout=timeout)
        self._pg = c10d
        self._meeting: Optional[_Meeting] = store  # released (once) by _close
        self._store = store.store
        self._prefix = prefix
        self._tls = threading.local()
        #: Group rank -> process id, for the ranks on this host (see `_dead_peers`).
        self._local_pids: dict[int, int] = self._exchange_pids()
        close_at_exit(self)  # only now: a failed constructor's caller releases the store

    # ------------------------------------------------------------------ construction
    @classmethod
    def _make_c10d(cls, store: Any, rank: int, size: int, timeout: float) -> Any:
        # As torch builds it: devices from GLOO_SOCKET_IFNAME or this host's address, two
        # worker threads per device. (One thread would run operations in issue order by
        # itself, but when the CPUs are oversubscribed its back-to-back wake-ups cost
        # milliseconds; _run orders the operations that conflict instead.)
        pg = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=timeout))
        # A rank leaves the constructor when its own side of every connection is up; a
        # peer may still be finishing its handshake, and a rank that closes the group (or
        # exits) at once makes that peer fail with "Connection closed by peer". After a
        # barrier every rank is connected.
        pg.barrier(_BARRIER_OPTS).wait()
        return pg

    @classmethod
    def _connect(cls, rendezvous: Rendezvous, timeout: float, **extra: Any) -> "TorchGroup":
        rank, size = rendezvous.rank, rendezvous.world_size
        meeting, prefix = _world_store(rendezvous, timeout)
        where = _where(rank, size, f"init_process_group(backend={cls.backend!r})")
        try:
            c10d = _construct(lambda: cls._make_c10d(dist.PrefixStore(prefix, meeting.store),
                                                     rank, size, timeout, **extra),
                              where, timeout)
            group = cls(rank, size, timeout=timeout, c10d=c10d, store=meeting, prefix=prefix,
                        **extra)
        except BaseException:
            meeting.release(broken=True)
            raise
        return group

    def _new_group(self, ranks: tuple[int, ...], instance: int) -> "TorchGroup":
        prefix = f"{self._prefix}{'.'.join(map(str, ranks))}#{instance}/"
        rank, size = ranks.index(self.rank), len(ranks)
        where = f"{self._where('new_group')}({list(ranks)})"
        extra = self._sub_group_extra()
        meeting = self._meeting
        if meeting is None or self._store is None:
            raise CollectiveError(f"{where}: the group is closed")
        meeting.acquire()  # the sub-group shares its parent's store
        try:
            c10d = _construct(lambda: self._make_c10d(dist.PrefixStore(prefix, self._store),
                                                      rank, size, self.timeout, **extra),
                              where, self.timeout)
            return type(self)(rank, size, timeout=self.timeout, c10d=c10d, store=meeting,
                              prefix=prefix, **extra)
        except BaseException:
            meeting.release(broken=True)
            raise

    def _sub_group_extra(self) -> dict:
        return {}

    # --------------------------------------------------------------------- plumbing
    def _to_host(self, obj: Any, *, where: str, arg: str, write: bool) -> HostBuffer:
        """A contiguous CPU tensor goes to the hooks as it is (c10d takes tensors; no
        round trip through numpy); everything else as the base class stages it. The
        memory of every argument is noted for :meth:`_run`'s ordering."""
        args = getattr(self._tls, "args", None)
        if args is None:
            args = self._tls.args = []
        args.append((obj, write))
        if isinstance(obj, torch.Tensor) and obj.is_cpu and obj.dtype in _TORCH_DTYPES \
                and obj.is_contiguous() and not obj.is_neg():
            return HostBuffer(obj.detach() if obj.requires_grad else obj)
        return to_host(obj, where=where, arg=arg, write=write)

    def _take_args(self) -> list:
        """The arguments noted by ``_to_host`` since the last call (and forget them)."""
        args = getattr(self._tls, "args", None)
        self._tls.args = []
        return args or []

    def _wait_for_conflicts(self, spans: list) -> None:
        """Finish every async operation in flight whose memory overlaps ``spans`` (one of
        the two writing): the new operation then sees its results, as in issue order."""
        for work in self._in_flight():
            if _conflict(work._spans, spans):
                work._finish()  # its error, if any, stays with it for its own wait()

    def _c10d(self, op: str) -> Any:
        if self._pg is None:
            raise CollectiveError(f"{self._where(op)}: the group is closed")
        return self._pg

    def _issue(self, work: Any, op: str, seq: int,
               then: Optional[Callable[[], None]] = None, keep: Sequence[Any] = ()) -> TorchWork:
        """The Work of a collective hook: torch's ``work``, what to do once it finished
        (AVG's division, int16's narrowing) and the tensors torch uses until then (see
        collectives.hooks). It carries the memory spans ``_before_start`` noted, for the
        ordering of later async ops."""
        mine = TorchWork(self, op, seq, [work], [then] if then is not None else (), (), keep)
        mine._spans = getattr(self._tls, "spans", None) or []
        return mine

    def _before_start(self, async_op: bool) -> None:
        """Order the op after every async op in flight whose memory overlaps its
        arguments (one of the two writing): torch runs ops concurrently on its threads,
        so without this a later op could read what an earlier one has yet to write."""
        args = self._take_args()
        inflight = self._in_flight() if self._inflight else []  # the lock only when needed
        spans = [_span(obj, write) for obj, write in args] if async_op or inflight else []
        if inflight:
            self._wait_for_conflicts(spans)
        self._tls.spans = spans

    # -------------------------------------------------------------- point to point
    def _isend(self, array: np.ndarray, dst: int, tag: int) -> Work:
        self._take_args()  # point to point is not ordered with collectives
        t = _bytes(_tensor(array))
        try:
            w = self._c10d("isend").send([t], dst, _wire_tag(tag))
        except RuntimeError as exc:
            self._reraise(exc, "isend", -1, dst)
        work = TorchWork(self, f"isend(dst={dst}, tag={tag})", -1, [w], keep=[t], peer=dst)
        self._track(work)
        return work

    def _irecv(self, array: np.ndarray, src: int, tag: int) -> Work:
        self._take_args()
        t = _bytes(_tensor(array))
        try:
            w = self._c10d("irecv").recv([t], src, _wire_tag(tag))
        except RuntimeError as exc:
            self._reraise(exc, "irecv", -1, src)
        work = TorchWork(self, f"irecv(src={src}, tag={tag})", -1, [w], keep=[t], peer=src)
        self._track(work)
        return work

    def size_thresholds(self) -> tuple:
        """None of ours: every collective is the library's own, which picks its algorithms."""
        return ()

    def _barrier(self, seq: int) -> TorchWork:
        return self._issue(self._c10d("barrier").barrier(_BARRIER_OPTS), "barrier", seq)

    # ------------------------------------------------------------------ collectives
    def _reducible(self, a: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(the tensor of ``a``, the tensor to reduce: itself or a widened copy)."""
        t = _tensor(a)
        wide = _WIDEN.get(t.dtype)
        return t, (t if wide is None else t.to(wide))

    def _after_reduce(self, a: Any, t: torch.Tensor, reduced: torch.Tensor,
                      op: ReduceOp) -> Optional[Callable[[], None]]:
        """What to do once ``reduced`` holds the result meant for ``a``/``t``."""
        narrow = reduced is not t
        if not narrow and op is not ReduceOp.AVG:
            return None
        size = self.size

        def then() -> None:
            if narrow:
                t.copy_(reduced)  # int32 -> int16 wraps like numpy's int16 arithmetic
            if op is ReduceOp.AVG:
                if t.device.type == "cpu":  # the library's one definition of AVG
                    finish(op, a if isinstance(a, np.ndarray) else _numpy(t), size)
                else:
                    t.div_(size)

        return then

    def _broadcast(self, a: np.ndarray, src: int, seq: int) -> TorchWork:
        t = _bytes(_tensor(a))
        opts = _options(dist.BroadcastOptions, rootRank=src, rootTensor=0)
        return self._issue(self._c10d("broadcast").broadcast([t], opts), "broadcast", seq,
                           keep=[t])

    def _all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> TorchWork:
        t, r = self._reducible(a)
        return self._issue(self._c10d("all_reduce").allreduce([r], _ALLREDUCE_OPTS[op]),
                           "all_reduce", seq, self._after_reduce(a, t, r, op), keep=[t, r])

    def _reduce(self, a: np.ndarray, dst: int, op: ReduceOp, seq: int) -> TorchWork:
        t, r = self._reducible(a)
        if self.rank != dst and r is t:
            r = t.clone()  # gloo uses the non-root inputs as scratch space
        opts = _options(dist.ReduceOptions, rootRank=dst, reduceOp=_C10D_OP[op])
        then = self._after_reduce(a, t, r, op) if self.rank == dst else None
        return self._issue(self._c10d("reduce").reduce([r], opts), "reduce", seq, then,
                           keep=[t, r])

    def _all_gather(self, out: np.ndarray, inp: np.ndarray, seq: int) -> TorchWork:
        o, i = _bytes(_tensor(out)), _bytes(_tensor(inp))
        pg = self._c10d("all_gather")
        if hasattr(pg, "_allgather_base"):
            w = pg._allgather_base(o, i)
        else:
            w = pg.allgather([_parts(o, self.size)], [i])
        return self._issue(w, "all_gather", seq, keep=[o, i])

    def _gather(self, inp: np.ndarray, out: Optional[np.ndarray], dst: int, seq: int) -> TorchWork:
        i = _bytes(_tensor(inp))
        parts = [] if out is None else [_parts(_bytes(_tensor(out)), self.size)]
        opts = _options(dist.GatherOptions, rootRank=dst)
        return self._issue(self._c10d("gather").gather(parts, [i], opts), "gather", seq,
                           keep=[i, parts])

    def _scatter(self, out: np.ndarray, inp: Optional[np.ndarray], src: int, seq: int) -> TorchWork:
        o = _bytes(_tensor(out))
        parts = [] if inp is None else [_parts(_bytes(_tensor(inp)), self.size)]
        opts = _options(dist.ScatterOptions, rootRank=src)
        return self._issue(self._c10d("scatter").scatter([o], parts, opts), "scatter", seq,
                           keep=[o, parts])

    def _reduce_scatter(self, out: np.ndarray, inp: np.ndarray, op: ReduceOp, seq: int) -> TorchWork:
        o, ro = self._reducible(out)
        i = _tensor(inp)
        ri = i if ro is o else i.to(ro.dtype)
        pg = self._c10d("reduce_scatter")
        if self._native_reduce_scatter and hasattr(pg, "_reduce_scatter_base"):
            try:
                w = pg._reduce_scatter_base(ro, ri, _REDUCE_SCATTER_OPTS[op])
            except RuntimeError as exc:
                if not _unsupported(exc):
                    raise
                # Raised on every rank, before any communication: switch for good.
                self._native_reduce_scatter = False
            else:
                return self._issue(w, "reduce_scatter", seq, self._after_reduce(out, o, ro, op),
                                   keep=[o, ro, i, ri])
        # all_reduce of a private copy, then keep this rank's slice: the same values as
        # the native reduce-scatter on every rank.
        full = ri.clone() if ri is i else ri
        n = o.numel()
        mine = full[self.rank * n:(self.rank + 1) * n]
        avg = self._after_reduce(out, o, o, op)

        def then() -> None:
            o.copy_(mine)  # int32 -> int16 wraps like numpy's int16 arithmetic
            if avg is not None:
                avg()

        return self._issue(pg.allreduce([full], _ALLREDUCE_OPTS[op]), "reduce_scatter", seq,
                           then, keep=[o, i, full])

    def _all_to_all(self, out: np.ndarray, inp: np.ndarray, out_counts: Sequence[int],
                    in_counts: Sequence[int], seq: int) -> TorchWork:
        o, i = _tensor(out), _tensor(inp)
        k = o.element_size()
        ob, ib = _bytes(o), _bytes(i)
        equal = len(set(out_counts)) <= 1 and len(set(in_counts)) <= 1
        out_splits = [] if equal else [c * k for c in out_counts]
        in_splits = [] if equal else [c * k for c in in_counts]
        w = self._c10d("all_to_all").alltoall_base(ob, ib, out_splits, in_splits,
                                                    _ALLTOALL_OPTS)
        return self._issue(w, "all_to_all", seq, keep=[ob, ib])

    # --------------------------------------------------------------------- lifetime
    def _close(self) -> None:
        forget_at_exit(self)
        deadline = time.monotonic() + self.timeout
        while True:  # finish what is still in flight (results land, errors are dropped)
            pending = self._in_flight()
            if not pending:
                break
            for w in pending:
                try:
                    w.wait(max(0.0, deadline - time.monotonic()) or 1e-3)
                except CollectiveTimeout:
                    if time.monotonic() >= deadline:
                        self._untrack(w)  # hung: give up on it
                except Exception:  # noqa: BLE001 - close() must not raise for old errors
                    pass
        pg, self._pg = self._pg, None
        meeting, self._meeting = self._meeting, None
        self._store = None
        self._tls = threading.local()  # noted arguments: no reason to keep them alive
        broken = pg is not None and bool(self._dead_peers())
        if broken:
            # A member died: gloo's threads may still be blocked in an operation this
            # rank gave up on (see _wait) until the group timeout, and the destructor
            # would wait for them. The group is broken anyway: keep it to the end of
            # the process (its threads and sockets end with it), close() returns now.
            _keep_forever(pg)
        elif pg is not None:
            _shutdown(pg)
            del pg  # the destructor joins gloo's threads (the GIL is released meanwhile)
        if meeting is not None:
            # After the c10d group (which holds the store too) is gone. A broken world's
            # store is not waited for: its dead members never give theirs back.
            meeting.release(broken=broken)


# --------------------------------------------------------------------------- factories
def create_gloo(rendezvous: Rendezvous, timeout: float) -> TorchGroup:
    """The world group over gloo (registry name ``gloo``)."""
    if not dist.is_available() or not dist.is_gloo_available():
        raise RuntimeError("backend 'gloo': this torch build has no gloo "
                           "(torch.distributed.is_gloo_available() is False)")
    return TorchGroup._connect(rendezvous, timeout)


def _shutdown(pg: Any) -> None:
    shutdown = getattr(pg, "shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception:  # noqa: BLE001 - best effort; the destructor still runs
            pass

