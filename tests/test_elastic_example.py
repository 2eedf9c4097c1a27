"""``python examples/elastic.py --nproc 4`` with one rank SIGKILLed from outside at a
random time finishes with exit 0 and ``final_acc`` >= 0.85 on shm, zmq, gloo and
collectives; with ``--respawn``, ``world_size_final`` is 4. The test finds the ranks as a
chaos tool would: among the launcher's descendants, by the ``RANK`` in the environment the
kernel shows (``/proc/PID/environ``), every live rank's and the replacement's. The kill
comes in the first second after the first quorum (8 epochs train for several seconds on 2
cores, so a replacement has time to join).
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
NPROC = 4


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as f:
                kids = [int(p) for p in f.read().split()]
        except OSError:
            kids = []
        found += kids
        todo += kids
    return found


def _real_environment(pid: int) -> dict[str, str]:
    """The environment block the kernel holds for ``pid`` (what ``/proc/PID/environ``
    shows an outside tool; not a Python ``os.environ`` changed after the start)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def ranks_by_environment(launcher: int) -> dict[int, int]:
    """``{RANK: pid}`` of the live rank processes of the example started as
    ``launcher``, found by ``RANK`` in their real environment."""
    ranks = {}
    for pid in _descendants(launcher):
        env = _real_environment(pid)
        if "RANK" in env:
            assert env.get("WORLD_SIZE") == str(NPROC) and env.get("LOCAL_RANK") == \
                env["RANK"], (pid, {k: env.get(k) for k in ("RANK", "LOCAL_RANK",
                                                            "WORLD_SIZE")})
            ranks[int(env["RANK"])] = pid
    return ranks


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _wait_for(predicate, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)


def run_with_a_kill(backend: str, respawn: bool, seed: int) -> dict:
    """Start the example, wait for its first quorum (it says so on stderr), find its
    ranks by their environment, SIGKILL a random one (rank 0 included) at a random
    moment of the first second of training and, with ``respawn``, find the replacement
    the same way. The exit status, the summary, stderr and what was found."""
    rng = random.Random(seed)
    cmd = [sys.executable, os.path.join(ROOT, "examples", "elastic.py"), "--backend", backend,
           "--nproc", str(NPROC), "--epochs", "8", "--timeout", "5"] + \
        (["--respawn"] if respawn else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    err_lines: list[str] = []
    reader = threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)
    reader.start()
    seen: dict = {}
    try:
        _wait_for(lambda: any("quorum 1:" in line for line in err_lines)
                  or proc.poll() is not None, 120)
        seen["before"] = ranks_by_environment(proc.pid)
        seen["names"] = {r: _process_name(p) for r, p in seen["before"].items()}
        time.sleep(rng.uniform(0.0, 1.0))
        victim = seen["victim"] = rng.randrange(NPROC)
        os.kill(seen["before"][victim], signal.SIGKILL)
        if respawn:
            def replaced() -> bool:
                now = ranks_by_environment(proc.pid)
                if now.get(victim, seen["before"][victim]) != seen["before"][victim]:
                    seen["replacement"] = now[victim]
                return "replacement" in seen or proc.poll() is not None
            _wait_for(replaced, 60)
        out = proc.stdout.read()
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    lines = out.strip().splitlines()
    return {"code": proc.returncode, "summary": json.loads(lines[-1]) if lines else {},
            "err": "".join(err_lines), **seen}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend, respawn", [
    _param("shm", False), _param("shm", True, slow=True), _param("zmq", False, slow=True),
    _param("zmq", True, slow=True), _param("gloo", False, slow=True),
    _param("gloo", True, slow=True), _param("collectives", False, slow=True),
    _param("collectives", True, slow=True)])
def test_elastic_example_survives_a_sigkill(backend, respawn):
    run = run_with_a_kill(backend, respawn, seed=sum(map(ord, backend)) + respawn)
    summary, err = run["summary"], run["err"]
    # every live rank carries RANK in the environment the kernel shows, and its name
    assert sorted(run["before"]) == list(range(NPROC)), (run["before"], err[-2000:])
    assert run["names"] == {r: f"coll-rank{r}" for r in range(NPROC)}, run["names"]
    assert run["code"] == 0, err[-4000:]
    assert summary["final_acc"] >= 0.85, summary
    assert summary["failures"] == 1 and summary["replicas_equal"] is True, summary
    assert summary["world_size_final"] == (NPROC if respawn else NPROC - 1), summary
    if respawn:   # the replacement is found by the same RANK
        assert run.get("replacement") not in (None, run["before"][run["victim"]]), run
    for key in ("recoveries", "steps_committed", "steps_skipped"):
        assert key in summary, summary
