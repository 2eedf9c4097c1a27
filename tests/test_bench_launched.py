"""``python -m collectives.bench`` as the ranks of an outside launcher (torchrun, mpiexec,
srun simulated by hand): it starts nothing, every process is one rank, and rank 0 alone
prints one table (and writes the JSON)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from job_env import ROOT, free_slurm_job, job_env, srun_env

BENCH = ["-m", "collectives.bench", "--sizes", "4K,64K", "--iters", "3", "--warmup", "1"]
HAVE_MPIEXEC = bool(shutil.which(os.environ.get("MPIEXEC") or "mpiexec")) and \
    importlib.util.find_spec("mpi4py") is not None
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def check_one_table(stdout: str, started_by: str, impls: list[str], rows_path: Path,
                    world_size: int) -> None:
    assert stdout.count("# collectives.bench:") == 1, stdout       # rank 0 only
    assert f"on {world_size} ranks started by {started_by}" in stdout
    assert stdout.count("# all_reduce:") == 1
    assert stdout.count("# wrong elements in total: 0") == 1
    rows = json.loads(rows_path.read_text())
    assert sorted({r["impl"] for r in rows}) == sorted(impls)
    assert {r["bytes"] for r in rows} == {4096, 65536}
    assert {r["world_size"] for r in rows} == {world_size}
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows)


def run(command: list[str], timeout: float = 240, env: dict | None = None
        ) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, env=env or job_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(not HAVE_TORCH, reason="torchrun comes with torch")
def test_under_torchrun(tmp_path):
    # torchrun's -m runs the module in each worker as `python -m` would
    rows = tmp_path / "rows.json"
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", *BENCH, "--peer", "torch-gloo", "--json", str(rows)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_one_table(proc.stdout, "torchrun", ["shm", "torch-gloo"], rows, 2)


@pytest.mark.skipif(not HAVE_MPIEXEC, reason="needs mpiexec and mpi4py (pip install mpich "
                                             "mpi4py)")
def test_under_mpiexec(tmp_path):
    rows = tmp_path / "rows.json"
    mpiexec = shutil.which(os.environ.get("MPIEXEC") or "mpiexec")
    proc = run([mpiexec, "-n", "2", sys.executable, *BENCH, "--peer", "mpi4py",
                "--json", str(rows)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the launcher's default backend: mpi
    check_one_table(proc.stdout, "mpiexec", ["mpi", "mpi4py"], rows, 2)


def srun_tasks(ntasks: int, args: list[str]) -> list[subprocess.CompletedProcess]:
    job = free_slurm_job()
    procs = [subprocess.Popen([sys.executable, *args], cwd=ROOT,
                              env=srun_env(rank, ntasks, job=job), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
             for rank in range(ntasks)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err)
            for p, (out, err) in zip(procs, outs)]


def test_under_simulated_srun(tmp_path):
    rows = tmp_path / "rows.json"
    done = srun_tasks(2, [*BENCH, "--backend", "zmq", "--json", str(rows)])
    for rank, proc in enumerate(done):
        assert proc.returncode == 0, f"task {rank}:\n{proc.stderr[-3000:]}"
    assert done[1].stdout == ""                                 # only rank 0 prints
    check_one_table(done[0].stdout, "srun", ["zmq"], rows, 2)


@pytest.mark.parametrize("args, message", [
    (["--nproc", "3"], "argument --nproc: 3, but srun started 2 ranks"),
    (["--peer", "mpi4py"], "mpi4py needs MPI's launcher, but these ranks were started by "
                           "srun"),
])
def test_usage_errors_under_a_launcher_end_every_rank(args, message):
    done = srun_tasks(2, [*BENCH, *args])
    assert [p.returncode for p in done] == [2, 2]
    assert message in done[0].stderr and done[1].stderr == ""   # said once, by rank 0
    assert all(p.stdout == "" for p in done)


def test_a_step_without_slurm_procid_is_a_usage_error():
    env = srun_env(0, 2, job=free_slurm_job())
    del env["SLURM_PROCID"]
    proc = run([sys.executable, *BENCH], env=env, timeout=120)
    assert proc.returncode == 2
    assert "under srun" in proc.stderr and "SLURM_PROCID" in proc.stderr


def test_a_rank_whose_peer_never_comes_fails_with_one_line():
    # task 0 of a 2-task step, alone: its group times out and it says so, with status 1
    env = srun_env(0, 2, job=free_slurm_job())
    proc = run([sys.executable, *BENCH, "--backend", "shm", "--timeout", "3"], env=env,
               timeout=120)
    assert proc.returncode == 1
    assert "rank 0 of 2 (started by srun) failed:" in proc.stderr
    assert "Traceback" not in proc.stderr
