"""examples/moe.py: the examples' contract (the closing JSON line, with the experts' load
added), at least 85% accuracy within 5 minutes, every expert at least half its fair share
of the tokens with the load-balancing loss on, and the capacity limit dropping tokens."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from examples.common.cli import SUMMARY_KEYS
from job_env import job_env

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = shutil.which(os.environ.get("MPIEXEC") or "mpiexec") or shutil.which("mpirun")
LIMIT_S = 300       # the bound on the training time, on 2 cores


def _run(command: list, timeout: float = 400) -> tuple:
    proc = subprocess.run(command, cwd=ROOT, env=job_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]), lines[:-1]


def _check(summary: dict, lines: list, world_size: int, backend: str = "shm") -> None:
    assert list(summary)[:len(SUMMARY_KEYS)] == list(SUMMARY_KEYS)
    assert summary["example"] == "moe" and summary["backend"] == backend
    assert summary["world_size"] == world_size and summary["epochs"] == 5
    assert summary["final_acc"] >= 0.85 and summary["wall_s"] < LIMIT_S, summary
    counts = summary["tokens_per_expert"]
    assert len(counts) == 2 and all(len(layer) == 8 for layer in counts)
    # every choice of the last epoch (4000 images, top-2, two layers) accepted or dropped
    assert abs(sum(map(sum, counts)) - 16000 * (1 - summary["drop_rate"])) <= 1, summary
    fair = min(min(c) / (sum(c) / len(c)) for c in counts)
    assert summary["min_expert_share"] == round(fair, 4) and fair >= 0.5, summary
    assert any(line.startswith("expert load, last epoch, all ranks: layer 0: ")
               for line in lines), lines


@pytest.mark.parametrize("nproc", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_example_trains_with_balanced_experts(nproc):
    summary, lines = _run([sys.executable, "examples/moe.py", "--nproc", str(nproc)])
    _check(summary, lines, nproc)
    assert summary["drop_rate"] == 0.0


def test_experts_that_do_not_divide_are_refused():
    proc = subprocess.run([sys.executable, "examples/moe.py", "--nproc", "3"], cwd=ROOT,
                          env=job_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--experts 8 is not divisible by --nproc 3" in proc.stderr


@pytest.mark.slow
def test_capacity_drops_and_still_trains():
    summary, lines = _run([sys.executable, "examples/moe.py", "--nproc", "4",
                           "--capacity-factor", "1.0"])
    _check(summary, lines, 4)
    assert 0.0 < summary["drop_rate"] < 0.5


@pytest.mark.slow
def test_without_the_aux_loss_the_load_is_less_even():
    """The bundled digits and seed 0: with the loss off, the least loaded expert gets
    less of its fair share than with it on (the same run otherwise)."""
    on, _ = _run([sys.executable, "examples/moe.py"])
    off, _ = _run([sys.executable, "examples/moe.py", "--aux-weight", "0"])
    assert off["min_expert_share"] < on["min_expert_share"], (off, on)


@pytest.mark.slow
def test_zmq_moves_the_same_tokens_as_shm():
    shm, _ = _run([sys.executable, "examples/moe.py"])
    zmq, lines = _run([sys.executable, "examples/moe.py", "--backend", "zmq"])
    _check(zmq, lines, 2, "zmq")
    assert zmq["tokens_per_expert"] == shm["tokens_per_expert"]


@pytest.mark.slow
@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec")
def test_under_mpiexec():
    summary, lines = _run([MPIEXEC, "-n", "4", sys.executable, "examples/moe.py"])
    _check(summary, lines, 4, "mpi")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="needs torchrun")
def test_under_torchrun_gloo():
    summary, lines = _run([shutil.which("torchrun"), "--standalone", "--nproc-per-node", "2",
                           "examples/moe.py", "--backend", "gloo"])
    _check(summary, lines, 2, "gloo")
