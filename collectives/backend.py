"""``Backend``: the one contract between a :class:`~collectives.ProcessGroup` and a
transport. This docstring is the only place it is written; every backend of the library
(shm, zmq, mpi, gloo, nccl, the thread world of the testing kit) and every third-party one
keeps it.

The split of work
    The group (``collectives.group``) checks every argument, stages tensors into the
    memory the backend takes, numbers each collective (``seq``, the same on every rank),
    runs it inline or on its thread (``async_op=True``), keeps the flight record and the
    debug check, and takes the fast path for blocking calls on contiguous host memory.
    The backend moves bytes: it is handed checked, flat buffers and a sequence number.
    A backend never sees a ``ProcessGroup``; a third-party transport subclasses
    ``Backend``, registers a factory ``factory(rendezvous, timeout) -> Backend``
    (:func:`collectives.register_backend`), and ``collectives.init_process_group`` wraps
    what the factory returns in a ``ProcessGroup``.

Required
    ``isend(array, dst, tag) -> Work`` and ``irecv(array, src, tag) -> Work`` start a send
    or a receive of one array to or from group rank ``dst``/``src`` (never this rank) and
    return a :class:`~collectives.work.Work`. ``array`` is a flat, C-contiguous numpy
    array of a supported dtype (writable for a receive). ``Work.wait(timeout=None)`` blocks
    until the array may be reused (send) or holds the message (receive), at most the
    backend's ``timeout`` when ``timeout`` is None, and raises on failure. Messages
    between one pair with one tag arrive in order; a send completes even if the receive
    is posted later. Tags are ints in ``[0, 2**63)``: user tags below ``2**31``, the
    library's own above (:mod:`collectives.algorithms.links`). Both may be called from
    several threads of one rank at once (the user's and the group's async thread).

    ``close()`` releases everything (sockets, shared memory, threads, communicators)
    once the calls in flight finished; idempotent.

    ``abort()`` ends everything now: from any thread, every wait inside the backend
    (in every thread) ends within a second by raising (any exception: the group reports
    :class:`~collectives.errors.GroupAborted` naming the op and rank), every later call
    raises, nothing blocks on a peer (a dead or stopped one included: abort never waits
    for a peer), the process lives on, and the backend's resources are released (at
    once, or by the thread that leaves its last wait). Peers see this rank as gone:
    their calls over it fail with ``PeerError`` (or time out). Idempotent; ``close()``
    after it does nothing more.

Optional collectives (the defaults run :mod:`collectives.algorithms` over ``isend`` and
``irecv``: a backend with only the required methods is complete and correct)
    One uniform signature: the flat buffers (outputs written in place), then the root or
    the reduction where the op has one, then ``seq``::

        barrier(seq)                          broadcast(a, root, seq)
        all_reduce(a, op, seq)                reduce(a, root, op, seq)
        all_gather(out, inp, seq)             gather(inp, out, root, seq)    # out None off root
        reduce_scatter(out, inp, op, seq)     scatter(out, inp, root, seq)   # inp None off root
        all_to_all(out, inp, out_counts, in_counts, seq)   # elements per peer

    What they receive: one flat (1-D), C-contiguous buffer per tensor argument, of the
    kind the backend declares (``Capabilities.memory``: host numpy arrays, ``bfloat16``
    as ``ml_dtypes.bfloat16``, by default; a 0-d tensor arrives as one element), already
    checked on this rank (ranks in range, dtypes equal, sizes consistent, the reduction
    valid for the dtype). Whether the *other* ranks made the same call is checked only
    with ``COLLECTIVES_DEBUG=1`` or by the backend itself. ``seq`` names the call in
    errors (``self.describe_call(op, seq)``) and keeps concurrent calls apart (the
    defaults' tags come from it).

    Reductions combine through :func:`collectives.reduce_op.combine_into` and
    :func:`~collectives.reduce_op.finish` (AVG divides once, at the end), in an order
    that is the same on every rank: ``all_reduce`` leaves bitwise-identical values on
    every rank.

    What they return: ``None`` once the operation is complete on this rank (they may
    block; every wait bounded by ``self.timeout``). They run on the calling thread or on
    the group's one async thread (so every rank's operations keep their issue order);
    they must not assume which. A backend that declares ``Capabilities.returns_work``
    (MPI's and torch's non-blocking calls) instead *starts* the operation and returns its
    ``Work`` (``None`` when it is already done); the group then calls it on the calling
    thread also for ``async_op=True`` and waits on the Work or hands it out.

    Failures are typed: :class:`~collectives.errors.CollectiveTimeout` for a wait that
    ran out, :class:`~collectives.errors.PeerError` for a peer that died or left,
    :class:`~collectives.errors.CollectiveMismatch` for calls that do not match; each names
    the op, ``seq`` and the rank.

Optional, everything else
    ``send_now(array, dst, tag)`` / ``recv_now(array, src, tag)``: a blocking send and
    receive (the defaults wait on ``isend``/``irecv``), used by the group's fast path for
    ``pg.send``/``pg.recv`` of contiguous host memory; same rules as the posted ones
    (order per (peer, tag), bounded waits, typed errors).

    ``new_group(ranks, instance) -> Backend | None``: a backend over ``ranks`` (sorted
    ranks of this backend, this rank among them); ``instance`` counts earlier groups over
    the same ranks, identically on every member. None (the default) makes the group run
    the sub-group as a view over this backend's point to point with its own tag space
    (:class:`collectives.subgroup.SubGroup`).

    ``paths() -> PathTable``: which path each op takes by size (see
    :mod:`collectives.paths`), chosen when the backend is made; ``pg.describe()`` prints
    it and the conformance suite crosses every threshold in it from both sides. The
    default is the send/recv algorithms' table.

    ``describe() -> list[str]``: lines about the transport's state for ``pg.describe()``
    (the compiled core in use, the wait policy, the endpoints).

    ``decode_object(data, src)``: unpickle the bytes of an object collective from ``src``
    (the default trusts the peers: ``pickle.loads``); a network backend refuses what an
    unauthenticated peer could have sent.

Capabilities (declared in ``capabilities``, one place, never found out by ``hasattr``)
    ``memory``: what the collective methods receive. ``"host"`` (the default): flat host
    numpy arrays, CPU tensors as zero-copy views, the rest (CUDA, non-contiguous,
    read-only inputs) staged and written back by the group. ``"tensors"`` or
    ``"device"``: the backend's own ``stage(obj, where, arg, write) -> HostBuffer``
    decides (torch's backends take tensors; NCCL device memory). The group's fast path
    runs only for ``"host"`` backends that do not return works.

    ``returns_work``: see above; with it, ``before_start(async_op)`` runs before each
    collective method starts an operation (torch orders operations that share memory).

    ``persistent``: ``persistent(op, arrays, reduce_op) -> call | None`` gives a native
    round for a persistent request (``all_reduce``: ``[a]``; ``all_gather``,
    ``reduce_scatter``: ``[out, inp]``), made once when the request is made on every rank
    (it may itself be collective): ``call(seq)`` runs one round as the collective
    method would. ``call.release()``, where it exists, frees it.

    ``symmetric_memory``: ``alloc_symmetric(nbytes, where, all_ranks) -> np.ndarray``
    makes buffers the peers may read (see :mod:`collectives.symmetric`); ``all_ranks(
    values) -> array`` is the group's all_gather of a few ints, for the votes. Without
    it the group hands out plain zero-filled memory.

    ``translates_errors``: ``translate(exc, op, seq, peer=-1) -> BaseException`` turns a
    transport library's exception raised by a method into this library's typed error.

    ``regroups``: the backend's registered factory connects a *re-formed* group: given a
    :class:`~collectives.launch.Rendezvous` whose ``generation`` is k > 0 (new rank, new
    size, and, for a network backend, the port of that generation), it meets only the
    processes of generation k, never those still in an older group of the same job. On
    it rest ``ProcessGroup.shrink`` (the survivors of a dead rank, without restarting
    them) and ``grow``/``collectives.join_group`` (survivors and fresh processes); see
    :mod:`collectives.regroup`. ``regroup_refusal()`` says why a backend without it
    cannot (MPI names ULFM).

A backend of two ranks, the smallest complete one (see ``tests/test_backend_contract.py``
for one that passes the whole conformance sweep)::

    class Mailboxes(Backend):
        name = "mailboxes"
        def isend(self, array, dst, tag):
            BOXES[self.rank, dst, tag].put(array.copy()); return CompletedWork()
        def irecv(self, array, src, tag):
            return QueueWork(BOXES[src, self.rank, tag], array, self.timeout)
        def close(self): pass
        def abort(self): ABORTED.set()
"""

