"""What one benchmarked operation moves, how fast that is, and whether it came out right.

Pure numpy, no communication: the same :class:`Case` feeds our ProcessGroup and the raw
peer libraries (:mod:`collectives.bench.peers`), so every implementation moves the same
bytes and is checked against the same expected values.

Sizes follow nccl-tests: ``bytes`` is the size of the op's *full* buffer, the one that
holds all ``n`` parts where there are parts:

============== ============================== ======================
op             ``bytes`` is                   busbw factor
============== ============================== ======================
all_reduce     the buffer (in place)          2(n-1)/n
reduce         the buffer (in place at root)  1
broadcast      the buffer                     1
all_gather     the output (n x input)         (n-1)/n
reduce_scatter the input (n x output)         (n-1)/n
gather         the root's output (n x input)  (n-1)/n
scatter        the root's input (n x output)  (n-1)/n
all_to_all     the input (= the output)       (n-1)/n
============== ============================== ======================

With ``--uneven`` an all_to_all's parts differ: rank i sends rank j ``splits[i][j]``
elements, a fixed random pattern per size and world size (:func:`uneven_splits`), the same
for every implementation; each rank's input still holds ``bytes``, its output what the
others send it.

``count`` is that buffer's number of elements; a requested size is rounded down to a
whole number of elements (and, for the ops with parts, of ``n`` elements), with at least
one element per part, so 4 bytes of all_gather at 2 ranks becomes 8. ``algbw = bytes /
time`` and ``busbw = algbw x factor``: the traffic of each rank's busiest link, comparable
across world sizes and with the hardware's bandwidth.

Inputs are small integers depending on rank and index (:func:`pattern`): every sum over a
few ranks is exact in float16, bfloat16, float32, float64 and the integer types, so a
result is either bitwise right or counted wrong, element by element (nccl-tests'
``#wrong``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from .. import dtypes

#: Every op the benchmark knows, in the order ``--ops all`` runs them.
OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "broadcast",
                        "all_to_all", "reduce", "gather", "scatter")

#: busbw = algbw x factor(n); nccl-tests' factors (the contract in :mod:`collectives.bench`).
BUSBW_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,
    "reduce": lambda n: 1.0,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
}

#: Ops whose buffer holds one part per rank: their count is a multiple of the world size.
PARTED = frozenset({"all_gather", "reduce_scatter", "gather", "scatter", "all_to_all"})
#: Ops that reduce (their expected values are sums over ranks).
REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter"})

#: Supported dtypes and the largest integer each represents exactly (sums must stay below).
_EXACT_UP_TO: dict[str, int] = {"float16": 2048, "bfloat16": 256, "float32": 1 << 24,
                                "float64": 1 << 53, "int32": (1 << 31) - 1,
                                "int64": (1 << 63) - 1}
DTYPES: tuple[str, ...] = tuple(_EXACT_UP_TO)

#: Pattern values are 1 ..  _MODULUS.
_MODULUS = 11
#: The root of the rooted ops (reduce, broadcast, gather, scatter).
ROOT = 0


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype called ``name`` (bfloat16 through ml_dtypes)."""
    if name == "bfloat16":
        return dtypes.bfloat16()
    if name not in _EXACT_UP_TO:
        raise ValueError(f"bench: argument `dtype` must be one of {', '.join(DTYPES)}, "
                         f"got {name!r}")
    return np.dtype(name)


def busbw_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``op`` at ``world_size`` ranks.

    >>> busbw_factor("all_reduce", 4)
    1.5
    """
    try:
        return BUSBW_FACTORS[op](world_size)
    except KeyError:
        raise ValueError(f"bench: unknown op {op!r}; known: {', '.join(OPS)}") from None


def bandwidths(op: str, nbytes: int, world_size: int, seconds: float) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s (10**9 bytes per second) of ``nbytes`` in ``seconds``."""
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * busbw_factor(op, world_size)


