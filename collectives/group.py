"""The abstract ProcessGroup: the one interface every strategy in ``parallel/`` is written
against and every transport in ``backends/`` implements.

A backend implements point to point (``_isend``, ``_irecv``) and ``_barrier``; every
collective then works through the send/recv algorithms of ``collectives.algorithms``.
A backend overrides the ``_broadcast``/``_all_reduce``/... hooks it can do natively; what
a hook receives and returns is written once, in :mod:`collectives.hooks`.

The class is put together from one module per concern:

- :mod:`collectives.validation`: the argument checks (before any message moves, so a bad
  call leaves the group usable);
- :mod:`collectives.running`: numbering, running inline or on the group's thread, the
  debug call check and the flight record;
- :mod:`collectives.point_to_point`, :mod:`collectives.collective_calls`,
  :mod:`collectives.objects`: the public calls;
- :mod:`collectives.fast_path`: blocking calls on contiguous CPU memory in ~1 us;
- :mod:`collectives.persistent`: ``all_reduce_init`` and the other persistent requests;
- :mod:`collectives.symmetric`: ``alloc_symmetric``, buffers the peers may read;
- this module: state, the hooks with their defaults, sub-groups and lifetime.
"""

from __future__ import annotations

import abc
import concurrent.futures
import datetime
import threading
from typing import Any, Optional, Sequence

import numpy as np

from . import algorithms, call_check, flight
from .buffers import HostBuffer, to_host
from .collective_calls import CollectiveCalls
from .fast_path import FastPath, HostViews
from .objects import ObjectCalls
from .persistent import PersistentCalls
from .point_to_point import PointToPointCalls
from .reduce_op import ReduceOp
from .running import CallRunner, _CommitOnWait, _RecordedWork  # noqa: F401 - re-exported
from .symmetric import SymmetricCalls
from .thresholds import SizeThreshold
from .validation import MAX_USER_TAG, ArgumentChecks
from .work import Work

__all__ = ["MAX_USER_TAG", "ProcessGroup", "timeout_seconds"]


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


class ProcessGroup(PointToPointCalls, CollectiveCalls, PersistentCalls, SymmetricCalls,
                   ObjectCalls, CallRunner, FastPath, ArgumentChecks, abc.ABC):
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
        self._inflight: dict = {}  # Works started and not yet waited for (_track)
        self._inflight_lock = threading.Lock()
        # COLLECTIVES_DEBUG=1: every collective first checks that all ranks make the same
        # call (collectives.call_check); the flight recorder keeps the last calls for
        # `python -m collectives.doctor` (collectives.flight).
        self._debug = call_check.debug_enabled()
        capacity = flight.capacity_from_env()
        self._recorder: Optional[flight.Recorder] = flight.Recorder(capacity) if capacity else None
        self._flight_name = "world"
        # The fast path (collectives.fast_path) for blocking calls on contiguous CPU
        # memory: not where the debug check must run, nor for a backend whose hooks
        # return Works or take something else than host arrays.
        self._host_views = HostViews()
        self._fast = (not self._debug and not self.hooks_return_work
                      and type(self)._to_host is ProcessGroup._to_host)

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

    def _send_now(self, array: np.ndarray, dst: int, tag: int) -> None:
        """A blocking send of the fast path (``pg.send`` of contiguous CPU memory): return
        once ``array`` may be reused. A backend with a cheaper blocking send overrides it."""
        self._isend(array, dst, tag).wait()

    def _recv_now(self, array: np.ndarray, src: int, tag: int) -> None:
        """A blocking receive of the fast path: return once ``array`` holds the message."""
        self._irecv(array, src, tag).wait()

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
