"""``MpiBackend``: MPI through mpi4py as a backend of this library (registry name
``mpi``).

Start the ranks with the MPI launcher; ``init_process_group()`` with no arguments then
picks this backend, the launcher's rank and the world size::

    mpiexec -n 4 python train.py                  # pg = collectives.init_process_group()

A world of one also works without a launcher (MPI's singleton start). Ranks started any
other way (``collectives.spawn``, torchrun) each see an MPI world of one: ``create``
refuses them with a message that says to use ``mpiexec``.

Everything is MPI's own, through mpi4py's buffer interface (the upper-case methods) on
zero-copy views of the arrays the group hands the backend (``collectives.buffers``
stages non-contiguous and CUDA tensors). Collectives are the non-blocking ones:
``Iallreduce`` (``MPI_IN_PLACE``), ``Ibcast``, ``Ireduce``, ``Iallgather``, ``Igather``,
``Iscatter``, ``Ireduce_scatter_block``, ``Ialltoall``/``Ialltoallv`` (split sizes),
``Ibarrier``; point to point is ``Isend``/``Irecv``. Data-moving collectives and point to
point carry every dtype as raw bytes (``MPI.BYTE``).

Reductions (one table, ``_MPI_OPS`` in :mod:`backends.mpi.library`, maps each
:class:`ReduceOp` to MPI's):

- ``AVG`` is MPI's ``SUM``, then a division by the group size with
  :func:`collectives.reduce_op.finish` (on every rank of all_reduce and reduce_scatter,
  on the root of reduce), done when the operation is seen to complete.
- ``float16`` and ``bfloat16``, which MPI has no reduction for, are reduced by
  user-defined MPI operations (``MPI.Op.Create(..., commute=True)``) over 16-bit words
  (``MPI.UINT16_T``) whose function is :func:`collectives.reduce_op.combine_into`, the
  library's one definition of each operator: the values are those of numpy's float16 /
  ml_dtypes' bfloat16 arithmetic (each step rounded to the 16-bit type, as on the shm
  backend), with no widened copy and no extra traffic. Every rank gets bitwise-identical
  results because MPICH's all-reduce algorithms either combine the same pair of partial
  results on every rank (recursive doubling: ``a + b`` and ``b + a`` are the same bits)
  or compute each block once and then move it (reduce-scatter + all-gather, ring,
  tree/shm reduce + broadcast); ``tests/test_mpi_backend.py`` checks this on random,
  inexact inputs at 1..4 ranks and several sizes. The Python function runs inside
  ``Test()`` of the rank that reduces; it costs a numpy call per chunk.
- ``bool`` has no reduction (the group raises ``TypeError`` before any message).
- ``reduce`` passes non-root tensors as MPI's send buffer, which MPI never writes: they
  are left unchanged without a scratch copy.

Point-to-point tags. MPI's tags stop at ``MPI.TAG_UB`` (at least 32767; 2**29 - 1 with
MPICH 4/5), this library's at 2**63:

- user tags (below 2**31) go to MPI unchanged, on the group's communicator. A user tag
  above ``MPI.TAG_UB`` is a ``ValueError`` (raised by ``send``/``isend``/``recv``/
  ``irecv`` before any message);
- the tags of the library's send/recv algorithms (``p2p:mpi``, the default sub-groups
  over it: bit 39 or the sub-group bits 40..60 set, see
  :mod:`collectives.algorithms.links`) travel on an auxiliary *duplicate* of the group's
  communicator, so they can never meet a user tag, folded into ``[0, 2**B)``, the
  largest power of two below the 4 tags reserved at ``MPI.TAG_UB`` (2**28 with MPICH):
  the algorithm step (bits 0..11) and the low sequence bits are kept, the bits above
  ``B`` are hashed into bits 12..B-1 (:func:`fold_tag`). Two messages in flight between
  one pair of ranks could share a folded tag only when their collectives are 2**(B-12)
  (65536 with MPICH) sequence numbers apart or belong to different default sub-groups,
  and then only with probability 2**-(B-12); MPI matches equal tags in posting order, so
  even that is harmless unless two unrelated operations post in opposite orders.

Waits, timeouts and errors. Every wait polls MPI's request with ``Test()`` and a deadline
(:mod:`backends.mpi.polling`: MPI makes progress only inside these calls; there is no
progress thread); a wait past the group's timeout raises :class:`CollectiveTimeout`
naming, where knowable, the ranks that did not arrive, and MPI's exceptions become this
library's typed errors (:mod:`backends.mpi.diagnostics`, which also says what the other
ranks see when one dies).

Abort. ``abort()`` makes every wait end within a poll (each checks the flag between two
``Test()`` calls) and later calls raise; it never calls ``MPI_Abort`` (the process lives
on). MPI cannot cancel a collective in flight: its requests and arrays are kept to the
end of the process (a peer may still complete it), the communicators are freed (MPI
completes the free once the requests did).

Threads and initialisation. No thread of this module touches MPI: ``async_op=True``
returns a :class:`MpiWork` around MPI's request (native non-blocking collectives, not the
group's thread). MPI is initialised when the first group is created (importing this
module does not), by mpi4py with ``MPI_THREAD_MULTIPLE`` (mpi4py's default, stated here;
``MPI4PY_RC_THREAD_LEVEL`` still overrides it) so that user threads may wait on works;
``MPI_Finalize`` runs at exit (mpi4py), after the ``atexit`` hook of ``collectives.lifetime`` closed the
groups still open. If the program initialised MPI itself, its thread level is kept. Under
oversubscription (more local ranks than usable cores) MPICH's own blocking loops
(``Comm.Create_group``, ``MPI_Finalize``, and any raw mpi4py call of the program) are made
to yield with ``MPIR_CVAR_CH4_PROGRESS_THROTTLE=1`` and ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1``
unless already set, so a rank blocked in MPICH leaves most of its core to the rank it
waits for. With spare cores they are left alone: there they slow MPICH's small
collectives by tens of times (docs/performance.md). ``COLLECTIVES_MPI_TUNE=0`` leaves
MPICH's settings alone.

Groups. The world is a duplicate of ``MPI.COMM_WORLD`` (so several worlds and user code
on ``COMM_WORLD`` never mix messages); ``new_group(ranks)`` first waits (with the group
timeout) until every member arrived, then calls ``Comm.Create_group`` with the members'
``MPI.Group`` (collective over the members only, matching the contract that only members
call ``new_group``). ``close()`` completes the collectives still in flight (bounded by
the timeout; point to point gets a second), cancels unmatched receives and frees the
group's communicators; never ``COMM_WORLD``. Arrays that MPI may still write after that
(an operation that timed out) stay referenced until the process exits.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from typing import Any, Callable, Optional, Sequence

import numpy as np

from collectives import logs
from collectives.algorithms.links import fold_tag
from collectives.backend import Backend, Capabilities
from collectives.errors import CollectiveError, CollectiveMismatch, CollectiveTimeout
from collectives.errors import where as _where
from collectives.launch import Rendezvous
from collectives.lifetime import close_at_exit, forget_at_exit
from collectives.paths import PathTable
from collectives.reduce_op import ReduceOp, finish
from collectives.validation import MAX_USER_TAG
from collectives.work import InFlight, Work

from . import library, polling
from .diagnostics import ARRIVE, RELEASE, RESERVED_TAGS, Diagnostics, answer_all_peers
from .library import byte_buffer, reduction
from .persistent import free_requests, persistent_call
from .work import MpiWork

__all__ = ["MpiBackend", "MpiWork", "create", "fold_tag", "load_mpi"]

#: ``mpi4py.MPI`` once :func:`load_mpi` ran.
MPI: Any = None


# ---------------------------------------------------------------------- initialisation
def load_mpi() -> Any:
    """``mpi4py.MPI``, initialising MPI on first use (:mod:`backends.mpi.library`), and
    the wait tuned to the host (:func:`backends.mpi.polling.tune`)."""
    global MPI
    if MPI is None:
        polling.tune()
        MPI = library.load_mpi()
    return MPI


def _poll(test: Callable[[], bool], limit: float) -> bool:
    return polling.poll(test, limit, answer_all_peers)


# ------------------------------------------------------------------------------ groups
#: Works whose group closed before MPI finished them: their arrays must outlive MPI.
_ORPHANS: list = []


class MpiBackend(Backend):
    """A Backend over an MPI communicator.

    Four ranks, ``mpiexec -n 4 python script.py``::

        pg = collectives.init_process_group()          # backend "mpi" under mpiexec
        t = np.full(4, pg.rank + 1.0, np.float32)
        pg.all_reduce(t)                               # [10, 10, 10, 10] on every rank
        work = pg.all_gather(out, t, async_op=True)    # MPI_Iallgather underneath
        work.wait()
        pair = pg.new_group([0, 1] if pg.rank < 2 else [2, 3])   # MPI_Comm_create_group
        pg.close()

    MPI's errors and the diagnosis of timeouts are its :class:`Diagnostics`'s
    (:mod:`backends.mpi.diagnostics`).
    """

    name = "mpi"
    # Every collective method starts MPI's non-blocking call (MPI_I...) and returns its
    # Work; persistent rounds are MPI-4's persistent collectives.
    capabilities = Capabilities(returns_work=True, persistent=True, translates_errors=True)

    def regroup_refusal(self) -> str:
        return REGROUP_REFUSAL

    def __init__(self, comm: Any, *, timeout: float, where: str) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size(), timeout)
        self.comm = comm
        #: Collectives entered so far (what a peer diagnosing its timeout asks for).
        self.entered = 0
        #: Set by abort(): every wait ends at its next poll.
        self.aborted = False
        self.inflight = InFlight()
        # The auxiliary communicator: the library's internal send/recv tags, the timeout
        # diagnostics and new_group's handshake (two MPI context ids per group in all).
        aux, request = comm.Idup()
        if not _poll(request.Test, timeout):
            raise CollectiveTimeout(f"{where}: not every rank arrived within {timeout:g} s",
                                    op="init")
        self.aux = aux
        tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self.tag_ub = int(tag_ub) if tag_ub is not None else 32767
        #: Internal tags fold into [0, 2**bits), below the reserved tags at the top.
        self._tag_bits = (self.tag_ub + 1 - RESERVED_TAGS).bit_length() - 1
        self.diagnostics = Diagnostics(self)
        self.persistent_requests: list = []
        close_at_exit(self)

    # --------------------------------------------------------------------- plumbing
    def _closed_error(self, op: str) -> CollectiveError:
        how = "aborted" if self.aborted else "closed"
        return CollectiveError(f"{self.where(op)}: the group is {how}")

    def _issue(self, request: Any, op: str, seq: int,
               then: Optional[Callable[[], None]] = None, keep: Any = None) -> MpiWork:
        """The Work of a collective method: MPI's ``request``, what to do once it
        completed (AVG's division), and the arrays MPI uses until then."""
        self.entered = seq + 1
        work = MpiWork(self, op, seq, [request], then, (), keep)
        self.inflight.add(work)
        return work

    def keep_alive(self, work: MpiWork) -> None:
        """A wait timed out: MPI may still use the work's arrays, keep them referenced."""
        work._timed_out = True
        self.inflight.add(work)

    def translate(self, exc: BaseException, op: str, seq: int,
                  peer: int = -1) -> BaseException:
        return self.diagnostics.translate(exc, op, seq, peer)

    def paths(self) -> PathTable:
        """None of ours: every collective is MPI's own, which picks its algorithms."""
        return PathTable({}, notes=["every collective is MPI's own non-blocking call "
                                    "(MPI_Iallreduce, ...): the MPI library picks"])

    def describe(self) -> list[str]:
        return [f"MPI: {MPI.Get_library_version().splitlines()[0].strip()}"]

    # -------------------------------------------------------------- point to point
    def _route(self, tag: int, op: str) -> tuple[Any, int]:
        """(communicator, MPI tag) for a tag of this library (see the module docstring)."""
        comm = self.comm
        if comm is None or self.aborted:
            raise self._closed_error(op)
        if tag < MAX_USER_TAG:
            if tag > self.tag_ub:
                raise ValueError(f"{self.where(op)}: argument `tag`={tag} is above MPI's "
                                 f"largest tag MPI.TAG_UB={self.tag_ub} of this MPI "
                                 f"library; the mpi backend passes user tags to MPI "
                                 f"unchanged, so use tags in [0, {self.tag_ub}]")
            return comm, tag
        return self.aux, fold_tag(tag, self._tag_bits)

    def isend(self, array: np.ndarray, dst: int, tag: int) -> Work:
        comm, mtag = self._route(tag, "isend")
        try:
            request = comm.Isend(byte_buffer(array), dst, mtag)
        except MPI.Exception as exc:
            raise self.translate(exc, "isend", -1, dst) from exc
        work = MpiWork(self, f"isend(dst={dst}, tag={tag})", -1, [request], keep=array, peer=dst)
        self.inflight.add(work)
        return work

    def irecv(self, array: np.ndarray, src: int, tag: int) -> Work:
        comm, mtag = self._route(tag, "irecv")
        try:
            request = comm.Irecv(byte_buffer(array), src, mtag)
        except MPI.Exception as exc:
            raise self.translate(exc, "irecv", -1, src) from exc
        work = MpiWork(self, f"irecv(src={src}, tag={tag})", -1, [request], keep=array, peer=src)
        self.inflight.add(work)
        return work

    def _comm(self, op: str) -> Any:
        comm = self.comm
        if comm is None or self.aborted:
            raise self._closed_error(op)
        return comm

    def barrier(self, seq: int) -> MpiWork:
        return self._issue(self._comm("barrier").Ibarrier(), "barrier", seq)

    # ----------------------------------------------------------------- collectives
    def _avg(self, a: np.ndarray, op: ReduceOp) -> Optional[Callable[[], None]]:
        if op is not ReduceOp.AVG or self.size == 1:
            return None
        size = self.size
        return lambda: finish(op, a, size)

    def broadcast(self, a: np.ndarray, root: int, seq: int) -> MpiWork:
        return self._issue(self._comm("broadcast").Ibcast(byte_buffer(a), root=root),
                           "broadcast", seq, keep=a)

    def all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> MpiWork:
        buf, mop = reduction(a, op)
        request = self._comm("all_reduce").Iallreduce(MPI.IN_PLACE, buf, mop)
        return self._issue(request, "all_reduce", seq,
                           self._avg(a, op) if op is ReduceOp.AVG else None, keep=a)

    def reduce(self, a: np.ndarray, root: int, op: ReduceOp, seq: int) -> MpiWork:
        buf, mop = reduction(a, op)
        comm = self._comm("reduce")
        if self.rank == root:
            request = comm.Ireduce(MPI.IN_PLACE, buf, mop, root=root)
            return self._issue(request, "reduce", seq, self._avg(a, op), keep=a)
        # MPI only reads a non-root's send buffer: the tensor stays unchanged
        return self._issue(comm.Ireduce(buf, None, mop, root=root), "reduce", seq, keep=a)

    def all_gather(self, out: np.ndarray, inp: np.ndarray, seq: int) -> MpiWork:
        request = self._comm("all_gather").Iallgather(byte_buffer(inp), byte_buffer(out))
        return self._issue(request, "all_gather", seq, keep=(out, inp))

    def gather(self, inp: np.ndarray, out: Optional[np.ndarray], root: int,
               seq: int) -> MpiWork:
        recv = byte_buffer(out) if self.rank == root else None
        request = self._comm("gather").Igather(byte_buffer(inp), recv, root=root)
        return self._issue(request, "gather", seq, keep=(out, inp))

    def scatter(self, out: np.ndarray, inp: Optional[np.ndarray], root: int,
                seq: int) -> MpiWork:
        send = byte_buffer(inp) if self.rank == root else None
        request = self._comm("scatter").Iscatter(send, byte_buffer(out), root=root)
        return self._issue(request, "scatter", seq, keep=(out, inp))

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, op: ReduceOp,
                       seq: int) -> MpiWork:
        send, mop = reduction(inp, op)
        recv, _ = reduction(out, op)
        request = self._comm("reduce_scatter").Ireduce_scatter_block(send, recv, mop)
        return self._issue(request, "reduce_scatter", seq, self._avg(out, op),
                           keep=(out, inp))

    def all_to_all(self, out: np.ndarray, inp: np.ndarray, out_counts: Sequence[int],
                   in_counts: Sequence[int], seq: int) -> MpiWork:
        # Always Ialltoallv, never Ialltoall for counts that happen to be equal: a rank
        # sees only its own counts, and MPI requires every rank to call the same
        # collective. A rank whose split sizes were all 0 called Ialltoall while the others
        # called Ialltoallv; MPICH completed that call and then hung in the next
        # collective (found by the 4-rank soak).
        k = out.dtype.itemsize
        o, i = out.reshape(-1).view(np.uint8), inp.reshape(-1).view(np.uint8)
        send_counts = [c * k for c in in_counts]
        recv_counts = [c * k for c in out_counts]
        request = self._comm("all_to_all").Ialltoallv(
            [i, (send_counts, _displacements(send_counts)), MPI.BYTE],
            [o, (recv_counts, _displacements(recv_counts)), MPI.BYTE])
        return self._issue(request, "all_to_all", seq, keep=(out, inp))

    def persistent(self, op: str, arrays: Sequence[np.ndarray],
                   reduce_op: Optional[ReduceOp]) -> Optional[Callable[[int], Any]]:
        """MPI-4's persistent collectives (see :mod:`backends.mpi.persistent`)."""
        return persistent_call(self, op, arrays, reduce_op)

    # ----------------------------------------------------------------- sub-groups
    def new_group(self, ranks: tuple[int, ...], instance: int) -> "MpiBackend":
        where = f"{self.where('new_group')}({list(ranks)})"
        comm = self._comm("new_group")
        key = zlib.crc32(repr((ranks, instance)).encode()) & 0x7FFFFFFF
        self._wait_for_members(ranks, key, where)
        group = comm.Get_group()
        members = group.Incl(list(ranks))
        try:
            # On the auxiliary communicator: never busy with the user's collectives.
            sub = self.aux.Create_group(members, key % (self.tag_ub + 1))
        except MPI.Exception as exc:
            raise self.translate(exc, "new_group", -1) from exc
        finally:
            members.Free()
            group.Free()
        return MpiBackend(sub, timeout=self.timeout, where=where)

    def _wait_for_members(self, ranks: tuple[int, ...], key: int, where: str) -> None:
        """Return once every member of ``ranks`` called new_group for them (the lowest
        member gathers a token from each and releases them), or raise CollectiveTimeout
        naming those that did not come: ``Comm.Create_group`` itself cannot time out."""
        if len(ranks) == 1:
            return
        leader, diag = ranks[0], self.aux
        tags = self.diagnostics.tags
        arrive, release_tag = tags[ARRIVE], tags[RELEASE]
        token = np.array([key], np.int64)
        if self.rank == leader:
            others = list(ranks[1:])
            got = {r: np.empty(1, np.int64) for r in others}
            recvs = [diag.Irecv([got[r], MPI.INT64_T], r, arrive) for r in others]
            if not _poll(lambda: MPI.Request.Testall(recvs) or self.aborted, self.timeout) \
                    or self.aborted:
                missing = [r for r, q in zip(others, recvs) if not q.Test()]
                for q in recvs:
                    if q != MPI.REQUEST_NULL:
                        q.Cancel()
                if self.aborted:
                    raise self._closed_error("new_group")
                raise CollectiveTimeout(f"{where}: ranks {missing} did not call new_group "
                                        f"within {self.timeout:g} s", op="new_group",
                                        missing=missing)
            wrong = [r for r in others if int(got[r][0]) != key]
            if wrong:
                raise CollectiveMismatch(f"{where}: ranks {wrong} called new_group with other "
                                         f"members (or in another order) than this rank")
            sends = [diag.Isend([token, MPI.INT64_T], r, release_tag) for r in others]
            _poll(lambda: MPI.Request.Testall(sends) or self.aborted, self.timeout)
        else:
            release = np.empty(1, np.int64)
            reqs = [diag.Isend([token, MPI.INT64_T], leader, arrive),
                    diag.Irecv([release, MPI.INT64_T], leader, release_tag)]
            if not _poll(lambda: MPI.Request.Testall(reqs) or self.aborted, self.timeout) \
                    or self.aborted:
                if self.aborted:
                    raise self._closed_error("new_group")
                raise CollectiveTimeout(f"{where}: the other members did not all call "
                                        f"new_group within {self.timeout:g} s (rank {leader} "
                                        f"gathers them)", op="new_group", missing=(leader,))

    # --------------------------------------------------------------------- lifetime
    def close(self) -> None:
        if self.comm is None:
            return
        forget_at_exit(self)
        deadline = time.monotonic() + self.timeout
        for w in self.inflight.snapshot():  # finish what is in flight (results land)
            try:  # collectives get the timeout; point to point and works that timed out
                left = max(deadline - time.monotonic(), 1e-3)  # already, a short grace
                w.wait(min(left, 0.2) if w._timed_out else min(left, 1.0) if w._peer >= 0
                       else left)
            except Exception:  # noqa: BLE001 - close() must not raise for old errors
                pass
        self._release(self.inflight.take_all())

    def abort(self) -> None:
        """Every wait ends at its next poll; nothing waits for a peer (see the module
        docstring: no ``MPI_Abort``, collectives in flight are kept, not cancelled)."""
        if self.aborted or self.comm is None:
            return
        self.aborted = True
        forget_at_exit(self)
        self._release(self.inflight.take_all())

    def _release(self, stuck: list) -> None:
        """Cancel the unmatched receives among ``stuck``, keep what MPI may still use to
        the end of the process, free the persistent requests and the communicators."""
        for w in stuck:
            for request in w._requests:
                try:  # an unmatched receive can be cancelled; collectives cannot
                    if request != MPI.REQUEST_NULL and w._op.startswith("irecv"):
                        request.Cancel()
                        polling.poll(request.Test, 1.0, lambda: None)  # it must complete
                except MPI.Exception:
                    pass
        _ORPHANS.extend(w for w in stuck if not w._finished)
        self.diagnostics.close()
        if not MPI.Is_finalized():
            free_requests(self)
        comms = [self.comm, self.aux]
        self.comm = self.aux = None
        for comm in comms:
            if comm is not None and comm != MPI.COMM_NULL and not MPI.Is_finalized():
                try:
                    comm.Free()
                except MPI.Exception:
                    pass


