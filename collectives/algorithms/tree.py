"""Binomial-tree algorithms: broadcast, reduce, gather and scatter in ``ceil(log2 n)``
rounds.

Ranks are renumbered relative to the root, ``v = (rank - root) % n``. Node ``v > 0`` has
parent ``v - lowbit(v)``; its children are ``v + 2**i`` for every ``2**i`` below its
subtree size ``min(lowbit(v), n - v)`` (the root's subtree is all ``n``). The subtree of
``v`` is the contiguous range of relative ranks ``[v, v + size)``, so gather and scatter
move each subtree's parts as one message.

Reduction order: node ``v`` folds its children's partial results in on the right, smallest
subtree first, so the root computes a left fold over relative ranks ``root, root+1, ...,
root-1`` with a tree parenthesisation (one fixed order for given ``n`` and root).

Reference: R. Thakur, R. Rabenseifner and W. Gropp, "Optimization of collective
communication operations in MPICH", IJHPCA 19(1), 2005. Costs use the alpha-beta-gamma
model (``m`` bytes, ``n`` ranks, ``L = ceil(log2 n)``).
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import numpy as np

from ..reduce_op import ReduceOp, combine_into, finish
from .links import Links, wait_all
from .messages import irecv, isend, recv, send

#: ``region(lo, hi)``: the contiguous array holding the parts of relative ranks [lo, hi).
Region = Callable[[int, int], np.ndarray]


def subtree_size(v: int, n: int) -> int:
    """Number of relative ranks in the subtree of ``v`` (itself included)."""
    return n if v == 0 else min(v & -v, n - v)


def children(v: int, n: int) -> Iterator[tuple[int, int]]:
    """``(child, its subtree size)`` of node ``v``, largest subtree first."""
    mask = 1 << max(subtree_size(v, n) - 1, 0).bit_length() >> 1
    while mask:
        yield v + mask, min(mask, n - v - mask)
        mask >>= 1


def scatter_regions(links: Links, root: int, region: Region, *, step: int = 0) -> None:
    """Binomial scatter: each node receives its subtree's region from its parent, then
    passes each child the child's subtree region (non-blocking, largest first)."""
    n = links.size
    v = (links.rank - root) % n
    if v:
        recv(links, region(v, v + subtree_size(v, n)), (v - (v & -v) + root) % n, step)
    wait_all([w for c, size in children(v, n)
              for w in isend(links, region(c, c + size), (c + root) % n, step)])


def gather_regions(links: Links, root: int, region: Region, *, step: int = 0) -> None:
    """Binomial gather: each node receives every child's subtree region (all posted at
    once), then sends its whole subtree region to its parent."""
    n = links.size
    v = (links.rank - root) % n
    wait_all([w for c, size in children(v, n)
              for w in irecv(links, region(c, c + size), (c + root) % n, step)])
    if v:
        send(links, region(v, v + subtree_size(v, n)), (v - (v & -v) + root) % n, step)


def broadcast(links: Links, a: np.ndarray, src: int, *, step: int = 0) -> None:
    """Binomial-tree broadcast of ``a`` from ``src`` (read only there).

    Idea: in round ``i`` every rank that has the data sends it ``2**i`` places further;
    the set of informed ranks doubles each round.
    Cost: ``L (alpha + m beta)``; no scratch. Best for small messages.
    Reference: Thakur, Rabenseifner and Gropp, IJHPCA 19(1), 2005, sec. 4.1.
    """
    scatter_regions(links, src, lambda lo, hi: a, step=step)


def reduce(links: Links, a: np.ndarray, dst: int, op: ReduceOp, *, step: int = 0) -> None:
    """Binomial-tree reduce of every rank's ``a`` into ``a`` on ``dst``; the other ranks'
    ``a`` stay unchanged (an inner node combines into a scratch copy).

    Idea: the broadcast tree run backwards; each node receives its children's partial
    results one by one (smallest subtree first), folds them in on the right, and sends
    its own partial to its parent.
    Cost: ``L (alpha + m beta + m gamma)``; scratch ``2 m`` on inner nodes, ``m`` at the
    root.
    Reference: Thakur, Rabenseifner and Gropp, IJHPCA 19(1), 2005.
    """
    n = links.size
    v = (links.rank - dst) % n
    kids = sorted(children(v, n))
    acc = a if v == 0 or not kids else a.copy()
    if kids:
        tmp = np.empty_like(a)
        for c, _ in kids:
            recv(links, tmp, (c + dst) % n, step)
            combine_into(op, acc, tmp)
    if v:
        send(links, acc, (v - (v & -v) + dst) % n, step)
    else:
        finish(op, a, n)


def gather(links: Links, inp: np.ndarray, out: Optional[np.ndarray], dst: int, *,
           step: int = 0) -> None:
    """Binomial-tree gather: ``out`` on ``dst`` = every rank's ``inp`` in rank order.

    Idea: each node collects its subtree's parts (relative rank order, contiguous) and
    forwards them as one message; the root rotates relative order into rank order.
    Cost: ``L alpha + (n-1)/n m beta`` (``m`` = output bytes); scratch: the subtree's
    parts on inner nodes, plus ``m`` on the root when ``dst != 0``.
    Reference: Thakur, Rabenseifner and Gropp, IJHPCA 19(1), 2005.
    """
    n, k = links.size, inp.size
    v = (links.rank - dst) % n
    if v == 0:
        buf = out if dst == 0 else np.empty(n * k, inp.dtype)
    elif subtree_size(v, n) == 1:
        buf = inp
    else:
        buf = np.empty(subtree_size(v, n) * k, inp.dtype)
    if buf is not inp:
        buf[:k] = inp
    gather_regions(links, dst, lambda lo, hi: buf[(lo - v) * k:(hi - v) * k], step=step)
    if v == 0 and dst != 0:
        out[dst * k:] = buf[:(n - dst) * k]
        out[:dst * k] = buf[(n - dst) * k:]


def scatter(links: Links, out: np.ndarray, inp: Optional[np.ndarray], src: int, *,
            step: int = 0) -> None:
    """Binomial-tree scatter: part ``r`` of ``inp`` on ``src`` lands in ``out`` on rank
    ``r`` (``inp`` is only read).

    Idea: the gather tree run forwards; each node receives its subtree's parts at once
    and hands each child the child's subtree.
    Cost: ``L alpha + (n-1)/n m beta`` (``m`` = input bytes); scratch: the subtree's
    parts on inner nodes, plus ``m`` on the root when ``src != 0``.
    Reference: Thakur, Rabenseifner and Gropp, IJHPCA 19(1), 2005.
    """
    n, k = links.size, out.size
    v = (links.rank - src) % n
    if v == 0:
        buf = inp if src == 0 else np.concatenate((inp[src * k:], inp[:src * k]))
    elif subtree_size(v, n) == 1:
        buf = out
    else:
        buf = np.empty(subtree_size(v, n) * k, out.dtype)
    scatter_regions(links, src, lambda lo, hi: buf[(lo - v) * k:(hi - v) * k], step=step)
    if buf is not out:
        out[...] = buf[:k]
