"""Recursive-doubling all-reduce: the latency-optimal all-reduce for small messages.

With ``p = 2**floor(log2 n)`` and ``rem = n - p``, the first ``2 rem`` ranks fold in
pairwise (even rank ``2i`` sends to ``2i+1``, which combines ``x[2i] op x[2i+1]``), leaving
``p`` participants. Participant ``i`` stands for ranks ``{2i, 2i+1}`` if ``i < rem``,
else ``{i + rem}``: participants are numbered in rank order. In round ``d = 1, 2, 4, ...``
participant ``i`` swaps its partial result with participant ``i ^ d`` and both compute
``lower op higher`` (the lower-numbered participant's value on the left). At the end the
folded-in even ranks get the result from their partner.

Order of reduction (bitwise identity): both partners of a round evaluate the same
expression on the same operand bits in the same operand order, so they hold the same
bits after every round; the result is a fold in rank order ``0, 1, ..., n-1`` with a
balanced-tree parenthesisation, e.g. ``((x0 op x1) op (x2 op x3))``. Finishing (AVG
divides by ``n``) is the same operation on the same bits everywhere.

Reference: R. Thakur, R. Rabenseifner and W. Gropp, "Optimization of collective
communication operations in MPICH", IJHPCA 19(1), 2005 (sec. 4.4); the fold-in of
non-powers of two as in R. Rabenseifner, "Optimization of collective reduction operations",
ICCS 2004.
"""

from __future__ import annotations

import numpy as np

from ..reduce_op import ReduceOp, combine_into, finish
from .links import Links
from .messages import exchange, recv, send

_FOLD_IN, _EXCHANGE, _FOLD_OUT = 0, 1, 2


def all_reduce(links: Links, a: np.ndarray, op: ReduceOp, *, step: int = 0) -> None:
    """Recursive-doubling all-reduce of ``a`` in place (any ``n``).

    Idea: ``log2 p`` rounds of pairwise exchange with partners at distance 1, 2, 4, ...;
    after round ``k`` each rank holds the reduction of its aligned block of ``2**(k+1)``
    participants. Non-powers of two fold ``rem`` ranks in before and out after.
    Cost: ``(log2 p + 2 [n != p]) alpha + (log2 p + 2 [n != p]) m beta
    + (log2 p + [n != p]) m gamma``; scratch ``m``. Best for small ``m``.
    Uses steps ``step .. step + 2``.
    Reference: Thakur, Rabenseifner and Gropp, IJHPCA 19(1), 2005.
    """
    n, r = links.size, links.rank
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    if r < 2 * rem and r % 2 == 0:
        # Folded in: hand our data to the odd neighbour, later take the result back.
        send(links, a, r + 1, step + _FOLD_IN)
        recv(links, a, r + 1, step + _FOLD_OUT)
        return

    mine, other = a, np.empty_like(a)
    if r < 2 * rem:
        recv(links, other, r - 1, step + _FOLD_IN)
        combine_into(op, other, mine)          # x[r-1] op x[r]
        mine, other = other, mine
        me = r // 2
    else:
        me = r - rem

    d = 1
    while d < p:
        peer = me ^ d
        peer_rank = 2 * peer + 1 if peer < rem else peer + rem
        exchange(links, mine, peer_rank, other, peer_rank, step + _EXCHANGE)
        if me < peer:
            combine_into(op, mine, other)      # mine op theirs
        else:
            combine_into(op, other, mine)      # theirs op mine
            mine, other = other, mine
        d <<= 1

    finish(op, mine, n)
    if mine is not a:
        a[...] = mine
    if r < 2 * rem:
        send(links, a, r - 1, step + _FOLD_OUT)
