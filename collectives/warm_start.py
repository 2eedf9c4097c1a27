"""How :func:`collectives.spawn` starts its ranks: forked from a warm fork server (the
default), or each a fresh interpreter (``COLLECTIVES_START_METHOD=spawn``).

A fresh interpreter per rank imports numpy, collectives and, for most programs, torch
again, all ranks at once on the same cores: seconds per job. With ``forkserver`` the
first :func:`collectives.spawn` of a process starts one server (``multiprocessing``'s
fork server) that imports numpy, collectives and the shm backend, and torch and
``parallel`` when the calling program has imported torch; every rank of this and later
jobs is then a fork of that server, started in milliseconds with nothing imported twice.

Why forking the server is safe, and how it is checked:

- Forking a process that runs threads copies the locks those threads hold into a child
  where no thread will ever release them. The server imports with ``OMP_NUM_THREADS``,
  ``OPENBLAS_NUM_THREADS`` and ``MKL_NUM_THREADS`` at 1, so numpy's BLAS starts no pool
  at import (it would otherwise); torch's intra-op (OpenMP) pool starts at the first
  parallel operation, which the server never runs; nothing in ``collectives`` starts a
  thread at import (the flight recorder is written by the calling thread).
- The server imports :mod:`collectives.preloaded` last, which records its thread count
  then; a rank forked from a server that had more than one thread refuses to run
  (``RuntimeError`` naming ``COLLECTIVES_START_METHOD=spawn``). The tests assert one.
- The server does not import the program's ``__main__`` (its top level may start
  threads or do work): each rank imports it by path before running, as ``spawn`` does,
  so functions defined in ``__main__`` work alike.

What a rank takes from the call and not from the server (see :func:`rank_setup`): the
calling process's environment at the call plus the rank's variables (``RANK``, ...),
its standard output and error, torch's thread count from ``OMP_NUM_THREADS`` (torch
reads the variable once, in the server), and a fresh seed for numpy's global generator
(Python's ``random`` reseeds itself at a fork; torch's default seed is the same in every
process under both methods). Two differences remain: the program's ``__main__`` runs
its top level before the rank's environment is set (read ``RANK`` inside the rank's
function), and numpy's BLAS in a rank keeps one thread.

The server lives as long as the calling process and exits when it does; its ranks die
with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import sys
from typing import Iterator, Mapping, Sequence

from . import settings

#: Variables that keep thread pools from starting while the server imports.
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
#: The module the server imports last: it records the server's thread count.
_LAST_PRELOAD = "collectives.preloaded"


def start_method() -> str:
    """``forkserver`` or ``spawn``: the setting, or forkserver where the platform has it.

    >>> start_method() in ("forkserver", "spawn")
    True
    """
    chosen = settings.START_METHOD.get()
    if chosen is None:
        chosen = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() \
            else "spawn"
    return chosen


#: Modules a program asked the server to preload (:func:`prewarm`).
_requested: list[str] = []


def preload_modules() -> list[str]:
    """What the server imports, in order: the heavy modules this program uses (torch and
    ``parallel`` once it has imported torch) and those :func:`prewarm` was given."""
    modules = ["numpy", "collectives", "backends.shm"]
    if "torch" in sys.modules:
        modules += ["torch", "parallel"]
    modules += [m for m in _requested if m not in modules]
    return modules + [_LAST_PRELOAD]


def prewarm(modules: Sequence[str] = ()) -> None:
    """Start the fork server now, preloading ``modules`` too, while this program goes on
    (it imports in the background): a script that will spawn ranks calls it before its own
    heavy imports, so that the server imports torch on one core while the script imports
    it on another. A no-op under ``COLLECTIVES_START_METHOD=spawn`` or when the server is
    running already. In a script that spawns its ranks::

        collectives.warm_start.prewarm(["torch"])
        import torch
        ...
        collectives.spawn(train, 2)
    """
    if start_method() != "forkserver":
        return
    _requested.extend(m for m in modules if m not in _requested)
    context("forkserver")


def context(method: str) -> multiprocessing.context.BaseContext:
    """The multiprocessing context of ``method``; for ``forkserver``, its server running
    (started now, with :func:`preload_modules`, when this process has none)."""
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(preload_modules())
        # The server runs `python -c`: give it this program's import path (Python 3.11
        # does not pass it on) so that it imports the same collectives the ranks use.
        path = os.pathsep.join(p or os.getcwd() for p in sys.path)
        with environment(dict(_ONE_THREAD, PYTHONPATH=path)):
            multiprocessing.forkserver.ensure_running()
    return ctx


class RankSetup:
    """An argument of a rank's target that, when the rank unpickles it (before the rank's
    function is unpickled and its module imported), gives the rank the calling process's
    environment ``env`` and, under forkserver, its standard output and error."""

    def __init__(self, env: Mapping[str, str], method: str) -> None:
        self.env, self.method = dict(env), method

    def __reduce__(self) -> tuple:
        streams: tuple = ()
        if self.method == "forkserver":
            # Pickled while the rank is being started: the descriptors travel with it.
            streams = tuple(multiprocessing.reduction.DupFd(fd) for fd in (1, 2))
        return (rank_setup, (self.env, self.method, streams))


def rank_setup(env: dict, method: str, streams: tuple) -> str:
    """In the rank: take the caller's environment and streams; under forkserver, check
    the server and re-set what a fork shares. Returns ``method``."""
    os.environ.clear()
    os.environ.update(env)
    if method != "forkserver":
        return method
    for target, shared in zip((1, 2), streams):
        fd = shared.detach()
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    preloaded = sys.modules.get(_LAST_PRELOAD)
    threads = getattr(preloaded, "THREADS", 1)
    if threads > 1:
        raise RuntimeError(
            f"collectives.spawn: the fork server had {threads} threads when it forked this "
            f"rank (a preloaded module started them), and forking a process with threads "
            f"is unsafe; set {settings.START_METHOD.name}=spawn")
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            threads = int(env.get("OMP_NUM_THREADS", ""))
        except ValueError:
            threads = len(os.sched_getaffinity(0))
        torch.set_num_threads(max(1, threads))
    if "numpy.random" in sys.modules:
        sys.modules["numpy"].random.seed()   # fresh entropy, as a new process has
    return method


def run_exit_handlers(method: str) -> None:
    """Under forkserver, do now what a spawned rank's interpreter does as it exits and a
    forked rank's ``os._exit`` skips: run the exit handlers (closing its open groups, ...),
    then finalise MPI where mpi4py initialised it (mpi4py finalises after the handlers;
    MPICH removes its shared-memory files then)."""
    if method != "forkserver":
        return
    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block (child processes
    started inside inherit them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

