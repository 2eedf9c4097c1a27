"""``python examples/elastic.py --nproc 4`` with one rank SIGKILLed from outside at a
random time finishes with exit 0 and ``final_acc`` >= 0.85 on shm, zmq and gloo; with
``--respawn``, ``world_size_final`` is 4. The ranks are the launcher's grandchildren
(forked from its fork server);
the kill comes in the first second after the first quorum (8 epochs train for a few
seconds on 2 cores, so a replacement has time to join).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from test_faults import _param

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def rank_processes(launcher: int) -> list[int]:
    """The live rank processes of the example started as ``launcher``: the children of
    its children (the ranks are forked from its fork server; ``RANK`` is set in each
    by Python, so /proc's copy of the initial environment does not show it)."""
    return sorted(g for c in _children(launcher) for g in _children(c))


def run_with_a_kill(backend: str, respawn: bool, seed: int) -> tuple[int, dict, str]:
    """Start the example, wait for its first quorum (it says so on stderr), SIGKILL a
    random rank at a random moment of the first second of training; the exit status,
    the summary and stderr."""
    rng = random.Random(seed)
    cmd = [sys.executable, os.path.join(ROOT, "examples", "elastic.py"), "--backend", backend,
           "--nproc", "4", "--epochs", "8", "--timeout", "5"] + (["--respawn"] if respawn else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    err_lines: list[str] = []
    reader = threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("quorum 1:" in line for line in err_lines) and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        ranks = rank_processes(proc.pid)
        assert len(ranks) == 4, (ranks, err_lines)
        time.sleep(rng.uniform(0.0, 1.0))
        os.kill(rng.choice(ranks), signal.SIGKILL)
        out = proc.stdout.read()
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    lines = out.strip().splitlines()
    return proc.returncode, json.loads(lines[-1]) if lines else {}, "".join(err_lines)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend, respawn", [
    _param("shm", False), _param("shm", True, slow=True), _param("zmq", False, slow=True),
    _param("zmq", True, slow=True), _param("gloo", False, slow=True),
    _param("gloo", True, slow=True)])
def test_elastic_example_survives_a_sigkill(backend, respawn):
    code, summary, err = run_with_a_kill(backend, respawn, seed=sum(map(ord, backend)) + respawn)
    assert code == 0, err[-4000:]
    assert summary["final_acc"] >= 0.85, summary
    assert summary["failures"] == 1 and summary["replicas_equal"] is True, summary
    assert summary["world_size_final"] == (4 if respawn else 3), summary
    for key in ("recoveries", "steps_committed", "steps_skipped"):
        assert key in summary, summary
