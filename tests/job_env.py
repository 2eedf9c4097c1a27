"""The environment a test gives a job it starts as a subprocess (an example, mpiexec, a
script): the caller's, without any launcher's rank variables or a backend choice that
would leak into the job, one compute thread per rank, and the repository importable."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                       "MASTER_PORT", "COLLECTIVES_BACKEND", "COLLECTIVES_JOB_ID")


def job_env() -> dict:
    # Slurm's too: under an sbatch/srun the test run itself may be a task, and a job it
    # starts by hand must not take that task's identity.
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_VARIABLES and not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def srun_env(rank: int, ntasks: int, *, job: int, step: int = 0, nodelist: str = "localhost",
             tasks_per_node: str = "") -> dict:
    """:func:`job_env` plus what ``srun -n NTASKS`` gives task ``rank`` on a single node
    (the variables a real srun exported here, less the ones nothing reads)."""
    env = job_env()
    env.update({
        "SLURM_JOB_ID": str(job), "SLURM_JOBID": str(job), "SLURM_STEP_ID": str(step),
        "SLURM_STEPID": str(step), "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0", "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks),
        "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODELIST": nodelist,
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node or str(ntasks),
        "SLURM_TASKS_PER_NODE": tasks_per_node or str(ntasks),
    })
    return env


def free_slurm_job() -> int:
    """A job id whose step 0 meets at a port (``collectives.slurm.slurm_port``) that is
    free here now, for a simulated srun step."""
    from collectives.slurm import slurm_port
    rng = random.Random()
    for _ in range(200):
        job = rng.randrange(10_000, 10_000_000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", slurm_port(job)))
                return job
            except OSError:
                continue
    raise RuntimeError("no free port in Slurm's range 20000-29999")
