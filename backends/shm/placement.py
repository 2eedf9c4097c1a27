"""Where a shm rank runs: one core each when the ranks outnumber the cores.

With more ranks than cores (4 ranks on 2 cores), every collective hands the cores from
rank to rank, and left to itself the kernel moves the ranks between cores as they do.
Some jobs then settle into a slow rhythm that lasts the whole job: the median is no
better bound, but the worst jobs are (docs/performance.md;
``python benchmarks/shm_placement.py --jobs 16`` alternates the two). So the world
group binds each rank of an oversubscribed host to one core, round robin over the
cores this process may use (rank r on the (r mod c)-th), as ``mpiexec -bind-to core``
would; closing the group gives the process its cores back.

``COLLECTIVES_SHM_BIND``: ``auto`` (the default) binds only when the group's ranks
outnumber the cores and the process may still run on more than one (a launcher or
``taskset`` that already placed it is obeyed); ``core`` binds whenever there is more than
one core to choose from; ``none`` never binds. ``pg.transport.bound_core`` tells the choice
(None where the rank was left where it was)::

    >>> import collectives
    >>> def where():
    ...     pg = collectives.init_process_group()
    ...     core = pg.transport.bound_core
    ...     pg.close()
    ...     return core
    >>> collectives.spawn(where, 2, backend="shm")   # on 2 cores or more
    [None, None]
    >>> collectives.spawn(where, 4, backend="shm")   # on 2 cores  # doctest: +SKIP
    [0, 1, 0, 1]

The wait policy (``native.wait_policy``) counts the world's ranks on this host, not only
a group's: a sub-group of 2 in a world of 4 on 2 cores shares them with all 4.

Only the threads that exist when the group opens are bound (the process's threads, each
by its id); threads started later inherit the binding from the thread that starts them.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

from collectives import settings

#: ``auto`` (default), ``core`` or ``none``: see the module docstring.
BIND_ENV = settings.SHM_BIND.name
_MODES = ("auto", "core", "none")


def bind_mode() -> str:
    """The binding asked for by ``COLLECTIVES_SHM_BIND`` (ValueError naming it if it is
    not one of auto, core, none).

    >>> bind_mode() in ("auto", "core", "none")
    True
    """
    return settings.SHM_BIND.get()


def allowed_cores() -> list[int]:
    """The cores this process may run on, in order ([] where the OS cannot say)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def chosen_core(rank: int, size: int, mode: Optional[str] = None) -> Optional[int]:
    """The core rank ``rank`` of a ``size``-rank group on this host should be bound to,
    or None to leave it where it is.

    >>> chosen_core(0, 1, "core") is None      # one rank: nothing to share
    True
    >>> chosen_core(1, 4, "none") is None
    True
    """
    mode = bind_mode() if mode is None else mode
    cores = allowed_cores()
    if mode == "none" or size < 2 or len(cores) < 2:
        return None
    if mode == "auto" and size <= len(cores):
        return None
    return cores[rank % len(cores)]


#: The world groups open in this process (one, in practice), newest last.
_worlds: list["Placement"] = []


def host_cores() -> int:
    """Cores this process's ranks share: those it could use before a binding of ours
    narrowed it to one (so the wait policy still tells a core per rank from too few).

    >>> host_cores() >= 1
    True
    """
    if _worlds:
        return len(_worlds[-1].before)
    return len(allowed_cores()) or os.cpu_count() or 1


def host_ranks(size: int) -> int:
    """Ranks that share this host's cores with a group of ``size``: the world's, once
    a world group is open (a sub-group of 2 in a world of 4 on 2 cores still shares
    them with all 4).

    >>> host_ranks(3) >= 3
    True
    """
    return max(size, _worlds[-1].ranks) if _worlds else size


class Placement:
    """The world group's place on this host: its ``ranks`` here, the cores the process
    had (``before``) and the ``core`` :func:`chosen_core` bound it to (None: not bound,
    or the OS refused, and then the ranks run where the kernel puts them).
    :meth:`release` gives the process its cores back."""

    def __init__(self, rank: int, size: int) -> None:
        self.ranks = size
        self.before = frozenset(allowed_cores())
        self.core = chosen_core(rank, size)
        if self.core is not None:
            try:
                _set_all_threads({self.core})
            except OSError:
                self.core = None
                _set_all_threads(self.before)
        _worlds.append(self)

    def release(self) -> None:
        """Forget this world; let every thread of the process run on the cores it had
        before (idempotent)."""
        if self in _worlds:
            _worlds.remove(self)
            if self.core is not None:
                _set_all_threads(self.before)


def _set_all_threads(cores: "set[int] | frozenset[int]") -> None:
    """``sched_setaffinity`` of every thread of this process (Linux binds one thread per
    call: the process id alone would leave the others where they were)."""
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    me = threading.get_native_id()
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:
            if tid in (0, me):
                raise      # the calling thread must be bound; another may have ended
