"""``init_process_group``: connect this process to its world and return the world's
:class:`~collectives.ProcessGroup`.

Who this rank is and how the ranks meet comes from :mod:`collectives.launch`; which
transport from the argument, ``COLLECTIVES_BACKEND`` or the launcher; the transport
itself from the registry (:mod:`collectives.registry`), whose factory returns a
:class:`~collectives.backend.Backend` that the group wraps.
"""

from __future__ import annotations

import datetime
import time
from typing import Optional, Union

from . import logs, settings, trace
from .group import ProcessGroup
from .hosts import spans_hosts
from .launch import Rendezvous, default_backend, detect_rendezvous
from .regroup import connect, generation_rendezvous, regrouped
from .registry import check_backend_name, create_backend
from .validation import timeout_seconds

__all__ = ["DEFAULT_TIMEOUT", "init_process_group", "join_group"]

#: Seconds a blocking wait lasts before ``CollectiveTimeout``, unless told otherwise
#: (``init_process_group(timeout=...)`` or the ``COLLECTIVES_TIMEOUT`` variable).
DEFAULT_TIMEOUT: float = settings.TIMEOUT.default

_log = logs.get_logger("rendezvous")


def init_process_group(backend: Optional[str] = None, *, rank: Optional[int] = None,
                       world_size: Optional[int] = None,
                       timeout: Union[float, datetime.timedelta, None] = None) -> ProcessGroup:
    """Connect this process to its world and return the world's :class:`ProcessGroup`.

    The group is an object, not global state: several may coexist. Two ranks started by
    ``collectives.spawn(main, 2)``, ``torchrun --nproc-per-node 2`` or ``mpirun -n 2``::

        def main():
            pg = collectives.init_process_group()       # backend from the launcher
            t = torch.ones(3) * (pg.rank + 1)
            pg.all_reduce(t)                            # tensor([3., 3., 3.]) on both
            pg.close()
    """
    settings.check_environment()
    logs.configure()   # (again: the variable may have been set since the import)
    seconds = timeout_seconds(timeout, settings.TIMEOUT.get(), where="init_process_group")
    rendezvous = detect_rendezvous(rank, world_size)
    logs.note_rank(rendezvous.rank, rendezvous.world_size)
    if backend is None or backend == "":
        name = default_backend(rendezvous)
        what = (f"the backend in {settings.BACKEND.name}" if settings.BACKEND.is_set()
                else "the default backend")
    else:
        name, what = backend, "argument `backend`"
    name = across_hosts(name, rendezvous)
    check_backend_name(name, where="init_process_group", what=what)
    _log.debug("rank %d of %d (launcher %s, job %s) meeting on %s, timeout %g s",
               rendezvous.rank, rendezvous.world_size, rendezvous.launcher,
               rendezvous.job_id, name, seconds)
    start = time.monotonic()
    try:
        made = create_backend(name, rendezvous, seconds, where="init_process_group",
                              what=what)
    except Exception as exc:
        _log.warning("init_process_group on %s failed after %.1f s: %s", name,
                     time.monotonic() - start, exc)
        raise
    _log.info("world of %d ranks ready on %s in %.3f s", rendezvous.world_size, name,
              time.monotonic() - start)
    group = ProcessGroup(made)
    group.origin = rendezvous
    trace.start_from_settings(group)   # with tracing on: a clock mark on the new world
    return group


def across_hosts(name: str, rendezvous: Rendezvous) -> str:
    """``hier`` where ``name`` is ``shm`` and the world spans several hosts
    (:func:`collectives.hosts.spans_hosts`): shm inside each host, the network between
    them; ``name`` otherwise. Logged at info.

    >>> across_hosts("zmq", Rendezvous(0, 4, 0, 2, "h0", 29500, "j", "torchrun"))
    'zmq'
    """
    if name != "shm" or not spans_hosts(rendezvous):
        return name
    _log.info("the world of %d ranks spans several hosts: backend hier (shm inside each "
              "host, %s between hosts) instead of shm", rendezvous.world_size,
              settings.HIER_NET.get())
    return "hier"


def join_group(backend: Optional[str] = None, *, rank: int, world_size: int,
               generation: int, port: Optional[int] = None,
               timeout: Union[float, datetime.timedelta, None] = None) -> ProcessGroup:
    """Join survivors that call ``pg.grow(world_size)`` (or ``pg.reform``) as rank
    ``rank`` of a group of ``world_size`` in ``generation``: a fresh process (a
    replacement started by the launcher, with the job's environment) meets the group
    re-formed under that generation (see :mod:`collectives.regroup`).

    Two survivors of a world of three, and a replacement for the dead one::

        big = pg.grow(3)                                   # on both survivors
        big = collectives.join_group(rank=2, world_size=3, generation=1)   # the new one
        big.all_reduce(t)                                  # all three
    """
    settings.check_environment()
    seconds = timeout_seconds(timeout, settings.TIMEOUT.get(), where="join_group")
    base = detect_rendezvous()
    name = default_backend(base) if not backend else backend
    rendezvous = generation_rendezvous(base, rank, world_size, generation, port)
    name = across_hosts(name, rendezvous)
    made = connect(name, rendezvous, seconds, "join_group")
    return regrouped(ProcessGroup, made, base, generation, "world")
