"""What outlives a call: whether a process is alive, what happens to it when its parent
dies, and the groups to close at exit.

Backends whose libraries run threads of their own (MPI, torch's gloo and NCCL) must close
their groups before the interpreter finalises: MPI_Finalize (mpi4py's, after the atexit
hooks) and torch's C++ destructors must not meet a group still in use. They register each
group with :func:`close_at_exit` when it opens and :func:`forget_at_exit` when it closes;
one atexit hook closes the rest.

In such a backend::

    close_at_exit(group)        # in the group's constructor
    forget_at_exit(group)       # in its _close
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import weakref
from typing import Any

#: prctl options (linux/prctl.h).
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15

_OPEN: "weakref.WeakSet[Any]" = weakref.WeakSet()


def close_at_exit(group: Any) -> None:
    """Close ``group`` at interpreter exit unless it was closed before."""
    _OPEN.add(group)


def forget_at_exit(group: Any) -> None:
    _OPEN.discard(group)


def open_groups(kind: type) -> list:
    """The registered groups that are instances of ``kind``, still open."""
    return [g for g in list(_OPEN) if isinstance(g, kind)]


@atexit.register
def _close_all_at_exit() -> None:
    for group in list(_OPEN):
        try:
            group.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def process_alive(pid: int) -> bool:
    """True unless process ``pid`` is gone or a zombie (an ended process not yet reaped).

    >>> process_alive(os.getpid())
    True
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, as another user's
    except OSError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # no /proc (not Linux): signal 0 said it exists
    end = stat.rfind(b")")
    return stat[end + 2:end + 3] not in (b"Z", b"X", b"x")


def prctl(option: int, arg: Any) -> None:
    """Linux's ``prctl(option, arg)`` for this process (``PR_SET_PDEATHSIG``: the signal
    it gets when its parent dies; ``PR_SET_NAME``: its name); best effort, and nothing
    off Linux."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)
        except OSError:
            pass
