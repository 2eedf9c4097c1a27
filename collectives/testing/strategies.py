"""Hypothesis strategies for collectives, and each rank's input derived from a case.

The driver draws a :class:`CollectiveCase` (which op, shape, dtype, reduction, root,
memory layout, tensor kind, seed); every rank then derives its own input from
``(case.seed, rank)`` with :func:`make_input`, so ranks never draw on their own and
cannot fall out of step. :func:`expected_outputs` is the numpy reference
(:mod:`collectives.testing.reference`) applied to all ranks' inputs.

Values are small integers, so every sum, product, minimum and maximum is exact whatever
order a backend combines the ranks in: ``-3..3`` (``0..3`` unsigned) for SUM, AVG, MIN
and MAX, ``{-2, -1, 1, 2}`` (``{1, 2}`` unsigned, and ``+-1`` beyond the sixth rank so that
products fit ``int8``) for PRODUCT, ``-100..100`` (``0..100`` unsigned) for ops that only
move data. Only AVG rounds (one division), and is compared with a tolerance.

What two ranks get and must hold (computed in any process: no ranks are started):

>>> case = CollectiveCase("all_reduce", (3,), "float32", reduce_op="SUM")
>>> inputs = [make_input(case, r, 2) for r in range(2)]     # each rank's tensor
>>> outputs = expected_outputs(case, 2)                     # [sum, sum]
>>> bool((outputs[0] == inputs[0] + inputs[1]).all()), len(outputs)
(True, 2)
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
from hypothesis import strategies as st

from .. import dtypes
from ..reduce_op import ReduceOp
from ..thresholds import SizeThreshold, boundary_sizes
from . import reference

#: Every operation of the contract, by method name.
OPS: tuple[str, ...] = ("broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter",
                        "reduce_scatter", "all_to_all", "barrier")
#: Ops that take a ReduceOp.
REDUCING_OPS = frozenset({"all_reduce", "reduce", "reduce_scatter"})
#: Ops whose one tensor is both input and output.
IN_PLACE_OPS = frozenset({"broadcast", "all_reduce", "reduce"})
#: Ops with a root, and the name of its argument.
ROOT_ARG = {"broadcast": "src", "reduce": "dst", "gather": "dst", "scatter": "src"}

#: Dtype names, as ``str(numpy.dtype)`` spells them (``bfloat16`` is ml_dtypes').
DTYPES: tuple[str, ...] = dtypes.NAMES
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
LAYOUTS = ("contiguous", "strided")
KINDS = ("numpy", "torch")

def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a dtype name of :data:`DTYPES`."""
    if name not in DTYPES:
        raise KeyError(name)
    return dtypes.by_name(name)


@dataclass(frozen=True)
class CollectiveCase:
    """One call of one collective on every rank of a world, fully determined.

    ``shape`` is the shape of one rank's contribution: the tensor of broadcast,
    all_reduce and reduce; the input of all_gather and gather; the output of scatter and
    reduce_scatter; one peer's part of all_to_all (whose tensors have ``size`` parts).
    With ``splits`` (all_to_all only), rank i sends ``splits[i][j]`` rows of shape
    ``shape[1:]`` to rank j and ``shape[0]`` is not used. ``layout="strided"`` passes
    non-contiguous views; ``kind`` is ``"numpy"``, ``"torch"`` (CPU) or ``"cuda"``.
    """

    op: str
    shape: tuple[int, ...] = ()
    dtype: str = "float32"
    reduce_op: Optional[str] = None
    root: Optional[int] = None
    layout: str = "contiguous"
    kind: str = "numpy"
    seed: int = 0
    splits: Optional[tuple[tuple[int, ...], ...]] = None
    async_op: bool = False
    #: ``(rank, seconds)``: that rank sleeps so long before the call (skewed arrival).
    delay: Optional[tuple[int, float]] = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"CollectiveCase: unknown op {self.op!r}; one of {OPS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"CollectiveCase: unknown dtype {self.dtype!r}; one of {DTYPES}")
        for arg, value, wanted in (("reduce_op", self.reduce_op, REDUCING_OPS),
                                   ("root", self.root, ROOT_ARG)):
            if (value is None) == (self.op in wanted):
                raise ValueError(f"CollectiveCase: {self.op} "
                                 f"{'needs' if value is None else 'takes no'} {arg}")
        if self.splits is not None and self.op != "all_to_all":
            raise ValueError("CollectiveCase: splits are for all_to_all only")
        if self.op == "all_to_all" and not self.shape:
            raise ValueError("CollectiveCase: all_to_all needs at least one dimension")

    @property
    def reduction(self) -> Optional[ReduceOp]:
        """``reduce_op`` as a :class:`ReduceOp` (None for ops that do not reduce)."""
        return None if self.reduce_op is None else ReduceOp[self.reduce_op]

    def replace(self, **changes: object) -> "CollectiveCase":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


