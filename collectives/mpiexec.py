"""Finding the ``mpiexec`` that starts MPI jobs: ``$MPIEXEC``, else ``mpiexec`` or
``mpirun`` on PATH (``pip install mpich`` puts one there). Used by the testing kit, the
benchmark and the scripts in ``benchmarks/``, which re-launch themselves under it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal

from . import lifetime


class MpiexecUnavailable(RuntimeError):
    """There is no way to start MPI ranks here; the message says what to install."""


def find_mpiexec() -> str:
    """The path of the ``mpiexec`` to use, or :class:`MpiexecUnavailable` when there is
    none or mpi4py is missing.

    >>> os.path.basename(find_mpiexec())    # where mpi4py and an MPI are installed
    'mpi...'
    """
    if importlib.util.find_spec("mpi4py") is None:
        raise MpiexecUnavailable("needs mpi4py (pip install 'collectives[mpi]')")
    for name in filter(None, (os.environ.get("MPIEXEC"), "mpiexec", "mpirun")):
        path = shutil.which(name)
        if path:
            return path
    raise MpiexecUnavailable("needs mpiexec or mpirun on PATH (pip install mpich, or set "
                             "MPIEXEC)")


def own_session_dying_with_parent() -> None:
    """For ``subprocess.Popen(preexec_fn=...)`` of an ``mpiexec``: a session of its own
    (so that one signal to the group reaches every rank) and SIGTERM when the launching
    process dies (no orphaned jobs)."""
    os.setsid()
    lifetime.prctl(lifetime.PR_SET_PDEATHSIG, signal.SIGTERM)