def element_count(op: str, nbytes: int, itemsize: int, world_size: int) -> int:
    """Elements of the op's full buffer for a requested size of ``nbytes`` (see the module
    docstring: rounded down, at least one element per part)."""
    count = nbytes // itemsize
    if op in PARTED:
        return max(world_size, count - count % world_size)
    return max(1, count)


def check_world(dtype: str, world_size: int) -> None:
    """ValueError if sums of ``world_size`` pattern values are not exact in ``dtype``."""
    if _MODULUS * world_size > _EXACT_UP_TO[dtype]:
        raise ValueError(f"bench: dtype {dtype} cannot hold the exact sums of {world_size} "
                         f"ranks (at most {_EXACT_UP_TO[dtype] // _MODULUS}); argument "
                         f"`dtype`: choose a wider one")


def pattern(rank: int, start: int, count: int, dtype: np.dtype) -> np.ndarray:
    """Rank ``rank``'s values at global indices ``start .. start+count-1``: integers in
    1..11 that depend on both, so a part that lands at the wrong place or comes from the
    wrong rank is counted wrong.

    >>> pattern(1, 0, 4, np.dtype("float32"))
    array([6., 2., 9., 5.], dtype=float32)
    """
    i = np.arange(start, start + count, dtype=np.int64)
    values = (i * 7 + (i // _MODULUS) * 3 + rank * 5) % _MODULUS + 1
    return values.astype(dtype)


def uneven_splits(count: int, world_size: int) -> list[list[int]]:
    """``splits[i][j]``: the elements rank i sends rank j in an uneven all_to_all where every
    rank sends ``count`` in all. A fixed random pattern (seeded by ``count`` and the world
    size, so every implementation and every rank draws the same one): rank i's parts are
    proportional to weights drawn from [0.25, 1), the last part taking the rounding.

    >>> uneven_splits(100, 2)
    [[46, 54], [56, 44]]
    """
    rng = np.random.default_rng([count, world_size, 33])
    weights = rng.uniform(0.25, 1.0, (world_size, world_size))
    splits = np.floor(count * weights / weights.sum(1, keepdims=True)).astype(np.int64)
    splits[:, -1] += count - splits.sum(1)
    return splits.tolist()


def _sum_over_ranks(world_size: int, start: int, count: int, dtype: np.dtype) -> np.ndarray:
    total = np.zeros(count, np.int64)
    for r in range(world_size):
        total += pattern(r, start, count, np.dtype(np.int64))
    return total.astype(dtype)


def _poison(a: Optional[np.ndarray]) -> None:
    """Fill an output with values no correct result has (patterns and sums are >= 1)."""
    if a is not None:
        a.fill(np.nan if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else -1)


@dataclass
class Case:
    """One op at one size on one rank: its buffers, how to reset them between
    iterations, and the check of the result.

    ``send``/``recv`` are the op's input and output (``recv`` alone for the in-place
    ops: all_reduce, reduce, broadcast); either is None where this rank passes none (the
    non-root ranks' output of gather, input of scatter). ``restore`` is the pristine
    input of an in-place reduction, copied back before each iteration so that every
    iteration reduces the same values (repeated in-place sums would overflow).
    """

    op: str
    rank: int
    world_size: int
    dtype: str
    count: int
    send: Optional[np.ndarray]
    recv: Optional[np.ndarray]
    restore: Optional[np.ndarray] = None
    #: An uneven all_to_all's :func:`uneven_splits` (None: equal parts).
    splits: Optional[list] = None

    @property
    def send_splits(self) -> list[int]:
        """Elements this rank sends each rank (an uneven all_to_all)."""
        return list(self.splits[self.rank])

    @property
    def recv_splits(self) -> list[int]:
        """Elements this rank receives from each rank (an uneven all_to_all)."""
        return [row[self.rank] for row in self.splits]

    @property
    def nbytes(self) -> int:
        """The op's size in nccl-tests' convention (the module docstring)."""
        return self.count * numpy_dtype(self.dtype).itemsize

    @property
    def part(self) -> int:
        """Elements per rank's part (the whole count for the ops without parts)."""
        return self.count // self.world_size if self.op in PARTED else self.count

    def prepare(self, final: bool) -> None:
        """Reset before an iteration (outside the timed region). ``final``: the iteration
        whose result :meth:`wrong` checks; its outputs are poisoned first, so a stale
        result from an earlier iteration cannot pass."""
        if self.restore is not None:
            np.copyto(self.recv, self.restore)
        elif final and not (self.op == "broadcast" and self.rank == ROOT):
            _poison(self.recv)

    def expected(self) -> Optional[np.ndarray]:
        """What ``recv`` must hold after the op on this rank (None: nothing to check)."""
        n, r, p, dt = self.world_size, self.rank, self.part, numpy_dtype(self.dtype)
        if self.op == "all_reduce" or (self.op == "reduce" and r == ROOT):
            return _sum_over_ranks(n, 0, self.count, dt)
        if self.op == "broadcast":
            return pattern(ROOT, 0, self.count, dt)
        if self.op == "all_gather" or (self.op == "gather" and r == ROOT):
            return np.concatenate([pattern(j, 0, p, dt) for j in range(n)])
        if self.op == "scatter":
            return pattern(ROOT, r * p, p, dt)
        if self.op == "reduce_scatter":
            return _sum_over_ranks(n, r * p, p, dt)
        if self.op == "all_to_all" and self.splits is not None:
            return np.concatenate([pattern(j, sum(self.splits[j][:r]), self.splits[j][r], dt)
                                   for j in range(n)])
        if self.op == "all_to_all":
            return np.concatenate([pattern(j, r * p, p, dt) for j in range(n)])
        return None  # reduce and gather on a non-root rank

    def wrong(self) -> int:
        """Elements of this rank's result that differ from the expected values."""
        want = self.expected()
        if want is None:
            return 0
        got = self.recv
        if got is None or got.shape != want.shape:
            return int(want.size)
        return int(np.count_nonzero(got != want))


def make_case(op: str, nbytes: int, dtype: str, rank: int, world_size: int, *,
              uneven: bool = False) -> Case:
    """The buffers of ``op`` at ``nbytes`` (nccl-tests' convention) on ``rank``; with
    ``uneven``, an all_to_all's parts follow :func:`uneven_splits` (other ops ignore it).

    Two ranks, all_gather of 16 bytes of float32: rank 0 sends 2 elements and receives 4::

        case = make_case("all_gather", 16, "float32", 0, 2)
        case.send.size, case.recv.size    # (2, 4)
    """
    if op not in BUSBW_FACTORS:
        raise ValueError(f"bench: unknown op {op!r}; known: {', '.join(OPS)}")
    dt = numpy_dtype(dtype)
    check_world(dtype, world_size)
    count = element_count(op, nbytes, dt.itemsize, world_size)
    n, r = world_size, rank
    p = count // n if op in PARTED else count
    send = recv = restore = splits = None
    if op in ("all_reduce", "reduce"):
        restore = pattern(r, 0, count, dt)
        recv = restore.copy()
    elif op == "broadcast":
        recv = pattern(ROOT, 0, count, dt) if r == ROOT else np.empty(count, dt)
    elif op in ("all_gather", "gather"):
        send = pattern(r, 0, p, dt)
        if op == "all_gather" or r == ROOT:
            recv = np.empty(count, dt)
    elif op == "scatter":
        send = pattern(ROOT, 0, count, dt) if r == ROOT else None
        recv = np.empty(p, dt)
    elif op == "reduce_scatter":
        send = pattern(r, 0, count, dt)
        recv = np.empty(p, dt)
    else:  # all_to_all
        splits = uneven_splits(count, n) if uneven else None
        send = pattern(r, 0, count, dt)
        recv = np.empty(count if splits is None else sum(row[r] for row in splits), dt)
    case = Case(op=op, rank=r, world_size=n, dtype=dtype, count=count, send=send,
                recv=recv, restore=restore, splits=splits if op == "all_to_all" else None)
    case.prepare(final=True)  # touch every output page now, not in the first timed iteration
    return case
