"""Re-forming a group: the survivors of a dead rank, or survivors joined by new processes,
meet again as a new group without restarting anyone.

Why a new rendezvous and not a repaired group: a transport's group holds per-peer state
(shm's segment with one slot bank per rank, zmq's authenticated connections, gloo's
pairs) sized and numbered for its members; renumbering in place would touch every part.
Meeting again under a new *generation* reuses the code that starts a world, which every
transport already tests, and keeps the old group's waits (now aborted) apart from the new
group's traffic:

- shm names the new segment after the generation (same job, so the launcher's clean-up
  still finds it);
- zmq and gloo meet at the generation's port (:func:`generation_port`: the world's
  ``MASTER_PORT`` plus the generation, unless the caller names one), where the new rank 0
  listens;
- MPI cannot: a communicator with a dead process is unusable without the ULFM extension
  (``MPI_Comm_shrink``), which the MPI builds we run on lack; ``regroup_refusal`` says so.

Who calls what (the generation must be the same on every member; the ranks are numbered
``0 .. size-1`` in the new group):

- ``pg.shrink(exclude)`` on every survivor: the members keep their order;
- ``pg.grow(world_size)`` on every survivor, ``collectives.join_group(rank=..., ...)`` on
  each new process (ranks ``pg.size .. world_size-1``);
- ``pg.reform(rank, size, generation)`` for any other membership (what
  :mod:`parallel.ft` does with the quorum the coordinator decided).

The group's methods of those names are thin: the checks, the abort and the new
rendezvous are :func:`shrink`, :func:`grow` and :func:`reform` here, and
:func:`connect` makes the new backend, which :func:`regrouped` wraps in a group.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional

from .backend import Backend
from .launch import Rendezvous
from .registry import create_backend


__all__ = ["connect", "generation_port", "generation_rendezvous", "grow", "reform",
           "regrouped", "shrink", "shrunk_ranks"]

# The `group` arguments and results below are ProcessGroups, typed Any: group.py imports
# this module, and the library keeps no import cycle, not even a type-only one.

_MAX_PORT = 65535


def generation_port(base_port: Optional[int], generation: int,
                    port: Optional[int] = None) -> Optional[int]:
    """The port where generation ``generation`` meets: ``port`` when given, otherwise the
    world's port plus the generation (None without a world port: shm needs none).

    >>> generation_port(29500, 2)
    29502
    """
    if port is not None:
        return port
    if base_port is None:
        return None
    chosen = base_port + generation
    if chosen > _MAX_PORT:
        raise ValueError(f"regroup: generation {generation} would meet at port {chosen} "
                         f"(MASTER_PORT {base_port} + generation), beyond {_MAX_PORT}; "
                         f"pass `port` explicitly")
    return chosen


def generation_rendezvous(base: Rendezvous, rank: int, size: int, generation: int,
                          port: Optional[int] = None) -> Rendezvous:
    """``base`` (the world's rendezvous) for rank ``rank`` of ``size`` in generation
    ``generation`` (all local: a re-formed group lives on the hosts of its members).

    >>> from collectives import detect_rendezvous
    >>> r = generation_rendezvous(detect_rendezvous(env={"RANK": "2", "WORLD_SIZE": "3",
    ...     "MASTER_PORT": "29500"}), 1, 2, 1)
    >>> (r.rank, r.world_size, r.generation, r.master_port)
    (1, 2, 1, 29501)
    """
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 1:
        raise ValueError(f"regroup: `generation` must be an int >= 1 (0 is the launcher's "
                         f"world), got {generation!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"regroup: `size` must be an int >= 1, got {size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"regroup: `rank` must be an int in [0, {size}), got {rank!r}")
    local = base.local_world_size == base.world_size
    return dataclasses.replace(
        base, rank=rank, world_size=size, generation=generation,
        local_rank=rank if local else base.local_rank,
        local_world_size=size if local else base.local_world_size,
        master_port=generation_port(base.master_port, generation, port))


def shrunk_ranks(rank: int, size: int, exclude: Iterable[Any], where: str) -> tuple[int, int]:
    """This rank's rank and the size of the group without ``exclude`` (members keep their
    order). ``ValueError`` for a rank out of range, a repeated rank, this rank itself, or
    nobody left.

    >>> shrunk_ranks(3, 4, [1], "[rank 3/4] shrink")
    (2, 3)
    """
    try:
        dropped = list(exclude)
    except TypeError:
        raise TypeError(f"{where}: argument `exclude` must be an iterable of ranks, got "
                        f"{type(exclude).__name__}") from None
    for r in dropped:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < size:
            raise ValueError(f"{where}: argument `exclude` holds {r!r}, not a rank of this "
                             f"group (0 .. {size - 1})")
    if len(set(dropped)) != len(dropped):
        raise ValueError(f"{where}: argument `exclude` names a rank twice: {dropped}")
    if rank in dropped:
        raise ValueError(f"{where}: argument `exclude` names this rank ({rank}); an excluded "
                         f"rank does not call shrink (abort its group instead)")
    return rank - sum(1 for r in dropped if r < rank), size - len(dropped)


def connect(backend: str, rendezvous: Rendezvous, timeout: float, where: str) -> Backend:
    """Connect this process to generation ``rendezvous.generation`` through ``backend``'s
    registered factory (which must declare ``Capabilities.regroups``; otherwise it would
    meet an older group's processes)."""
    made = create_backend(backend, rendezvous, timeout, where=where)
    refusal = made.regroup_refusal()
    if refusal is not None:
        made.abort()
        raise NotImplementedError(f"{where}: {refusal}")
    return made


def regrouped(group_class: type, made: Backend, origin: Rendezvous, generation: int,
              name: str) -> Any:
    """The group of generation ``generation`` on the backend ``made`` (by
    :func:`connect`), named ``name@generation``, remembering the world's rendezvous
    ``origin`` that later generations meet again from."""
    group = group_class(made, name=f"{name}@{generation}")
    group.origin, group.generation = origin, generation
    return group


def shrink(group: Any, exclude: Iterable[Any],
           port: Optional[int] = None) -> Any:
    """``group.shrink(exclude, port=port)``: this rank's place among the survivors, then
    :func:`reform` under the next generation."""
    rank, size = shrunk_ranks(group.rank, group.size, exclude, group._where("shrink"))
    return reform(group, rank, size, group.generation + 1, port)


def grow(group: Any, world_size: int,
         port: Optional[int] = None) -> Any:
    """``group.grow(world_size, port=port)``: the members keep their ranks, the new
    processes take the ranks above, under the next generation."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) \
            or world_size < group.size:
        raise ValueError(f"{group._where('grow')}: argument `world_size` must be an int >= "
                         f"this group's size {group.size}, got {world_size!r}")
    return reform(group, group.rank, world_size, group.generation + 1, port)


def reform(group: Any, rank: int, size: int, generation: int,
           port: Optional[int] = None) -> Any:
    """``group.reform(rank, size, generation, port=port)``: every check first (so a
    refused call leaves ``group`` usable), then abort ``group`` and meet again."""
    w = group._where("reform")
    refusal = group.transport.regroup_refusal()
    if refusal is not None:
        raise NotImplementedError(f"{w}: {refusal}")
    if group.origin is None:
        raise ValueError(f"{w}: this group was made from a Backend by hand, not by "
                         f"init_process_group or join_group: no rendezvous to meet again "
                         f"from")
    if isinstance(generation, bool) or not isinstance(generation, int) \
            or generation <= group.generation:
        raise ValueError(f"{w}: argument `generation` must be an int greater than this "
                         f"group's ({group.generation}), got {generation!r}")
    try:
        rendezvous = generation_rendezvous(group.origin, rank, size, generation, port)
    except ValueError as exc:   # named by this rank and op, before anything is aborted
        raise ValueError(f"{w}: {exc}") from None
    timeout = group.timeout
    group.abort(f"re-formed as generation {generation}")
    made = connect(group.backend, rendezvous, timeout, w)
    return regrouped(type(group), made, group.origin, generation,
                     group._flight_name.split("@")[0])
