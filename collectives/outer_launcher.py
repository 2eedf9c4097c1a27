"""Is this process a rank of a world already? Then ``collectives.spawn`` must not start
another one inside it.

Under ``mpirun -n 2 python script.py`` a script that calls ``collectives.spawn(main, 2)``
would start a separate 2-rank world inside each of the two launcher ranks (and with
``backend="mpi"`` those children die in ``PMI_Init``). :func:`refuse_under_launcher` turns
that into an error that names the way out: call the function directly under a launcher.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from . import settings
from .launch import MPI_RANK_VARS, MPI_SIZE_VARS, under_mpi_launcher
from .slurm import slurm_task


def outer_launcher(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The launcher that made this process a rank of a world (``"torchrun"``, ``"mpi"``,
    ``"slurm"``), from its variables, or None. A Slurm job's batch script or ``salloc``
    shell is no rank (see :mod:`collectives.slurm`). A rank of ``collectives.spawn`` or of a test pool
    (``COLLECTIVES_SPAWNED``) is None: a job of its own started from there is a world of
    its own, as intended.

    >>> outer_launcher({"PMI_RANK": "1", "PMI_SIZE": "2"})
    'mpi'
    """
    env = os.environ if env is None else env
    if settings.SPAWNED.get(env):
        return None
    if env.get("RANK"):
        return "torchrun"
    if under_mpi_launcher(env):
        return "mpi"
    try:
        return "slurm" if slurm_task(env) is not None else None
    except ValueError:  # a task that lost SLURM_PROCID: a rank, though not a sound one
        return "slurm"


def refuse_under_launcher(nproc: Any) -> None:
    """``RuntimeError`` naming the way out when :func:`outer_launcher` finds one: what
    :func:`collectives.spawn` does before it starts anything."""
    launcher = outer_launcher()
    if launcher is None:
        return
    if launcher == "torchrun":
        rank, size, names = os.environ.get("RANK"), os.environ.get("WORLD_SIZE", "?"), \
            "RANK/WORLD_SIZE"
        program = "torchrun"
    elif launcher == "slurm":
        rank, size = os.environ.get("SLURM_PROCID", "?"), os.environ.get("SLURM_NTASKS", "?")
        names, program = "SLURM_PROCID/SLURM_NTASKS", "srun"
    else:
        rank = next(os.environ[n] for n in MPI_RANK_VARS if os.environ.get(n))
        size = next((os.environ[n] for n in MPI_SIZE_VARS if os.environ.get(n)), "?")
        names = "/".join(n for n in MPI_RANK_VARS if os.environ.get(n))
        program = "mpirun/mpiexec"
    raise RuntimeError(
        f"spawn: this process is already rank {rank} of {size}, started by {program} "
        f"({names} set); spawn(fn, {nproc}) here would start a separate {nproc}-rank world "
        f"inside each of its ranks. Under a launcher, call your function directly "
        f"(init_process_group() reads the launcher's variables), e.g. `main() if "
        f"collectives.detect_rendezvous().launcher != 'single' else collectives.spawn(main, "
        f"{nproc})`; or run the script with plain python")
