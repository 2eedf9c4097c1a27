"""What every collective means, as pure numpy functions over the whole world.

Each function takes every rank's input (a list indexed by rank) and returns every rank's
expected output (a list indexed by rank). They are the oracle of the conformance suite and
the plainest statement of the contract of :class:`collectives.ProcessGroup`: no transport,
no processes, no order of messages. Reductions combine the ranks left to right through
:func:`collectives.reduce_op.reduce_arrays`, the library's one definition of each operator.

Outputs that are "concatenated along dim 0" are laid out as the library lays them out:
``x`` of shape ``(d0, *rest)`` from ``n`` ranks gives ``(n * d0, *rest)``; a 0-d input
gives ``(n,)`` (see :func:`stacked_shape`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..reduce_op import ReduceOp, reduce_arrays

Splits = Sequence[Sequence[int]]


def stacked_shape(shape: Sequence[int], n: int) -> tuple[int, ...]:
    """The shape of ``n`` arrays of ``shape`` concatenated along dim 0.

    >>> stacked_shape((2, 3), 2), stacked_shape((), 2)
    ((4, 3), (2,))
    """
    shape = tuple(shape)
    return (n * shape[0], *shape[1:]) if shape else (n,)


def _concat(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Concatenate along dim 0 (0-d parts become one element each)."""
    return np.concatenate([_rows(p) for p in parts])


def _rows(x: np.ndarray) -> np.ndarray:
    """``x`` seen as rows along dim 0 (a 0-d array is one row)."""
    x = np.asarray(x)
    return x.reshape(1) if x.ndim == 0 else x


def _split_equal(x: np.ndarray, n: int, shape: Optional[Sequence[int]] = None) -> list[np.ndarray]:
    """``n`` equal parts of ``x`` along dim 0, each reshaped to ``shape`` if given."""
    rows = _rows(x)
    if rows.shape[0] % n:
        raise ValueError(f"{rows.shape[0]} rows cannot be split into {n} equal parts")
    parts = np.split(rows, n)
    return [p.reshape(shape).copy() if shape is not None else p.copy() for p in parts]


def broadcast(inputs: Sequence[np.ndarray], src: int) -> list[np.ndarray]:
    """Every rank ends with rank ``src``'s tensor.

    >>> broadcast([np.array([1, 2]), np.array([3, 4])], src=1)
    [array([3, 4]), array([3, 4])]
    """
    return [np.array(inputs[src], copy=True) for _ in inputs]


def all_reduce(inputs: Sequence[np.ndarray], op: ReduceOp = ReduceOp.SUM) -> list[np.ndarray]:
    """Every rank ends with the reduction of all ranks' tensors (bitwise the same on each).

    >>> all_reduce([np.array([1, 2]), np.array([3, 4])], ReduceOp.SUM)
    [array([4, 6]), array([4, 6])]
    """
    result = reduce_arrays(op, inputs)
    return [result.copy() for _ in inputs]


def reduce(inputs: Sequence[np.ndarray], dst: int,
           op: ReduceOp = ReduceOp.SUM) -> list[np.ndarray]:
    """Rank ``dst`` ends with the reduction; every other rank's tensor is unchanged.

    >>> reduce([np.array([1, 2]), np.array([3, 4])], dst=0, op=ReduceOp.MAX)
    [array([3, 4]), array([3, 4])]
    >>> reduce([np.array([1, 2]), np.array([3, 4])], dst=1, op=ReduceOp.MIN)
    [array([1, 2]), array([1, 2])]
    """
    result = reduce_arrays(op, inputs)
    return [result if r == dst else np.array(x, copy=True) for r, x in enumerate(inputs)]


def all_gather(inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Every rank ends with all ranks' tensors concatenated along dim 0, in rank order.

    >>> all_gather([np.array([1, 2]), np.array([3, 4])])
    [array([1, 2, 3, 4]), array([1, 2, 3, 4])]
    """
    result = _concat(inputs)
    return [result.copy() for _ in inputs]


def gather(inputs: Sequence[np.ndarray], dst: int) -> list[Optional[np.ndarray]]:
    """Rank ``dst`` ends with all tensors concatenated along dim 0; the others with
    nothing (their output argument is ignored).

    >>> gather([np.array([1, 2]), np.array([3, 4])], dst=1)
    [None, array([1, 2, 3, 4])]
    """
    result = _concat(inputs)
    return [result if r == dst else None for r in range(len(inputs))]


def scatter(inputs: Sequence[Optional[np.ndarray]], src: int,
            shape: Optional[Sequence[int]] = None) -> list[np.ndarray]:
    """Rank ``src``'s tensor is split into equal parts along dim 0; rank i gets part i
    (reshaped to ``shape``, the output's shape, if given). Other ranks' inputs are ignored.

    >>> scatter([np.array([1, 2, 3, 4]), None], src=0)
    [array([1, 2]), array([3, 4])]
    """
    return _split_equal(inputs[src], len(inputs), shape)


def reduce_scatter(inputs: Sequence[np.ndarray], op: ReduceOp = ReduceOp.SUM,
                   shape: Optional[Sequence[int]] = None) -> list[np.ndarray]:
    """The reduction of all ranks' tensors, split into equal parts along dim 0; rank i
    gets part i (reshaped to ``shape`` if given).

    >>> reduce_scatter([np.array([1, 2, 3, 4]), np.array([10, 20, 30, 40])])
    [array([11, 22]), array([33, 44])]
    """
    return _split_equal(reduce_arrays(op, inputs), len(inputs), shape)


def all_to_all(inputs: Sequence[np.ndarray],
               input_split_sizes: Optional[Splits] = None) -> list[np.ndarray]:
    """Rank i's tensor is cut along dim 0 into one part per rank; rank j ends with part j
    of every rank, concatenated in rank order. Parts are equal, or ``input_split_sizes[i]``
    gives rank i's part sizes in rows (then rank j's ``output_split_sizes`` are
    ``[input_split_sizes[i][j] for i in ranks]``, see :func:`output_split_sizes`).

    >>> all_to_all([np.array([1, 2]), np.array([3, 4])])
    [array([1, 3]), array([2, 4])]
    >>> all_to_all([np.array([1, 2, 3]), np.array([4])], [[1, 2], [0, 1]])
    [array([1]), array([2, 3, 4])]
    """
    n = len(inputs)
    parts = []
    for i, x in enumerate(inputs):
        if input_split_sizes is None:
            parts.append(_split_equal(x, n))
        else:
            bounds = np.cumsum([0, *input_split_sizes[i]])
            if bounds[-1] != np.shape(x)[0]:
                raise ValueError(f"rank {i}: split sizes {list(input_split_sizes[i])} do not "
                                 f"sum to its {np.shape(x)[0]} rows")
            parts.append([np.array(x[bounds[j]:bounds[j + 1]]) for j in range(n)])
    return [_concat([parts[i][j] for i in range(n)]) for j in range(n)]


def output_split_sizes(input_split_sizes: Splits) -> list[list[int]]:
    """The ``output_split_sizes`` of each rank matching every rank's ``input_split_sizes``
    (the transposed matrix).

    >>> output_split_sizes([[1, 2], [0, 1]])
    [[1, 0], [2, 1]]
    """
    n = len(input_split_sizes)
    return [[int(input_split_sizes[i][j]) for i in range(n)] for j in range(n)]


def barrier(world_size: int) -> list[None]:
    """Nothing moves; every rank returns once all arrived.

    >>> barrier(2)
    [None, None]
    """
    return [None] * world_size
