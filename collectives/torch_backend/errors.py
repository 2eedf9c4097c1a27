"""How this library's communication errors reach a torch.distributed caller.

torch's wrappers (DDP's reducer, FSDP2, pipelining) catch and re-raise
``torch.distributed.DistBackendError`` as the sign that the communication backend failed.
Our :class:`~collectives.CollectiveTimeout`, :class:`~collectives.PeerError` and
:class:`~collectives.CollectiveMismatch` become a :class:`CollectivesBackendError`, a
subclass of it, that keeps ours as ``__cause__`` and as ``.error``, and names the
operation, the sequence number and the rank in its message and its attributes. Argument
errors (``TypeError``/``ValueError``) pass through unchanged.
"""

from __future__ import annotations

import re
from typing import Optional

import torch.distributed as dist

from ..errors import CollectiveError, PeerError

__all__ = ["CollectivesBackendError", "translate"]

_SEQ = re.compile(r"\(seq (\d+)\)")


class CollectivesBackendError(dist.DistBackendError):
    """A collective of the ``"collectives"`` torch backend failed.

    ``error`` (also ``__cause__``) is the library's own exception; ``op`` the torch
    backend method that failed (``"allreduce"``, ``"send"``, ...), ``seq`` the
    collective's sequence number on our group (-1 for point to point), ``rank`` and
    ``size`` the caller's place in the group, ``peer`` the rank that died or hung up
    (for a :class:`~collectives.PeerError`, else -1), ``missing`` the ranks that did not
    arrive (for a :class:`~collectives.CollectiveTimeout`).

    Two ranks, rank 1 killed during ``dist.all_reduce(t)``: rank 0 gets
    ``CollectivesBackendError: [collectives backend, rank 0/2] allreduce failed:
    PeerError: [rank 0/2] all_reduce (seq 6): rank 1 (pid 4242) died ...``.
    """

    def __init__(self, message: str, *, error: BaseException, op: str, seq: int,
                 rank: int, size: int, peer: int = -1, missing: tuple = ()) -> None:
        super().__init__(message)
        self.error = error
        self.op = op
        self.seq = seq
        self.rank = rank
        self.size = size
        self.peer = peer
        self.missing = missing


def translate(exc: BaseException, *, op: str, rank: int, size: int) -> BaseException:
    """The exception a torch caller sees for ``exc``, raised in torch backend method ``op``.

    >>> from collectives import PeerError
    >>> e = translate(PeerError("[rank 0/2] all_reduce (seq 3): rank 1 died", peer=1),
    ...               op="allreduce", rank=0, size=2)
    >>> (type(e).__name__, e.seq, e.peer, isinstance(e, dist.DistBackendError))
    ('CollectivesBackendError', 3, 1, True)
    """
    if isinstance(exc, CollectivesBackendError) or not isinstance(exc, CollectiveError):
        return exc
    seq: Optional[int] = getattr(exc, "seq", None)
    if seq is None or seq < 0:
        found = _SEQ.search(str(exc))
        seq = int(found.group(1)) if found else -1
    message = (f"[collectives backend, rank {rank}/{size}] {op} failed: "
               f"{type(exc).__name__}: {exc}")
    translated = CollectivesBackendError(
        message, error=exc, op=op, seq=seq, rank=rank, size=size,
        peer=exc.peer if isinstance(exc, PeerError) else -1,
        missing=tuple(getattr(exc, "missing", ())))
    translated.__cause__ = exc
    return translated
