"""Symmetric memory: one buffer per rank, allocated together, that a backend may let the
peers read and write (``pg.alloc_symmetric``), as torch's ``SymmetricMemory`` and
NVSHMEM's symmetric heap. A backend that declares ``Capabilities.symmetric_memory``
makes them (``Backend.alloc_symmetric``); the others hand out plain memory.

The contract (every backend keeps it):

- ``buf = pg.alloc_symmetric(nbytes)`` is a collective: every rank calls it in the same
  order relative to its other collectives, with the same ``nbytes`` (a backend that can
  tell raises ``ValueError`` on every rank when they differ). It returns a writable,
  zero-filled ``numpy`` array of ``nbytes`` bytes (``uint8``), 64-byte aligned; view it
  as any dtype (``buf.view(np.float32)``, ``torch.frombuffer(buf, dtype=...)``).
- The memory is the caller's like any array: it stays valid after ``close()`` (and,
  being a shared mapping on shm, a forked child's writes to it show in the parent), and
  it is freed when nothing refers to it any more. There is no explicit free: a backend
  may keep what it needs to share a buffer (the peers' mappings) until this rank's
  buffer is gone and then until its next collective that looks for buffers (shm: a
  large all_reduce, a persistent request) or ``alloc_symmetric`` or ``close()``, not
  longer, so a process that builds model after model on one group (DDP makes a buffer
  per bucket) holds only the live ones.
- Where a backend cannot share a buffer (shm: /dev/shm full, a peer's file not
  mappable), every rank gets plain memory alike and a ``RuntimeWarning`` says why. What it
  adds: a collective whose array lies inside a symmetric buffer at the *same offset on
  every rank* may read the peers' copies in place, and write its results into them,
  while that collective runs (never before it starts or after it returns on the rank
  that owns the buffer). On shm an ``all_reduce`` past the one-phase size reads them
  with plain loads and pushes each reduced piece into every rank's buffer with plain
  stores (no staging copy through the segment, no kernel copy as in its single-copy
  path): less than half the memory traffic, in two phases.
- Everything else is unchanged: any collective takes any array, inside a buffer or not,
  with the same results (bitwise those of the other paths of the backend).
- The default (every backend without its own) is ``np.zeros(nbytes, np.uint8)``: plain
  memory, nothing shared, nothing exchanged.

Two ranks, a gradient bucket that autograd writes straight into shared memory::

    flat = torch.frombuffer(pg.alloc_symmetric(16384 * 4), dtype=torch.float32)  # 64 KiB
    req = pg.all_reduce_init(flat, ReduceOp.AVG)
    flat.fill_(pg.rank)
    req.start(); req.wait()      # flat == 0.5 on both ranks; on shm read in place
"""

from __future__ import annotations

import numpy as np

from typing import Any

from . import running

__all__ = ["alloc_symmetric", "plain_buffer"]

#: Alignment of a buffer's first byte (a cache line: every dtype, and vector loads).
_ALIGN = 64


def plain_buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` of zero-filled memory, 64-byte aligned, shared with nobody."""
    raw = np.zeros(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + nbytes]


def alloc_symmetric(group: Any, nbytes: int) -> np.ndarray:
    """``pg.alloc_symmetric(nbytes)`` (see the module docstring)."""
    where = group._where("alloc_symmetric")
    running.check_open(group, "alloc_symmetric")
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or nbytes < 0:
        raise ValueError(f"{where}: argument `nbytes` must be a non-negative int, got "
                         f"{nbytes!r}")
    transport = group.transport
    if not transport.capabilities.symmetric_memory:
        return plain_buffer(int(nbytes))
    # The fast path's views of small tensors would keep earlier buffers alive (see the
    # contract: a buffer nothing refers to is freed); they are found again.
    group._host_views.clear()

    def all_ranks(values: list) -> np.ndarray:
        """``values`` (ints) of every rank, one row per rank (the group's all_gather)."""
        mine = np.array(values, np.int64)
        every = np.zeros(group.size * mine.size, np.int64)
        group.all_gather(every, mine)
        return every.reshape(group.size, mine.size)

    return transport.alloc_symmetric(int(nbytes), where, all_ranks)
