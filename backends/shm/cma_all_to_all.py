"""The large all_to_all of the shm backend in one copy: each rank reads its parts straight
from the peers' inputs (``process_vm_readv``, as the single-copy all_reduce of
:mod:`backends.shm.cma` does).

An all_to_all whose inputs do not all fit behind the counts of its first phase
(:func:`backends.shm.moves.all_to_all`) otherwise stages every byte through the shared
segment: a copy into the slot, a copy out of it, and for inputs larger than a slot, a
phase per round of pieces. Here, after that first phase (which every all_to_all has: it
agrees on the counts), each byte moves once:

1. phase 2: every rank publishes the address of its input and its vote
   (:meth:`SingleCopy.line`; 0: it cannot or must not read its peers' memory). A 0 turns
   the path off for the group, on every rank (``SingleCopy.decided`` False, shared with
   the all_reduce: the same question), and that call and every later one stage. The
   first time all can, the probe of :class:`~backends.shm.cma.SingleCopy` (a read of a
   byte of every peer's input, or of its ``anchor`` where the input is empty, and a
   write through the kernel) decides it once for the group, alike on every rank.
2. each rank copies its own part and reads every other part where it lies in its
   sender's input (offsets from the counts every rank published in phase 1), GIL
   released; nobody writes into a peer, so an error leaves no copy in flight into this
   rank's memory.
3. phase 3: every rank has read what it needed, so each may return and reuse its input.

Parts of :data:`CMA_ALL_TO_ALL_BYTES` and more take this path (the largest part of the
call, which every rank reads from the counts alike), where every rank votes for it;
smaller ones stage, where the one more phase of an input that fits a slot copies in
cache and beats the kernel's copy, whose cost per page dominates there (measured in
docs/performance.md). Two ranks, both::

    pg.all_to_all(out, inp, output_split_sizes=..., input_split_sizes=...)   # 2 MiB each
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Sequence

import numpy as np

#: An all_to_all whose largest part (of any rank, for any rank) has at least this many
#: bytes reads the parts in place where the group votes for it; below, staging's copies
#: through the slots cost less than the kernel's copy (docs/performance.md).
CMA_ALL_TO_ALL_BYTES = 1 << 20


def takes(rows: list, n: int, itemsize: int) -> bool:
    """Whether an all_to_all of these counts (``rows[j][k]``: elements rank j sends rank
    k, as every rank read them in phase 1) is large enough for the single copy."""
    return max(max(row[:n]) for row in rows) * itemsize >= CMA_ALL_TO_ALL_BYTES


def single_copy_all_to_all(copy: Any, out: np.ndarray, inp: np.ndarray, rows: list,
                           out_counts: Sequence[int]) -> bool:
    """Phases 2 and 3 above for the group's :class:`~backends.shm.cma.SingleCopy`
    ``copy``, once phase 1 published ``rows`` (``rows[j][k]``: the elements rank j sends
    rank k, agreed by every rank); False (agreed with every rank, nothing copied) where
    the caller must stage instead."""
    ph, core = copy.ph, copy.core
    n, me = ph.size, ph.rank
    q = ph.enter()
    words = ph.sv(q & 1, me, np.uint64)
    words[0] = (inp if inp.size else copy.anchor).ctypes.data
    words[1] = copy.line()
    core.exchange(q)
    published = [ph.sv(q & 1, r, np.uint64)[:2].tolist() for r in range(n)]
    if not all(w[1] for w in published):
        copy.decided = False
        return False
    addrs = [w[0] for w in published]
    if copy.decided is None:
        copy.decided = copy.probe(addrs)
        if not copy.decided:
            return False
    itemsize = out.itemsize
    out_at = [0, *accumulate(out_counts)]
    for r in range(n):
        c = out_counts[r]
        if not c:
            continue
        at = sum(rows[r][:me])           # where r's part for this rank starts in r's input
        part = out[out_at[r]:out_at[r] + c]
        if r == me:
            np.copyto(part, inp[at:at + c])
            continue
        rc = copy.mod.cma_read(part, ph.pids[r], addrs[r] + at * itemsize)
        if rc:
            # A peer that failed and left may have freed its input: name it, not the
            # address that went with it.
            for p in ph.peers:
                ph.check_peer(p, ph.op_name, ph.op_seq, check_pid=True)
            copy.check(rc, "reading the peers' parts")
    core.exchange(ph.enter())
    return True
