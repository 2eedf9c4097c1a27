"""How every wait of the mpi backend waits: it polls MPI's request with ``Test()`` and a
deadline instead of blocking in ``MPI_Wait``.

First ``Test()`` in a loop for ``COLLECTIVES_MPI_SPIN_US`` microseconds (default 1000),
calling ``os.sched_yield()`` after every poll when this host's ranks outnumber its cores
(the peer that must answer then gets the core) and after every 64 polls otherwise (like
MPICH's own loops; ``COLLECTIVES_MPI_YIELD_EVERY`` overrides), then ``time.sleep`` from
20 us doubling up to 1 ms, so a long wait costs almost no CPU. MPI makes progress only
inside these ``Test()`` calls (there is no progress thread); the 1 ms cap keeps them
frequent enough for large messages (``benchmarks/mpi_overhead.py`` measures the cost
against raw mpi4py). While it sleeps, a wait runs ``idle()`` (the backend answers its
peers' questions there: :mod:`backends.mpi.diagnostics`).

Two ranks: ``poll(request.Test, 60.0, idle)`` -> True once the request completed, False
after 60 s.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from collectives import settings

from .library import yield_every

_SLEEP_MIN = 20e-6
_SLEEP_MAX = 1e-3
#: Seconds of polling (``Test()``, with a ``sched_yield`` every few polls) before a wait
#: starts sleeping.
_spin_s = 1e-3
#: Polls between two ``sched_yield`` calls while spinning (:func:`tune`).
_yield_every = 64


def tune() -> None:
    """Read the wait's settings (when MPI is loaded: the host's layout is known then)."""
    global _spin_s, _yield_every
    _spin_s = settings.MPI_SPIN_US.get() * 1e-6
    _yield_every = yield_every(os.environ)


def poll(test: Callable[[], bool], limit: float, idle: Callable[[], None]) -> bool:
    """Call ``test`` until it returns True (then True) or ``limit`` seconds passed (then
    False): yielding the CPU between calls for the spin time, then sleeping with a delay
    that doubles from 20 us to 1 ms, running ``idle()`` before each sleep."""
    if test():
        return True
    now = time.monotonic()
    deadline = now + limit
    spin_end = min(now + _spin_s, deadline)
    burst = min(_yield_every, 16)  # polls between two looks at the clock
    bursts_per_yield, bursts = max(_yield_every // burst, 1), 0
    yield_cpu = os.sched_yield
    while now < spin_end:
        for _ in range(burst):
            if test():
                return True
        bursts += 1
        if bursts >= bursts_per_yield:
            yield_cpu()
            bursts = 0
        now = time.monotonic()
    delay = _SLEEP_MIN
    while now < deadline:
        idle()
        time.sleep(min(delay, deadline - now))
        if test():
            return True
        delay = min(2 * delay, _SLEEP_MAX)
        now = time.monotonic()
    return test()
