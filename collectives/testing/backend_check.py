"""``check_backend``: the whole hypothesis conformance sweep of one backend in one call."""

from __future__ import annotations

import importlib.util
from typing import Optional, Sequence, Union

from .check_report import CheckReport, Progress
from .hypothesis_storage import Database, example_database, storage_outside_cwd
from .launchers import Launcher, resolve_launcher
from .pool import WorldPool
from .strategies import DTYPES, OPS, CollectiveCase, collective_cases
from .workers import Task


def check_backend(backend: Union[str, Sequence[str]], world_sizes: Sequence[int] = (1, 2, 3, 4),
                  max_examples: int = 200, *, ops: Sequence[str] = OPS,
                  dtypes: Sequence[str] = DTYPES, kinds: Optional[Sequence[str]] = None,
                  timeout: float = 60.0, initializer: Optional[Task] = None,
                  derandomize: bool = True,
                  launcher: "Launcher | str | None" = None,
                  database: Database = None) -> CheckReport:
    """Check one backend (or several) against the reference: for each world size, a pool
    of workers is fed ``max_examples`` hypothesis-drawn cases of every op, dtype,
    reduction, root, shape and layout. Raises ``AssertionError`` on the first (shrunk)
    failing case. To check a backend of your own, register it in ``initializer`` (a
    top-level function of a module or of the script itself, or ``"module:function"``),
    which runs in every worker before it joins::

        def register():
            collectives.register_backend("mine", "mypkg.mine:create")

        if __name__ == "__main__":            # workers import this script
            check_backend("mine", initializer=register)
            check_backend("p2p:mine", initializer=register)   # the default algorithms

    ``launcher`` starts the workers (:func:`~collectives.testing.launchers.resolve_launcher`):
    by default ``mpiexec`` for ``mpi`` and ``p2p:mpi`` and ``multiprocessing`` for the
    rest; a backend of your own built on MPI passes ``launcher="mpiexec"``. Backend names
    contain no ``':'`` (:func:`collectives.register_backend` refuses it): it separates the
    ``p2p:`` prefix from the backend it wraps.

    Returns a :class:`~collectives.testing.check_report.CheckReport` of what passed
    (``print(check_backend("shm"))``: one line); each world is logged at info on the
    ``collectives.testing`` logger as it starts and passes (``COLLECTIVES_LOG_LEVEL=info``
    shows it). ``database``: where hypothesis keeps failing examples (None, the default:
    nowhere; a folder, or an ``ExampleDatabase``); hypothesis's other files go to the
    system's temporary folder, not the current one
    (:mod:`~collectives.testing.hypothesis_storage`).
    """
    from hypothesis import HealthCheck, given, settings

    cases = {n: collective_cases(n, ops, dtypes, kinds=kinds) for n in world_sizes}
    uses_torch = kinds is None or set(kinds) & {"torch", "cuda"}
    preload = ("torch",) if uses_torch and importlib.util.find_spec("torch") else ()
    names = [backend] if isinstance(backend, str) else list(backend)
    launchers = {name: resolve_launcher(launcher, name, where="check_backend") for name in names}
    examples = example_database(database, "check_backend")
    progress = Progress(f"backend {' and '.join(map(repr, names))}",
                        f"up to {max_examples} cases of {', '.join(ops)} at world sizes "
                        f"{', '.join(map(str, world_sizes))}")
    for name in names:
        for n in world_sizes:
            with progress.world(name, n) as world, storage_outside_cwd(), \
                    WorldPool(name, n, timeout=timeout, initializer=initializer,
                              preload=preload, launcher=launchers[name]) as pool:
                @settings(max_examples=max_examples, deadline=None, derandomize=derandomize,
                          database=examples, suppress_health_check=list(HealthCheck))
                @given(cases[n])
                def conforms(case: CollectiveCase) -> None:
                    world.case()
                    pool.check(case)

                conforms()
    return progress.report()

