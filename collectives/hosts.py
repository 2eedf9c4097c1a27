"""Whether a world spans several hosts, as far as one rank can tell before it talks to the
others: what ``init_process_group`` asks to choose the ``hier`` backend over ``shm``.

A launcher that places ranks on several hosts says so (torchrun's, Slurm's and MPI's
local world is one host's ranks); ``COLLECTIVES_HOST`` may also list every rank's host, to
make virtual hosts on one machine (see :mod:`backends.hier.topology`).
"""

from __future__ import annotations

import os
import socket
from typing import Mapping, Optional

from . import settings
from .launch import Rendezvous

__all__ = ["file_text", "listed_hosts", "machine_identity", "namespace", "spans_hosts"]


def file_text(path: str) -> str:
    """The stripped text of a small file (``/proc/sys/kernel/random/boot_id``), or ''."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def namespace(kind: str) -> str:
    """This process's namespace of ``kind`` (``net``, ``mnt``, ``uts``) as an inode
    number, equal for processes in the same one ('' where /proc does not tell)."""
    return _stat_field(f"/proc/self/ns/{kind}", "st_ino")


def device(path: str) -> str:
    """The device number of the file system ``path`` is on ('' where it cannot be read):
    ``/dev/shm``'s tells a container's private one from the machine's."""
    return _stat_field(path, "st_dev")


def _stat_field(path: str, field: str) -> str:
    try:
        return str(getattr(os.stat(path), field))
    except OSError:
        return ""


def machine_identity() -> list[str]:
    """What makes a host as the network sees it: hostname, boot id, network namespace
    (a container or a namespace is another host) and user. The zmq and hier backends
    hash these (hier adds ``/dev/shm``'s device) into their host keys."""
    return [socket.gethostname(), file_text("/proc/sys/kernel/random/boot_id"),
            namespace("net"), str(os.getuid())]


def listed_hosts(world_size: int, env: Optional[Mapping[str, str]] = None
                 ) -> Optional[list[str]]:
    """The host of every rank when ``COLLECTIVES_HOST`` lists them (a comma-separated
    list, one name per rank; extra names are ignored), else None; ``ValueError`` naming
    the variable when the list is too short.

    >>> listed_hosts(3, {"COLLECTIVES_HOST": "a,a,b,b"})
    ['a', 'a', 'b']
    """
    named = settings.HOST.get(env)
    if named is None or "," not in named:
        return None
    names = [n.strip() for n in named.split(",")]
    if len(names) < world_size or any(not n for n in names[:world_size]):
        raise ValueError(f"environment variable {settings.HOST.name}={named!r} lists "
                         f"{len(names)} hosts, but the world has {world_size} ranks: give "
                         f"one non-empty name per rank (or one name for this process)")
    return names[:world_size]


def spans_hosts(rendezvous: Rendezvous, env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the world of ``rendezvous`` spans several hosts: ``COLLECTIVES_HOST`` lists
    more than one, or (without a list) the launcher's local world is smaller than the
    world.

    >>> spans_hosts(Rendezvous(0, 4, 0, 2, "h0", 29500, "j", "torchrun"), env={})
    True
    """
    listed = listed_hosts(rendezvous.world_size, env)
    if listed is not None:
        return len(set(listed)) > 1
    return rendezvous.local_world_size < rendezvous.world_size
