"""Start-up: who am I, how many are we, how do we meet, and which backend.

:func:`detect_rendezvous` reads, in order: explicit arguments; the variables of
``collectives.spawn`` and torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``); those of MPI launchers (Open MPI
``OMPI_COMM_WORLD_*``, MPICH/Hydra ``PMI_*``, PMIx ``PMIX_*``); those of Slurm's srun
(``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, the step's node list: see
:mod:`collectives.slurm`, which also says why a batch script is no task). With none of
them it is a world of one. Under an MPI launcher the default backend is ``mpi``, otherwise ``shm``
(:func:`default_backend`). This module only reads the environment;
:func:`collectives.init_process_group` (:mod:`collectives.world`) connects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from . import settings
from .environment import first_env_int as _int
from .nodelist import expand_nodelist
from .slurm import slurm_task

__all__ = ["Rendezvous", "detect_rendezvous", "default_backend", "expand_nodelist",
           "job_id", "under_mpi_launcher"]


@dataclass(frozen=True)
class Rendezvous:
    """Everything a backend factory needs to connect one rank to its world."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: Optional[str]
    master_port: Optional[int]
    #: A string every rank of this job shares and no other job on the host uses; the shm
    #: backend names its segments after it.
    job_id: Optional[str]
    #: ``"explicit"``, ``"spawn"``, ``"torchrun"``, ``"mpi"``, ``"slurm"`` or ``"single"``.
    launcher: str
    #: 0 for the world a launcher started; k > 0 for the k-th group re-formed from it
    #: (:mod:`collectives.regroup`: a shrink, or survivors joined by new processes).
    #: A backend that can re-form meets under a name or port of that generation only.
    generation: int = 0


MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")


def under_mpi_launcher(env: Optional[Mapping[str, str]] = None) -> bool:
    """True when this process was started by mpirun/mpiexec (Open MPI, MPICH, PMIx)."""
    env = os.environ if env is None else env
    return any(env.get(name) for name in MPI_RANK_VARS)


def job_id(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """What names this job on every rank alike (from the launcher's variables), or None.

    >>> job_id({settings.JOB_ID.name: "abc"}).endswith("=abc")
    True
    """
    env = os.environ if env is None else env
    return _launcher_job_id(env) or _slurm_job_id(env)


def _launcher_job_id(env: Mapping[str, str]) -> Optional[str]:
    """The job id in the variables of ``collectives.spawn``, torchrun and MPI launchers."""
    for name in (settings.JOB_ID.name, "TORCHELASTIC_RUN_ID", "OMPI_MCA_ess_base_jobid",
                 "PMIX_NAMESPACE", "PMI_KVSNAME"):
        value = env.get(name)
        if value and value != "none":
            return f"{name}={value}"
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if addr and port:
        return f"master={addr}:{port}"
    if under_mpi_launcher(env):
        # MPICH's Hydra exports no job id; the ranks of one host share their parent
        # (the launcher's proxy), which no other job has.
        return f"mpi-ppid={os.getppid()}"
    return None


def _slurm_job_id(env: Mapping[str, str]) -> Optional[str]:
    """The job id of the srun step this process is a task of, if any."""
    try:
        task = slurm_task(env)
    except ValueError:  # detect_rendezvous says what is wrong, where it matters
        task = None
    return task.job_id if task is not None else None


def detect_rendezvous(rank: Optional[int] = None, world_size: Optional[int] = None,
                      env: Optional[Mapping[str, str]] = None) -> Rendezvous:
    """Rank, size and meeting point from explicit values, then the launcher's variables.

    >>> detect_rendezvous(env={"RANK": "1", "WORLD_SIZE": "2"}).rank
    1
    """
    env = os.environ if env is None else env
    addr = env.get("MASTER_ADDR") or None
    port = _int(env, "MASTER_PORT")
    job = _launcher_job_id(env)   # (a task's own is added below: its variables parsed once)
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise ValueError("init_process_group: give both `rank` and `world_size`, or neither")
        launcher = "explicit"
        job = job or _slurm_job_id(env)
        local_rank = _int(env, "LOCAL_RANK") if _int(env, "RANK") == rank else None
        local_size = _int(env, "LOCAL_WORLD_SIZE")
    elif _int(env, "RANK") is not None:
        rank, world_size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        if world_size is None:
            raise ValueError("RANK is set but WORLD_SIZE is not; a launcher sets both")
        launcher = "spawn" if settings.SPAWNED.get(env) else "torchrun"
        job = job or _slurm_job_id(env)
        local_rank = _int(env, "LOCAL_RANK")
        local_size = _int(env, "LOCAL_WORLD_SIZE")
    elif under_mpi_launcher(env):
        rank = _int(env, *MPI_RANK_VARS)
        world_size = _int(env, *MPI_SIZE_VARS)
        launcher = "mpi"
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMIX_LOCAL_RANK")
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMIX_LOCAL_SIZE")
        if world_size is None:
            world_size = _mpi_world_size()
    elif (task := slurm_task(env)) is not None:
        rank, world_size, launcher = task.rank, task.world_size, "slurm"
        local_rank, local_size = task.local_rank, task.local_world_size
        addr = addr or task.master_addr
        port = task.master_port if port is None else port
        job = job or task.job_id or (f"master={addr}:{port}" if addr and port else None)
    else:
        rank, world_size, launcher = 0, 1, "single"
        local_rank = local_size = None
        job = job or f"single-{os.getpid()}"
    if isinstance(rank, bool) or not isinstance(rank, int) or \
            isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"init_process_group: rank and world_size must be ints, got "
                        f"{rank!r} and {world_size!r}")
    if world_size < 1:
        source = "argument `world_size`" if launcher == "explicit" else \
            f"the world size from the {launcher} launcher's variables"
        raise ValueError(f"init_process_group: {source} must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"init_process_group: rank {rank} is not in a world of size {world_size}"
                         f"{' (argument `rank`)' if launcher == 'explicit' else ''}")
    return Rendezvous(rank=rank, world_size=world_size,
                      local_rank=rank if local_rank is None else local_rank,
                      local_world_size=world_size if local_size is None else local_size,
                      master_addr=addr, master_port=port, job_id=job, launcher=launcher)


def _mpi_world_size() -> int:
    # PMIx exports no size variable; ask MPI itself (only reached under an MPI launcher).
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_size()


def default_backend(rendezvous: Rendezvous, env: Optional[Mapping[str, str]] = None) -> str:
    """``COLLECTIVES_BACKEND`` if set, ``mpi`` under an MPI launcher, otherwise ``shm``."""
    chosen = settings.BACKEND.get(env)
    if chosen:
        return chosen.strip()
    return "mpi" if rendezvous.launcher == "mpi" else "shm"
