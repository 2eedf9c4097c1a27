"""Running a test's job in real processes: spawned on each transport that imports here,
and one rank of an ``mpiexec`` job (the test file run as a script), so that a test file
states only its job and its checks.

    @pytest.mark.parametrize("backend, nproc", spawn_cases())
    def test_spawned(backend, nproc):
        check(spawn_job(_job, backend, nproc), backend)

    def test_under_mpiexec(tmp_path):
        check(mpiexec_job(MPIEXEC, __file__, 3, tmp_path), "mpi")

    if __name__ == "__main__":      # python test_x.py DIR, under mpiexec
        mpi_rank_main(_job_on)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

import collectives


def spawn_cases(shm_ranks: int = 4, other_ranks: int = 2, *, others_slow: bool = False) -> list:
    """(backend, nproc): shm with ``shm_ranks``, every other spawnable transport with
    ``other_ranks`` (mpi runs under mpiexec, nccl needs CUDA); with ``others_slow``, those
    others carry the ``slow`` mark (the default run keeps shm only)."""
    others = [b for b in collectives.available_backends()
              if b not in ("shm", "mpi", "nccl", "torch")]
    marks = [pytest.mark.slow] if others_slow else []
    return [("shm", shm_ranks)] + [pytest.param(b, other_ranks, marks=marks) for b in others]


def spawn_job(job: Callable[[], Any], backend: str, nproc: int, *,
              join_timeout: float = 120) -> list:
    """``job()`` in ``nproc`` processes of ``backend`` (skipped if it does not import
    here); the results in rank order."""
    if backend != "shm":
        try:
            collectives.get_backend(backend)
        except ImportError as exc:
            pytest.skip(f"backend {backend} does not import: {exc}")
    return collectives.spawn(job, nproc, backend=backend, timeout=60,
                             join_timeout=join_timeout)


def mpiexec_job(mpiexec: str, script: str, nproc: int, out_dir: Path,
                timeout: float = 180) -> list:
    """Run ``script`` (a test file whose ``__main__`` calls :func:`mpi_rank_main`) as an
    ``mpiexec -n nproc`` job; every rank's report, in rank order, after checking that the
    job succeeded on the mpi backend."""
    from job_env import ROOT, job_env
    proc = subprocess.run([mpiexec, "-n", str(nproc), sys.executable, script, str(out_dir)],
                          cwd=ROOT, env=job_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads((Path(out_dir) / f"rank{r}.json").read_text())
               for r in range(nproc)]
    assert {d["backend"] for d in reports} == {"mpi"}
    return [d["result"] for d in reports]


def mpi_rank_main(job_on: Callable[[Any], Any]) -> None:
    """One rank of an mpiexec job: ``job_on(world)``, its result written as
    ``DIR/rank{r}.json`` (``{"backend", "result"}``) for the test to read."""
    import torch
    torch.set_num_threads(1)
    pg = collectives.init_process_group()
    try:
        report = {"backend": pg.backend, "result": job_on(pg)}
        Path(sys.argv[1], f"rank{pg.rank}.json").write_text(json.dumps(report))
        pg.barrier()
    finally:
        pg.close()
