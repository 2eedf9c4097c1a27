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

NCCL tensors stay on the device: :meth:`NcclGroup._to_host` hands the hooks CUDA tensors
(staging host or other-device arguments through ``cuda:LOCAL_RANK``), and waits block the
host (``TORCH_NCCL_BLOCKING_WAIT=1`` unless set) so ``Work.wait`` re-raises errors.
NCCL ignores send/recv tags: messages between a pair match in posting order.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import socket
import threading
import time
import warnings
from typing import Any, Callable, NoReturn, Optional, Sequence

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist

from collectives.buffers import HostBuffer, to_host
from collectives.errors import CollectiveError, CollectiveTimeout, PeerError
from collectives.errors import where as _where
from collectives.algorithms.links import fold_tag
from collectives.group import ProcessGroup
from collectives.lifetime import close_at_exit, forget_at_exit, process_alive
from collectives.launch import Rendezvous
from collectives.reduce_op import ReduceOp, finish
from collectives.work import Work

from .torch_meeting import _construct, _first_line, _Meeting, _world_store
from .torch_work import _WATCH_INTERVAL, TorchWork, _is_watch_timeout

try:
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # numpy < 2
    _byte_bounds = np.byte_bounds

__all__ = ["TorchGroup", "NcclGroup", "TorchWork", "create_gloo", "create_nccl",
           "create_auto"]

_C10D_OP = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVG: dist.ReduceOp.SUM,
            ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT, ReduceOp.MIN: dist.ReduceOp.MIN,
            ReduceOp.MAX: dist.ReduceOp.MAX}

#: The torch dtypes of ``collectives.buffers.SUPPORTED_DTYPES``.
_TORCH_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64,
                           torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
                           torch.bool))

#: Dtypes neither gloo nor NCCL reduces, and the dtype they are reduced in instead.
_WIDEN = {torch.int16: torch.int32}

_MAX_C10D_TAG = 1 << 31
_FOLDED_TAG_BASE = 1 << 30


def _options(cls: Any, **fields: Any) -> Any:
    opts = cls()
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


# Options objects are copied by c10d on every call; build the constant ones once.
_ALLREDUCE_OPTS = {op: _options(dist.AllreduceOptions, reduceOp=c) for op, c in _C10D_OP.items()}
_REDUCE_SCATTER_OPTS = {op: _options(dist.ReduceScatterOptions, reduceOp=c)
                        for op, c in _C10D_OP.items()}
_ALLTOALL_OPTS = dist.AllToAllOptions()
_BARRIER_OPTS = dist.BarrierOptions()
#: After a timeout, how long to wait for the other ranks to report theirs (the ranks
#: that do not are named as missing).
_TIMEOUT_REPORT_GRACE = 1.0


# ---------------------------------------------------------------------------- tensors
def _tensor(a: Any) -> torch.Tensor:
    """``a`` as a flat torch tensor sharing its memory (a numpy array or a tensor)."""
    if isinstance(a, torch.Tensor):
        return a if a.dim() == 1 else a.reshape(-1)
    if a.dtype == ml_dtypes.bfloat16:
        return _from_numpy(a.view(np.uint16)).view(torch.bfloat16).reshape(-1)
    return _from_numpy(a).reshape(-1)


def _numpy(t: torch.Tensor) -> np.ndarray:
    """The numpy view of a CPU tensor (bfloat16 as ``ml_dtypes.bfloat16``)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _from_numpy(a: np.ndarray) -> torch.Tensor:
    if a.flags.writeable:
        return torch.from_numpy(a)
    # An input the caller passed read-only: torch warns that it cannot mark the tensor
    # read-only; the transports only read inputs.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view: data-moving collectives carry every dtype as raw bytes."""
    if t.dtype == torch.uint8:
        return t
    if t.numel() <= 1 and t.stride(-1) != 1:
        # numpy calls an array of 0 or 1 element contiguous whatever its stride
        t = t.as_strided((t.numel(),), (1,))
    return t.view(torch.uint8)


