"""Slurm's srun as a launcher: what detect_rendezvous reads, and simulated steps (tasks
started by hand with srun's variables and no other launcher's) forming one world.

The environments below are what a real srun, sbatch and salloc exported on this machine
(Slurm 22.05, tests/scripts/slurm_single_node.sh), less the variables nothing reads.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from collectives import slurm
from collectives.launch import default_backend, detect_rendezvous, job_id
from collectives.outer_launcher import outer_launcher
from job_env import ROOT, free_slurm_job, srun_env

TASK = str(ROOT / "tests" / "scripts" / "slurm_task.py")

#: Task 1 of ``srun -N 2 -n 4`` in job 123456, step 2 (two tasks per node).
STEP_TASK = {
    "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "2", "SLURM_STEPID": "2",
    "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
    "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NODELIST": "gpu-a[001-002]-ib", "SLURM_JOB_NODELIST": "gpu-a[001-003]-ib",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}
#: The batch script of ``sbatch -n 3``: SLURM_PROCID=0 but no step.
BATCH_SCRIPT = {
    "ENVIRONMENT": "BATCH", "SLURM_JOB_ID": "3", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0", "SLURM_NTASKS": "3", "SLURM_NPROCS": "3",
    "SLURM_JOB_NODELIST": "vm", "SLURM_TASKS_PER_NODE": "3",
}
#: The shell of ``salloc -n 3``: no SLURM_PROCID, no step.
SALLOC_SHELL = {"SLURM_JOB_ID": "4", "SLURM_NTASKS": "3", "SLURM_NPROCS": "3",
                "SLURM_JOB_NODELIST": "vm", "SLURM_TASKS_PER_NODE": "3"}


# ------------------------------------------------------------------------- detection
def test_a_step_task_is_a_rank_of_the_step():
    r = detect_rendezvous(env=STEP_TASK)
    assert (r.rank, r.world_size, r.local_rank, r.local_world_size, r.launcher) == \
        (1, 4, 1, 2, "slurm")
    assert r.master_addr == "gpu-a001-ib"                   # the step's first host
    assert r.master_port == slurm.slurm_port(123456, 2) == 24562
    assert r.job_id == "SLURM_JOB_ID=123456.2"
    assert default_backend(r, env={}) == "shm"


def test_the_second_node_counts_its_own_tasks():
    env = dict(STEP_TASK, SLURM_PROCID="4", SLURM_LOCALID="0", SLURM_NODEID="1",
               SLURM_NTASKS="5", SLURM_STEP_NUM_TASKS="5", SLURM_STEP_TASKS_PER_NODE="3,2")
    r = detect_rendezvous(env=env)
    assert (r.rank, r.world_size, r.local_rank, r.local_world_size) == (4, 5, 0, 2)


def test_master_addr_and_port_set_by_the_user_win():
    r = detect_rendezvous(env=dict(STEP_TASK, MASTER_ADDR="10.1.2.3", MASTER_PORT="29400"))
    assert (r.master_addr, r.master_port) == ("10.1.2.3", 29400)


def test_without_a_step_node_list_the_job_list_is_used():
    env = {k: v for k, v in STEP_TASK.items() if k != "SLURM_STEP_NODELIST"}
    assert detect_rendezvous(env=env).master_addr == "gpu-a001-ib"


def test_two_steps_of_one_job_do_not_share_a_name_or_a_port():
    a, b = (detect_rendezvous(env=dict(STEP_TASK, SLURM_STEP_ID=s, SLURM_STEPID=s))
            for s in ("0", "1"))
    assert a.job_id != b.job_id and a.master_port != b.master_port


@pytest.mark.parametrize("job", [0, 1, 999, 1000, 123456, 2 ** 31 - 1])
@pytest.mark.parametrize("step", [0, 9, 10, 4294967294])
def test_the_port_formula_stays_unprivileged_and_below_the_ephemeral_range(job, step):
    assert 20000 <= slurm.slurm_port(job, step) <= 29999


def test_the_batch_script_and_the_salloc_shell_are_worlds_of_one():
    for env in (BATCH_SCRIPT, SALLOC_SHELL):
        r = detect_rendezvous(env=env)
        assert (r.rank, r.world_size, r.launcher) == (0, 1, "single")
        assert r.job_id.startswith("single-")       # not the job's: two pythons may run
        assert outer_launcher(env) is None         # so spawn may start ranks there


def test_mpi_variables_under_srun_keep_choosing_mpi():
    # srun --mpi=pmi2 / pmix: MPI's variables beside srun's
    env = dict(STEP_TASK, PMI_RANK="1", PMI_SIZE="4", PMI_FD="5")
    r = detect_rendezvous(env=env)
    assert (r.rank, r.world_size, r.launcher) == (1, 4, "mpi")
    assert default_backend(r, env={}) == "mpi"


def test_torchrun_inside_srun_is_torchrun():
    env = dict(STEP_TASK, RANK="3", WORLD_SIZE="8", LOCAL_RANK="1",
               MASTER_ADDR="h", MASTER_PORT="29500", TORCHELASTIC_RUN_ID="r")
    r = detect_rendezvous(env=env)
    assert (r.rank, r.world_size, r.launcher, r.job_id) == \
        (3, 8, "torchrun", "TORCHELASTIC_RUN_ID=r")


@pytest.mark.parametrize("env", [
    {"SLURM_NTASKS": "2"},
    {k: v for k, v in STEP_TASK.items() if k != "SLURM_PROCID"},
    {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7", "SLURM_STEP_NUM_TASKS": "2"},
])
def test_many_tasks_without_slurm_procid_is_a_clear_error(env):
    with pytest.raises(ValueError, match="SLURM_PROCID .*not set.*world of its own"):
        detect_rendezvous(env=env)
    assert job_id(env) is None                      # the error comes from one place
    assert outer_launcher(env) == "slurm"           # and spawn refuses too


def test_one_task_without_slurm_procid_is_rank_zero():
    r = detect_rendezvous(env={"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7",
                               "SLURM_NTASKS": "1", "SLURM_STEP_NODELIST": "n1"})
    assert (r.rank, r.world_size, r.launcher) == (0, 1, "slurm")


@pytest.mark.parametrize("env, match", [
    ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}, "neither SLURM_NTASKS"),
    (dict(STEP_TASK, SLURM_PROCID="4"), "rank 4 is not in a world of size 4"),
    (dict(STEP_TASK, SLURM_STEP_NODELIST="n[2-1]"), "runs backwards"),
    (dict(STEP_TASK, SLURM_STEP_TASKS_PER_NODE="2x2"), "not a list like"),
    (dict(STEP_TASK, SLURM_NODEID="5"), "SLURM_NODEID=5"),
    (dict(STEP_TASK, SLURM_PROCID="one"), "SLURM_PROCID='one' is not an integer"),
])
def test_bad_slurm_variables_are_clear_errors(env, match):
    with pytest.raises(ValueError, match=match):
        detect_rendezvous(env=env)


def test_tasks_per_node_syntax():
    assert [slurm.tasks_on_node("4(x2),3,1(x2)", n) for n in range(5)] == [4, 4, 3, 1, 1]


def test_without_per_node_counts_srun_block_distribution_is_assumed():
    env = {k: v for k, v in STEP_TASK.items() if "TASKS_PER_NODE" not in k}
    env.update(SLURM_NTASKS="5", SLURM_STEP_NUM_TASKS="5")
    sizes = [detect_rendezvous(env=dict(env, SLURM_NODEID=str(n))).local_world_size
             for n in (0, 1)]
    assert sizes == [3, 2]


# ------------------------------------------------------------------ simulated srun
def run_step(ntasks: int, args: list[str], timeout: float = 180, **env_kw) -> list[dict]:
    """Start ``ntasks`` copies of tests/scripts/slurm_task.py as srun would; their JSON."""
    job = free_slurm_job()
    procs = [subprocess.Popen([sys.executable, TASK, *args], cwd=ROOT,
                              env=srun_env(rank, ntasks, job=job, **env_kw),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(ntasks)]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"task {rank} failed:\n{err[-3000:]}"
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


@pytest.mark.parametrize("backend, ntasks", [("shm", 3), ("zmq", 2), ("gloo", 2)])
def test_simulated_srun_forms_one_world(backend, ntasks):
    rows = run_step(ntasks, ["--backend", backend])
    assert [r["rank"] for r in rows] == list(range(ntasks))
    for r in rows:
        assert (r["world_size"], r["launcher"], r["local_world_size"]) == \
            (ntasks, "slurm", ntasks)
        assert r["sum"] == ntasks * (ntasks + 1) / 2       # one world, not N of one
    assert len({r["master"] for r in rows}) == 1


def test_simulated_srun_without_procid_fails_clearly():
    env = srun_env(0, 2, job=free_slurm_job())
    del env["SLURM_PROCID"]
    proc = subprocess.run([sys.executable, TASK, "--backend", "shm"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "SLURM_PROCID" in proc.stderr and "world of its own" in proc.stderr


def test_spawn_refuses_inside_a_step_task():
    env = srun_env(0, 2, job=free_slurm_job())
    code = ("import collectives\n"
            "try:\n    collectives.spawn(print, 2)\n"
            "except RuntimeError as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert "started by srun" in proc.stdout and "SLURM_PROCID" in proc.stdout, proc.stderr
