"""Pairwise-exchange all-to-all (any number of ranks, any split sizes).

Reference: R. Thakur, R. Rabenseifner and W. Gropp, "Optimization of collective
communication operations in MPICH", IJHPCA 19(1), 2005 (sec. 4.6).
"""

from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import numpy as np

from ..errors import CollectiveMismatch, where
from .links import Links
from .messages import exchange


def all_to_all(links: Links, out: np.ndarray, inp: np.ndarray, out_counts: Sequence[int],
               in_counts: Sequence[int], *, step: int = 0) -> None:
    """Rank ``i`` sends part ``j`` of ``inp`` (``in_counts[j]`` elements) to rank ``j``,
    which stores it as part ``i`` of ``out`` (``out_counts[i]`` elements); ``inp`` is
    only read.

    Idea: copy the own part locally, then in step ``s = 1 .. n-1`` send to ``rank + s``
    and receive from ``rank - s`` at once (each step is a permutation, so no rank is a
    hot spot and no send waits for another).
    Cost: ``(n-1) alpha + (n-1)/n m beta`` for equal parts (``m`` = bytes sent per
    rank); no scratch.
    Reference: Thakur, Rabenseifner and Gropp, IJHPCA 19(1), 2005.
    """
    n, r = links.size, links.rank
    out_at = [0, *accumulate(out_counts)]
    in_at = [0, *accumulate(in_counts)]
    if out_counts[r] != in_counts[r]:
        raise CollectiveMismatch(
            f"{where(r, n, 'all_to_all')}: this rank sends itself {in_counts[r]} elements "
            f"but expects {out_counts[r]} from itself (split sizes disagree)")
    out[out_at[r]:out_at[r + 1]] = inp[in_at[r]:in_at[r + 1]]
    for s in range(1, n):
        dst, src = (r + s) % n, (r - s) % n
        exchange(links, inp[in_at[dst]:in_at[dst + 1]], dst,
                 out[out_at[src]:out_at[src + 1]], src, step)