from __future__ import annotations

import abc
import pickle
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence

import numpy as np

from . import algorithms
from .errors import where as _format_where
from .reduce_op import ReduceOp
from .work import Work

__all__ = ["Backend", "Capabilities"]


@dataclass(frozen=True)
class Capabilities:
    """What a backend does beyond the required methods (see :mod:`collectives.backend`).

    ``memory``: ``"host"``, ``"tensors"`` or ``"device"``; ``returns_work``,
    ``persistent``, ``symmetric_memory``, ``translates_errors``, ``regroups``: booleans.

    >>> Capabilities(persistent=True).memory
    'host'
    """

    memory: str = "host"
    returns_work: bool = False
    persistent: bool = False
    symmetric_memory: bool = False
    translates_errors: bool = False
    regroups: bool = False

    def __post_init__(self) -> None:
        if self.memory not in ("host", "tensors", "device"):
            raise ValueError(f"Capabilities: memory must be 'host', 'tensors' or 'device', "
                             f"got {self.memory!r}")


class Backend(abc.ABC):
    """A transport for one group of ranks (see the module docstring for the contract).

    A backend of one's own (``docs/writing-a-backend.md`` builds one that runs)::

        backend = MyBackend(rank, 2, timeout=60.0)      # what a factory returns
        pg = collectives.ProcessGroup(backend)          # init_process_group does this
        pg.all_reduce(t)                                # -> backend.all_reduce(flat, op, seq)
    """

    #: The registry name (``"shm"``); ``pg.backend`` reports it.
    name: ClassVar[str] = "abstract"
    #: What the backend does beyond the required methods.
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(self, rank: int, size: int, timeout: float) -> None:
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self._where_text: dict[str, str] = {}

    # ------------------------------------------------------------------ required
    @abc.abstractmethod
    def isend(self, array: np.ndarray, dst: int, tag: int) -> Work:
        """Start sending the flat, C-contiguous ``array`` to rank ``dst`` with ``tag``."""

    @abc.abstractmethod
    def irecv(self, array: np.ndarray, src: int, tag: int) -> Work:
        """Start receiving into the flat, C-contiguous ``array`` from ``src`` with ``tag``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the transport's resources once the calls in flight finished."""

    @abc.abstractmethod
    def abort(self) -> None:
        """End every wait now and release everything, without waiting for any peer."""

    # ------------------------------------------------------------------ naming
    def where(self, op: str) -> str:
        """``[rank r/n] op``: how errors name a call (kept per op)."""
        try:
            return self._where_text[op]
        except KeyError:
            text = self._where_text[op] = _format_where(self.rank, self.size, op)
            return text

    def describe_call(self, op: str, seq: int) -> str:
        """``[rank r/n] op (seq k)`` for a collective, ``[rank r/n] op`` for point to point
        (``seq`` -1)."""
        return f"{self.where(op)} (seq {seq})" if seq >= 0 else self.where(op)

    # ------------------------------------------------------------ point to point
    def send_now(self, array: np.ndarray, dst: int, tag: int) -> None:
        """A blocking send: return once ``array`` may be reused."""
        self.isend(array, dst, tag).wait()

    def recv_now(self, array: np.ndarray, src: int, tag: int) -> None:
        """A blocking receive: return once ``array`` holds the message."""
        self.irecv(array, src, tag).wait()

    # ------------------------------------------------------ collectives (defaults)
    def links(self, seq: int) -> "algorithms.Links":
        """Point to point inside collective ``seq`` (this call's tags)."""
        return algorithms.Links(self, seq)

    def barrier(self, seq: int) -> Optional[Work]:
        algorithms.barrier(self.links(seq))
        return None

    def broadcast(self, a: np.ndarray, root: int, seq: int) -> Optional[Work]:
        algorithms.broadcast(self.links(seq), a, root)
        return None

    def all_reduce(self, a: np.ndarray, op: ReduceOp, seq: int) -> Optional[Work]:
        algorithms.all_reduce(self.links(seq), a, op)
        return None

    def reduce(self, a: np.ndarray, root: int, op: ReduceOp, seq: int) -> Optional[Work]:
        algorithms.reduce(self.links(seq), a, root, op)
        return None

    def all_gather(self, out: np.ndarray, inp: np.ndarray, seq: int) -> Optional[Work]:
        algorithms.all_gather(self.links(seq), out, inp)
        return None

    def gather(self, inp: np.ndarray, out: Optional[np.ndarray], root: int,
               seq: int) -> Optional[Work]:
        algorithms.gather(self.links(seq), inp, out, root)
        return None

    def scatter(self, out: np.ndarray, inp: Optional[np.ndarray], root: int,
                seq: int) -> Optional[Work]:
        algorithms.scatter(self.links(seq), out, inp, root)
        return None

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray, op: ReduceOp,
                       seq: int) -> Optional[Work]:
        algorithms.reduce_scatter(self.links(seq), out, inp, op)
        return None

    def all_to_all(self, out: np.ndarray, inp: np.ndarray, out_counts: Sequence[int],
                   in_counts: Sequence[int], seq: int) -> Optional[Work]:
        algorithms.all_to_all(self.links(seq), out, inp, out_counts, in_counts)
        return None

    # ---------------------------------------------------------------- groups
    def new_group(self, ranks: tuple[int, ...], instance: int) -> Optional["Backend"]:
        """A backend of its own over ``ranks`` (see the module docstring), or None (the
        default): the group then runs the sub-group over this backend's point to point
        with its own tag space (:class:`collectives.subgroup.SubGroup`)."""
        return None

    # ------------------------------------------------------------ description
    def paths(self) -> "Any":
        """The table of paths by op and size (:class:`collectives.paths.PathTable`)."""
        return algorithms.dispatch.PATHS

    def describe(self) -> list[str]:
        """Lines about the transport's state for ``pg.describe()`` (none by default)."""
        return []

    # ---------------------------------------------------------------- objects
    def decode_object(self, data: np.ndarray, src: int) -> Any:
        """The object whose pickled bytes ``data`` came from rank ``src``."""
        return pickle.loads(data.tobytes())

    # ------------------------------------------------- capability-specific hooks
    def stage(self, obj: Any, *, where: str, arg: str, write: bool) -> Any:
        """(``memory`` other than ``"host"``) The buffer the collective methods receive
        for argument ``arg``, as a :class:`~collectives.buffers.HostBuffer`."""
        raise NotImplementedError(f"{type(self).__name__} declares memory="
                                  f"{self.capabilities.memory!r} but has no stage()")

    def before_start(self, async_op: bool) -> None:
        """(``returns_work``) Called before a collective method starts an operation."""

    def persistent(self, op: str, arrays: Sequence[Any],
                   reduce_op: Optional[ReduceOp]) -> Optional[Callable[[int], Any]]:
        """(``persistent``) A native round of persistent ``op``, or None."""
        return None

    def alloc_symmetric(self, nbytes: int, where: str,
                        all_ranks: Callable[[list], np.ndarray]) -> np.ndarray:
        """(``symmetric_memory``) A buffer the peers may read (see
        :mod:`collectives.symmetric`)."""
        raise NotImplementedError(f"{type(self).__name__} declares symmetric_memory but "
                                  f"has no alloc_symmetric()")

    def regroup_refusal(self) -> Optional[str]:
        """Why this backend cannot re-form a group (shrink, grow, join), or None when its
        ``capabilities.regroups`` says it can."""
        if self.capabilities.regroups:
            return None
        return (f"the {self.name} backend cannot re-form a group without restarting its "
                f"processes (its factory does not declare Capabilities.regroups)")

    def translate(self, exc: BaseException, op: str, seq: int,
                  peer: int = -1) -> BaseException:
        """(``translates_errors``) This library's typed error for ``exc``."""
        return exc

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} rank={self.rank}/{self.size}>"