def _displacements(counts: Sequence[int]) -> list[int]:
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


# ----------------------------------------------------------------------------- factory
_log = logs.get_logger("backend.mpi")

#: Why the mpi backend cannot shrink, grow or join (collectives.regroup).
REGROUP_REFUSAL = (
    "the mpi backend cannot re-form a group (shrink, grow, join): after a process dies, "
    "standard MPI leaves its communicators unusable; re-forming one needs the ULFM fault "
    "tolerance extension (MPIX_Comm_revoke, MPIX_Comm_shrink), which this library does "
    "not use; use shm, zmq or gloo for elastic jobs")


def create(rendezvous: Rendezvous, timeout: float) -> MpiBackend:
    """The world group over ``MPI.COMM_WORLD`` (registry name ``mpi``)."""
    if rendezvous.generation:
        raise NotImplementedError(f"{_where(rendezvous.rank, rendezvous.world_size, 'join_group')}"
                                  f": {REGROUP_REFUSAL}")
    mpi = load_mpi()
    world = mpi.COMM_WORLD
    where = _where(rendezvous.rank, rendezvous.world_size, "init_process_group(backend='mpi')")
    if (world.Get_rank(), world.Get_size()) != (rendezvous.rank, rendezvous.world_size):
        raise RuntimeError(
            f"{where}: MPI says this is rank {world.Get_rank()} of {world.Get_size()}, but the "
            f"launcher's environment says rank {rendezvous.rank} of {rendezvous.world_size}; "
            f"start the ranks of the mpi backend with mpiexec/mpirun (each rank started "
            f"another way is an MPI world of one)")
    _log.debug("rank %d of %d: MPI initialised; waiting for every rank in "
               "MPI_Comm_idup(COMM_WORLD)", rendezvous.rank, rendezvous.world_size)
    dup = world.Idup()
    if not _poll(dup[1].Test, timeout):
        raise CollectiveTimeout(f"{where}: not every rank arrived within {timeout:g} s",
                                op="init")
    _unlink_mpich_init_segments()
    return MpiBackend(dup[0], timeout=timeout, where=where)


def _unlink_mpich_init_segments() -> None:
    """Unlink the ``/dev/shm/mpich_shm_*`` files this process has mapped.

    MPICH maps one such file per node in ``MPI_Init``, and means to unlink it once every
    local rank mapped it. MPICH 5.0.2 (the ``mpich`` wheel) leaves it behind now and then,
    after a clean ``MPI_Finalize`` too: 4 MiB per job, in 2 of 5 four-rank jobs here.
    Once the world's ``Idup`` completed on this rank, every rank is past ``MPI_Init``, so
    no rank opens the file by name any more; the mapping lives on without the name."""
    prefix = "/dev/shm/mpich_shm_"
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if prefix in line}
    except OSError:  # not Linux: nothing to do
        return
    for path in paths:
        if path.startswith(prefix) and not path.endswith(" (deleted)"):
            try:
                os.unlink(path)
            except OSError:  # another local rank was first, or not ours to remove
                pass
