"""Ring algorithms: every rank talks only to its neighbours ``rank - 1`` and ``rank + 1``.

The message is cut into ``n`` chunks (``chunk_bounds``: the first ``m % n`` chunks are one
element longer, so sizes need not divide). Chunk ``c`` belongs to its *owner*; a
reduce-scatter pipelines each chunk once around the ring, combining as it goes, so that it
arrives fully reduced at its owner; an all-gather then passes the finished chunks around.
Each rank sends ``(n-1)/n`` of the message per phase, which is optimal in bandwidth.

Order of reduction (what makes all ranks bitwise identical): chunk ``c`` is combined by
exactly one chain of ranks, in the ring order that starts right after its owner,
``owner+1, owner+2, ..., owner`` (a left fold: ``((x[o+1] op x[o+2]) op ...) op x[o]``),
then finished (AVG divides) by its owner alone; the all-gather only copies those bits.

Reference: P. Patarasuk and X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters
of workstations", J. Parallel Distrib. Comput. 69(2), 2009; R. Thakur, R. Rabenseifner
and W. Gropp, "Optimization of collective communication operations in MPICH", IJHPCA
19(1), 2005.

Costs below use the alpha-beta-gamma model: ``alpha`` per message, ``beta`` per byte
moved, ``gamma`` per byte reduced, ``m`` bytes, ``n`` ranks.
"""

from __future__ import annotations

import numpy as np

from ..reduce_op import ReduceOp, combine_into, finish
from .links import Links, wait_all
from .messages import exchange, irecv, isend


def chunk_bounds(m: int, n: int) -> list[int]:
    """Offsets of ``n`` near-equal chunks of ``m`` elements (``n + 1`` values).

    >>> chunk_bounds(7, 3)
    [0, 3, 5, 7]
    """
    q, extra = divmod(m, n)
    bounds = [0]
    for c in range(n):
        bounds.append(bounds[-1] + q + (c < extra))
    return bounds


def reduce_scatter_chunks(links: Links, src: np.ndarray, bounds: list[int], op: ReduceOp,
                          dst: np.ndarray, *, shift: int = 0, step: int = 0) -> None:
    """Ring reduce-scatter of ``src`` (read only) cut at ``bounds``: the rank at ring
    position ``j = (rank - shift) % n`` stores the combined chunk ``j`` in ``dst`` (not
    finished: AVG is still a sum). ``dst`` may be ``src``'s own chunk ``j``.

    At step ``s`` position ``j`` sends the partial result of chunk ``j - s - 1`` to the
    right and receives the partial of chunk ``j - s - 2`` from the left, then folds its
    own data in *on the right* (``partial op own``). Scratch: two chunks.
    """
    n, rank = links.size, links.rank
    j = (rank - shift) % n
    right, left = (rank + 1) % n, (rank - 1) % n

    def chunk(c: int) -> np.ndarray:
        c %= n
        return src[bounds[c]:bounds[c + 1]]

    width = max(bounds[c + 1] - bounds[c] for c in range(n))
    scratch = (np.empty(width, src.dtype), np.empty(width, src.dtype)) if n > 1 else ()
    send = chunk(j - 1)
    for s in range(n - 1):
        own = chunk(j - s - 2)
        recv = scratch[s % 2][:own.size]
        exchange(links, send, right, recv, left, step)
        combine_into(op, recv, own)
        send = recv
    dst[...] = send


def all_gather_chunks(links: Links, buf: np.ndarray, bounds: list[int], *, shift: int = 0,
                      step: int = 0, first_has_all: bool = False) -> None:
    """Ring all-gather in place: on entry the rank at ring position ``j = (rank - shift)
    % n`` holds chunk ``j`` of ``buf``; on return every rank holds every chunk.

    With ``first_has_all`` position 0 already holds all of ``buf`` (a broadcast root):
    it receives nothing and position ``n - 1`` sends it nothing (the ring is opened),
    so position 0's buffer is only read.
    """
    n, rank = links.size, links.rank
    j = (rank - shift) % n
    right, left = (rank + 1) % n, (rank - 1) % n

    def chunk(c: int) -> np.ndarray:
        c %= n
        return buf[bounds[c]:bounds[c + 1]]

    for s in range(n - 1):
        works = []
        if not (first_has_all and j == 0):
            works += irecv(links, chunk(j - s - 1), left, step)
        if not (first_has_all and j == n - 1):
            works += isend(links, chunk(j - s), right, step)
        wait_all(works)


def all_reduce(links: Links, a: np.ndarray, op: ReduceOp, *, step: int = 0) -> None:
    """Ring all-reduce of ``a`` in place: reduce-scatter, then all-gather.

    Idea: rank ``r`` owns chunk ``r``; the reduce-scatter leaves chunk ``r`` reduced (in
    the order ``r+1, ..., n-1, 0, ..., r``) and finished on rank ``r``; the all-gather
    copies each owner's bits to everyone, so all ranks hold identical values.
    Cost: ``2(n-1) alpha + 2(n-1)/n m beta + (n-1)/n m gamma``; scratch ``2 m/n``.
    Uses steps ``step`` and ``step + 1``.
    Reference: Patarasuk and Yuan, JPDC 69(2), 2009.
    """
    n = links.size
    if n == 1:
        finish(op, a, 1)
        return
    bounds = chunk_bounds(a.size, n)
    mine = a[bounds[links.rank]:bounds[links.rank + 1]]
    reduce_scatter_chunks(links, a, bounds, op, mine, step=step)
    finish(op, mine, n)
    all_gather_chunks(links, a, bounds, step=step + 1)


def reduce_scatter(links: Links, out: np.ndarray, inp: np.ndarray, op: ReduceOp, *,
                   step: int = 0) -> None:
    """Ring reduce-scatter: ``out`` on rank ``r`` = part ``r`` of the reduction of every
    rank's ``inp`` (``n x out.size`` elements; ``inp`` is not modified).

    Idea: part ``c`` travels once around the ring starting after rank ``c``, each rank
    folding its own part in, and ends reduced at rank ``c``.
    Cost: ``(n-1) alpha + (n-1)/n m beta + (n-1)/n m gamma`` (``m`` = input bytes);
    scratch ``2 m/n``.
    Reference: Thakur, Rabenseifner and Gropp, IJHPCA 19(1), 2005.
    """
    n, k = links.size, out.size
    bounds = [c * k for c in range(n + 1)]
    reduce_scatter_chunks(links, inp, bounds, op, out, step=step)
    finish(op, out, n)


def all_gather(links: Links, out: np.ndarray, inp: np.ndarray, *, step: int = 0) -> None:
    """Ring all-gather: ``out`` = every rank's ``inp`` concatenated in rank order.

    Idea: at step ``s`` rank ``r`` forwards to ``r+1`` the part it received at step
    ``s-1`` (its own at ``s = 0``).
    Cost: ``(n-1) alpha + (n-1)/n m beta`` (``m`` = output bytes); no scratch.
    Reference: Thakur, Rabenseifner and Gropp, IJHPCA 19(1), 2005.
    """
    n, k, r = links.size, inp.size, links.rank
    out[r * k:(r + 1) * k] = inp
    all_gather_chunks(links, out, [c * k for c in range(n + 1)], step=step)
