"""The public kit's promises beyond the README's scripts: check_algorithm's errors and
verdicts, functions of a script reaching mpiexec workers, check_backend(launcher=) for a
backend of your own built on MPI, a failed mpiexec start leaving nothing in /dev/shm,
collectives.spawn refusing to nest inside a launcher's rank, and the test session's own
temp-dir hygiene."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import collectives
from collectives.testing import (FunctionRef, LauncherUnavailable, PoolError, WorldPool,
                                 check_algorithm, check_backend, launcher_for,
                                 resolve_launcher, spawn_launcher)
from collectives.testing.mpi_launch import mpich_files

ROOT = Path(__file__).resolve().parents[1]


def _mpiexec_here() -> bool:
    try:
        resolve_launcher("mpiexec", "mine")
        return True
    except LauncherUnavailable:
        return False


needs_mpiexec = pytest.mark.skipif(not _mpiexec_here(), reason="no mpiexec or mpi4py here")


# ---------------------------------------------------------------- check_algorithm, fast
def gather_raising_on_rank_1(links, inp, out, dst):
    if links.rank == 1:
        raise ValueError("rank 1 refuses")
    if links.rank == dst:
        out[:] = 0


def test_check_algorithm_refuses_bad_arguments():
    with pytest.raises(TypeError, match=r"check_algorithm: argument `fn`.*top level"):
        check_algorithm(lambda links, a, op: None, "all_reduce")

    def nested(links, a, op):
        pass

    with pytest.raises(TypeError, match="top level"):
        check_algorithm(nested, "all_reduce")
    with pytest.raises(ValueError, match=r"check_algorithm: argument `op` must be one of"):
        check_algorithm(gather_raising_on_rank_1, "allreduce")
    with pytest.raises(ValueError, match="no backend"):
        check_algorithm(gather_raising_on_rank_1, "gather", backends=[])
    with pytest.raises(ValueError, match=r"check_algorithm: argument `launcher`: unknown"):
        check_algorithm(gather_raising_on_rank_1, "gather", backends=["shm"], launcher="srun")


def test_check_algorithm_names_the_rank_that_raised_and_the_shrunk_case():
    with pytest.raises(AssertionError) as info:
        check_algorithm(gather_raising_on_rank_1, "gather", backends=["shm"],
                        world_sizes=(2,), max_examples=5)
    text = str(info.value)
    assert "gather_raising_on_rank_1 as gather on backend 'shm' with 2 ranks" in text
    assert "rank 1 raised rank 1: ValueError: rank 1 refuses" in text
    assert "reproduce: check_algorithm(gather_raising_on_rank_1, 'gather'" in text


def test_function_refs_find_module_functions_and_refuse_what_workers_cannot():
    ref = FunctionRef.of(os.path.join)
    assert ref("a", "b") == "a/b" and ref.path is None
    with pytest.raises(TypeError, match=r"WorldPool|collectives.testing"):
        FunctionRef.of(3)


# ------------------------------------------------------------- launchers and mpiexec
def test_launchers_follow_the_backend_name_exactly_and_launcher_names_are_checked():
    assert launcher_for("shm") is spawn_launcher
    assert launcher_for("mympi") is spawn_launcher  # a name is no reason for mpiexec
    assert resolve_launcher("spawn", "mpi") is spawn_launcher
    assert resolve_launcher(spawn_launcher, "x") is spawn_launcher
    with pytest.raises(ValueError, match=r"check_backend: argument `launcher`: unknown"):
        check_backend("shm", launcher="torchrun")
    with pytest.raises(TypeError, match=r"WorldPool: argument `launcher` must be"):
        WorldPool("shm", 2, launcher=3)


def register_mine():
    collectives.register_backend("mine", "backends.mpi:create")


@needs_mpiexec
def test_check_backend_runs_a_backend_of_your_own_built_on_mpi_under_mpiexec():
    check_backend("mine", world_sizes=(2,), max_examples=5, ops=("all_reduce", "broadcast"),
                  kinds=("numpy",), initializer=register_mine, launcher="mpiexec")


def die_after_mpi_init():
    from mpi4py import MPI  # MPI_Init: MPICH maps its /dev/shm/mpich_shm_* file
    MPI.COMM_WORLD.Barrier()
    with open("/proc/self/maps") as maps:
        mapped = sorted({line.rsplit("/", 1)[1].strip() for line in maps
                         if "/dev/shm/mpich_shm_" in line})
    print("mapped:", mapped, flush=True)
    os._exit(3)  # no MPI_Finalize: mpiexec kills the job, nobody unlinks the file


@needs_mpiexec
def test_a_failed_mpiexec_start_leaves_nothing_in_dev_shm():
    before = mpich_files()
    pool = WorldPool("mine", 2, timeout=20, initializer=die_after_mpi_init,
                     launcher="mpiexec")
    with pytest.raises(PoolError) as info:
        pool.start()
    assert "mapped: ['mpich_shm_" in str(info.value)  # the job did have a file
    assert mpich_files() - before == set()


SCRIPT = '''
import sys
from collectives.testing import check_algorithm


def my_broadcast(links, a, src):
    """Root sends to everyone: a script's own function, run by mpiexec workers."""
    if links.rank == src:
        for dst in range(links.size):
            if dst != src:
                links.send(a, dst)
    else:
        links.recv(a, src)


