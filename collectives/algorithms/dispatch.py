"""Which algorithm runs each collective, by message size and world size.

The choice depends only on values every rank shares (the group size and the message's
byte count, equal on every rank of a correct call), so all ranks always pick the same
algorithm. The thresholds are module constants, to be tuned with ``collectives.bench``.

- broadcast: binomial tree (``tree``); for ``n > 2`` and ``m >= BROADCAST_LARGE_BYTES``
  scatter + ring all-gather (``two_phase``).
- all_reduce: recursive doubling (``recursive_doubling``); for ``m >=
  ALL_REDUCE_RING_BYTES`` (and at least ``n`` elements) ring reduce-scatter + all-gather
  (``ring``).
- reduce: binomial tree (``tree``); for ``n > 2`` and ``m >= REDUCE_LARGE_BYTES`` ring
  reduce-scatter + binomial gather (``two_phase``).
- all_gather, reduce_scatter: ring (``ring``).
- gather, scatter: binomial tree (``tree``).
- all_to_all: pairwise exchange (``pairwise``).
- barrier: dissemination (``dissemination``).

A world of one never communicates.

Every all-reduce algorithm here leaves bitwise-identical results on all ranks (each
module's docstring gives its order of reduction).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..paths import Path, PathTable
from ..reduce_op import ReduceOp, finish
from . import dissemination, pairwise, recursive_doubling, ring, tree, two_phase
from .links import Links

#: all_reduce switches from recursive doubling to the ring at this many bytes.
ALL_REDUCE_RING_BYTES = 64 * 1024
#: broadcast switches from the binomial tree to scatter + all-gather at this many bytes.
BROADCAST_LARGE_BYTES = 512 * 1024
#: reduce switches from the binomial tree to reduce-scatter + gather at this many bytes.
REDUCE_LARGE_BYTES = 512 * 1024

#: The choices below as a table (``pg.describe()``; the conformance suite crosses every
#: line from both sides).
PATHS = PathTable({
    "broadcast": [Path("binomial tree", BROADCAST_LARGE_BYTES,
                       "algorithms.BROADCAST_LARGE_BYTES", min_ranks=3),
                  Path("scatter + ring all-gather", min_ranks=3),
                  Path("binomial tree", max_ranks=2)],
    "all_reduce": [Path("recursive doubling", ALL_REDUCE_RING_BYTES,
                        "algorithms.ALL_REDUCE_RING_BYTES"),
                   Path("ring reduce-scatter + all-gather")],
    "reduce": [Path("binomial tree", REDUCE_LARGE_BYTES, "algorithms.REDUCE_LARGE_BYTES",
                    min_ranks=3),
               Path("ring reduce-scatter + binomial gather", min_ranks=3),
               Path("binomial tree", max_ranks=2)],
    "all_gather": [Path("ring")],
    "reduce_scatter": [Path("ring")],
    "gather": [Path("binomial tree")],
    "scatter": [Path("binomial tree")],
    "all_to_all": [Path("pairwise exchange")],
    "barrier": [Path("dissemination")],
})


def _split_pays(links: Links, a: np.ndarray, threshold: int) -> bool:
    """Whether cutting ``a`` into ``n`` chunks beats sending it whole."""
    return links.size > 2 and a.nbytes >= threshold and a.size >= links.size


def broadcast(links: Links, a: np.ndarray, src: int) -> None:
    """Copy ``a`` of rank ``src`` into ``a`` of every rank."""
    if links.size == 1:
        return
    if _split_pays(links, a, BROADCAST_LARGE_BYTES):
        two_phase.broadcast(links, a, src)
    else:
        tree.broadcast(links, a, src)


def all_reduce(links: Links, a: np.ndarray, op: ReduceOp) -> None:
    """Reduce ``a`` over all ranks in place; bitwise-identical results everywhere."""
    if links.size == 1:
        finish(op, a, 1)
    elif a.nbytes >= ALL_REDUCE_RING_BYTES and a.size >= links.size:
        ring.all_reduce(links, a, op)
    else:
        recursive_doubling.all_reduce(links, a, op)


def reduce(links: Links, a: np.ndarray, dst: int, op: ReduceOp) -> None:
    """Reduce ``a`` over all ranks into ``a`` on ``dst``; other ranks' ``a`` unchanged."""
    if links.size == 1:
        finish(op, a, 1)
    elif _split_pays(links, a, REDUCE_LARGE_BYTES):
        two_phase.reduce(links, a, dst, op)
    else:
        tree.reduce(links, a, dst, op)


def all_gather(links: Links, out: np.ndarray, inp: np.ndarray) -> None:
    """``out`` = every rank's ``inp`` concatenated in rank order."""
    ring.all_gather(links, out, inp)


def gather(links: Links, inp: np.ndarray, out: Optional[np.ndarray], dst: int) -> None:
    """``out`` on ``dst`` = every rank's ``inp`` concatenated (``out`` unused elsewhere)."""
    tree.gather(links, inp, out, dst)


def scatter(links: Links, out: np.ndarray, inp: Optional[np.ndarray], src: int) -> None:
    """Part ``r`` of ``inp`` on ``src`` into ``out`` on rank ``r`` (``inp`` unused elsewhere)."""
    tree.scatter(links, out, inp, src)


def reduce_scatter(links: Links, out: np.ndarray, inp: np.ndarray, op: ReduceOp) -> None:
    """``out`` on rank ``r`` = part ``r`` of the reduction of every rank's ``inp``."""
    ring.reduce_scatter(links, out, inp, op)


def all_to_all(links: Links, out: np.ndarray, inp: np.ndarray, out_counts: Sequence[int],
               in_counts: Sequence[int]) -> None:
    """Part ``j`` of ``inp`` to rank ``j``, stored there as part ``rank`` of ``out``
    (counts are elements per peer)."""
    pairwise.all_to_all(links, out, inp, out_counts, in_counts)


def barrier(links: Links) -> None:
    """Return once every rank entered."""
    dissemination.barrier(links)
