"""Real Slurm: the examples under ``srun`` on the one-node cluster that
tests/scripts/slurm_single_node.sh sets up, each training to the one-host run's result.

Slow (``-m slow``). As root the cluster is set up (or found running) first; without srun,
or without root and without a controller that answers, the tests skip with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from job_env import ROOT, job_env

pytestmark = pytest.mark.slow

SETUP = ROOT / "tests" / "scripts" / "slurm_single_node.sh"


@pytest.fixture(scope="module")
def cluster() -> None:
    """A Slurm controller that takes jobs, or a skip that says why there is none."""
    if shutil.which("srun") is None:
        pytest.skip(f"srun is not installed (as root, {SETUP.relative_to(ROOT)} installs "
                    f"Debian's slurm-wlm and starts a one-node cluster)")
    if os.geteuid() == 0:
        proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, f"{SETUP.name} failed:\n{proc.stdout}{proc.stderr}"
    elif subprocess.run(["scontrol", "ping"], capture_output=True,
                        timeout=30).returncode != 0:
        pytest.skip(f"no Slurm controller answers, and only root may run "
                    f"{SETUP.relative_to(ROOT)}")


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