if __name__ == "__main__":
    check_algorithm(my_broadcast, "broadcast", backends=sys.argv[1:], world_sizes=(1, 3),
                    max_examples=8)
    print("passed")
'''


@needs_mpiexec
def test_a_function_of_the_script_reaches_mpiexec_workers():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory(prefix="kit-script-") as folder:
        Path(folder, "my_broadcast.py").write_text(SCRIPT)
        done = subprocess.run([sys.executable, "my_broadcast.py", "mpi"], cwd=folder, env=env,
                              text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "passed"


# ------------------------------------------------------------------ spawn and launchers
@pytest.mark.parametrize("variables, launcher", [
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, "mpirun/mpiexec"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "mpirun/mpiexec"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "torchrun"),
], ids=["mpich", "openmpi", "torchrun"])
def test_spawn_refuses_inside_a_launchers_rank(monkeypatch, variables, launcher):
    monkeypatch.delenv("COLLECTIVES_SPAWNED", raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    before = set(multiprocessing_children())  # the session's worker pools, if any
    with pytest.raises(RuntimeError) as info:
        collectives.spawn(os.getpid, 2)
    text = str(info.value)
    assert text.startswith("spawn: this process is already rank")
    assert f"started by {launcher}" in text and "call your function directly" in text
    assert set(multiprocessing_children()) - before == set()  # it started no rank


def multiprocessing_children() -> list:
    import multiprocessing
    return multiprocessing.active_children()


def test_spawn_still_nests_inside_its_own_ranks():
    from collectives.outer_launcher import outer_launcher
    assert outer_launcher({"RANK": "1", "WORLD_SIZE": "2", "COLLECTIVES_SPAWNED": "1",
                           "PMI_RANK": "1"}) is None
    assert outer_launcher({}) is None


# ------------------------------------------------------------------------ temp hygiene
def test_a_worker_importing_conftest_makes_no_temp_folder():
    with tempfile.TemporaryDirectory(prefix="kit-tmp-") as tmp:
        env = dict(os.environ, TMPDIR=tmp, PYTHONPATH=os.pathsep.join([str(ROOT),
                                                                       str(ROOT / "tests")]))
        env["COLLECTIVES_FLIGHT_DIR"] = os.path.join(tmp, "inherited")
        subprocess.run([sys.executable, "-c", "import conftest"], env=env, check=True,
                       timeout=120, capture_output=True)
        assert os.listdir(tmp) == []
        env.pop("COLLECTIVES_FLIGHT_DIR")  # the session's own process does make one
        subprocess.run([sys.executable, "-c", "import conftest"], env=env, check=True,
                       timeout=120, capture_output=True)
        assert [n.startswith("collectives-test-") for n in os.listdir(tmp)] == [True]