# ------------------------------------------------------------------------------ shapes
def input_shape(case: CollectiveCase, rank: int, world_size: int) -> Optional[tuple[int, ...]]:
    """The shape of ``rank``'s input tensor (None: the op takes none there)."""
    if case.op == "barrier":
        return None
    if case.op in ("scatter", "reduce_scatter"):
        if case.op == "scatter" and rank != case.root:
            return None
        return reference.stacked_shape(case.shape, world_size)
    if case.op == "all_to_all":
        if case.splits is not None:
            return (sum(case.splits[rank]), *case.shape[1:])
        return reference.stacked_shape(case.shape, world_size)
    return tuple(case.shape)


def output_shape(case: CollectiveCase, rank: int, world_size: int) -> Optional[tuple[int, ...]]:
    """The shape of ``rank``'s separate output tensor (None: in place, or none there)."""
    if case.op in IN_PLACE_OPS or case.op == "barrier":
        return None
    if case.op in ("scatter", "reduce_scatter"):
        return tuple(case.shape)
    if case.op == "gather" and rank != case.root:
        return None
    if case.op == "all_to_all" and case.splits is not None:
        return (sum(row[rank] for row in case.splits), *case.shape[1:])
    return reference.stacked_shape(case.shape, world_size)


# ------------------------------------------------------------------------------ inputs
def value_range(case: CollectiveCase, rank: int) -> tuple[int, ...]:
    """The integers ``rank``'s input values are drawn from (see the module docstring)."""
    unsigned = case.dtype == "uint8"
    if case.reduction is ReduceOp.PRODUCT:
        if unsigned:
            return (1, 2) if rank < 7 else (1,)
        return (-2, -1, 1, 2) if rank < 6 else (-1, 1)
    if case.reduction is not None:
        return tuple(range(0 if unsigned else -3, 4))
    return tuple(range(0 if unsigned else -100, 101))


def make_input(case: CollectiveCase, rank: int, world_size: int) -> Optional[np.ndarray]:
    """``rank``'s input as a C-contiguous numpy array, derived from ``(case.seed, rank)``
    only (None where the rank passes no input: barrier, scatter off the root). Every
    process computes the same arrays for the same arguments.

    >>> case = CollectiveCase("reduce_scatter", (2,), "int32", reduce_op="MAX", seed=7)
    >>> x = make_input(case, 1, 2)            # two ranks x 2 elements, values in -3..3
    >>> x.shape, x.dtype, x.tolist() == make_input(case, 1, 2).tolist()
    ((4,), dtype('int32'), True)
    """
    shape = input_shape(case, rank, world_size)
    if shape is None:
        return None
    rng = np.random.default_rng([case.seed, rank])
    dtype = numpy_dtype(case.dtype)
    if case.dtype == "bool":
        return np.asarray(rng.integers(0, 2, size=shape), np.bool_)
    values = np.array(value_range(case, rank), np.int64)
    return np.asarray(values[rng.integers(0, len(values), size=shape)], dtype)


def all_inputs(case: CollectiveCase, world_size: int) -> list[Optional[np.ndarray]]:
    """:func:`make_input` of every rank, in rank order."""
    return [make_input(case, r, world_size) for r in range(world_size)]


def expected_outputs(case: CollectiveCase, world_size: int) -> list[Optional[np.ndarray]]:
    """What each rank must hold after the call: its output tensor (the tensor itself for
    in-place ops), None for barrier and for gather off the root.

    >>> case = CollectiveCase("gather", (2,), "int64", root=1, seed=3)
    >>> out = expected_outputs(case, 2)
    >>> out[0] is None, out[1].tolist() == [*make_input(case, 0, 2), *make_input(case, 1, 2)]
    (True, True)
    """
    inputs = all_inputs(case, world_size)
    op, root, red = case.op, case.root, case.reduction
    if op == "barrier":
        return reference.barrier(world_size)
    if op == "broadcast":
        return reference.broadcast(inputs, root)
    if op == "all_reduce":
        return reference.all_reduce(inputs, red)
    if op == "reduce":
        return reference.reduce(inputs, root, red)
    if op == "all_gather":
        return reference.all_gather(inputs)
    if op == "gather":
        return reference.gather(inputs, root)
    if op == "scatter":
        return reference.scatter(inputs, root, case.shape)
    if op == "reduce_scatter":
        return reference.reduce_scatter(inputs, red, case.shape)
    return reference.all_to_all(inputs, case.splits)


