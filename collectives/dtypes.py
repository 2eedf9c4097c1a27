"""The element types every backend moves, with ``bfloat16`` resolved only when first met.

numpy has no ``bfloat16``; ``ml_dtypes`` adds one, but importing it costs more than the
rest of ``import collectives`` together. So the library names its dtypes by a fixed list
of names (the wire and the compiled core number them by it), keeps its tables keyed by the
numpy dtypes it already has, and adds ``bfloat16`` to them the first time an argument
brings one: a numpy array of ``ml_dtypes.bfloat16`` (its caller imported ``ml_dtypes``
already) or a ``torch.bfloat16`` tensor (then this module imports it).

A table keyed by dtype registers itself with :func:`when_bfloat16`; the entry points
that look at a caller's dtype (``collectives.buffers``, ``collectives.fast_path``) call
:func:`resolve` on a dtype they do not know before they refuse it. Two ranks:

>>> import torch, collectives
>>> def bf16():
...     pg = collectives.init_process_group()
...     a = torch.ones(4, dtype=torch.bfloat16)
...     pg.all_reduce(a)   # the first bfloat16 call imports ml_dtypes, then every table
...     pg.close()         # (shm's codes, zmq's wire, the fast path) knows it
...     return a.tolist()
>>> collectives.spawn(bf16, 2)
[[2.0, 2.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]]
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

import numpy as np

#: The dtypes the library moves, by name, in the order of their stable codes (code = index
#: + 1; 0 means "not one of them"). Reductions are defined on all but bool.
NAMES: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64", "int8", "uint8",
                          "int16", "int32", "int64", "bool")
BFLOAT16_CODE = NAMES.index("bfloat16") + 1

#: The numpy dtypes known without importing anything (every name but bfloat16).
NUMPY_DTYPES: tuple[np.dtype, ...] = tuple(np.dtype(n) for n in NAMES if n != "bfloat16")

_bfloat16: Optional[np.dtype] = None
_waiting: list[Callable[[np.dtype], None]] = []


def when_bfloat16(register: Callable[[np.dtype], None]) -> None:
    """Call ``register(bfloat16 dtype)`` once bfloat16 is known: now if it already is.

    >>> table = {}
    >>> when_bfloat16(lambda dt: table.setdefault(dt, 2))
    >>> _ = bfloat16(); list(table.values())
    [2]
    """
    if _bfloat16 is not None:
        register(_bfloat16)
    else:
        _waiting.append(register)


def bfloat16() -> np.dtype:
    """numpy's ``bfloat16`` dtype (``ml_dtypes``'), importing ml_dtypes on the first call
    and completing every table registered with :func:`when_bfloat16`."""
    global _bfloat16
    if _bfloat16 is None:
        import ml_dtypes
        dt = np.dtype(ml_dtypes.bfloat16)
        _bfloat16 = dt
        for register in _waiting:
            register(dt)
        _waiting.clear()
    return _bfloat16


def resolve(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is the bfloat16 the tables lacked, now added to them. Only a
    dtype called bfloat16 while ``ml_dtypes`` is imported can be: nothing is imported for
    any other."""
    if _bfloat16 is None and dtype.name == "bfloat16" and "ml_dtypes" in sys.modules:
        return bfloat16() == dtype
    return False


def supported_dtypes() -> tuple[np.dtype, ...]:
    """Every dtype the library moves, in code order (imports ml_dtypes: for messages,
    tests and documentation, not for a call's path)."""
    bf16 = bfloat16()
    return tuple(bf16 if n == "bfloat16" else np.dtype(n) for n in NAMES)


def by_name(name: str) -> np.dtype:
    """The numpy dtype called ``name`` (bfloat16 through ml_dtypes).

    >>> by_name("float32")
    dtype('float32')
    """
    return bfloat16() if name == "bfloat16" else np.dtype(name)
