"""What the training benchmarks share: their common options, the rounds of runs, and
their mpi runs: each starts itself under ``mpiexec`` with ``--mpi-rank WORK_JSON``, and
rank 0 prints one tagged line with its result (``SECONDS 1.23`` or ``RESULT {...}``) for
the parent to read.

    payload = run_under_mpiexec(__file__, 2, work, timeout=600, tag="SECONDS",
                                threads=work[0])
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any, Callable, Optional

import collectives
from collectives.cli_flags import add_flag, positive_int
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


# ------------------------------------------------------------------ the training runs
def add_run_options(p: argparse.ArgumentParser, *, batch: int, steps: int,
                    bucket_help: Optional[str] = None) -> None:
    """The options every training benchmark takes beside ``--nproc`` and ``--backend``
    (its case list): batch, steps, warm-up, threads, (DDP's) bucket size, repeats, the
    time a run may take, JSON file, and the hidden ``--mpi-rank`` of its mpiexec ranks."""
    add_flag(p, "--batch-size", default=batch)
    add_flag(p, "--steps", default=steps, help="timed steps per run")
    add_flag(p, "--warmup", default=20, help="untimed steps before them")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="compute threads per rank (default: %(default)s)")
    if bucket_help is not None:
        p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                       help=f"{bucket_help} (default: %(default)s)")
    add_flag(p, "--repeat", default=3, help="runs of each case (the median reported)")
    add_flag(p, "--job-timeout", default=600.0, help="seconds one run may take")
    add_flag(p, "--json")
    p.add_argument("--mpi-rank", help=argparse.SUPPRESS)


def report_from_rank_0(tag: str, text: str) -> None:
    """The mpiexec job's answer: rank 0 prints ``TAG text`` for :func:`run_under_mpiexec`."""
    if collectives.detect_rendezvous().rank == 0:
        print(f"{tag} {text}", flush=True)


def run_rounds(cases: list, repeat: int, run_case: Callable[[tuple], Any]) -> dict:
    """``case -> [result of each run]``, round by round (every case once per round), so
    that the machine's changing load hits the cases alike."""
    results: dict = {case: [] for case in cases}
    for _ in range(repeat):
        for case in cases:
            results[case].append(run_case(case))
    return results
