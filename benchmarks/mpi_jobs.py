"""What the training benchmarks share for their mpi runs: each starts itself under
``mpiexec`` with ``--mpi-rank WORK_JSON``, and rank 0 prints one tagged line with its
result (``SECONDS 1.23`` or ``RESULT {...}``) for the parent to read.

    payload = run_under_mpiexec(__file__, 2, work, timeout=600, tag="SECONDS",
                                threads=work[0])
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

import collectives
from collectives.mpiexec import MpiexecUnavailable, find_mpiexec

#: A launcher's rank variables of the parent, which the mpiexec job must not inherit.
_RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def mpiexec_or_why() -> tuple[Optional[str], str]:
    """The mpiexec program, or None and why not."""
    try:
        return find_mpiexec(), ""
    except MpiexecUnavailable as exc:
        return None, str(exc)


def unavailable(backend: str, what: str = "backend") -> Optional[str]:
    """Why ``backend`` cannot run here (``what`` names it in the text), or None."""
    if backend not in collectives.available_backends():
        return f"{what} {backend!r} is not installed"
    if backend == "mpi":
        return mpiexec_or_why()[1] or None
    return None


def run_under_mpiexec(script: str, n: int, work: tuple, *, timeout: float, tag: str,
                      threads: int, env: Optional[dict] = None) -> str:
    """Run ``script --mpi-rank WORK_JSON`` on ``n`` ranks under mpiexec; the text after
    ``tag`` on the last line that starts with it (RuntimeError with mpiexec's output if
    the job fails)."""
    program, why = mpiexec_or_why()
    if program is None:
        raise RuntimeError(why)
    job_env = {k: v for k, v in os.environ.items() if k not in _RANK_VARIABLES}
    job_env.update(OMP_NUM_THREADS=str(threads), **(env or {}))
    command = [program, "-n", str(n), sys.executable, script, "--mpi-rank",
               json.dumps(list(work))]
    proc = subprocess.run(command, env=job_env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    found = [line for line in proc.stdout.splitlines() if line.startswith(f"{tag} ")]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(command)} exited with code {proc.returncode}:\n"
                           f"{(proc.stdout + proc.stderr)[-3000:]}")
    return found[-1][len(tag) + 1:]
