"""all_reduce and reduce of the shm backend over the segment: the limits of the one-phase
path, and the pipelined path for larger messages.

Small messages (up to :data:`SMALL_REDUCE_BYTES`, and at most a slot): one phase
(``core.small_reduce``). Every rank copies its whole input into its slot and, once all
arrived, reduces the n slots in rank order straight into its array: ``a = s0 (op) s1``,
then ``a = a (op) s_r``.

Large messages: an all_reduce of an array in symmetric memory reads the peers' buffers
in place (:mod:`backends.shm.symmetric`), one of ``cma.cma_min_bytes(n)`` or more reads
the peers' arrays where the group can and the kernel copies fast enough
(:mod:`backends.shm.cma`); otherwise, and for ``reduce``, reduce-scatter then
all-gather, pipelined one chunk per phase (:func:`pipelined_reduce`). A chunk of C = n x
P elements splits into n pieces of P; rank k owns piece k. In the phase of chunk j every
rank

1. copies the pieces of chunk j that *others* own into the input part of its slot (its
   own piece stays in its array: a single copy in, of (n-1)/n of the data),
2. reduces its piece of chunk j-1 from the peers' input parts of the previous bank and
   its own array, in rank order, into the output part of its slot (and, where it wants
   the result, into its array at once), and
3. copies the others' reduced pieces of chunk j-2 (their output parts, previous bank)
   into its array,

then publishes the phase. All writes of phase q go to bank ``q % 2`` and all reads are of
bank ``(q - 1) % 2``, which every rank finished writing before the barrier of phase q-1:
the protocol's rule, so a chunk costs one barrier (not two) and the last reads (chunk
K-1's outputs, after the final barrier) are of the last published bank. Each element is
reduced once, by its owner, so every rank copies out the same bits.

Memory traffic per rank and chunk of C bytes: (n-1)/n C copied in, C read and 2C/n
written by the reduction, (n-1)/n C copied out: about 4 C for two ranks, against 6.5 C
for copying the whole chunk in and reducing through a staged accumulator. On the compiled
core (``NativeCore.pipelined_reduce``) the same steps over the same slots run in calls of
the core, the GIL released, a call going on through the phases until one's wait outlasts
the core's budget.

Two ranks, both, 4 MiB of float32: ``core.pipelined_reduce(a, ReduceOp.SUM, seq, -1,
OP_ALL_REDUCE)`` -> ``a`` holds the sum on both.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from collectives.reduce_op import ReduceOp

from .codes import ALIGN

#: all_reduce/reduce up to this many bytes take the one-phase path.
SMALL_REDUCE_BYTES = 32 << 10
#: The pipelined path's largest piece (the compiled core's own, checked when it loads):
#: a phase's copy in, reduction and copy out then stay within a core's L2 (the choice
#: is measured in docs/performance.md).
PIECE_MAX_BYTES = 64 << 10


def small_limit(ph: Any) -> int:
    """Largest message of the one-phase path: it must fit one slot."""
    return min(SMALL_REDUCE_BYTES, ph.S)


def piece_layout(ph: Any, itemsize: int) -> tuple[int, int]:
    """(P, C): elements per piece and per chunk. A slot holds the chunk's input part
    (C = n x P elements) followed by one output piece (P): (n + 1) x P elements, at most
    :data:`PIECE_MAX_BYTES` a piece."""
    piece_bytes = min(ph.S // (ph.size + 1) // ALIGN * ALIGN, PIECE_MAX_BYTES)
    P = max(1, piece_bytes // itemsize)
    return P, ph.size * P


def pipelined_reduce(ph: Any, core: Any, a: np.ndarray, op: ReduceOp, seq: int, dst: int,
                     opcode: int) -> None:
    """Reduce-scatter + all-gather, one chunk per phase (see the module docstring)."""
    n, me, dt = ph.size, ph.rank, a.dtype
    ph.start(opcode, seq, dt, a.nbytes, dst, op)
    gets_result = dst < 0 or dst == me
    P, C = piece_layout(ph, a.itemsize)
    align = max(1, ALIGN // a.itemsize)
    views = ph.views(dt)           # [bank][rank] -> whole slot as dt
    total = a.size
    K = (total + C - 1) // C       # chunks; phases K + 1
    # Chunk j starts at j * C; piece k of it is [k0, k1) relative to that start.
    # Pieces are aligned but never longer than P (the output part of a slot).
    bounds = []
    for lo in range(0, total, C):
        c = min(C, total - lo)
        part = min(P, ((c + n - 1) // n + align - 1) // align * align)
        bounds.append([(min(c, k * part), min(c, (k + 1) * part)) for k in range(n)])

    for j in range(K + 1):
        q = ph.enter()
        b = q & 1
        slot_in = views[b][me]
        if j < K:                              # 1. copy in others' pieces of chunk j
            lo = j * C
            c = min(C, total - lo)
            k0, k1 = bounds[j][me]
            if k0 > 0:
                slot_in[:k0] = a[lo:lo + k0]
            if k1 < c:
                slot_in[k1:c] = a[lo + k1:lo + c]
        if j >= 1:                             # 2. reduce my piece of chunk j-1
            lo = (j - 1) * C
            k0, k1 = bounds[j - 1][me]
            if k1 > k0:
                prev = views[b ^ 1]
                mine = a[lo + k0:lo + k1]
                srcs = [mine if r == me else prev[r][k0:k1] for r in range(n)]
                published = slot_in[C:C + (k1 - k0)]
                if gets_result:   # into my array too: step 3 skips my own piece
                    core.combine(mine, srcs, op, (published,))
                else:
                    core.combine(published, srcs, op)
        if j >= 2 and gets_result:             # 3. copy out chunk j-2
            _copy_out(a, views[b ^ 1], (j - 2) * C, C, bounds[j - 2], me)
        core.exchange(q)
    if gets_result:                            # chunk K-1, from the last bank
        _copy_out(a, views[q & 1], (K - 1) * C, C, bounds[K - 1], me)


def _copy_out(a: np.ndarray, bank: list, lo: int, C: int, bounds: list, me: int) -> None:
    """The peers' reduced pieces of the chunk at ``lo`` (the output parts of ``bank``,
    piece k at ``bounds[k]``) into ``a`` (this rank reduced its own into ``a``)."""
    for r, (k0, k1) in enumerate(bounds):
        if k1 > k0 and r != me:
            a[lo + k0:lo + k1] = bank[r][C:C + (k1 - k0)]
