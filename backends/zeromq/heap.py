"""Where libzmq's receive buffers come from: glibc's malloc thresholds, set once a process.

libzmq allocates every frame it receives above 8 KiB with ``malloc`` (one buffer of the
frame's size; a large tensor travels as frames of up to ``wire.FRAME_MAX`` = 4 MiB), and the
backend frees it as soon as it has read it. glibc serves an allocation from 128 KiB up with a
fresh ``mmap`` until its *dynamic* threshold has seen such a block freed, and gives the top
of a heap back to the kernel once more than the *trim* threshold is free there. libzmq's I/O
thread allocates in its own arena and the backend's thread frees, so the heap's top keeps
crossing the trim threshold: the next frames land on fresh pages, which the kernel faults in
and zeroes one 4 KiB page at a time. Measured on a 2-vCPU VM, 2 ranks, 16 MiB float32
all_reduce over ipc: 270-1600 page faults per call and 10-12 ms, against 0-70 faults and
6.0-6.6 ms with the thresholds below (64 MiB: 41-43 ms against 27-30 ms).

:func:`keep_receive_buffers` sets the two thresholds to the largest values glibc's own
dynamic rule ever grows them to on a 64-bit machine (mmap 32 MiB, trim 64 MiB), at once,
instead of leaving them to it. What changes for the rest of the process: blocks of 128 KiB
to 32 MiB come from the heap (as they already do once glibc has seen one freed), and up to
64 MiB free at the top of a heap stay mapped instead of going back to the kernel. MPI
libraries make the same trade for their buffers (MVAPICH2 disables trimming altogether).

``COLLECTIVES_ZMQ_MALLOC=keep`` (the default) sets them; ``system`` leaves malloc alone.
Nothing is set when the process already chose its own thresholds (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, or the same in ``GLIBC_TUNABLES``), or when the C library is not
glibc (musl, macOS: they have no such thresholds to set).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Mapping, Optional

MALLOC_ENV = "COLLECTIVES_ZMQ_MALLOC"
#: glibc's ``mallopt`` parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: The ceilings of glibc's dynamic thresholds on a 64-bit machine (DEFAULT_MMAP_THRESHOLD_MAX
#: and twice it).
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20

_lock = threading.Lock()
_state: Optional[str] = None  # what the first call decided, for every later one


def keep_receive_buffers(env: Optional[Mapping[str, str]] = None) -> str:
    """Set glibc's mmap and trim thresholds once per process (see the module docstring).

    Returns what this process does: ``"kept"`` (set, by this call or an earlier one),
    ``"system"`` (``COLLECTIVES_ZMQ_MALLOC=system``), ``"user"`` (the process set its own
    thresholds through the environment) or ``"unsupported"`` (not glibc). Raises
    ValueError naming the variable for a value other than ``keep`` or ``system``.

    Example (each of two ranks calls it when its zmq group starts)::

        >>> keep_receive_buffers({"COLLECTIVES_ZMQ_MALLOC": "system"})  # doctest: +SKIP
        'system'
    """
    global _state
    env = os.environ if env is None else env
    choice = env.get(MALLOC_ENV, "keep").strip().lower() or "keep"
    if choice not in ("keep", "system"):
        raise ValueError(f"environment variable {MALLOC_ENV}={env.get(MALLOC_ENV)!r}: "
                         f"expected 'keep' or 'system'")
    with _lock:
        if _state is not None:
            return _state
        if choice == "system":
            return "system"  # not remembered: a later group may still ask to keep
        if _user_chose(env):
            _state = "user"
        elif not is_glibc():
            _state = "unsupported"
        else:
            mallopt = ctypes.CDLL(None).mallopt
            mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
            # mallopt returns 1 on success; the trim threshold first, so that a heap is
            # never trimmed under the new mmap threshold with the old trim one
            ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and \
                mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            _state = "kept" if ok else "unsupported"
        return _state


def is_glibc() -> bool:
    """The C library is glibc (the only one with these thresholds)."""
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError, AttributeError):  # no such name here (musl, macOS)
        return False


def _user_chose(env: Mapping[str, str]) -> bool:
    """The process set a threshold of its own (glibc read it at start-up)."""
    if env.get("MALLOC_MMAP_THRESHOLD_") or env.get("MALLOC_TRIM_THRESHOLD_"):
        return True
    tunables = env.get("GLIBC_TUNABLES", "")
    return "malloc.mmap_threshold" in tunables or "malloc.trim_threshold" in tunables
