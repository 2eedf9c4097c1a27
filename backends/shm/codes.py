"""The small integers the shm protocol publishes, and how a phase's fingerprint is made.

Every rank of a phase publishes a fingerprint of the call it is in: word 0 holds the
operation, the reduce operator, the dtype, root + 1 and the call's sequence number
(:func:`fingerprint`); word 1 the message's bytes. The compiled core computes the same
words (``_native.c`` checks the codes below against its own when it loads), so a rank on
the core and a rank on the Python path talk in one group.

Two ranks, both in an all_reduce of 16 float32 (seq 7)::

    fingerprint(OP_ALL_REDUCE, REDOP_CODE[ReduceOp.SUM], dtype_code(np.float32), -1, 7)
"""

from __future__ import annotations

import numpy as np

from collectives import dtypes
from collectives.reduce_op import ReduceOp, kernel

#: dtype -> code (1, 2, ...; 0 for anything else), and back to a name for messages.
#: (bfloat16 joins DTYPE_CODE when first met: collectives.dtypes. The compiled core
#: holds this very dict, so it learns bfloat16 then too.)
DTYPE_CODE = {np.dtype(name): i + 1 for i, name in enumerate(dtypes.NAMES)
              if name != "bfloat16"}
DTYPE_NAME = {i + 1: name for i, name in enumerate(dtypes.NAMES)}
dtypes.when_bfloat16(lambda dt: DTYPE_CODE.__setitem__(dt, dtypes.BFLOAT16_CODE))


def dtype_code(dt: np.dtype) -> int:
    """A small code for the dtypes the library moves (0 for anything else).

    >>> dtype_code(np.dtype(np.float16))
    1
    """
    return DTYPE_CODE.get(dt, 0)


def dtype_name(code: int) -> str:
    return DTYPE_NAME.get(code, "bytes")


OP_BARRIER, OP_BROADCAST, OP_ALL_REDUCE, OP_REDUCE, OP_ALL_GATHER, OP_GATHER, OP_SCATTER, \
    OP_REDUCE_SCATTER, OP_ALL_TO_ALL = range(1, 10)
#: Written over a rank's fingerprint when it fails a phase it had published, so that a
#: peer arriving later raises PeerError instead of completing with it.
OP_FAILED = 0xF
OP_NAMES = {OP_BARRIER: "barrier", OP_BROADCAST: "broadcast", OP_ALL_REDUCE: "all_reduce",
            OP_REDUCE: "reduce", OP_ALL_GATHER: "all_gather", OP_GATHER: "gather",
            OP_SCATTER: "scatter", OP_REDUCE_SCATTER: "reduce_scatter",
            OP_ALL_TO_ALL: "all_to_all"}
_ROOTED = {OP_BROADCAST, OP_REDUCE, OP_GATHER, OP_SCATTER}
REDOP_CODE = {ReduceOp.SUM: 1, ReduceOp.AVG: 2, ReduceOp.PRODUCT: 3, ReduceOp.MIN: 4,
              ReduceOp.MAX: 5}
_REDOP_NAME = {v: k.name for k, v in REDOP_CODE.items()}
#: ReduceOp -> code, and -> numpy ufunc, keyed by id(): hashing an Enum member runs Python
#: code. The kernels are collectives.reduce_op's: one definition of every operator.
REDOP_BY_ID = {id(k): v for k, v in REDOP_CODE.items()}
KERNEL_BY_ID = {id(op): kernel(op) for op in ReduceOp}

#: Alignment of slots, pieces and the all_to_all's counts (a cache line).
ALIGN = 64
INT64 = np.dtype(np.int64)


def fingerprint(opcode: int, redop: int, dtype: int, root: int, seq: int) -> int:
    """Word 0 of a phase's fingerprint (word 1 is the message's bytes): the operation,
    operator and dtype codes, root + 1 (0: none) and the call's sequence number, in the
    fields every rank compares (the core computes the same in ``small_all_reduce``).

    >>> hex(fingerprint(OP_ALL_REDUCE, 1, 2, -1, 7))
    '0x700000213'
    """
    return (opcode | (redop << 4) | (dtype << 8) | (((root + 1) & 0xFFFF) << 16)
            | ((seq & 0xFFFFFFFF) << 32))


def describe(fp0: int, fp1: int) -> str:
    """The call a fingerprint stands for, in words (for a mismatch's message).

    >>> describe(fingerprint(OP_BROADCAST, 0, 3, 1, 5), 64)
    'broadcast (seq 5) with 64 bytes of float32, root 1'
    """
    op = fp0 & 0xF
    redop = (fp0 >> 4) & 0xF
    dt = dtype_name((fp0 >> 8) & 0xFF)
    root = ((fp0 >> 16) & 0xFFFF) - 1
    seq = fp0 >> 32
    text = f"{OP_NAMES.get(op, f'op {op}')} (seq {seq})"
    if op == OP_ALL_TO_ALL:
        text += f" on {dt}"
    elif op != OP_BARRIER:
        text += f" with {fp1} bytes of {dt}"
    if op in _ROOTED:
        text += f", root {root}"
    if redop:
        text += f", op {_REDOP_NAME.get(redop, redop)}"
    return text


def piece_bounds(count: int, n: int, itemsize: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of rank k's piece of a ``count``-element array split n ways, each piece
    starting on an ``ALIGN`` boundary (the last ones may be short or empty): the
    ownership of the in-place all_reduces (single-copy and symmetric).

    >>> piece_bounds(10, 3, 4)
    [(0, 10), (10, 10), (10, 10)]
    >>> piece_bounds(100, 2, 4)
    [(0, 64), (64, 100)]
    """
    align = max(1, ALIGN // itemsize)
    part = ((count + n - 1) // n + align - 1) // align * align
    return [(min(count, k * part), min(count, (k + 1) * part)) for k in range(n)]