def _span(obj: Any, write: bool) -> tuple:
    """(device, first byte, end, written) of the memory an argument occupies."""
    if isinstance(obj, np.ndarray):
        lo, hi = _byte_bounds(obj) if obj.size else (0, 0)
        return ("cpu", lo, hi, write)
    if obj.numel() == 0:
        return ("cpu", 0, 0, write)
    last = sum((n - 1) * s for n, s in zip(obj.shape, obj.stride()))
    lo = obj.data_ptr()
    return (str(obj.device), lo, lo + (last + 1) * obj.element_size(), write)


def _conflict(a: list, b: list) -> bool:
    """Whether two operations' memory overlaps where at least one of them writes."""
    return any(da == db and la < hb and lb < ha and (wa or wb)
               for da, la, ha, wa in a for db, lb, hb, wb in b)


def _parts(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``t`` cut into ``n`` equal consecutive views."""
    k = t.numel() // n
    return [t.narrow(0, r * k, k) for r in range(n)]


def _wire_tag(tag: int) -> int:
    """A c10d tag (a C int) for a tag of this library (below 2**63)."""
    if tag < _MAX_C10D_TAG:
        return tag
    return _FOLDED_TAG_BASE | fold_tag(tag, 30)


# ----------------------------------------------------------------------------- groups
class TorchGroup(ProcessGroup):
    """A ProcessGroup over a c10d ``ProcessGroupGloo`` (and base of :class:`NcclGroup`).

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

    # ------------------------------------------------------------- failure diagnosis
    def _exchange_pids(self) -> dict[int, int]:
        """Every member publishes ``host pid`` in the store; returns group rank -> pid
        of the other members on this host (empty for a world of one or NCCL, whose
        waits are not watched). Lets a rank name a peer that died (`_dead_peers`)."""
        if self.size == 1 or self.backend != "gloo" or self._store is None:
            return {}
        key = f"{self._prefix}collectives-pid/"
        host = socket.gethostname()
        self._store.set(f"{key}{self.rank}", f"{host} {os.getpid()}")
        pids = {}
        for r in range(self.size):
            if r != self.rank:
                peer_host, _, pid = self._store.get(f"{key}{r}").decode().rpartition(" ")
                if peer_host == host:
                    pids[r] = int(pid)
        return pids

    def _dead_peers(self) -> list[int]:
        """Group ranks on this host whose process has ended."""
        return [r for r, pid in self._local_pids.items() if not process_alive(pid)]

    def _wait(self, w: Any, op: str, seq: int, peer: int = -1) -> None:
        """``w.wait()``, raising :class:`PeerError` as soon as a member of the group on
        this host dies (checked every ``_WATCH_INTERVAL``).

        A send or receive (``seq < 0``, ``peer >= 0``) is waited on whole: a sliced wait on one that
        times out closes gloo's connection (see :class:`TorchWork`). Its peer's death
        still ends it at once, as a closed connection (``_translate`` names the rank).
        """
        if not self._local_pids or (seq < 0 and peer >= 0):
            w.wait()
            return
        while True:
            try:
                w.wait(_WATCH_INTERVAL)
                return
            except RuntimeError as exc:
                if not _is_watch_timeout(exc):
                    raise  # gloo's own error (or its group timeout): see _translate
                dead = self._dead_peers()
                if dead:
                    # gloo still runs it and holds its tensors: if its thread dropped the
                    # last reference while the interpreter exits, the process would abort.
                    _keep_forever(w)
                    raise PeerError(f"{self._describe(op, seq)}: rank {dead[0]} died "
                                    f"(its process {self._local_pids[dead[0]]} has ended)",
                                    peer=dead[0]) from None

    def _timed_out_with(self, seq: int) -> list[int]:
        """After a timeout in collective ``seq``: the ranks that did not report a timeout
        in it too within ``_TIMEOUT_REPORT_GRACE`` (they never arrived). Through the
        store; empty when the store cannot be reached."""
        store = self._store
        if store is None or self.size == 1:
            return []
        key = f"{self._prefix}collectives-timeout/{seq}/"
        try:
            store.set(f"{key}{self.rank}", "1")
            deadline = time.monotonic() + _TIMEOUT_REPORT_GRACE
            while True:
                missing = [r for r in range(self.size) if not store.check([f"{key}{r}"])]
                if not missing or time.monotonic() >= deadline:
                    return missing
                time.sleep(0.05)
        except RuntimeError:  # the store's host is gone
            return []

    def _c10d(self, op: str) -> Any:
        if self._pg is None:
            raise CollectiveError(f"{self._where(op)}: the group is closed")
        return self._pg

    def _translate(self, exc: BaseException, op: str, seq: int, peer: int = -1) -> BaseException:
        """A typed error of this library for a torch/gloo/NCCL error of operation ``op``."""
        if isinstance(exc, CollectiveError) or not isinstance(exc, RuntimeError):
            return exc
        where = self._describe(op, seq)
        detail = _first_line(exc)
        low = detail.lower()
        dead = self._dead_peers()
        if not dead and self._local_pids and any(s in low for s in _PEER_GONE):
            # The kernel closes a killed process's sockets before it has ended: give it
            # a moment, so that the error names the rank.
            deadline = time.monotonic() + 0.5
            while not dead and time.monotonic() < deadline:
                time.sleep(0.01)
                dead = self._dead_peers()
        missing = self._timed_out_with(seq) if not dead and seq >= 0 and (
            "timed out" in low or "timeout" in low) and "pair closure" not in low else []
        if dead:
            error: BaseException = PeerError(
                f"{where}: rank {dead[0]} died (its process {self._local_pids[dead[0]]} "
                f"has ended): {detail}", peer=dead[0])
        elif missing:
            names = ", ".join(map(str, missing))
            error = CollectiveTimeout(
                f"{where}: did not complete within the group timeout of {self.timeout:g} s: "
                f"rank{'s' if len(missing) > 1 else ''} {names} did not arrive ({detail})",
                op=op, seq=seq, missing=missing)
        elif "pair closure" in low:
            error = CollectiveTimeout(
                f"{where}: an earlier operation of this group timed out and gloo closed its "
                f"connections; the group cannot be used any more ({detail})",
                op=op, seq=seq)
        elif any(s in low for s in _PEER_GONE):
            error = PeerError(f"{where}: a peer closed its connection (did a rank exit or "
                              f"crash?): {detail}", peer=peer)
        elif "timed out" in low or "timeout" in low:
            error = CollectiveTimeout(
                f"{where}: did not complete within the group timeout of {self.timeout:g} s"
                f"{f'; rank {peer} did not answer' if peer >= 0 else ''} ({detail})",
                op=op, seq=seq, missing=(peer,) if peer >= 0 else ())
        else:
            error = CollectiveError(f"{where}: {detail}")
        error.__cause__ = exc
        return error

    def _reraise(self, exc: RuntimeError, op: str, seq: int, peer: int = -1) -> NoReturn:
        error = self._translate(exc, op, seq, peer)
        if error is exc:
            raise exc
        raise error from exc

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


class NcclGroup(TorchGroup):
    """A ProcessGroup over a c10d ``ProcessGroupNCCL`` on ``cuda:LOCAL_RANK``.

    The hooks receive CUDA tensors on this group's device (see :meth:`_to_host`), so CUDA
    tensors go to NCCL without a trip through host memory. CPU tensors and numpy arrays are
    accepted too, staged through the device.
    """

    backend = "nccl"
    #: NCCL's reduce-scatter moves (n-1)/n of the data all_reduce does, and its waits
    #: are not watched (see `_exchange_pids`).
    _native_reduce_scatter = True

    def __init__(self, rank: int, size: int, *, timeout: float, c10d: Any, store: Any,
                 prefix: str, device: torch.device) -> None:
        super().__init__(rank, size, timeout=timeout, c10d=c10d, store=store, prefix=prefix)
        self.device = device

    @classmethod
    def _make_c10d(cls, store: Any, rank: int, size: int, timeout: float,
                   device: Optional[torch.device] = None) -> Any:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=timeout)
        opts.is_high_priority_stream = False
        return dist.ProcessGroupNCCL(store, rank, size, opts)

    @classmethod
    def _connect(cls, rendezvous: Rendezvous, timeout: float, **extra: Any) -> "TorchGroup":
        if not _nccl_usable():
            where = _where(rendezvous.rank, rendezvous.world_size, "init_process_group")
            raise RuntimeError(f"{where}: backend 'nccl' needs CUDA and a torch build with "
                               f"NCCL; use 'gloo' (or 'torch', which picks it)")
        device = torch.device("cuda", rendezvous.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        # Work.wait() must block the host and raise NCCL's errors, as on every backend.
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        return super()._connect(rendezvous, timeout, device=device)

    def _sub_group_extra(self) -> dict:
        return {"device": self.device}

    def _to_host(self, obj: Any, *, where: str, arg: str, write: bool) -> HostBuffer:
        """Device memory on ``self.device`` for argument ``arg``: the tensor itself when it
        is a contiguous CUDA tensor there, otherwise a device copy written back after the
        operation when ``write``."""
        if isinstance(obj, torch.Tensor) and obj.device.type == "cuda":
            if obj.dtype not in _TORCH_DTYPES:
                raise TypeError(f"{where}: argument `{arg}` has unsupported dtype {obj.dtype}")
            src = obj.detach()
            if src.device == self.device and src.is_contiguous() and not src.is_neg() \
                    and not src.is_conj():
                return HostBuffer(src)
            staged = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            staged.copy_(src)
            return HostBuffer(staged, (lambda d: src.copy_(d)) if write else None)
        host = to_host(obj, where=where, arg=arg, write=write)  # checks; host staging
        staged = _tensor(host.array).to(self.device).reshape(host.array.shape)

        def writeback(d: torch.Tensor, host: HostBuffer = host) -> None:
            _tensor(host.array).copy_(d.reshape(-1))  # device -> host, synchronous
            host.commit()

        return HostBuffer(staged, writeback if write else None)

    def _barrier(self, seq: int) -> TorchWork:
        t = torch.zeros(1, device=self.device)
        return self._issue(self._c10d("barrier").allreduce([t], _ALLREDUCE_OPTS[ReduceOp.SUM]),
                           "barrier", seq, keep=[t])


# --------------------------------------------------------------------------- factories
def create_gloo(rendezvous: Rendezvous, timeout: float) -> TorchGroup:
    """The world group over gloo (registry name ``gloo``)."""
    if not dist.is_available() or not dist.is_gloo_available():
        raise RuntimeError("backend 'gloo': this torch build has no gloo "
                           "(torch.distributed.is_gloo_available() is False)")
    return TorchGroup._connect(rendezvous, timeout)


def create_nccl(rendezvous: Rendezvous, timeout: float) -> TorchGroup:
    """The world group over NCCL on ``cuda:LOCAL_RANK`` (registry name ``nccl``)."""
    return NcclGroup._connect(rendezvous, timeout)


def create_auto(rendezvous: Rendezvous, timeout: float) -> TorchGroup:
    """``nccl`` where CUDA and NCCL are usable here, otherwise ``gloo`` (name ``torch``)."""
    return create_nccl(rendezvous, timeout) if _nccl_usable() else create_gloo(rendezvous, timeout)


def _nccl_usable() -> bool:
    return (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()
            and torch.cuda.device_count() > 0)


_PEER_GONE = ("closed by peer", "connection reset", "broken pipe", "connection refused",
              "connection closed", "end of file", "socket closed")


def _keep_forever(obj: Any) -> None:
    """Leak one reference to ``obj`` on purpose, so that it is never destroyed, not even
    when the interpreter exits: for torch objects whose destructor would block on (or
    abort in) a gloo thread stuck on a dead peer."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _unsupported(exc: BaseException) -> bool:
    low = str(exc).lower()
    return "not supported" in low or "does not support" in low or "unsupported" in low


def _shutdown(pg: Any) -> None:
    shutdown = getattr(pg, "shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception:  # noqa: BLE001 - best effort; the destructor still runs
            pass

