"""The ``hier`` backend: shared memory among the ranks of a host, a network transport
between hosts; the two-level scheme of NCCL, MPI and Horovod. Registered as ``hier``
(``backends.hier:create``), and chosen by ``init_process_group`` instead of ``shm`` (asked
for, or the default) when the world spans several hosts.

Modules: ``topology`` (who shares a host: the host identity and the ``COLLECTIVES_HOST``
override, and the layout of ranks over hosts), ``backend`` (``HierBackend``: the two
groups composed, the direct routes of point to point, sub-groups, errors) and
``algorithms`` (the two-level collectives). See docs/hierarchical.md.

Start-up (:func:`create`): the network group over the whole world comes first (zmq, or
``COLLECTIVES_HIER_NET=mpi|gloo``), from the launcher's rendezvous as that backend alone
would; the ranks then exchange their host keys over it (one ``all_gather_object``), and
the ranks of each host open their shm group in a segment named after the host. Two
shortcuts skip the exchange: a ``COLLECTIVES_HOST`` list (every rank's host is known) and a
world the launcher puts on one host (``LOCAL_WORLD_SIZE`` equal to ``WORLD_SIZE``, no
``COLLECTIVES_HOST``): then no network group is made at all, and every call goes straight
to shm.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from collectives import logs, settings
from collectives.group import ProcessGroup
from collectives.hosts import listed_hosts
from collectives.launch import Rendezvous
from collectives.registry import create_backend, get_backend
from collectives.shm_names import job_digest

from .backend import HierBackend
from .topology import Topology, host_key

__all__ = ["HierBackend", "Topology", "create", "host_key"]

_log = logs.get_logger("hier")


def create(rendezvous: Rendezvous, timeout: float) -> HierBackend:
    """Connect this rank to its world: the network group between hosts (where there are
    several), then this host's shm group (see the module docstring)."""
    size, net_name = rendezvous.world_size, settings.HIER_NET.get()
    listed = listed_hosts(size)
    net: Optional[ProcessGroup] = None
    try:
        if listed is not None:
            keys = listed
            if len(set(keys)) > 1:
                net = _network(net_name, rendezvous, timeout)
        elif rendezvous.local_world_size == size and not settings.HOST.is_set():
            keys = [host_key()] * size
        else:
            net = _network(net_name, rendezvous, timeout)
            keys = net.all_gather_object(host_key())
        topo = Topology.from_keys(keys, rendezvous.rank)
        if net is not None and len(topo.hosts) == 1:
            net.close()   # (one host after all: shm only)
            net = None
        local = _host_group(topo, rendezvous, timeout)
        try:
            backend = HierBackend(topo, local, net, timeout, net_name)
        except BaseException:
            local.abort("the hier group could not be made")
            raise
    except BaseException:
        if net is not None:
            net.abort("the hier group could not be made")
        raise
    _log.debug("rank %d: %s; between hosts: %s", rendezvous.rank, topo.describe(),
               net_name if net is not None else "nothing")
    return backend


def _network(name: str, rendezvous: Rendezvous, timeout: float) -> ProcessGroup:
    return ProcessGroup(create_backend(name, rendezvous, timeout,
                                       where="init_process_group(backend='hier')",
                                       what=settings.HIER_NET.name), name="hier.net")


def _host_group(topo: Topology, rendezvous: Rendezvous, timeout: float) -> ProcessGroup:
    """This host's shm group, in a segment named after the host (so that virtual hosts
    on one machine stay apart)."""
    local_rank, local_size = topo.local_index, len(topo.local_ranks)
    here = dataclasses.replace(rendezvous, rank=local_rank, world_size=local_size,
                               local_rank=local_rank, local_world_size=local_size)
    digest = job_digest(topo.names[topo.host_index])
    made = get_backend("shm")(here, timeout, group=f"hier-{digest}")
    return ProcessGroup(made, name=f"hier.host{topo.host_index}")
