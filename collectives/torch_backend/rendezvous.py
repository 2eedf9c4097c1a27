"""Building our process group when torch asks the ``"collectives"`` backend for one.

torch hands a backend factory its rendezvous store (``TCPStore``, ``FileStore``, ... with
a prefix per group), the group rank and size and the timeout. From the store alone every
rank learns what our transports need to meet: a job id nobody else uses (rank 0 draws
it), which ranks share this host (each rank posts its host name) and, for zmq, a port
for its own rendezvous (torch's store already listens at ``MASTER_PORT``). The world
group is built that way (:func:`build_group`, which this library's own ``collectives``
backend, :mod:`backends.torchdist.bridge`, calls too); ``dist.new_group`` makes a
sub-group of it with our ``ProcessGroup.new_group`` (so mpi sub-groups are MPI
communicators, shm ones their own segments), run in order with the world's queued
collectives.

The transport (:func:`transport_of`): the options' ``transport``, else
``COLLECTIVES_BACKEND``, else ``shm``; ``shm`` becomes ``hier`` when the ranks span
several hosts, as in ``collectives.init_process_group``. A ``COLLECTIVES_BACKEND`` of
``collectives`` means this backend itself (``examples/ddp.py --backend collectives``
exports it to the ranks it spawns), so the transport underneath is then the default.
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Union

from .. import settings
from ..group import ProcessGroup
from ..validation import timeout_seconds
from ..launch import Rendezvous
from ..registry import P2P_ONLY_PREFIX, create_backend as _create_transport
from ..spawn import free_port
from ..world import across_hosts
from .adapter import BACKEND_NAME, ProcessGroupCollectives

__all__ = ["DEFAULT_TRANSPORT", "Options", "build_group", "create_backend", "transport_of"]

#: The transport when neither the options nor ``COLLECTIVES_BACKEND`` name one.
DEFAULT_TRANSPORT = "shm"

#: Transports that are torch.distributed themselves: use torch's own backend instead.
_TORCH_TRANSPORTS = ("gloo", "nccl", "torch")

_KEY = "collectives/"
_WHERE = "init_process_group(backend='collectives')"

# The live world group, which sub-groups are made from (torch has one world at a time),
# and the transport it was asked for (``shm`` where ``hier`` was built across hosts).
_world: "Optional[weakref.ref[ProcessGroupCollectives]]" = None
_world_asked: Optional[str] = None


@dataclass(frozen=True)
class Options:
    """The ``"collectives"`` backend's options: ``dist.init_process_group("collectives",
    pg_options=Options(transport="zmq"))`` (also for ``dist.new_group``).

    ``transport``: a registered name of ours (``shm``, ``zmq``, ``mpi``, ``p2p:shm``,
    ...); ``None`` reads ``COLLECTIVES_BACKEND``, then defaults to ``shm``.
    ``timeout``: seconds (or a ``timedelta``) our group's waits last before
    ``CollectiveTimeout``; ``None`` takes the init call's ``timeout`` (which also bounds
    torch's own rendezvous through the store).
    """

    transport: Optional[str] = None
    timeout: Union[float, datetime.timedelta, None] = None


def transport_of(options: Any, *, where: str = _WHERE) -> str:
    """The registry name of the transport underneath: ``options.transport`` (an
    :class:`Options`, or None), else ``COLLECTIVES_BACKEND``, else :data:`DEFAULT_TRANSPORT`.

    ``COLLECTIVES_BACKEND=collectives`` names this backend itself (a launcher exports
    the backend it was given), so it means the default here rather than a group inside a
    group inside ...; ``Options(transport="collectives")``, which can only be a slip, is
    a ``ValueError``, as are torch's own transports.

    >>> transport_of(Options(transport="zmq"))
    'zmq'
    """
    if options is not None and not isinstance(options, Options):
        raise TypeError(f"{where}: argument `pg_options` must be a "
                        f"collectives.torch_backend.Options, got {type(options).__name__}")
    name, source = (options.transport if options is not None else None), "Options.transport"
    if name is None or name == "":
        name, source = (settings.BACKEND.get() or "").strip(), settings.BACKEND.name
        if not name or name.removeprefix(P2P_ONLY_PREFIX) == BACKEND_NAME:
            name = DEFAULT_TRANSPORT
    if not isinstance(name, str):
        raise TypeError(f"{where}: Options.transport must be a string, got "
                        f"{type(name).__name__}")
    base = name.removeprefix(P2P_ONLY_PREFIX)
    if base in _TORCH_TRANSPORTS:
        raise ValueError(f"{where}: transport {name!r} (from {source}) is torch.distributed "
                         f"itself; use dist.init_process_group({base!r}) directly")
    if base == BACKEND_NAME:
        raise ValueError(f"{where}: Options.transport {name!r} names this backend itself; "
                         f"name the transport underneath it (shm, zmq, mpi, hier, ...)")
    return name


def _meet(store: Any, rank: int, size: int) -> Rendezvous:
    """Job id, host layout and a rendezvous port for our transport, through torch's store."""
    if rank == 0:
        launcher_job = settings.JOB_ID.get() or os.environ.get(
            "TORCHELASTIC_RUN_ID") or "torch"
        store.set(_KEY + "job", f"{launcher_job}-{secrets.token_hex(6)}")
    host = socket.gethostname()
    store.set(_KEY + f"host/{rank}", host)
    hosts = [host if r == rank else store.get(_KEY + f"host/{r}").decode()
             for r in range(size)]
    local = [r for r in range(size) if hosts[r] == host]
    one_host = len(local) == size
    if rank == 0:
        addr = "127.0.0.1" if one_host else (os.environ.get("MASTER_ADDR")
                                             or socket.getfqdn())
        store.set(_KEY + "master", f"{addr} {free_port('0.0.0.0' if not one_host else addr)}")
    addr, port = store.get(_KEY + "master").decode().split()
    return Rendezvous(
        rank=rank, world_size=size, local_rank=local.index(rank),
        local_world_size=len(local), master_addr=addr, master_port=int(port),
        job_id=store.get(_KEY + "job").decode(),
        # One host: what our transports treat as a local launcher's job (shm allowed,
        # zmq's per-job key file); several: an explicit rendezvous.
        launcher="torchrun" if one_host else "explicit")


