"""One collective-communication interface, many transports.

>>> import collectives
>>> pg = collectives.init_process_group()   # a world of one when no launcher is present
>>> pg.size
1
>>> pg.close()
"""

from . import logs
from ._version import __version__
from .backend import Backend, Capabilities
from .errors import (CollectiveError, CollectiveMismatch, CollectiveTimeout, GroupAborted,
                     PeerError)
from .group import ProcessGroup
from .launch import Rendezvous, detect_rendezvous
from .persistent import PersistentRequest
from .reduce_op import ReduceOp
from .registry import available_backends, get_backend, register_backend
from .spawn import SpawnError, spawn
from .work import Work
from .world import init_process_group, join_group

__all__ = [
    "Backend", "Capabilities", "CollectiveError", "CollectiveMismatch", "CollectiveTimeout",
    "GroupAborted", "PeerError", "PersistentRequest", "ProcessGroup", "ReduceOp",
    "Rendezvous", "SpawnError", "Work", "available_backends", "detect_rendezvous",
    "get_backend", "init_process_group", "join_group", "new_group", "register_backend",
    "spawn", "__version__",
]

# The library never prints: its loggers stay silent unless COLLECTIVES_LOG_LEVEL or the
# application's own logging set-up asks for them (collectives/logs.py).
logs.configure()


def new_group(group: ProcessGroup, ranks: list[int]) -> ProcessGroup:
    """Functional spelling of :meth:`ProcessGroup.new_group` (torch.distributed style)."""
    return group.new_group(ranks)
