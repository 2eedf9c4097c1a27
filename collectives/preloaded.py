"""Imported last by ``collectives.spawn``'s fork server (see :mod:`collectives.warm_start`):
records how many threads the server runs once everything else is imported, so that each
rank forked from it can check there was only one. Nothing else imports it."""

from __future__ import annotations

import os
import sys
import threading


def count_threads() -> int:
    """This process's threads: the kernel's count (every thread, including those started
    by C libraries), or Python's own where /proc is missing.

    >>> count_threads() >= 1
    True
    """
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


#: The server's thread count when its preloading ended.
THREADS = count_threads()
#: Whether the server imported torch (it does when the calling program had).
HAD_TORCH = "torch" in sys.modules