def build_group(store: Any, rank: int, size: int, timeout: float, transport: str, *,
                where: str = _WHERE, name: str = "world") -> ProcessGroupCollectives:
    """A new world of ours over ``transport`` (a registry name, see :func:`transport_of`)
    for ``size`` ranks that meet through torch's ``store``, as a
    :class:`ProcessGroupCollectives`: the one way both torch's ``"collectives"`` backend
    (:func:`create_backend`) and this library's ``collectives`` backend
    (:mod:`backends.torchdist.bridge`) build it. ``shm`` across hosts becomes ``hier``.
    ``name``: our group's name (its flight records' file name).
    """
    rendezvous = _meet(store, rank, size)
    chosen = across_hosts(transport, rendezvous)
    made = _create_transport(chosen, rendezvous, timeout, where=where, what="the transport")
    return ProcessGroupCollectives(ProcessGroup(made, name=name), chosen)


def create_backend(options: Any, backend_options: Any) -> ProcessGroupCollectives:
    """torch's factory for the ``"collectives"`` backend (``extended_api=True``).

    ``options`` is torch's ``_DistributedBackendOptions`` (store, group_rank, group_size,
    timeout, global_ranks_in_group: empty for the world), ``backend_options`` the
    ``pg_options`` of the init call (an :class:`Options` or None).
    """
    global _world, _world_asked
    transport = transport_of(backend_options)
    seconds = timeout_seconds(getattr(backend_options, "timeout", None),
                              timeout_seconds(options.timeout, 0.0), where=_WHERE,
                              arg="Options.timeout")
    ranks = list(options.global_ranks_in_group)
    world = _world() if _world is not None else None
    if ranks and world is not None and _world_asked == transport:
        members = tuple(sorted(ranks))
        sub = world.run_on_group_thread(lambda: world.group.new_group(members))
        return ProcessGroupCollectives(sub, world.transport)
    adapter = build_group(options.store, options.group_rank, options.group_size, seconds,
                          transport)
    if not ranks:
        _world, _world_asked = weakref.ref(adapter), transport
        adapter._on_shutdown.append(_forget_world)
    return adapter


def _forget_world() -> None:
    """The world was shut down (``dist.destroy_process_group``): later groups are not
    made from it."""
    global _world
    _world = None
