"""Loading MPI for the mpi backend (:mod:`backends.mpi`) and the tables of its reductions.

- :func:`load_mpi`: ``mpi4py.MPI``, initialised on first use with ``MPI_THREAD_MULTIPLE``
  (mpi4py's defaults stated; a user's ``MPI4PY_RC_*`` variables win), MPICH's busy loops
  made to yield when this host's ranks outnumber its cores (``_tune_mpich``), and the
  reduction tables filled;
- :func:`yield_every`: how often a spinning wait of the backend yields the core;
- :func:`reduction` / :func:`byte_buffer`: the MPI buffer spec and operator of a reduction
  (float16 and bfloat16 through user-defined operators over 16-bit words, ``_user_op``),
  and the raw-bytes spec of every data-moving call.

Importing this module does not initialise MPI.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import numpy as np

from collectives import dtypes, settings
from collectives.reduce_op import ReduceOp, combine_into

#: ``mpi4py.MPI`` once :func:`load_mpi` ran.
MPI: Any = None


# ---------------------------------------------------------------------- initialisation
def _oversubscribed(env: Any) -> bool:
    local = None
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_LOCAL_SIZE",
                 "LOCAL_WORLD_SIZE"):
        value = env.get(name)
        if value and value.isdigit():
            local = int(value)
            break
    if local is None:
        return False
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return local > cores


def _tune_mpich(env: Any) -> None:
    """Make MPICH's own busy-wait loops yield when the ranks outnumber the cores."""
    if not settings.MPI_TUNE.get(env) or not _oversubscribed(env):
        return
    env.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")
    env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")


def yield_every(env: Any) -> int:
    """Polls between two ``sched_yield`` calls of a spinning wait: every poll when this
    host's ranks outnumber its cores (the peer that must answer then gets the core), else
    every 64, like MPICH's own loops; ``COLLECTIVES_MPI_YIELD_EVERY`` overrides."""
    every = settings.MPI_YIELD_EVERY.get(env)
    return every if every else 1 if _oversubscribed(env) else 64


def load_mpi() -> Any:
    """``mpi4py.MPI``, initialising MPI (``MPI_THREAD_MULTIPLE``) on first use."""
    global MPI
    if MPI is None:
        if "mpi4py.MPI" not in sys.modules:
            import mpi4py
            # mpi4py's defaults, stated; a user's MPI4PY_RC_* variables still win.
            for name, value in (("initialize", True), ("finalize", True), ("threads", True),
                                ("thread_level", "multiple")):
                if f"MPI4PY_RC_{name.upper()}" not in os.environ:
                    setattr(mpi4py.rc, name, value)
            _tune_mpich(os.environ)
        from mpi4py import MPI as _mpi
        if not _mpi.Is_initialized():
            _mpi.Init_thread(_mpi.THREAD_MULTIPLE)
        _init_tables(_mpi)
        MPI = _mpi
    return MPI


#: ReduceOp -> MPI's operator (AVG is a SUM followed by ``finish``).
_MPI_OPS: dict = {}
#: numpy dtype -> MPI datatype for reductions MPI does itself.
_REDUCE_TYPES: dict = {}
#: float16 and bfloat16: reduced by user-defined operators over 16-bit words.
_USER_OP_DTYPES: list = []
_USER_OPS: dict = {}
_USER_OPS_LOCK = threading.Lock()


def _init_tables(mpi: Any) -> None:
    _MPI_OPS.update({ReduceOp.SUM: mpi.SUM, ReduceOp.AVG: mpi.SUM, ReduceOp.PRODUCT: mpi.PROD,
                     ReduceOp.MIN: mpi.MIN, ReduceOp.MAX: mpi.MAX})
    _REDUCE_TYPES.update({
        np.dtype(np.float32): mpi.FLOAT, np.dtype(np.float64): mpi.DOUBLE,
        np.dtype(np.int8): mpi.INT8_T, np.dtype(np.uint8): mpi.UINT8_T,
        np.dtype(np.int16): mpi.INT16_T, np.dtype(np.int32): mpi.INT32_T,
        np.dtype(np.int64): mpi.INT64_T})
    if not _USER_OP_DTYPES:
        _USER_OP_DTYPES.append(np.dtype(np.float16))
        dtypes.when_bfloat16(_USER_OP_DTYPES.append)


def _user_op(op: ReduceOp, dtype: np.dtype) -> Any:
    """The commutative MPI operator that reduces 16-bit words as ``dtype`` with ``op``."""
    key = (ReduceOp.SUM if op is ReduceOp.AVG else op, dtype)
    mop = _USER_OPS.get(key)
    if mop is None:
        with _USER_OPS_LOCK:
            mop = _USER_OPS.get(key)
            if mop is None:
                kind = key[0]

                def reduce16(inbuf: Any, inoutbuf: Any, datatype: Any,
                             kind: ReduceOp = kind, dtype: np.dtype = dtype) -> None:
                    acc = np.frombuffer(inoutbuf, dtype)
                    combine_into(kind, acc, np.frombuffer(inbuf, dtype))

                mop = _USER_OPS[key] = MPI.Op.Create(reduce16, commute=True)
    return mop


#: (dtype, ReduceOp value) -> (MPI datatype, MPI operator), filled on first use.
_REDUCTIONS: dict = {}


def reduction(a: np.ndarray, op: ReduceOp) -> tuple[list, Any]:
    """(MPI buffer spec of the C-contiguous array ``a``, MPI operator) to reduce ``a``."""
    found = _REDUCTIONS.get((a.dtype, op._value_))  # (an enum's own hash is slow)
    if found is None:
        dtype = a.dtype
        if dtype in _REDUCE_TYPES:
            found = (_REDUCE_TYPES[dtype], _MPI_OPS[op])
        elif dtype in _USER_OP_DTYPES:
            found = (MPI.UINT16_T, _user_op(op, dtype))
        else:
            raise TypeError(f"the mpi backend cannot reduce dtype {dtype}")
        _REDUCTIONS[(dtype, op._value_)] = found
    return [a, found[0]], found[1]


def byte_buffer(a: np.ndarray) -> list:
    """An MPI buffer spec of the C-contiguous ``a``'s bytes (every dtype, incl. bfloat16
    and bool; mpi4py counts the bytes)."""
    return [a, MPI.BYTE]
