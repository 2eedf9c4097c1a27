"""The public testing kit: what each collective means, cases to try, worlds to try them on.

- :mod:`~collectives.testing.reference`: every collective as a pure numpy function over
  all ranks' inputs (the oracle).
- :mod:`~collectives.testing.strategies`: hypothesis strategies drawing a
  :class:`CollectiveCase`; :func:`make_input` derives each rank's input from the case;
  :func:`expected_outputs` applies the reference.
- :mod:`~collectives.testing.pool`: :class:`WorldPool`, a world of worker processes started
  once and fed many cases (started by :mod:`~collectives.testing.launchers`);
  :func:`check_backend` runs the whole sweep over a backend in one call,
  :func:`check_algorithm` over a collective algorithm of your own, on every backend.
- :mod:`~collectives.testing.threads` (when present): :func:`run_threads`, a world of
  threads in one process, for checking algorithms with no processes at all.
- :mod:`~collectives.testing.hosts`: :class:`HostRig`, several emulated hosts on one Linux
  machine (namespaces: own hostname, ``/dev/shm`` and address, a rate-limited link; root
  only), and :mod:`~collectives.testing.hosts_launch` to start torchrun, mpiexec or plain
  ranks across them.

Check a backend (or the default algorithms over its point to point) in one call::

    from collectives.testing import check_backend
    check_backend("shm")
    check_backend("p2p:shm", world_sizes=(2, 5), max_examples=500)
    check_algorithm(my_all_reduce, "all_reduce")     # my_all_reduce(links, array, op)

Needs ``hypothesis`` (``pip install 'collectives[test]'``).
"""

from . import reference
from .execution import CaseResult, array_diff, compare, run_case
from .algorithm_check import check_algorithm
from .backend_check import check_backend
from .check_report import CheckReport
from .functions import FunctionRef
from .launchers import resolve_launcher
from .pool import (LaunchedWorld, LauncherUnavailable, PoolError, RemoteError, RemoteErrors,
                   WorldPool, launcher_for, serve, spawn_launcher)
from .strategies import (OPS, CollectiveCase, collective_cases, expected_outputs, input_shape,
                         make_input, output_shape)

__all__ = [
    "OPS", "CaseResult", "CheckReport", "CollectiveCase", "FunctionRef", "LaunchedWorld", "LauncherUnavailable",
    "PoolError", "RemoteError", "RemoteErrors", "WorldPool", "array_diff", "check_algorithm", "check_backend",
    "collective_cases", "compare", "expected_outputs", "input_shape", "launcher_for",
    "make_input", "output_shape", "reference", "resolve_launcher", "run_case", "serve",
    "spawn_launcher",
]

try:  # written separately; the kit works without it
    from .threads import ThreadBackend, run_threads
except ImportError:  # pragma: no cover - only before collectives.testing.threads exists
    pass
else:
    __all__ += ["ThreadBackend", "run_threads"]
