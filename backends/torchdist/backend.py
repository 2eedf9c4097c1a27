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
(``Meeting``, :mod:`backends.torchdist.meeting`: rank 0 stops its server once the other
ranks reported their close, and a rank joining the next world at the same port makes
sure it reached the server of that world). A gloo
group is returned only after a barrier over it, so that no rank can close it (or exit)
while a peer is still finishing its handshake.

Every collective is torch's own (``allreduce``, ``_allgather_base``, ``alltoall_base``,
...) on the caller's memory: a contiguous CPU tensor goes to c10d as it is
(``TorchBackend.stage``), a numpy array as a zero-copy ``torch.from_numpy`` view, the
rest staged by the group (:mod:`collectives.buffers`). gloo runs operations on two worker
threads, as torch configures it; an operation whose memory overlaps that of an async operation still in
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
  ``TorchBackend.native_reduce_scatter``); NCCL's is ``_reduce_scatter_base``, falling back
  to the same when the build has none.
- send/recv tags: c10d takes a C ``int``; user tags (< 2**31) pass unchanged, the 63-bit
  tags of the library's send/recv algorithms (``p2p:gloo``) are folded into
  [2**30, 2**31), so only those runs share tags with user tags above 2**30.

``async_op=True`` returns a :class:`TorchWork` around torch's work object (no extra
thread). ``abort()`` aborts torch's group (``ProcessGroup.abort``: gloo's and NCCL's own),
which ends the operations in flight with an error, and ends the waits that slice (gloo's
collectives look at the flag every half second); the c10d group is then kept to the
end of the process (its threads may still be stuck on a peer), the store released. Staged results (non-contiguous or CUDA tensors on gloo, AVG's division, int16's
narrowing) are written when the work is seen to complete: ``wait()``,
``is_completed()`` returning True, or ``close()``.

Shutdown: ``close()`` finishes outstanding work, drops every reference to torch's work
objects and then the c10d group, whose destructor (run with the GIL released) joins
gloo's worker threads. An ``atexit`` hook closes every group still open, before the
interpreter finalises: a gloo worker that drops the last reference to a tensor viewing a
numpy array must take the GIL, and doing that during finalisation aborts the process
("terminate called without an active exception", about 1 run in 10 on torch 2.13 CPU).

The NCCL backend and the ``nccl`` and ``torch`` factories are in
:mod:`backends.torchdist.nccl`; the ``collectives`` backend (this class over
torch.distributed's ``"collectives"`` group instead of gloo's) in
:mod:`backends.torchdist.bridge`; the conversion of arguments to tensors, byte views, c10d
options and tags in :mod:`backends.torchdist.tensors`; the failure diagnosis (a member on
this host that died, the ranks that never arrived) in :mod:`backends.torchdist.failures`;
the store every group of a job meets through in :mod:`backends.torchdist.meeting`.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from collectives.backend import Backend, Capabilities
from collectives.buffers import HostBuffer, to_host
from collectives.errors import CollectiveError, CollectiveTimeout
from collectives.errors import where as _where
from collectives.launch import Rendezvous
from collectives.lifetime import close_at_exit, forget_at_exit
from collectives.paths import PathTable
from collectives.reduce_op import ReduceOp, finish
from collectives.work import InFlight, Work

from .failures import Failures, keep_forever, unsupported
from .meeting import construct, Meeting, world_store
from .tensors import (ALLREDUCE_OPTS, ALLTOALL_OPTS, BARRIER_OPTS, C10D_OP,
                            REDUCE_SCATTER_OPTS, TORCH_DTYPES, WIDEN, as_bytes, conflict,
                            as_numpy, c10d_options, parts_of, span_of, as_tensor, wire_tag)
from .work import TorchWork

__all__ = ["TorchBackend", "TorchWork", "create_gloo"]


