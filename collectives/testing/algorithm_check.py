"""``check_algorithm``: a collective of your own, written over send/recv, checked on every
backend against the numpy reference, with hypothesis shrinking a failure to a minimal case.

The algorithm is a function with the signature of the library's own (see
:mod:`collectives.algorithms.dispatch`): a :class:`~collectives.algorithms.Links` (this
call's send/recv between the group's ranks) and flat, C-contiguous host numpy arrays,
outputs written in place; reductions through :func:`collectives.reduce_op.combine_into`
and :func:`~collectives.reduce_op.finish`::

    broadcast(links, a, src)              all_gather(links, out, inp)
    all_reduce(links, a, op)              gather(links, inp, out, dst)   # out None off dst
    reduce(links, a, dst, op)             scatter(links, out, inp, src)  # inp None off src
    reduce_scatter(links, out, inp, op)   all_to_all(links, out, inp, out_counts, in_counts)
    barrier(links)

For each backend and world size a :class:`~collectives.testing.WorldPool` is started once;
every rank then calls the function on ``Links(group, seq)`` over the backend's own point
to point with the inputs of a drawn :class:`~collectives.testing.CollectiveCase`, and
:func:`~collectives.testing.compare` judges the outputs (every all_reduce result must be
bitwise identical on all ranks, as the library's own are). The function reaches the
workers by name (:class:`~collectives.testing.functions.FunctionRef`): define it at the top
level of a module, or of the script that calls ``check_algorithm``, with the script's own
work under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .. import settings
from ..algorithms import Links
from ..registry import available_backends
from .check_report import CheckReport, Progress
from .execution import SENTINEL, CaseResult
from .functions import FunctionRef
from .hypothesis_storage import Database, example_database, storage_outside_cwd
from .launchers import Launcher, resolve_launcher
from .pool import WorldPool
from .strategies import (DTYPES, OPS, CollectiveCase, collective_cases, make_input,
                         numpy_dtype, output_shape)
from .workers import Task

#: Comma-separated backend names that ``check_algorithm(backends=None)`` checks instead of
#: every available one (a CI job that runs only some).
BACKENDS_VARIABLE = settings.CHECK_BACKENDS.name
#: Backends left out of the default list: aliases (``torch`` is gloo or nccl) and those
#: whose point to point takes device memory, not host arrays.
_NOT_BY_DEFAULT = ("torch", "nccl")
#: Where this world's algorithm calls number their tags: far above the group's own
#: sequence numbers (bits 12..35 of a tag, see ``collectives.algorithms.links``), so no
#: call of the check shares a tag with a collective of the group (its close, say).
_FIRST_SEQ = 1 << 23
_calls = [0]


def default_backends() -> list[str]:
    """The backends :func:`check_algorithm` checks by default: ``COLLECTIVES_CHECK_BACKENDS``
    when set, otherwise every one :func:`collectives.available_backends` reports but
    ``torch`` (an alias of gloo or nccl) and ``nccl`` (device memory)."""
    chosen = (settings.CHECK_BACKENDS.get() or "").strip()
    if chosen:
        return [b.strip() for b in chosen.split(",") if b.strip()]
    return [b for b in available_backends() if b not in _NOT_BY_DEFAULT]


def _arguments(case: CollectiveCase, links: Links, inp: Optional[np.ndarray],
               out: Optional[np.ndarray]) -> tuple:
    """The algorithm's arguments for ``case``, in the order of
    :mod:`collectives.algorithms.dispatch`."""
    op, root, red = case.op, case.root, case.reduction
    if op == "barrier":
        return (links,)
    if op == "broadcast":
        return (links, inp, root)
    if op == "all_reduce":
        return (links, inp, red)
    if op == "reduce":
        return (links, inp, root, red)
    if op == "all_gather":
        return (links, out, inp)
    if op == "gather":
        return (links, inp, out, root)
    if op == "scatter":
        return (links, out, inp, root)
    if op == "reduce_scatter":
        return (links, out, inp, red)
    n, rank = links.size, links.rank
    row = int(np.prod(case.shape[1:], dtype=np.int64))
    if case.splits is None:
        count = int(np.prod(case.shape, dtype=np.int64))
        return (links, out, inp, [count] * n, [count] * n)
    return (links, out, inp, [case.splits[j][rank] * row for j in range(n)],
            [case.splits[rank][j] * row for j in range(n)])


def run_algorithm_case(group: Any, fn: Callable[..., Any], case: CollectiveCase) -> CaseResult:
    """Run ``fn`` as collective ``case.op`` on this rank of ``group`` with the inputs of
    ``case`` (flat, C-contiguous numpy; outputs start as the sentinel 111) and return what
    the rank holds afterwards, in the case's shapes. Every rank calls it with the same
    case; exceptions propagate."""
    rank, n = group.rank, group.size
    _calls[0] += 1
    links = Links(group, seq=_FIRST_SEQ + _calls[0])
    data = make_input(case, rank, n)
    inp = None if data is None else data.reshape(-1).copy()
    shape = output_shape(case, rank, n)
    out = None if shape is None else np.full(
        int(np.prod(shape, dtype=np.int64)), SENTINEL).astype(numpy_dtype(case.dtype))
    if case.delay is not None and case.delay[0] == rank:
        time.sleep(case.delay[1])
    fn(*_arguments(case, links, inp, out))
    result = CaseResult(rank)
    if case.op in ("broadcast", "all_reduce", "reduce"):
        result.output = inp.reshape(data.shape)
    else:
        result.output = None if out is None else out.reshape(shape)
        result.input_after = None if inp is None else inp.reshape(data.shape)
    return result


def check_algorithm(fn: Callable[..., Any], op: str, *, backends: Optional[Sequence[str]] = None,
                    world_sizes: Sequence[int] = (1, 2, 3, 4), max_examples: int = 50,
                    dtypes: Sequence[str] = DTYPES, timeout: float = 20.0,
                    launcher: "Launcher | str | None" = None,
                    initializer: Optional[Task] = None, derandomize: bool = True,
                    database: Database = None) -> CheckReport:
    """Check ``fn``, an implementation of collective ``op`` (one of
    :data:`~collectives.testing.OPS`) over send/recv, on each of ``backends`` (default:
    :func:`default_backends`, every available one, ``mpi`` under ``mpiexec``) and world
    size: ``max_examples`` hypothesis-drawn cases each (shapes incl. empty, 0-d and odd,
    up to past 4 MiB; every dtype of ``dtypes``, reduction and root). Raises
    ``AssertionError`` on the first failing case, shrunk to a minimal one, naming the
    backend, the world size, the case and what each rank got; returns a
    :class:`~collectives.testing.check_report.CheckReport` of what passed when all do (one
    line as text), after logging each world at info on the ``collectives.testing``
    logger (``COLLECTIVES_LOG_LEVEL=info`` shows the progress). ``database``: as
    :func:`~collectives.testing.check_backend`'s (default: no hypothesis database, and
    nothing written in the current folder).

    ``fn`` has the signature of the library's algorithm for ``op`` (module docstring),
    e.g. ``fn(links, array, op)`` for all_reduce, and must be defined at the top level
    of a module or script. ``timeout`` (seconds) is the group timeout in the workers: an
    algorithm that waits for a message never sent fails with ``CollectiveTimeout`` after
    it. ``launcher`` and ``initializer`` are :class:`~collectives.testing.WorldPool`'s
    (a backend of your own: register it in ``initializer``). Three ranks::

        def my_all_reduce(links, a, op):     # at the top level of the script
            ...

        if __name__ == "__main__":
            check_algorithm(my_all_reduce, "all_reduce", world_sizes=(3,))
    """
    from hypothesis import HealthCheck, given, settings

    ref = FunctionRef.of(fn, where="check_algorithm")
    if op not in OPS:
        raise ValueError(f"check_algorithm: argument `op` must be one of {list(OPS)}, "
                         f"got {op!r}")
    names = default_backends() if backends is None else list(backends)
    if not names:
        raise ValueError("check_algorithm: no backend to check on (argument `backends`, "
                         f"or {BACKENDS_VARIABLE}, is empty)")
    launchers = {b: resolve_launcher(launcher, b, where="check_algorithm") for b in names}
    examples = example_database(database, "check_algorithm")
    progress = Progress(f"{ref.qualname} as {op}",
                        f"up to {max_examples} cases on {', '.join(names)} at world sizes "
                        f"{', '.join(map(str, world_sizes))}")
    for backend in names:
        for n in world_sizes:
            cases = collective_cases(n, [op], dtypes, kinds=("numpy",),
                                     layouts=("contiguous",), async_op=False)
            with progress.world(backend, n) as world, storage_outside_cwd(), \
                    WorldPool(backend, n, timeout=timeout, launcher=launchers[backend],
                              initializer=initializer) as pool:
                @settings(max_examples=max_examples, deadline=None, derandomize=derandomize,
                          database=examples, suppress_health_check=list(HealthCheck))
                @given(cases)
                def algorithm_matches_reference(case: CollectiveCase) -> None:
                    world.case()
                    _check_case(pool, ref, case)

                algorithm_matches_reference()
    return progress.report()


def _check_case(pool: WorldPool, ref: FunctionRef, case: CollectiveCase) -> None:
    pool.check(case, task=run_algorithm_case, args=(ref,), name=ref.qualname,
               reproduce=f"check_algorithm({ref.qualname}, {case.op!r}, "
                         f"backends=[{pool.backend!r}], world_sizes=[{pool.world_size}])")
