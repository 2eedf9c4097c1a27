"""The environment a test gives a job it starts as a subprocess (an example, mpiexec, a
script): the caller's, without any launcher's rank variables or a backend choice that
would leak into the job, one compute thread per rank, and the repository importable."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                       "MASTER_PORT", "COLLECTIVES_BACKEND", "COLLECTIVES_JOB_ID")


def job_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env