# ----------------------------------------------------------------------------- groups
class TorchBackend(Backend):
    """A Backend over a c10d ``ProcessGroupGloo`` (and base of
    :class:`backends.torchdist.nccl.NcclBackend`).

    Two ranks, from ``collectives.spawn(main, 2, backend="gloo")`` or
    ``torchrun --nproc-per-node 2 script.py``::

        pg = collectives.init_process_group("gloo")
        t = torch.ones(4) * (pg.rank + 1)
        pg.all_reduce(t)                          # tensor([3., 3., 3., 3.]) on both
        work = pg.all_reduce(t, async_op=True)    # torch's own async work underneath
        work.wait()
        pg.close()
    """

    name = "gloo"
    # Every collective method starts torch's asynchronous c10d call and returns its Work;
    # contiguous CPU tensors go to c10d as they are (``stage``).
    # regroups: a re-formed group meets at its generation's port (meeting.world_store).
    capabilities = Capabilities(memory="tensors", returns_work=True, translates_errors=True,
                                regroups=True)
    #: Use c10d's ``_reduce_scatter_base``; False (or a build without it) runs
    #: all_reduce of a copy and keeps this rank's slice. False on gloo: its
    #: ``_reduce_scatter_base`` (and list ``reduce_scatter``) work ignores
    #: ``wait(timeout)`` and reports ``is_completed()`` only after a plain ``wait()``, so
    #: neither the dead-peer watch of ``Failures.wait`` nor ``Work.is_completed()``/
    #: ``wait(timeout)`` could see it finish. gloo's all_reduce work can be watched, and
    #: costs the same here (2 and 4 ranks, 4 KiB and 4 MiB per rank: within 10 % of
    #: ``_reduce_scatter_base``, either way round).
    native_reduce_scatter = False
    #: What diagnoses this backend's failures (a subclass over another c10d group may
    #: bring its own: :mod:`backends.torchdist.bridge`).
    failures_class = Failures
    #: Keep a broken group's c10d object to the end of the process instead of shutting
    #: it down (gloo's threads may be stuck on a dead peer: see ``_release``).
    keeps_broken_c10d = True

    def __init__(self, rank: int, size: int, *, timeout: float, c10d: Any,
                 store: "Meeting", prefix: str) -> None:
        super().__init__(rank, size, timeout)
        self._pg = c10d
        self._meeting: Optional[Meeting] = store  # released (once) by close
        #: torch's store of this job (None once closed).
        self.store = store.store
        self._prefix = prefix
        self._tls = threading.local()
        #: Set by abort(): the waits that slice end at their next look.
        self.aborted = False
        self.inflight = InFlight()
        #: Collectives entered so far.
        self.entered = 0
        self.failures = self.failures_class(self, prefix)
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
        pg.barrier(BARRIER_OPTS).wait()
        return pg

    @classmethod
    def _connect(cls, rendezvous: Rendezvous, timeout: float, **extra: Any) -> "TorchBackend":
        rank, size = rendezvous.rank, rendezvous.world_size
        meeting, prefix = world_store(rendezvous, timeout)
        where = _where(rank, size, f"init_process_group(backend={cls.name!r})")
        try:
            c10d = construct(lambda: cls._make_c10d(dist.PrefixStore(prefix, meeting.store),
                                                     rank, size, timeout, **extra),
                              where, timeout)
            group = cls(rank, size, timeout=timeout, c10d=c10d, store=meeting, prefix=prefix,
                        **extra)
        except BaseException:
            meeting.release(broken=True)
            raise
        return group

    def new_group(self, ranks: tuple[int, ...], instance: int) -> "TorchBackend":
        prefix = f"{self._prefix}{'.'.join(map(str, ranks))}#{instance}/"
        rank, size = ranks.index(self.rank), len(ranks)
        where = f"{self.where('new_group')}({list(ranks)})"
        extra = self._sub_group_extra()
        meeting = self._meeting
        if meeting is None or self.store is None:
            raise CollectiveError(f"{where}: the group is closed")
        meeting.acquire()  # the sub-group shares its parent's store
        try:
            c10d = construct(lambda: self._make_sub_c10d(
                dist.PrefixStore(prefix, self.store), ranks, **extra), where, self.timeout)
            return type(self)(rank, size, timeout=self.timeout, c10d=c10d, store=meeting,
                              prefix=prefix, **extra)
        except BaseException:
            meeting.release(broken=True)
            raise

    def _make_sub_c10d(self, store: Any, ranks: tuple[int, ...], **extra: Any) -> Any:
        """torch's group for the sub-group ``ranks`` (called on its members): a new one
        built on ``store``, the parent's store under the sub-group's prefix."""
        return self._make_c10d(store, ranks.index(self.rank), len(ranks), self.timeout,
                               **extra)

    def _sub_group_extra(self) -> dict:
        return {}

    # --------------------------------------------------------------------- plumbing
    def stage(self, obj: Any, *, where: str, arg: str, write: bool) -> HostBuffer:
        """A contiguous CPU tensor goes to the collective methods as it is (c10d takes
        tensors; no round trip through numpy); everything else staged through host
        memory as every backend's is. The memory of every argument is noted for
        :meth:`before_start`'s ordering."""
        args = getattr(self._tls, "args", None)
        if args is None:
            args = self._tls.args = []
        args.append((obj, write))
        if isinstance(obj, torch.Tensor) and obj.is_cpu and obj.dtype in TORCH_DTYPES \
                and obj.is_contiguous() and not obj.is_neg():
            return HostBuffer(obj.detach() if obj.requires_grad else obj)
        return to_host(obj, where=where, arg=arg, write=write)

    def _take_args(self) -> list:
        """The arguments noted by ``stage`` since the last call (and forget them)."""
        args = getattr(self._tls, "args", None)
        self._tls.args = []
        return args or []

    def _wait_for_conflicts(self, spans: list) -> None:
        """Finish every async operation in flight whose memory overlaps ``spans`` (one of
        the two writing): the new operation then sees its results, as in issue order."""
        for work in self.inflight.snapshot():
            if conflict(work._spans, spans):
                work._finish()  # its error, if any, stays with it for its own wait()

    def _c10d(self, op: str) -> Any:
        if self._pg is None or self.aborted:
            how = "aborted" if self.aborted else "closed"
            raise CollectiveError(f"{self.where(op)}: the group is {how}")
        return self._pg

    def _issue(self, work: Any, op: str, seq: int,
               then: Optional[Callable[[], None]] = None, keep: Sequence[Any] = ()) -> TorchWork:
        """The Work of a collective method: torch's ``work``, what to do once it
        finished (AVG's division, int16's narrowing) and the tensors torch uses until
        then. It carries the memory spans ``before_start`` noted, for the ordering of
        later async ops."""
        self.entered = seq + 1
        mine = TorchWork(self, op, seq, [work], [then] if then is not None else (), (), keep)
        mine._spans = getattr(self._tls, "spans", None) or []
        self.inflight.add(mine)
        return mine

    def translate(self, exc: BaseException, op: str, seq: int,
                  peer: int = -1) -> BaseException:
        return self.failures.translate(exc, op, seq, peer)

    def paths(self) -> PathTable:
        """None of ours: every collective is torch's own, which picks its algorithms."""
        return PathTable({}, notes=[f"every collective is torch's own ({self.name}): "
                                    f"c10d picks the algorithms"])

    def before_start(self, async_op: bool) -> None:
        """Order the op after every async op in flight whose memory overlaps its
        arguments (one of the two writing): torch runs ops concurrently on its threads,
        so without this a later op could read what an earlier one has yet to write."""
        args = self._take_args()
        inflight = self.inflight.snapshot() if self.inflight else []  # the lock only if needed
        spans = [span_of(obj, write) for obj, write in args] if async_op or inflight else []
        if inflight:
            self._wait_for_conflicts(spans)
        self._tls.spans = spans

    # -------------------------------------------------------------- point to point
    def isend(self, array: np.ndarray, dst: int, tag: int) -> Work:
        self._take_args()  # point to point is not ordered with collectives
        t = as_bytes(as_tensor(array))
        try:
            w = self._c10d("isend").send([t], dst, wire_tag(tag))
        except RuntimeError as exc:
            self.failures.reraise(exc, "isend", -1, dst)
        work = TorchWork(self, f"isend(dst={dst}, tag={tag})", -1, [w], keep=[t], peer=dst)
        self.inflight.add(work)
        return work

    def irecv(self, array: np.ndarray, src: int, tag: int) -> Work:
        self._take_args()
        t = as_bytes(as_tensor(array))
        try:
            w = self._c10d("irecv").recv([t], src, wire_tag(tag))
        except RuntimeError as exc:
            self.failures.reraise(exc, "irecv", -1, src)
        work = TorchWork(self, f"irecv(src={src}, tag={tag})", -1, [w], keep=[t], peer=src)
        self.inflight.add(work)
        return work

    def barrier(self, seq: int) -> TorchWork:
        return self._issue(self._c10d("barrier").barrier(BARRIER_OPTS), "barrier", seq)

    # ------------------------------------------------------------------ collectives
    def _reducible(self, a: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(the tensor of ``a``, the tensor to reduce: itself or a widened copy)."""
        t = as_tensor(a)
        wide = WIDEN.get(t.dtype)
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
                    finish(op, a if isinstance(a, np.ndarray) else as_numpy(t), size)
                else:
                    t.div_(size)

        return then

    def broadcast(self, a: np.ndarray, root: int, seq: int) -> TorchWork:
        t = as_bytes(as_tensor(a))
        opts = c10d_options(dist.BroadcastOptions, rootRank=root, rootTensor=0)
        return self._issue(self._c10d("broadcast").broadcast([t], opts), "broadcast", seq,
                           keep=[t])

    def all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> TorchWork:
        t, r = self._reducible(a)
        return self._issue(self._c10d("all_reduce").allreduce([r], ALLREDUCE_OPTS[op]),
                           "all_reduce", seq, self._after_reduce(a, t, r, op), keep=[t, r])

    def reduce(self, a: np.ndarray, root: int, op: ReduceOp, seq: int) -> TorchWork:
        t, r = self._reducible(a)
        if self.rank != root and r is t:
            r = t.clone()  # gloo uses the non-root inputs as scratch space
        opts = c10d_options(dist.ReduceOptions, rootRank=root, reduceOp=C10D_OP[op])
        then = self._after_reduce(a, t, r, op) if self.rank == root else None
        return self._issue(self._c10d("reduce").reduce([r], opts), "reduce", seq, then,
                           keep=[t, r])

    def all_gather(self, out: np.ndarray, inp: np.ndarray, seq: int) -> TorchWork:
        o, i = as_bytes(as_tensor(out)), as_bytes(as_tensor(inp))
        pg = self._c10d("all_gather")
        if hasattr(pg, "_allgather_base"):
            w = pg._allgather_base(o, i)
        else:
            w = pg.allgather([parts_of(o, self.size)], [i])
        return self._issue(w, "all_gather", seq, keep=[o, i])

    def gather(self, inp: np.ndarray, out: Optional[np.ndarray], root: int,
               seq: int) -> TorchWork:
        i = as_bytes(as_tensor(inp))
        parts = [] if out is None else [parts_of(as_bytes(as_tensor(out)), self.size)]
        opts = c10d_options(dist.GatherOptions, rootRank=root)
        return self._issue(self._c10d("gather").gather(parts, [i], opts), "gather", seq,
                           keep=[i, parts])

    def scatter(self, out: np.ndarray, inp: Optional[np.ndarray], root: int,
                seq: int) -> TorchWork:
        o = as_bytes(as_tensor(out))
        parts = [] if inp is None else [parts_of(as_bytes(as_tensor(inp)), self.size)]
        opts = c10d_options(dist.ScatterOptions, rootRank=root)
        return self._issue(self._c10d("scatter").scatter([o], parts, opts), "scatter", seq,
                           keep=[o, parts])

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, op: ReduceOp, seq: int) -> TorchWork:
        o, ro = self._reducible(out)
        i = as_tensor(inp)
        ri = i if ro is o else i.to(ro.dtype)
        pg = self._c10d("reduce_scatter")
        if self.native_reduce_scatter and hasattr(pg, "_reduce_scatter_base"):
            try:
                w = pg._reduce_scatter_base(ro, ri, REDUCE_SCATTER_OPTS[op])
            except RuntimeError as exc:
                if not unsupported(exc):
                    raise
                # Raised on every rank, before any communication: switch for good.
                self.native_reduce_scatter = False
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

        return self._issue(pg.allreduce([full], ALLREDUCE_OPTS[op]), "reduce_scatter", seq,
                           then, keep=[o, i, full])

    def all_to_all(self, out: np.ndarray, inp: np.ndarray, out_counts: Sequence[int],
                    in_counts: Sequence[int], seq: int) -> TorchWork:
        o, i = as_tensor(out), as_tensor(inp)
        k = o.element_size()
        ob, ib = as_bytes(o), as_bytes(i)
        equal = len(set(out_counts)) <= 1 and len(set(in_counts)) <= 1
        out_splits = [] if equal else [c * k for c in out_counts]
        in_splits = [] if equal else [c * k for c in in_counts]
        w = self._c10d("all_to_all").alltoall_base(ob, ib, out_splits, in_splits,
                                                    ALLTOALL_OPTS)
        return self._issue(w, "all_to_all", seq, keep=[ob, ib])

    # --------------------------------------------------------------------- lifetime
    def close(self) -> None:
        if self._pg is None and self._meeting is None:
            return
        forget_at_exit(self)
        deadline = time.monotonic() + self.timeout
        while True:  # finish what is still in flight (results land, errors are dropped)
            pending = self.inflight.snapshot()
            if not pending:
                break
            for w in pending:
                try:
                    w.wait(max(0.0, deadline - time.monotonic()) or 1e-3)
                except CollectiveTimeout:
                    if time.monotonic() >= deadline:
                        self.inflight.discard(w)  # hung: give up on it
                except Exception:  # noqa: BLE001 - close() must not raise for old errors
                    pass
        broken = self._pg is not None and bool(self.failures.dead_peers())
        self._release(broken)

    def abort(self) -> None:
        """Abort torch's group (its operations in flight end with an error; the sliced
        waits end at their next look), keep it and the works in flight to the end of
        the process (gloo's threads may still be stuck on a peer: their destructors
        would block), and release the store without waiting for the peers."""
        if self.aborted or self._pg is None:
            return
        self.aborted = True
        forget_at_exit(self)
        try:
            self._pg.abort()
        except Exception:  # noqa: BLE001 - a build without abort: the waits still end
            pass
        for w in self.inflight.take_all():
            keep_forever(w)
        self._release(broken=True)

    def _release(self, broken: bool) -> None:
        pg, self._pg = self._pg, None
        meeting, self._meeting = self._meeting, None
        self.store = None
        self._tls = threading.local()  # noted arguments: no reason to keep them alive
        if broken and pg is not None and self.keeps_broken_c10d:
            # A member died (or the group was aborted): gloo's threads may still be
            # blocked in an operation this rank gave up on until the group timeout, and
            # the destructor would wait for them. The group is broken anyway: keep it to
            # the end of the process (its threads and sockets end with it).
            keep_forever(pg)
        elif pg is not None:
            # A broken group that may be dropped (the collectives backend's) ends its
            # pending calls first; a clean shutdown would wait for them.
            (_abort if broken else _shutdown)(pg)
            del pg  # the destructor joins gloo's threads (the GIL is released meanwhile)
        if meeting is not None:
            # After the c10d group (which holds the store too) is gone. A broken world's
            # store is not waited for: its dead members never give theirs back.
            meeting.release(broken=broken)


# --------------------------------------------------------------------------- factories
def create_gloo(rendezvous: Rendezvous, timeout: float) -> TorchBackend:
    """The world group over gloo (registry name ``gloo``)."""
    if not dist.is_available() or not dist.is_gloo_available():
        raise RuntimeError("backend 'gloo': this torch build has no gloo "
                           "(torch.distributed.is_gloo_available() is False)")
    return TorchBackend._connect(rendezvous, timeout)


def _abort(pg: Any) -> None:
    abort = getattr(pg, "abort", None)
    if abort is None:
        _shutdown(pg)
        return
    try:
        abort()
    except Exception:  # noqa: BLE001 - best effort, as _shutdown
        pass


def _shutdown(pg: Any) -> None:
    shutdown = getattr(pg, "shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception:  # noqa: BLE001 - best effort; the destructor still runs
            pass

