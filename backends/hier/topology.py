"""Who shares a host with whom: the host identity of a process, and the layout of a world
(or sub-group) over its hosts.

What "one host" means here
    Two ranks belong to one host when shared memory can carry their messages: the same
    kernel (``/proc/sys/kernel/random/boot_id``), the same ``/dev/shm`` file system (its
    device number: a mount namespace with a tmpfs of its own is another host, as each
    "host" of the network-namespace rig is), the same user (segments are private to
    their owner), and the same host as people see it: the hostname (UTS namespace) and
    the network namespace, so that two network-namespace "hosts" on one kernel count as
    two, as their launcher and their users think of them. A hostname alone is not enough
    (containers of one machine may share it; two machines may share it when cloned), and
    ``LOCAL_WORLD_SIZE`` alone is not either (launchers that do not set it give the whole
    world).

    ``COLLECTIVES_HOST`` overrides this, for tests and for users who want several "hosts"
    on one machine without root: a single name is this process's host; a comma-separated
    list gives the host of each rank by world rank (``h0,h0,h1,h1``: ranks 0 and 1 on
    ``h0``, 2 and 3 on ``h1``; extra entries are ignored, so one list serves every world
    size up to its length). The shm part of each virtual host then meets in segments named
    after that host, apart from the others'.

Layout
    :class:`Topology` lists the ranks of each host (hosts ordered by their lowest rank,
    ranks within a host in rank order) and derives what the algorithms need: this rank's
    host and local index, the *columns* (the ranks with local index ``i`` on every host,
    in rank order: the groups that carry the traffic between hosts) and whether the hosts
    are even (every host the same number of ranks).

Two ranks, one per virtual host (``COLLECTIVES_HOST=a,b``)::

    topo = Topology.from_keys(["a", "b"], rank=1)
    topo.hosts, topo.host_index, topo.column(0)       # ((0,), (1,)), 1, (0, 1)
"""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Optional, Sequence

import numpy as np

from collectives import settings
from collectives.hosts import device, machine_identity

__all__ = ["Topology", "host_key"]


def host_key(env: Optional[Mapping[str, str]] = None) -> str:
    """This process's host, as a string equal exactly for processes that share one (see
    the module docstring): the single name of ``COLLECTIVES_HOST`` when it holds one, else
    a digest of hostname, boot id, ``/dev/shm``'s device, network namespace and user.

    >>> host_key({"COLLECTIVES_HOST": "node7"})
    'node7'
    """
    named = settings.HOST.get(env)
    if named is not None and "," not in named:
        return named.strip()
    parts = [*machine_identity(), device("/dev/shm")]
    return socket.gethostname() + "#" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Topology:
    """The ranks of each host, and this rank's place among them (see the module
    docstring). ``hosts[h]`` are the ranks of host ``h``; ``names[h]`` its name."""

    hosts: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]
    rank: int

    @classmethod
    def from_keys(cls, keys: Sequence[str], rank: int) -> "Topology":
        """The layout of ranks whose host keys are ``keys`` (one per rank, in rank order)."""
        order: dict[str, list[int]] = {}
        for r, key in enumerate(keys):
            order.setdefault(key, []).append(r)
        return cls(tuple(tuple(rs) for rs in order.values()), tuple(order), rank)

    def restrict(self, ranks: Sequence[int]) -> "Topology":
        """The layout of the sub-group of ``ranks`` (sorted ranks of this layout, this rank
        among them), renumbered as the sub-group numbers them."""
        keys = [self.names[self.host_of(r)] for r in ranks]
        return Topology.from_keys(keys, list(ranks).index(self.rank))

    @cached_property
    def size(self) -> int:
        return sum(len(h) for h in self.hosts)

    @cached_property
    def _where(self) -> dict[int, tuple[int, int]]:
        return {r: (h, i) for h, ranks in enumerate(self.hosts) for i, r in enumerate(ranks)}

    def host_of(self, rank: int) -> int:
        """The index of ``rank``'s host."""
        return self._where[rank][0]

    def local_of(self, rank: int) -> int:
        """``rank``'s index among the ranks of its host."""
        return self._where[rank][1]

    @cached_property
    def host_index(self) -> int:
        return self.host_of(self.rank)

    @cached_property
    def local_index(self) -> int:
        return self.local_of(self.rank)

    @cached_property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks of this rank's host."""
        return self.hosts[self.host_index]

    @cached_property
    def even(self) -> bool:
        """Whether every host has the same number of ranks."""
        return len({len(h) for h in self.hosts}) == 1

    @cached_property
    def splittable(self) -> bool:
        """Whether a message can be split among a host's ranks (even hosts of more than
        one rank: every local index has a column)."""
        return self.even and len(self.local_ranks) > 1

    @property
    def two_hosts(self) -> bool:
        """Exactly two hosts: a split all_reduce streams each shard to the other host
        (with more, each piece is a column all_reduce)."""
        return len(self.hosts) == 2

    def column(self, i: int) -> tuple[int, ...]:
        """The ranks with local index ``i``, one per host that has one, in rank order."""
        return self._columns[i]

    @cached_property
    def _columns(self) -> tuple[tuple[int, ...], ...]:
        widest = max(len(h) for h in self.hosts)
        return tuple(tuple(sorted(h[i] for h in self.hosts if len(h) > i))
                     for i in range(widest))

    @cached_property
    def column_major(self) -> np.ndarray:
        """The ranks in the order the two-level all_gather delivers them: local index 0
        of every host (in its column's order), then local index 1, ... (even hosts)."""
        return np.array([r for i in range(len(self.local_ranks)) for r in self.column(i)])

    def describe(self) -> str:
        """``2 hosts: h0 [0, 1], h1 [2, 3]``."""
        shown = ", ".join(f"{name.split('#')[0]} {list(ranks)}"
                          for name, ranks in zip(self.names, self.hosts))
        return f"{len(self.hosts)} host{'s' if len(self.hosts) != 1 else ''}: {shown}"
