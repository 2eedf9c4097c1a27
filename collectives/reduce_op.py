"""The reduction operators and the one table that maps each to its numpy kernel.

Backends map ``ReduceOp`` to their library's own operator; everything else (the shm
backend, the send/recv algorithms, the reference semantics in ``collectives.testing``)
reduces through :func:`combine_into` and :func:`finish`, so there is exactly one
definition of what each operator computes.
"""

from __future__ import annotations

import enum
from typing import Sequence

import numpy as np


class ReduceOp(enum.Enum):
    """How ``all_reduce``, ``reduce`` and ``reduce_scatter`` combine values across ranks.

    ``AVG`` is the sum divided by the group size; it is a ``ValueError`` on integer dtypes.
    No reduction is defined on ``bool`` (a ``TypeError``).
    """

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"


_KERNELS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,  # summed here, divided once in finish()
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


def kernel(op: ReduceOp) -> np.ufunc:
    """The numpy ufunc that combines two operands of ``op`` (AVG sums; see :func:`finish`),
    for backends that call it with their own ``out=`` (one pass, no temporary).

    >>> kernel(ReduceOp.MAX)
    <ufunc 'maximum'>
    """
    return _KERNELS[op]


def combine_into(op: ReduceOp, acc: np.ndarray, other: np.ndarray) -> None:
    """``acc = acc (op) other`` elementwise, in place.

    Every all-reduce in this library fixes the order (and operand order) in which it
    applies this, and every rank applies it identically, so all ranks of one call hold
    bitwise-identical floats. Different algorithms (ring, tree, rank order) may round
    differently from each other.
    """
    _KERNELS[op](acc, other, out=acc)


def finish(op: ReduceOp, acc: np.ndarray, group_size: int) -> None:
    """Apply the last step of ``op`` after all inputs were combined (AVG divides)."""
    if op is ReduceOp.AVG and group_size != 1:
        np.divide(acc, acc.dtype.type(group_size), out=acc)


def reduce_arrays(op: ReduceOp, inputs: Sequence[np.ndarray]) -> np.ndarray:
    """Reduce ``inputs`` (one per rank, in rank order) into a new array.

    >>> reduce_arrays(ReduceOp.SUM, [np.ones(2), np.ones(2)])
    array([2., 2.])
    """
    acc = np.array(inputs[0], copy=True)
    for other in inputs[1:]:
        combine_into(op, acc, other)
    finish(op, acc, len(inputs))
    return acc


def check_reducible(op: object, dtype: np.dtype, where: str, arg: str = "tensor") -> ReduceOp:
    """Validate ``op`` for ``dtype`` (the dtype of argument ``arg``) and return it as a
    :class:`ReduceOp` (a name such as ``"sum"`` is accepted too).

    Raises ``TypeError`` for a non-ReduceOp or a bool dtype, ``ValueError`` for AVG on
    integers; ``where`` prefixes the message (``[rank 0/2] all_reduce``).

    >>> check_reducible("max", np.dtype(np.float32), "[rank 0/2] all_reduce")
    <ReduceOp.MAX: 'max'>
    """
    try:  # the hot path: a pair seen before (every call of a training loop)
        return _REDUCIBLE[id(op), dtype]
    except KeyError:
        pass
    given = op
    if isinstance(op, str):
        try:
            op = ReduceOp[op.upper()]
        except KeyError:
            pass
    if not isinstance(op, ReduceOp):
        raise TypeError(f"{where}: argument `op` must be a ReduceOp "
                        f"(SUM, AVG, PRODUCT, MIN, MAX), got {op!r}")
    if dtype == np.bool_:
        raise TypeError(f"{where}: argument `op`={op.name} is not defined on dtype bool "
                        f"(argument `{arg}`); cast to uint8 or int32 first")
    if op is ReduceOp.AVG and np.issubdtype(dtype, np.integer):
        raise ValueError(f"{where}: argument `op`=AVG is not defined on integer dtype "
                         f"{dtype} (argument `{arg}`); use SUM and divide, or a floating "
                         f"dtype")
    if type(given) is ReduceOp:  # (a bounded table: 5 ops x the supported dtypes)
        _REDUCIBLE[id(given), dtype] = op
    return op


#: (id of a ReduceOp member, dtype) pairs already found valid. Keyed by id because an
#: Enum member hashes in Python (slow for a hot path); members live forever, so an id that matches
#: is that member.
_REDUCIBLE: dict[tuple[int, np.dtype], ReduceOp] = {}
