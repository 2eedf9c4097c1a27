"""The ``mpi`` backend: MPI through mpi4py (registry name ``mpi``).

Start the ranks with the MPI launcher; ``init_process_group()`` with no arguments then
picks this backend::

    mpiexec -n 4 python train.py                  # pg = collectives.init_process_group()

Modules: :mod:`~backends.mpi.backend` (the :class:`MpiBackend` and its factory),
:mod:`~backends.mpi.library` (loading MPI, the reduction tables),
:mod:`~backends.mpi.polling` (how every wait polls), :mod:`~backends.mpi.work` (one
operation's requests), :mod:`~backends.mpi.diagnostics` (MPI's errors, timeouts that name
the ranks that did not arrive), :mod:`~backends.mpi.persistent` (MPI-4's persistent
collectives).
"""

from collectives.algorithms.links import fold_tag

from .backend import MpiBackend, create, load_mpi
from .work import MpiWork

__all__ = ["MpiBackend", "MpiWork", "create", "fold_tag", "load_mpi"]
