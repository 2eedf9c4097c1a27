"""Two-phase algorithms for large rooted messages: split the message into ``n`` chunks so
that every rank carries ``1/n`` of it, then reassemble.

- broadcast = binomial scatter of the chunks + ring all-gather (van de Geijn);
- reduce = ring reduce-scatter + binomial gather of the reduced chunks (Rabenseifner).

Chunks are numbered relative to the root: the rank at ``(root + j) % n`` owns chunk ``j``
(``ring.chunk_bounds``), so a subtree of the relative binomial tree owns a contiguous
range of the message and moves it as one message.

Reduction order: chunk ``j`` is combined by one ring chain, in ring order starting after
its owner (``ring``'s order with the owner at position ``j``), then gathered as bits.
"""

from __future__ import annotations

import numpy as np

from ..reduce_op import ReduceOp, finish
from . import ring, tree
from .links import Links


def broadcast(links: Links, a: np.ndarray, src: int, *, step: int = 0) -> None:
    """Scatter + all-gather broadcast of ``a`` from ``src`` (read only there).

    Idea: scatter chunk ``j`` to relative rank ``j`` down a binomial tree (straight into
    ``a``, which has room for all of it on every rank), then ring all-gather the chunks;
    the root already holds everything, so the ring is opened before it.
    Cost: ``(L + n - 1) alpha + 2 (n-1)/n m beta`` against the binomial tree's
    ``L (alpha + m beta)``; no scratch. Uses steps ``step`` and ``step + 1``.
    Reference: M. Barnett, S. Gupta, D. Payne, L. Shuler, R. van de Geijn and J. Watts,
    "Interprocessor collective communication library (InterCom)", SHPCC 1994; Thakur,
    Rabenseifner and Gropp, IJHPCA 19(1), 2005, sec. 4.1.
    """
    n = links.size
    bounds = ring.chunk_bounds(a.size, n)
    tree.scatter_regions(links, src, lambda lo, hi: a[bounds[lo]:bounds[hi]], step=step)
    ring.all_gather_chunks(links, a, bounds, shift=src, step=step + 1, first_has_all=True)


def reduce(links: Links, a: np.ndarray, dst: int, op: ReduceOp, *, step: int = 0) -> None:
    """Reduce-scatter + gather reduce of every rank's ``a`` into ``a`` on ``dst``; the
    other ranks' ``a`` stay unchanged.

    Idea: a ring reduce-scatter leaves reduced chunk ``j`` on relative rank ``j`` (in
    scratch off the root), then a binomial gather collects the chunks into ``a`` on the
    root, which finishes the result (AVG divides).
    Cost: ``(n - 1 + L) alpha + 2 (n-1)/n m beta + (n-1)/n m gamma`` against the binomial
    tree's ``L (alpha + m beta + m gamma)``; scratch ``2 m/n`` plus, off the root, the
    subtree's chunks (at most ``m/2``). Uses steps ``step`` and ``step + 1``.
    Reference: R. Rabenseifner, "Optimization of collective reduction operations",
    ICCS 2004.
    """
    n = links.size
    v = (links.rank - dst) % n
    bounds = ring.chunk_bounds(a.size, n)
    top = bounds[v + tree.subtree_size(v, n)]
    buf = a if v == 0 else np.empty(top - bounds[v], a.dtype)
    base = 0 if v == 0 else bounds[v]
    ring.reduce_scatter_chunks(links, a, bounds, op,
                               buf[bounds[v] - base:bounds[v + 1] - base], shift=dst, step=step)
    tree.gather_regions(links, dst, lambda lo, hi: buf[bounds[lo] - base:bounds[hi] - base],
                        step=step + 1)
    if v == 0:
        finish(op, a, n)
