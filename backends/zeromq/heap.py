"""Where libzmq's receive buffers come from: glibc's malloc thresholds, set once a process.

libzmq allocates every frame it receives above 8 KiB with ``malloc`` (one buffer of the
frame's size; a large tensor travels as frames of up to ``wire.FRAME_MAX`` = 4 MiB), and the
backend frees it as soon as it has read it. glibc serves an allocation from 128 KiB up with a
fresh ``mmap`` until its *dynamic* threshold has seen a block of that size freed, and gives
the top of a heap back to the kernel once more than the *trim* threshold is free there.
libzmq's I/O thread allocates in its own arena and the backend's thread frees, so the heap's
top keeps crossing the trim threshold: the next frames land on fresh pages, which the kernel
faults in and zeroes one 4 KiB page at a time: hundreds of page faults per large call,
which the thresholds below remove (docs/performance.md measures both).

:func:`keep_receive_buffers` sets the two thresholds to the largest values glibc's own
dynamic rule can grow them to (mmap: ``DEFAULT_MMAP_THRESHOLD_MAX``, 32 MiB on a 64-bit
machine; trim: twice that), at once and for good. What that changes for the whole process,
every allocation in it (torch and numpy included), until it exits (``close()`` does not
undo it; MPI libraries make the same trade for their buffers, MVAPICH2 turns trimming off):

- blocks of 128 KiB to 32 MiB come from a heap instead of their own ``mmap`` (glibc does so
  itself for a size once it has seen a block of that size freed); so ``np.zeros`` of such a
  size clears reused memory instead of getting fresh zeroed pages, and a long-lived block
  can pin a heap's freed memory below it;
- up to 64 MiB free at the top of each heap (one per arena: glibc allows 8 per core) stays
  mapped instead of going back to the kernel;
- glibc's dynamic rule is off: its thresholds stay where they are set.

``COLLECTIVES_ZMQ_MALLOC=keep`` (the default) sets them; ``system`` leaves malloc alone.
Nothing is set when the process chose for itself: thresholds in its environment
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or the same in ``GLIBC_TUNABLES``,
which glibc read at start-up) or another allocator through ``LD_PRELOAD`` (jemalloc,
tcmalloc, mimalloc); nor when the C library is not glibc (musl, macOS). A process that
called ``mallopt`` itself before its first zmq group is not recognised: set
``COLLECTIVES_ZMQ_MALLOC=system`` there.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Mapping, Optional

from collectives import settings

MALLOC_ENV = settings.ZMQ_MALLOC.name
#: glibc's ``mallopt`` parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: The ceilings of glibc's dynamic thresholds: DEFAULT_MMAP_THRESHOLD_MAX (4 MiB per byte
#: of a ``long``: 32 MiB on 64-bit machines, the most ``M_MMAP_THRESHOLD`` accepts) and
#: twice it.
MMAP_THRESHOLD = (4 << 20) * ctypes.sizeof(ctypes.c_long)
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
#: ``LD_PRELOAD`` naming one of these means another allocator answers ``malloc``.
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc", "hoard", "malloc")

_lock = threading.Lock()
_state: Optional[str] = None  # what the first call decided, for every later one


def keep_receive_buffers(env: Optional[Mapping[str, str]] = None) -> str:
    """Set glibc's mmap and trim thresholds once per process (see the module docstring).

    Returns what this process does: ``"kept"`` (set, by this call or an earlier one),
    ``"system"`` (``COLLECTIVES_ZMQ_MALLOC=system``), ``"user"`` (the process chose its
    own thresholds or allocator), ``"unsupported"`` (not glibc, or glibc refused both) or
    ``"partial"`` (glibc took the mmap threshold and refused the trim one). ``env`` holds
    the backend's options (default ``os.environ``); what glibc itself read is always
    looked for in ``os.environ``. Raises ValueError naming the variable for a value other
    than ``keep`` or ``system``.

    Example (each of two ranks calls it when its zmq group starts)::

        >>> keep_receive_buffers({MALLOC_ENV: "system"})  # doctest: +SKIP
        'system'
    """
    global _state
    choice = settings.ZMQ_MALLOC.get(env)
    with _lock:
        if _state is not None:
            return _state
        if choice == "system":
            return "system"  # not remembered: a later group may still ask to keep
        if _user_chose(os.environ):
            _state = "user"
        elif not is_glibc():
            _state = "unsupported"
        else:
            mallopt = ctypes.CDLL(None).mallopt
            mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
            # mallopt returns 1 on success. The mmap threshold first: if glibc refuses it,
            # nothing has changed (setting either one turns the dynamic rule off)
            if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
                _state = "unsupported"
            elif mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
                _state = "partial"
            else:
                _state = "kept"
        return _state


def is_glibc() -> bool:
    """The C library is glibc (the only one with these thresholds)."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError, AttributeError):  # no such name here (musl, macOS)
        return False


def _user_chose(environ: Mapping[str, str]) -> bool:
    """The process chose a threshold of its own, which glibc read at start-up, or another
    allocator."""
    if environ.get("MALLOC_MMAP_THRESHOLD_") or environ.get("MALLOC_TRIM_THRESHOLD_"):
        return True
    tunables = environ.get("GLIBC_TUNABLES", "")
    if "malloc.mmap_threshold" in tunables or "malloc.trim_threshold" in tunables:
        return True
    libraries = environ.get("LD_PRELOAD", "").replace(":", " ").split()
    return any(name in os.path.basename(lib).lower()
               for lib in libraries for name in OTHER_ALLOCATORS)
