"""Real Slurm: the examples under ``srun`` on the one-node cluster that
tests/scripts/slurm_single_node.sh sets up, each training to the one-host run's result.

Slow (``-m slow``). As root the cluster is set up (or found running) first; without srun,
or without root and without a controller that answers, the tests skip with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from job_env import ROOT, job_env

pytestmark = pytest.mark.slow

SETUP = ROOT / "tests" / "scripts" / "slurm_single_node.sh"


#: The daemons the set-up script starts, by their pid files.
DAEMON_PIDS = ("/run/slurmd.pid", "/run/slurmctld.pid", "/run/munge/munged.pid")


def _controller_answers() -> bool:
    return subprocess.run(["scontrol", "ping"], capture_output=True,
                          timeout=30).returncode == 0


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A Slurm controller that takes jobs, or a skip that says why there is none. A
    cluster these tests started is stopped after them; one that was running stays."""
    if shutil.which("srun") is None:
        pytest.skip(f"srun is not installed (as root, {SETUP.relative_to(ROOT)} installs "
                    f"Debian's slurm-wlm and starts a one-node cluster)")
    was_running = _controller_answers()
    if os.geteuid() == 0:
        proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, f"{SETUP.name} failed:\n{proc.stdout}{proc.stderr}"
    elif not was_running:
        pytest.skip(f"no Slurm controller answers, and only root may run "
                    f"{SETUP.relative_to(ROOT)}")
    yield
    if not was_running:
        for pid_file in DAEMON_PIDS:
            try:
                os.kill(int(Path(pid_file).read_text().split()[0]), signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                pass                              # not started, or gone already


def summary(command: list[str]) -> dict:
    """The example's last line of standard output (its JSON summary)."""
    proc = subprocess.run(command, cwd=ROOT, env=job_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("example, ntasks, args", [
    ("tp", 4, []),
    ("ddp", 2, ["--backend", "zmq"]),
])
def test_srun_trains_like_the_one_host_run(cluster, example, ntasks, args):
    script = f"examples/{example}.py"
    under_srun = summary(["srun", "-n", str(ntasks), "--time", "10", sys.executable,
                          script, *args])
    spawned = summary([sys.executable, script, "--nproc", str(ntasks), *args])
    assert under_srun["world_size"] == ntasks
    assert under_srun["backend"] == spawned["backend"]
    assert under_srun["final_acc"] == spawned["final_acc"]
    assert under_srun["final_loss"] == spawned["final_loss"]


def test_srun_runs_the_benchmark_as_its_ranks(cluster):
    proc = subprocess.run(["srun", "-n", "2", "--time", "10", sys.executable, "-m",
                           "collectives.bench", "--sizes", "4K,64K", "--iters", "5"],
                          cwd=ROOT, env=job_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("# collectives.bench") == 1          # one table, rank 0's
    assert "ranks started by srun" in proc.stdout
    assert len([line for line in proc.stdout.splitlines() if line.lstrip().startswith(
        ("4096", "65536"))]) == 2


def test_a_batch_script_spawns_locally_and_its_srun_steps_are_worlds(cluster, tmp_path):
    """The batch script sees SLURM_PROCID=0 and SLURM_NTASKS=2 without being a task: its
    own python is a world of one that spawns; its srun step is one world of 2."""
    out = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH -n 2\n#SBATCH --time 10\n"
        f"cd {ROOT}\n"
        f"{sys.executable} -c 'import collectives; r = collectives.detect_rendezvous(); "
        f"print(\"batch\", r.launcher, r.world_size)'\n"
        f"{sys.executable} examples/ddp.py --nproc 2 --epochs 1 | tail -1\n"
        f"srun {sys.executable} tests/scripts/slurm_task.py --backend shm\n")
    proc = subprocess.run(["sbatch", "--wait", "-o", str(out), str(script)], cwd=ROOT,
                          env=job_env(), capture_output=True, text=True, timeout=400)
    text = out.read_text() if out.exists() else ""
    assert proc.returncode == 0, f"{proc.stderr}\n{text[-3000:]}"
    lines = text.strip().splitlines()
    assert "batch single 1" in lines
    spawned = json.loads(next(line for line in lines if line.startswith('{"example"')))
    assert spawned["world_size"] == 2
    tasks = [json.loads(line) for line in lines if line.startswith('{"rank"')]
    assert sorted(t["rank"] for t in tasks) == [0, 1]
    assert all(t["launcher"] == "slurm" and t["sum"] == 3.0 for t in tasks)


def test_the_setup_script_is_idempotent(cluster):
    if os.geteuid() != 0:
        pytest.skip("the set-up script runs as root only")
    pid = (lambda: open("/run/slurmctld.pid").read().strip())
    before = pid()
    proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "is idle" in proc.stdout or "is mixed" in proc.stdout
    assert pid() == before                                    # nothing restarted