def tolerance(case: CollectiveCase) -> Optional[float]:
    """The relative tolerance of ``case``'s results, or None when they must be exact.

    Everything is exact but AVG, which may be divided before or after summing (a few
    roundings); compare with ``rtol`` and ``atol = 3 * rtol`` (inputs are at most 3).
    """
    if case.reduction is not ReduceOp.AVG:
        return None
    return {"float16": 1e-2, "bfloat16": 5e-2, "float32": 1e-5}.get(case.dtype, 1e-12)


# --------------------------------------------------------------------------- strategies
#: The largest contribution the size draws make: past zmq's 4 MiB frame, shm's 1 MiB slot.
LARGE_BYTES = (4 << 20) + (64 << 10)


def shape_of(count: int, ndim: int) -> tuple[int, ...]:
    """A shape of ``ndim`` (1..4) dimensions holding exactly ``count`` elements: small
    factors of ``count`` lead, the rest is the last dimension.

    >>> shape_of(24, 3), shape_of(7, 2)
    ((2, 2, 6), (1, 7))
    """
    dims, rest = [], count
    for _ in range(ndim - 1):
        f = next((f for f in (2, 3, 4, 5, 8) if rest % f == 0 and rest > f), 1)
        dims.append(f)
        rest //= f
    return (*dims, rest)


