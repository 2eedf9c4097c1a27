"""The data-moving collectives of the shm backend as loops over the phase protocol
(:mod:`backends.shm.phases`): broadcast, the gather family, the scatter family
(reduce_scatter among them) and all_to_all, for any message size, in chunks of a slot.

They run on both paths: the compiled core takes a message that fits one slot in one call
of its own (``NativeCore.move``) and leaves the larger ones to these loops, which wait for
each phase through the core's ``exchange``. Reductions combine the ranks' parts in rank
order 0, 1, ..., n-1 through the core's ``combine`` (numpy's kernels or the compiled
ones: the same bits), so all ranks hold identical results whatever the chunking.

Each function takes the group's :class:`~backends.shm.phases.Phases` and its core, and
the flat buffers of the call. Two ranks, both::

    phases.guard(moves.broadcast, phases, core, a, 1, seq)   # rank 1's ``a`` everywhere
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, Optional, Sequence

import numpy as np

from collectives.errors import CollectiveMismatch
from collectives.reduce_op import ReduceOp

from . import cma_all_to_all
from .codes import (INT64, OP_ALL_GATHER, OP_ALL_TO_ALL, OP_BROADCAST, OP_GATHER,
                    OP_REDUCE_SCATTER, OP_SCATTER)


def broadcast(ph: Any, core: Any, a: np.ndarray, src: int, seq: int) -> None:
    """``a`` of rank ``src`` into ``a`` of every rank, a slot per phase."""
    ph.start(OP_BROADCAST, seq, a.dtype, a.nbytes, src)
    E = ph.S // a.itemsize
    total = a.size
    lo = 0
    while True:
        hi = min(total, lo + E)
        q = ph.enter()
        slot = ph.sv(q & 1, src, a.dtype)
        if ph.rank == src:
            slot[:hi - lo] = a[lo:hi]
        core.exchange(q)
        if ph.rank != src:
            a[lo:hi] = slot[:hi - lo]
        lo = hi
        if lo >= total:
            break


def gather(ph: Any, core: Any, inp: np.ndarray, out: Optional[np.ndarray],
           dst: Optional[int], seq: int) -> None:
    """Every rank's ``inp`` into ``out`` on ``dst`` (None: on every rank, all_gather)."""
    n, me, dt = ph.size, ph.rank, inp.dtype
    ph.start(OP_ALL_GATHER if dst is None else OP_GATHER, seq, dt, inp.nbytes,
             -1 if dst is None else dst)
    gets_result = dst is None or dst == me
    m = inp.size
    E = ph.S // inp.itemsize
    lo = 0
    while True:
        hi = min(m, lo + E)
        q = ph.enter()
        b = q & 1
        ph.sv(b, me, dt)[:hi - lo] = inp[lo:hi]
        core.exchange(q)
        if gets_result:
            for r in range(n):
                out[r * m + lo:r * m + hi] = ph.sv(b, r, dt)[:hi - lo]
        lo = hi
        if lo >= m:
            break


def scatter(ph: Any, core: Any, out: np.ndarray, inp: Optional[np.ndarray], src: int,
            op: Optional[ReduceOp], seq: int) -> None:
    """scatter from ``src`` (``op`` None) or reduce_scatter (``src`` -1)."""
    n, me, dt = ph.size, ph.rank, out.dtype
    reducing = op is not None
    ph.start(OP_REDUCE_SCATTER if reducing else OP_SCATTER, seq, dt, out.nbytes, src, op)
    writes = reducing or me == src
    m = out.size
    E = ph.S // out.itemsize
    if n * m <= E:
        stride, step = m, max(m, 1)         # the whole input fits in one slot
    else:
        stride = step = ph.piece_elems(out.itemsize)
    lo = 0
    while True:
        hi = min(m, lo + step)
        c = hi - lo
        q = ph.enter()
        b = q & 1
        if writes:
            mine = ph.sv(b, me, dt)
            if stride == m:
                mine[:n * m] = inp
            else:
                for k in range(n):
                    mine[k * stride:k * stride + c] = inp[k * m + lo:k * m + hi]
        core.exchange(q)
        at = me * stride
        if reducing:
            core.combine(out[lo:hi], [ph.sv(b, r, dt)[at:at + c] for r in range(n)], op)
        else:
            out[lo:hi] = ph.sv(b, src, dt)[at:at + c]
        lo = hi
        if lo >= m:
            break


