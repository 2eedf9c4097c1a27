"""Which path a shm group takes (the compiled core or pure Python), and how it waits.

The compiled core, ``backends.shm._native`` (``_native.c``), is built by the package's
own build (``pip install -e .``, or ``python setup.py build_ext --inplace``) where a C
compiler and the Python headers are present. Where it is missing, the shm backend uses
its Python path, which speaks the same protocol, and says so once per process.
``COLLECTIVES_SHM_NATIVE=0`` forces the Python path (``1``, the default, uses the core
where it exists). ``pg.transport.native`` tells which path a group uses::

    >>> import collectives
    >>> def which():
    ...     pg = collectives.init_process_group()
    ...     native = pg.transport.native   # True where the core is loaded
    ...     pg.close()
    ...     return native
    >>> collectives.spawn(which, 2, backend="shm")
    [True, True]

The wait policy knows the machine, as MPICH's does: with a core per rank (the cores this
process may use, ``os.sched_getaffinity``, at least as many as the ranks of the world on
this host: ``placement.host_ranks``) a waiter spins for 50 us and then polls between
``sched_yield`` calls for 1 ms before it sleeps in the kernel, since a futex wake-up
costs tens of microseconds on a virtual machine and a yield with nothing else to run
returns at once; with more ranks than cores (4 ranks on 2 cores) it does not spin at all
and yields for 50 us, since the rank it waits for may need this very core (and the world
group binds each rank to one core: ``placement``). ``COLLECTIVES_SHM_SPIN_US`` /
``COLLECTIVES_SHM_YIELD_US`` override both; ``python benchmarks/shm_wait_policy.py
[--nproc N]`` times several side by side.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType
from typing import Optional


from collectives import settings
from . import placement

#: ``0`` forces the Python path; anything else uses the compiled core where it exists.
NATIVE_ENV = settings.SHM_NATIVE.name

#: (spin, yield) microseconds: with a core per rank, and oversubscribed.
DEDICATED_WAIT_US = (50, 1000)
OVERSUBSCRIBED_WAIT_US = (0, 50)

#: The revision of the core's calls this package makes (``CORE_REVISION`` in _native.c,
#: the last entry of its ``LAYOUT``): a build of another revision is refused at load.
CORE_REVISION = 5

_module: Optional[ModuleType] = None
_load_error: Optional[str] = None
_loaded = False
_warned = False


def _load() -> Optional[ModuleType]:
    """Import the core once and check that it agrees with the Python layout."""
    global _module, _load_error, _loaded
    if _loaded:
        return _module
    _loaded = True
    try:
        from . import _native as mod
    except ImportError as exc:
        _load_error = f"{exc} (build it with `pip install -e .` or " \
                      f"`python setup.py build_ext --inplace`)"
        return None
    from . import segment as sg
    from .codes import DTYPE_CODE, DTYPE_NAME, OP_ALL_REDUCE, REDOP_CODE
    from .reduce import PIECE_MAX_BYTES
    layout = (sg.CTRL_STRIDE, sg.W_ARRIVED, sg.W_FP, sg.W_STATE, sg.W_SLEEPERS, sg.W_PUSHING,
              sg.BELL_BYTE, PIECE_MAX_BYTES, CORE_REVISION)
    codes = {name: c for c, name in DTYPE_NAME.items()}
    redops = {op.name: c for op, c in REDOP_CODE.items()}
    if tuple(mod.LAYOUT) != layout or dict(mod.DTYPE_CODES) != codes or \
            dict(mod.REDOP_CODES) != redops or getattr(mod, "OP_ALL_REDUCE", None) \
            != OP_ALL_REDUCE:
        _load_error = (f"it was built for another layout ({mod.LAYOUT}, {mod.DTYPE_CODES}, "
                       f"all_reduce {getattr(mod, 'OP_ALL_REDUCE', None)}) than this "
                       f"package's ({layout}, {codes}, all_reduce {OP_ALL_REDUCE}): "
                       f"rebuild it")
        return None
    # small_all_reduce tells a call's operator and dtype by these, without Python
    # (the dict itself, not a copy: bfloat16 joins it when first met)
    mod.bind_codes(sorted(REDOP_CODE, key=REDOP_CODE.get), DTYPE_CODE)
    _module = mod
    return mod


def native_module() -> Optional[ModuleType]:
    """The compiled core, or None: forced off by ``COLLECTIVES_SHM_NATIVE=0``, or missing
    (then a warning, once per process, says why)."""
    global _warned
    if not settings.SHM_NATIVE.get():
        return None
    mod = _load()
    if mod is None and not _warned:
        _warned = True
        warnings.warn(f"shm backend: the compiled core backends.shm._native is not "
                      f"available ({_load_error}); using the Python path (set "
                      f"{NATIVE_ENV}=0 to choose it and silence this)", RuntimeWarning,
                      stacklevel=3)
    return mod


def load_error() -> Optional[str]:
    """Why the compiled core could not be loaded (None if it was, or was not tried)."""
    _load()
    return _load_error


def wait_policy(size: int) -> tuple[float, float]:
    """(spin, yield) seconds of a waiter before it sleeps in the kernel, for a group of
    ``size`` ranks on this host: long with a core per rank, short when oversubscribed.

    >>> spin, yld = wait_policy(1)
    >>> spin > 0 and yld > 0
    True
    """
    dedicated = placement.host_cores() >= placement.host_ranks(size)
    spin_us, yield_us = DEDICATED_WAIT_US if dedicated else OVERSUBSCRIBED_WAIT_US
    spin, yld = settings.SHM_SPIN_US.get(), settings.SHM_YIELD_US.get()
    return (spin_us if spin is None else spin) * 1e-6, (yield_us if yld is None else yld) * 1e-6


class NativeDoorbells:
    """``futex.Doorbells``' interface over the core: one ring counter for the whole
    group and an atomic count of this rank's sleepers (the Python class's count lives in
    the process; both must not be mixed in one group, so a native group uses only this)."""

    def __init__(self, core, mode: str) -> None:
        self.mode = mode
        self.current = core.bell
        self.fence = core.fence
        self.ring = core.ring
        self.local_sleepers = core.sleepers
        self.sleep = core.sleep
