"""The ``collectives`` backend: this library's ProcessGroup driven through torch.distributed's
``"collectives"`` backend, exactly as ``gloo`` is this library's ProcessGroup driven
through torch's gloo.

Why it exists: torch's own wrappers (DDP, FSDP2, pipelining) reach our transports through
:class:`collectives.torch_backend.ProcessGroupCollectives` (its thread per group, its
``Work`` and futures, its error translation). With this backend the examples, the
conformance suite and the multi-host runs go through that same object
(``python examples/ddp.py --backend collectives``), so it is tested like every transport.

The layers, for one ``all_reduce``::

    ProcessGroup "world"          (this library's, what the examples hold)
      CollectivesBackend          (TorchBackend: c10d calls, torch Works, ordering)
        ProcessGroupCollectives   (a torch.distributed.ProcessGroup written in Python)
          ProcessGroup            (this library's again, over the transport underneath)

:class:`CollectivesBackend` is :class:`~backends.torchdist.backend.TorchBackend` with
``ProcessGroupGloo`` replaced: the world meets through the same store (rank 0's TCPStore,
or torchrun's), and :func:`collectives.torch_backend.rendezvous.build_group` builds the
c10d group from it, as ``dist.init_process_group("collectives")`` does.

The transport underneath is the torch bridge's (``transport_of``): ``COLLECTIVES_BACKEND``,
else ``shm``; ``shm`` becomes ``hier`` when the ranks span several hosts. Launchers export
the chosen backend as ``COLLECTIVES_BACKEND``, so there it reads ``collectives``, which
means the default (never a bridge inside a bridge).

Sub-groups are the group underneath's own ``new_group`` (an MPI communicator on mpi, a
segment of its own on shm), run in order with its queued collectives, as ``dist.new_group``
does. Errors: the group underneath says what happened (the dead rank, the ranks that never
arrived, a mismatch); torch's side wraps that in a ``CollectivesBackendError``, and
:class:`BridgeFailures` hands the caller the same error again (its type and attributes),
named for the call on this group, with the one underneath as ``__cause__``. ``abort()``
aborts the group underneath, so pending calls end at once.
"""

from __future__ import annotations

import copy
from typing import Any

from collectives.errors import CollectiveError
from collectives.launch import Rendezvous
from collectives.paths import PathTable
from collectives.torch_backend import CollectivesBackendError, ProcessGroupCollectives
from collectives.torch_backend.rendezvous import build_group, transport_of

from .backend import TorchBackend
from .failures import Failures

__all__ = ["BridgeFailures", "CollectivesBackend", "create_collectives"]

#: The registry name (the same as torch's name for the backend underneath).
NAME = "collectives"
_WHERE = f"init_process_group(backend={NAME!r})"


class BridgeFailures(Failures):
    """Failures of a :class:`CollectivesBackend`: the group underneath already diagnosed
    them (and bounds every wait by its own timeout), so its error is restated for this
    group's call instead of guessed again from torch's text. The members on one host
    exchange their process ids as on gloo, so that ``close()`` after a member died does
    not wait for its report at the store."""

    knows_pids = True

    def translate(self, exc: BaseException, op: str, seq: int, peer: int = -1) -> BaseException:
        inner = exc.error if isinstance(exc, CollectivesBackendError) else exc
        if isinstance(inner, CollectiveError):
            return restate(inner, self._backend.describe_call(op, seq), op, seq)
        return super().translate(exc, op, seq, peer)


def restate(error: CollectiveError, where: str, op: str, seq: int) -> CollectiveError:
    """``error`` (raised by the group underneath) as the error of the call ``where`` on
    this group: the same type and attributes (``peer``, ``missing``, ``reason``), this
    call's ``op`` and ``seq``, and ``error`` as its ``__cause__``.

    >>> from collectives.errors import PeerError
    >>> e = restate(PeerError("[rank 0/2] all_reduce (seq 4): rank 1 died", peer=1),
    ...             "[rank 0/2] reduce_scatter (seq 4)", "reduce_scatter", 4)
    >>> type(e).__name__, e.peer, type(e.__cause__).__name__
    ('PeerError', 1, 'PeerError')
    >>> print(e)
    [rank 0/2] reduce_scatter (seq 4): [rank 0/2] all_reduce (seq 4): rank 1 died
    """
    try:
        again = copy.copy(error)   # (its attributes and notes; not its traceback or cause)
    except Exception:  # noqa: BLE001 - a subclass that cannot be rebuilt: say it as it is
        return error
    text = str(error)
    again.args = (text if text.startswith(where) else f"{where}: {text}",)
    for attr, value in (("op", op), ("seq", seq)):
        if hasattr(again, attr):
            setattr(again, attr, value)
    again.__cause__ = error
    return again


class CollectivesBackend(TorchBackend):
    """A Backend over :class:`~collectives.torch_backend.ProcessGroupCollectives` (registry
    name ``collectives``); see the module docstring.

    Two ranks, from ``collectives.spawn(main, 2, backend="collectives")`` or
    ``torchrun --nproc-per-node 2 script.py``::

        pg = collectives.init_process_group("collectives")
        t = torch.ones(4) * (pg.rank + 1)
        pg.all_reduce(t)           # tensor([3., 3., 3., 3.]): shm's, through torch's c10d
        pg.transport.c10d.transport   # 'shm' (the transport underneath)
        pg.close()
    """

    name = NAME
    failures_class = BridgeFailures
    #: The group underneath reduce-scatters natively, and its Work can be watched
    #: (gloo's reason for False does not apply).
    native_reduce_scatter = True
    #: No C++ thread of torch's can be stuck on a dead peer here: the group underneath
    #: bounds its own waits, and its close (or abort) ends its threads. Left open, it
    #: would abort the process at exit ("terminate called without an active exception").
    keeps_broken_c10d = False

    @property
    def c10d(self) -> Any:
        """The :class:`ProcessGroupCollectives` this backend drives (None once closed)."""
        return self._pg

    @classmethod
    def _make_c10d(cls, store: Any, rank: int, size: int, timeout: float) -> Any:
        # No barrier after it, unlike gloo's: our transports return connected groups.
        return build_group(store, rank, size, timeout, transport_of(None, where=_WHERE),
                           where=_WHERE, name="world.transport")

    def _make_sub_c10d(self, store: Any, ranks: tuple[int, ...], **extra: Any) -> Any:
        """The sub-group ``ranks`` of the group underneath (its own ``new_group``, in
        order with its queued collectives), not a new world met through ``store``."""
        parent: ProcessGroupCollectives = self._c10d("new_group")
        try:
            sub = parent.run_on_group_thread(lambda: parent.group.new_group(ranks))
        except CollectivesBackendError as exc:
            raise exc.error from exc   # (ours: construct() passes it on as it is)
        return ProcessGroupCollectives(sub, parent.transport)

    def paths(self) -> PathTable:
        """Those of the group underneath (every collective runs there, on the same
        bytes), so the conformance suite crosses its size lines through this backend."""
        pg = self._pg
        if pg is None:
            return super().paths()
        under = pg.group.transport.paths()
        return PathTable(under.paths, under.lines, notes=[
            f"every collective runs on this library's {pg.transport} group through "
            f"torch.distributed's 'collectives' backend (collectives.torch_backend)",
            *under.notes])


def create_collectives(rendezvous: Rendezvous, timeout: float) -> CollectivesBackend:
    """The world group over torch's ``"collectives"`` backend (registry name
    ``collectives``)."""
    return CollectivesBackend._connect(rendezvous, timeout)