def all_to_all(ph: Any, core: Any, out: np.ndarray, inp: np.ndarray, out_counts: list,
               in_counts: list, seq: int) -> None:
    """Part j of ``inp`` to rank j, stored there as part ``rank`` of ``out``."""
    n, me, dt = ph.size, ph.rank, out.dtype
    ph.start(OP_ALL_TO_ALL, seq, dt, 0)
    # Phase 1: everybody's counts, so that all agree on the data phases and check
    # that what j sends to k is what k expects from j; behind them, at `head`
    # elements, the whole input where it fits the rest of the slot. Where every
    # rank's did (the counts say so alike on every rank), this phase is the call.
    q = ph.enter()
    b = q & 1
    ph.sv(b, me, INT64)[:2 * n] = in_counts + out_counts
    head = ph.a2a_head_bytes() // out.itemsize
    if inp.size <= ph.S // out.itemsize - head:
        ph.sv(b, me, dt)[head:head + inp.size] = inp
    core.exchange(q)
    all_to_all_rest(ph, core, out, inp, out_counts, in_counts, seq, b)


def all_to_all_rest(ph: Any, core: Any, out: np.ndarray, inp: np.ndarray,
                    out_counts: Sequence[int], in_counts: Sequence[int], seq: int,
                    b: int) -> None:
    """The all_to_all once its first phase (in bank ``b``) is done: check the counts
    (CollectiveMismatch where they disagree), then copy out what came with them, or
    read the parts from the peers' inputs (the single copy, where the group can), or
    run one more phase (every input fits a slot) or rounds of pieces."""
    n, me, dt = ph.size, ph.rank, out.dtype
    head = ph.a2a_head_bytes() // out.itemsize
    room = ph.S // out.itemsize - head
    # Python lists, not numpy: for the few ranks of a host, each numpy call here
    # costs more than the whole comparison.
    rows = [ph.sv(b, r, INT64)[:2 * n].tolist() for r in range(n)]
    for j in range(n):   # rows[j][k]: j sends to k; rows[k][n + j]: k expects from j
        for k in range(n):
            if rows[j][k] != rows[k][n + j]:
                raise CollectiveMismatch(
                    f"{ph.owner.where('all_to_all')} (seq {seq}): rank {j} sends "
                    f"{rows[j][k]} elements to rank {k}, but rank {k} expects "
                    f"{rows[k][n + j]} from rank {j} (input/output split sizes disagree)")
    widest = max(sum(row[:n]) for row in rows)
    if widest > room and cma_all_to_all.takes(rows, n, out.itemsize):
        # Large parts: read them where they lie where the group can
        # (backends.shm.cma_all_to_all), else stage them below. (The backend owns the
        # group's single copy; a bare test double has none.)
        copy = getattr(ph.owner, "single_copy", None)
        if copy is not None and copy.decided is not False and \
                cma_all_to_all.single_copy_all_to_all(copy, out, inp, rows, out_counts):
            return
    in_off = list(accumulate(in_counts, initial=0))
    out_off = list(accumulate(out_counts, initial=0))
    if widest <= ph.S // out.itemsize:
        if widest > room:
            # One more phase: every rank's whole input fits in its slot.
            q = ph.enter()
            b = q & 1
            ph.sv(b, me, dt)[:inp.size] = inp
            core.exchange(q)
            head = 0
        # (else every input came with the counts, behind them)
        for r in range(n):
            c = out_counts[r]
            if c:
                at = head + sum(rows[r][:me])
                out[out_off[r]:out_off[r] + c] = ph.sv(b, r, dt)[at:at + c]
        return
    P = ph.piece_elems(out.itemsize)
    rounds = (max(max(row[:n]) for row in rows) + P - 1) // P
    for t in range(rounds):
        lo = t * P
        q = ph.enter()
        b = q & 1
        mine = ph.sv(b, me, dt)
        for k in range(n):
            c = min(P, in_counts[k] - lo)
            if c > 0:
                mine[k * P:k * P + c] = inp[in_off[k] + lo:in_off[k] + lo + c]
        core.exchange(q)
        for r in range(n):
            c = min(P, out_counts[r] - lo)
            if c > 0:
                out[out_off[r] + lo:out_off[r] + lo + c] = ph.sv(b, r, dt)[me * P:me * P + c]
