"""Turning the user's tensors into host memory a transport can read and write.

Every collective receives ``torch.Tensor`` or ``numpy.ndarray`` arguments. Backends see
only C-contiguous numpy arrays over host memory: a zero-copy view when the argument
already is one (a contiguous CPU tensor or array), otherwise a staged copy that is written
back into the argument when the operation finishes (non-contiguous views, CUDA tensors,
read-only arrays used as inputs). ``bfloat16`` travels as ``ml_dtypes.bfloat16`` so numpy
can reduce it; ``collectives.dtypes`` says when ml_dtypes is imported (the first bfloat16
argument, not before).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import numpy as np

from . import dtypes

#: The supported dtypes known so far (bfloat16 joins when first met: collectives.dtypes).
_SUPPORTED_SET: set = set(dtypes.NUMPY_DTYPES)
dtypes.when_bfloat16(_SUPPORTED_SET.add)


class HostBuffer:
    """A C-contiguous host array standing for one argument of a collective.

    ``commit()`` writes the result back into the caller's object when ``array`` is a
    staged copy; on a zero-copy view it does nothing.
    """

    __slots__ = ("array", "writeback")  # one or more per call: keep it light

    def __init__(self, array: np.ndarray,
                 writeback: Optional[Callable[[np.ndarray], None]] = None) -> None:
        self.array = array
        self.writeback = writeback

    def commit(self) -> None:
        if self.writeback is not None:
            self.writeback(self.array)


def _torch():
    # Only touch torch when the caller already imported it: a numpy-only user of the
    # shm backend never pays torch's import time.
    return sys.modules.get("torch")


def is_tensor_like(obj: Any) -> bool:
    """True for a numpy array or a torch tensor."""
    torch = _torch()
    return isinstance(obj, np.ndarray) or (torch is not None and isinstance(obj, torch.Tensor))


def _check_dtype(dtype: np.dtype, where: str, arg: str) -> None:
    if dtype not in _SUPPORTED_SET and not dtypes.resolve(dtype):
        names = ", ".join(dtypes.NAMES)
        raise TypeError(f"{where}: argument `{arg}` has unsupported dtype {dtype}; "
                        f"supported: {names}")


def _torch_to_host(t: Any, where: str, arg: str, write: bool) -> HostBuffer:
    torch = _torch()
    dtype = torch_numpy_dtype(torch, t.dtype)  # (complex dtypes are not in the table)
    if dtype is None:
        raise TypeError(f"{where}: argument `{arg}` has unsupported dtype {t.dtype}")
    if t.is_cpu and t.is_contiguous() and not t.is_neg():
        # The hot path (every DDP bucket): a zero-copy view, no staging. Each accessor
        # here is cheap; `detach()` and `device.type` cost several times more, so they are
        # avoided.
        host = t.detach() if t.requires_grad else t
        if t.dtype is torch.bfloat16:
            return HostBuffer(host.view(torch.uint16).numpy().view(dtype))
        return HostBuffer(host.numpy())
    src = t.detach()
    staged = src.device.type != "cpu" or not src.is_contiguous() or src.is_neg() or src.is_conj()
    host = src.to("cpu", copy=True).contiguous() if staged else src
    if host.dtype == torch.bfloat16:
        array = host.view(torch.uint16).numpy().view(dtype)
    else:
        array = host.numpy()
    if not staged:
        return HostBuffer(array)

    def writeback(a: np.ndarray, dst=src, host=host) -> None:
        dst.copy_(host)

    return HostBuffer(array, writeback if write else None)


def _numpy_to_host(a: np.ndarray, where: str, arg: str, write: bool) -> HostBuffer:
    dtype, flags = a.dtype, a.flags
    _check_dtype(dtype, where, arg)
    if write and not flags.writeable:
        raise ValueError(f"{where}: argument `{arg}` is a read-only array but the "
                         f"operation writes its result into it")
    if flags.c_contiguous and dtype.isnative:
        return HostBuffer(a)
    staged = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("="))

    def writeback(s: np.ndarray, dst=a) -> None:
        dst[...] = s

    return HostBuffer(staged, writeback if write else None)


def to_host(obj: Any, *, where: str, arg: str, write: bool) -> HostBuffer:
    """Host memory for argument ``arg`` of the operation described by ``where``.

    ``write`` says whether the operation stores a result into it (then a staged copy is
    written back on :meth:`HostBuffer.commit`).

    >>> buf = to_host(np.zeros(3, np.float32), where="[rank 0/2] all_reduce",
    ...               arg="tensor", write=True)
    >>> buf.array.shape
    (3,)
    """
    if type(obj) is np.ndarray:  # the hot path: a native, contiguous, usable array
        dtype = obj.dtype
        if dtype in _SUPPORTED_SET and dtype.isnative:
            flags = obj.flags
            if flags.c_contiguous and (flags.writeable or not write):
                return HostBuffer(obj)
    if isinstance(obj, np.ndarray):
        return _numpy_to_host(obj, where, arg, write)
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        return _torch_to_host(obj, where, arg, write)
    raise TypeError(f"{where}: argument `{arg}` must be a torch.Tensor or numpy.ndarray, "
                    f"got {type(obj).__name__}")


#: torch dtype -> the numpy dtype it travels as (bfloat16 once first met).
TORCH_TO_NUMPY: dict = {}


def init_torch_table(torch: Any) -> None:
    if not TORCH_TO_NUMPY:
        TORCH_TO_NUMPY.update({
            torch.float16: np.dtype(np.float16),
            torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
            torch.int8: np.dtype(np.int8), torch.uint8: np.dtype(np.uint8),
            torch.int16: np.dtype(np.int16), torch.int32: np.dtype(np.int32),
            torch.int64: np.dtype(np.int64), torch.bool: np.dtype(np.bool_),
        })
        dtypes.when_bfloat16(lambda dt: TORCH_TO_NUMPY.__setitem__(torch.bfloat16, dt))


def torch_numpy_dtype(torch: Any, dtype: Any) -> Optional[np.dtype]:
    """The numpy dtype a torch tensor of ``dtype`` travels as, or None (unsupported)."""
    found = TORCH_TO_NUMPY.get(dtype)   # (every call of the general path: one lookup)
    if found is None:                   # the table's first use, or the first bfloat16
        init_torch_table(torch)
        found = TORCH_TO_NUMPY.get(dtype)
        if found is None and dtype is torch.bfloat16:
            found = dtypes.bfloat16()   # completes TORCH_TO_NUMPY
    return found


def numel(obj: Any) -> int:
    """Number of elements of a tensor or array."""
    return int(obj.numel()) if not isinstance(obj, np.ndarray) else int(obj.size)


def host_dtype(obj: Any) -> np.dtype:
    """The numpy dtype that ``obj`` travels as."""
    if isinstance(obj, np.ndarray):
        return obj.dtype
    found = torch_numpy_dtype(_torch(), obj.dtype)
    return found if found is not None else np.dtype(object)
