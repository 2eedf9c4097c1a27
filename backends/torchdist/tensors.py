"""Arguments in the form c10d takes them, for the torch backends (:mod:`backends.torchdist`,
:mod:`backends.torchdist.nccl`).

c10d takes flat tensors: a numpy array becomes a zero-copy ``torch.from_numpy`` view
(bfloat16 through ``ml_dtypes``), and the data-moving collectives carry every dtype as a
uint8 view of the same memory. Reductions take c10d's ``ReduceOp`` (AVG runs as SUM, the
group divides after) and ``int16`` is reduced in ``int32`` (``WIDEN``). c10d's send/recv
tags are a C ``int``, so the 63-bit tags of this library are folded into [2**30, 2**31)
(``wire_tag``). The memory span of an argument (``span_of``) and whether two operations'
spans conflict (``conflict``) let :class:`~backends.torchdist.TorchGroup` order async
operations that share memory. Kept apart from the groups: tables and plain functions of
tensors and arrays, with no group state.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from collectives import dtypes
from collectives.algorithms.links import fold_tag
from collectives.reduce_op import ReduceOp

try:
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # numpy < 2
    _byte_bounds = np.byte_bounds

C10D_OP = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.AVG: dist.ReduceOp.SUM,
            ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT, ReduceOp.MIN: dist.ReduceOp.MIN,
            ReduceOp.MAX: dist.ReduceOp.MAX}

#: The torch dtypes of ``collectives.dtypes.NAMES``.
TORCH_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64,
                           torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
                           torch.bool))

#: Dtypes neither gloo nor NCCL reduces, and the dtype they are reduced in instead.
WIDEN = {torch.int16: torch.int32}

_MAX_C10D_TAG = 1 << 31
_FOLDED_TAG_BASE = 1 << 30


def c10d_options(cls: Any, **fields: Any) -> Any:
    opts = cls()
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


# Options objects are copied by c10d on every call; build the constant ones once.
ALLREDUCE_OPTS = {op: c10d_options(dist.AllreduceOptions, reduceOp=c) for op, c in C10D_OP.items()}
REDUCE_SCATTER_OPTS = {op: c10d_options(dist.ReduceScatterOptions, reduceOp=c)
                        for op, c in C10D_OP.items()}
ALLTOALL_OPTS = dist.AllToAllOptions()
BARRIER_OPTS = dist.BarrierOptions()


def as_tensor(a: Any) -> torch.Tensor:
    """``a`` as a flat torch tensor sharing its memory (a numpy array or a tensor)."""
    if isinstance(a, torch.Tensor):
        return a if a.dim() == 1 else a.reshape(-1)
    if a.dtype.name == "bfloat16":
        return _from_numpy(a.view(np.uint16)).view(torch.bfloat16).reshape(-1)
    return _from_numpy(a).reshape(-1)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """The numpy view of a CPU tensor (bfloat16 as ``ml_dtypes.bfloat16``)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(dtypes.bfloat16())
    return t.numpy()


def _from_numpy(a: np.ndarray) -> torch.Tensor:
    if a.flags.writeable:
        return torch.from_numpy(a)
    # An input the caller passed read-only: torch warns that it cannot mark the tensor
    # read-only; the transports only read inputs.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view: data-moving collectives carry every dtype as raw bytes."""
    if t.dtype == torch.uint8:
        return t
    if t.numel() <= 1 and t.stride(-1) != 1:
        # numpy calls an array of 0 or 1 element contiguous whatever its stride
        t = t.as_strided((t.numel(),), (1,))
    return t.view(torch.uint8)


def span_of(obj: Any, write: bool) -> tuple:
    """(device, first byte, end, written) of the memory an argument occupies."""
    if isinstance(obj, np.ndarray):
        lo, hi = _byte_bounds(obj) if obj.size else (0, 0)
        return ("cpu", lo, hi, write)
    if obj.numel() == 0:
        return ("cpu", 0, 0, write)
    last = sum((n - 1) * s for n, s in zip(obj.shape, obj.stride()))
    lo = obj.data_ptr()
    return (str(obj.device), lo, lo + (last + 1) * obj.element_size(), write)


def conflict(a: list, b: list) -> bool:
    """Whether two operations' memory overlaps where at least one of them writes."""
    return any(da == db and la < hb and lb < ha and (wa or wb)
               for da, la, ha, wa in a for db, lb, hb, wb in b)


def parts_of(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``t`` cut into ``n`` equal consecutive views."""
    k = t.numel() // n
    return [t.narrow(0, r * k, k) for r in range(n)]


def wire_tag(tag: int) -> int:
    """A c10d tag (a C int) for a tag of this library (below 2**63)."""
    if tag < _MAX_C10D_TAG:
        return tag
    return _FOLDED_TAG_BASE | fold_tag(tag, 30)