def _shapes(op: str, world_size: int, itemsize: int = 4,
            thresholds: Sequence[SizeThreshold] = ()) -> st.SearchStrategy[tuple[int, ...]]:
    dims = st.sampled_from([0, 1, 2, 3, 5, 7])
    small = st.integers(1 if op == "all_to_all" else 0, 3).flatmap(
        lambda ndim: st.tuples(*[dims] * ndim))
    # a longer odd length, so algorithms that cut a tensor into chunks cut unevenly
    long = st.integers(100, 1500).map(lambda n: (n | 1,))
    if op in ("all_gather", "gather", "scatter", "reduce_scatter", "all_to_all"):
        long = long.map(lambda s: (max(1, s[0] // world_size),))
    ndims = st.integers(1, 4)
    # 1-D to 4-D tensors from 1 KiB to past every threshold, rarer as they grow
    sized = st.tuples(st.integers(10, LARGE_BYTES.bit_length() - 1), st.integers(0, 1023),
                      ndims).map(lambda t: shape_of(
                          max(1, ((1 << t[0]) + (t[1] << max(0, t[0] - 10))) // itemsize),
                          t[2]))
    branches = [small] * 6 + [long] * 2 + [sized] * 2
    near = [(t, k) for t in thresholds if t.applies(op, world_size) for k in range(3)]
    if near:  # just below, at and just above one of the implementation's lines
        branches += [st.tuples(st.sampled_from(near), ndims).map(
            lambda p: shape_of(boundary_sizes(p[0][0], itemsize)[p[0][1]], p[1]))] * 2
    return st.one_of(*branches)


def _reduce_ops(dtype: str) -> list[str]:
    ops = ["SUM", "PRODUCT", "MIN", "MAX"]
    return ops + ["AVG"] if dtype in FLOAT_DTYPES else ops


def collective_cases(world_size: int, ops: Sequence[str] = OPS, dtypes: Sequence[str] = DTYPES,
                     *, kinds: Optional[Sequence[str]] = None,
                     layouts: Sequence[str] = LAYOUTS,
                     async_op: Optional[bool] = None,
                     thresholds: Sequence[SizeThreshold] = (),
                     skew: bool = False) -> st.SearchStrategy[CollectiveCase]:
    """A :class:`CollectiveCase` for a world of ``world_size``: any of ``ops`` and
    ``dtypes`` (bool is drawn only for ops that do not reduce), a reduction valid for the
    dtype, any root, empty, odd and 0-d shapes, 1-D to 4-D tensors up to
    :data:`LARGE_BYTES` (most examples stay small), contiguous or strided tensors of any
    of ``kinds`` (default numpy, plus torch where it is installed), blocking or
    ``async_op=True`` (unless ``async_op`` is fixed). Two all_to_alls in three have uneven
    split sizes: zeros, often a rank that sends nothing and one that receives nothing.

    ``thresholds`` (a group's :meth:`~collectives.ProcessGroup.size_thresholds`) adds
    sizes just below, at and just above each line (and, for uneven all_to_all, rows that
    put one call's parts on both sides of one); ``skew=True`` has a drawn rank sleep
    a drawn 0-2 s before the call (longer than every internal watch or poll interval).

    >>> from hypothesis import given
    >>> @given(collective_cases(2, ops=["all_reduce"]))
    ... def test(case): assert case.reduce_op is not None
    >>> test()
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"collective_cases: world_size must be a positive int, got {world_size!r}")
    unknown = (set(ops) - set(OPS)) | (set(dtypes) - set(DTYPES))
    if unknown:
        raise ValueError(f"collective_cases: unknown ops or dtypes {sorted(unknown)}")
    usable = [op for op in ops if op not in REDUCING_OPS or set(dtypes) - {"bool"}]
    if not usable or not dtypes:
        raise ValueError(f"collective_cases: no dtype of {list(dtypes)} can be used by "
                         f"{list(ops)}")
    if kinds is None:
        kinds = KINDS if importlib.util.find_spec("torch") is not None else ("numpy",)
    return _cases(world_size, tuple(usable), tuple(dtypes), tuple(kinds), tuple(layouts),
                  async_op, tuple(thresholds), skew)


@st.composite
def _cases(draw: st.DrawFn, world_size: int, ops: tuple[str, ...], dtypes: tuple[str, ...],
           kinds: tuple[str, ...], layouts: tuple[str, ...],
           async_op: Optional[bool], thresholds: tuple[SizeThreshold, ...] = (),
           skew: bool = False) -> CollectiveCase:
    op = draw(st.sampled_from(ops))
    delay = (draw(st.integers(0, world_size - 1)),
             draw(st.floats(0.0, 2.0, allow_nan=False))) if skew else None
    if op == "barrier":
        return CollectiveCase("barrier", seed=0, async_op=draw(_async(async_op)),
                              delay=delay)
    dtype = draw(st.sampled_from([d for d in dtypes
                                  if not (op in REDUCING_OPS and d == "bool")]))
    reduce_op = draw(st.sampled_from(_reduce_ops(dtype))) if op in REDUCING_OPS else None
    root = draw(st.integers(0, world_size - 1)) if op in ROOT_ARG else None
    itemsize = numpy_dtype(dtype).itemsize
    shape = draw(_shapes(op, world_size, itemsize, thresholds))
    splits = None
    if op == "all_to_all" and draw(st.integers(0, 2)) > 0:      # uneven, two times in three
        splits = draw(_split_sizes(world_size))
        lines = [t for t in thresholds if t.applies(op, world_size)]
        if lines and draw(st.booleans()):
            # Rows of two thirds of a line: parts of 1 row fall below it, of 2 or 3 rows
            # above, so one call can have parts (and ranks) on both sides.
            shape = (1, max(1, draw(st.sampled_from(lines)).nbytes * 2 // 3 // itemsize))
    return CollectiveCase(
        op=op, shape=shape, dtype=dtype, reduce_op=reduce_op, root=root,
        layout=draw(st.sampled_from(layouts)), kind=draw(st.sampled_from(kinds)),
        seed=draw(st.integers(0, 2**32 - 1)), splits=splits, async_op=draw(_async(async_op)),
        delay=delay)


@st.composite
def _split_sizes(draw: st.DrawFn, world_size: int) -> tuple[tuple[int, ...], ...]:
    """Rows rank i sends rank j: 0 to 3 each (0 often). About half the time one drawn rank
    sends nothing at all while the others may still send to it (in expert parallelism, a
    rank with no tokens), and about half the time one receives nothing (a rank whose
    experts nobody chose)."""
    n = world_size
    rows = [[draw(st.integers(0, 3)) for _ in range(n)] for _ in range(n)]
    silent = draw(st.one_of(st.none(), st.integers(0, n - 1)))
    if silent is not None:
        rows[silent] = [0] * n
    deaf = draw(st.one_of(st.none(), st.integers(0, n - 1)))
    if deaf is not None:
        for row in rows:
            row[deaf] = 0
    return tuple(tuple(row) for row in rows)


def _async(fixed: Optional[bool]) -> st.SearchStrategy[bool]:
    return st.booleans() if fixed is None else st.just(fixed)
