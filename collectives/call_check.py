"""``COLLECTIVES_DEBUG=1``: before every collective the ranks exchange a description of
the call they are making, and raise :class:`CollectiveMismatch` naming both sides when
they differ.

The shm and zmq transports check this on every message for free; MPI and torch's gloo
give no such hook, so there a mismatch (rank 0 in ``all_reduce``, rank 1 in
``broadcast``) would hang, crash inside the library, or silently combine the wrong
buffers. The switch costs one extra all_gather of ``DESCRIPTION_BYTES + 16 x size`` bytes
per call, through the backend's own all_gather, and makes queued async ops finish before
the next call starts (the check is a synchronous collective).

Every rank must set the switch alike: a rank without it does not take part in the
exchange.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from . import settings
from .errors import CollectiveMismatch

#: Room for one rank's description of its call, in bytes (longer ones are cut).
DESCRIPTION_BYTES = 192


def describe(op: str, shape: Optional[Sequence[int]], dtype: Any, root: int,
             reduce_op: Any) -> str:
    """One rank's call as text, the unit the ranks compare.

    >>> describe("all_reduce", (4,), "float32", -1, None)
    'all_reduce(shape=(4,), dtype=float32)'
    """
    parts = []
    if shape is not None:
        parts.append(f"shape={tuple(int(x) for x in shape)}")
    if dtype is not None:
        text = str(dtype)
        parts.append(f"dtype={text[6:] if text.startswith('torch.') else text}")
    if root >= 0:
        parts.append(f"root={root}")
    if reduce_op is not None:
        parts.append(f"op={getattr(reduce_op, 'name', reduce_op)}")
    return f"{op}({', '.join(parts)})"


def record_bytes(size: int) -> int:
    """The size of one rank's record in a world of ``size`` ranks."""
    return DESCRIPTION_BYTES + 16 * size


def encode(description: str, counts: Optional[tuple[Sequence[int], Sequence[int]]],
           size: int) -> np.ndarray:
    """The fixed-size record a rank contributes: its description, then (for all_to_all)
    how many elements it receives from and sends to each rank."""
    record = np.zeros(record_bytes(size), np.uint8)
    text = description.encode()[:DESCRIPTION_BYTES]
    record[:len(text)] = np.frombuffer(text, np.uint8)
    if counts is not None:
        record[DESCRIPTION_BYTES:] = np.asarray(
            [*counts[0], *counts[1]], np.int64).view(np.uint8)
    return record


def check(gathered: np.ndarray, *, rank: int, size: int, where: str,
          all_to_all: bool) -> None:
    """Raise :class:`CollectiveMismatch` unless every rank described the same call (and,
    for all_to_all, every rank sends each rank what that rank expects). Every rank sees
    every record, so every rank reaches the same verdict."""
    rows = gathered.reshape(size, record_bytes(size))
    names = [bytes(row[:DESCRIPTION_BYTES]).rstrip(b"\0").decode(errors="replace")
             for row in rows]
    mine = names[rank]
    others = [r for r in range(size) if names[r] != mine]
    if others:
        first = others[0]
        raise CollectiveMismatch(
            f"{where}: ranks called different collectives ({settings.DEBUG.name} check): this "
            f"rank ({rank}) called {mine}, rank {first} called {names[first]}"
            + (f" (also differing: ranks {others[1:]})" if len(others) > 1 else ""))
    if not all_to_all:
        return
    counts = rows[:, DESCRIPTION_BYTES:].copy().view(np.int64).reshape(size, 2, size)
    received, sent = counts[:, 0, :], counts[:, 1, :]
    for src in range(size):
        for dst in range(size):
            if sent[src, dst] != received[dst, src]:
                raise CollectiveMismatch(
                    f"{where}: split sizes disagree ({settings.DEBUG.name} check): rank {src} "
                    f"sends {sent[src, dst]} elements to rank {dst}, which expects "
                    f"{received[dst, src]} (this is rank {rank})")
