"""The launcher under signals and failures: SIGINT or SIGTERM to the parent of
``collectives.spawn`` (``tests/faults/signal_job.py``) or of ``examples/ddp.py`` stops
every rank and cleans up within :data:`STOP_LIMIT` seconds with a non-zero exit; a rank's
exception is shown once, with its rank, not as a wall of secondary errors.

Each test starts a real job in a session of its own (so that the clean-up here can reach
whatever it left), waits until every rank is inside its collectives, signals the parent
only (as ``kill PID`` does; a terminal's Ctrl-C signals the whole process group:
``test_ctrl_c_to_the_whole_process_group``), then checks: exit status, time to exit,
rank processes, the job's /dev/shm segments, its ports.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

import collectives
from collectives.shm_names import PREFIX, SHM_DIR, job_digest
from faults.world import port_bound

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "faults" / "signal_job.py"
#: Seconds from the signal until the parent has exited and every rank is gone.
STOP_LIMIT = 5.0
#: Seconds a job may take to start (interpreters importing torch on 2 busy cores).
START_LIMIT = 90.0


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COLLECTIVES_", "TORCHELASTIC_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _segments(job: str = "") -> set:
    stems = tuple(f"{PREFIX}{job_digest(k)}-" for k in (job, f"COLLECTIVES_JOB_ID={job}")) \
        if job else (PREFIX,)
    return {n for n in os.listdir(SHM_DIR) if n.startswith(stems)}


def _default_sigint() -> None:
    """In the job, before exec: Ctrl-C as a terminal delivers it. A test run started in
    the background of a non-interactive shell (as CI may be) inherits SIGINT ignored, and
    Python then never turns it into KeyboardInterrupt: the job would rightly ignore it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Job:
    """A job started in a session of its own, its output in files under ``tmp``."""

    def __init__(self, command: list, tmp: Path, env: Optional[dict] = None) -> None:
        self.tmp = tmp
        self.stdout, self.stderr = open(tmp / "stdout", "w+"), open(tmp / "stderr", "w+")
        self.proc = subprocess.Popen(command, cwd=ROOT, env=dict(_env(), **(env or {})),
                                     stdin=subprocess.DEVNULL,
                                     stdout=self.stdout, stderr=self.stderr,
                                     start_new_session=True, preexec_fn=_default_sigint)
        self.ranks: list[int] = []

    def output(self) -> tuple[str, str]:
        return (tmp_read(self.tmp / "stdout"), tmp_read(self.tmp / "stderr"))

    def wait_until(self, ready, what: str, limit: float = START_LIMIT) -> None:
        deadline = time.monotonic() + limit
        while not ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"the job exited ({self.proc.returncode}) before {what}:"
                                     f"\n{self.output()[1][-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {limit} s:\n{self.output()[1][-3000:]}")
            time.sleep(0.05)

    def signal_and_time(self, sig: int, whole_group: bool = False, times: int = 1) -> float:
        """Send ``sig`` to the parent (or its whole process group), ``times`` times 0.1 s
        apart (an impatient user); seconds until the parent exited and every rank seen is
        gone (``inf`` past the limit)."""
        start = time.monotonic()
        for i in range(times):
            if i:
                time.sleep(0.1)
            try:
                if whole_group:
                    os.killpg(self.proc.pid, sig)
                else:
                    os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                break
        try:
            self.proc.wait(STOP_LIMIT + 5)
        except subprocess.TimeoutExpired:
            return float("inf")
        while any(_alive(p) for p in self.ranks) and time.monotonic() - start < STOP_LIMIT + 5:
            time.sleep(0.02)
        return time.monotonic() - start if not any(_alive(p) for p in self.ranks) \
            else float("inf")

    def kill_all(self) -> None:
        """Whatever is left of the job (the test failed): SIGKILL it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in self.ranks:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)
        self.stdout.close()
        self.stderr.close()


def tmp_read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _rank_files(out: Path, n: int) -> list[dict]:
    files = sorted(out.glob("rank*.json"))
    return [json.loads(f.read_text()) for f in files] if len(files) == n else []


def _tracebacks(text: str) -> int:
    return text.count("Traceback (most recent call last)")


# ---------------------------------------------------------------- spawn's parent
@pytest.mark.parametrize("backend, sig, times", [
    ("shm", signal.SIGINT, 1), ("shm", signal.SIGTERM, 1), ("zmq", signal.SIGTERM, 1),
    pytest.param("gloo", signal.SIGINT, 1, marks=pytest.mark.slow),  # 3 x torch import
    ("shm", signal.SIGINT, 3)],
    ids=["shm-SIGINT", "shm-SIGTERM", "zmq-SIGTERM", "gloo-SIGINT", "shm-SIGINTx3"])
def test_signal_to_spawn_parent_stops_every_rank_and_cleans_up(tmp_path, backend, sig, times):
    if backend not in collectives.available_backends():
        pytest.skip(f"backend {backend!r} not available here")
    n = 3
    out = tmp_path / "ranks"
    out.mkdir()
    before = _segments()
    job = Job([sys.executable, str(JOB), "--backend", backend, "--nproc", str(n),
               "--out", str(out)], tmp_path)
    try:
        job.wait_until(lambda: _rank_files(out, n), f"{n} ranks running")
        ranks = _rank_files(out, n)
        job.ranks = [r["pid"] for r in ranks]
        time.sleep(0.3)  # inside their all_reduce loop
        elapsed = job.signal_and_time(sig, times=times)
        stdout, stderr = job.output()
        assert elapsed < STOP_LIMIT, f"{elapsed:.1f} s after {sig!r}; ranks alive: " \
            f"{[p for p in job.ranks if _alive(p)]}\n{stderr[-3000:]}"
        assert job.proc.returncode != 0, stderr[-3000:]
        assert not _segments(ranks[0]["job"]) and not (_segments() - before), \
            f"left in /dev/shm: {_segments() - before}"
        ports = {ranks[0]["master_port"], *(p for r in ranks for p in r["ports"])}
        assert not [p for p in ports if port_bound(p)], "ports still bound"
        # No wall of errors: at most the parent's own traceback (KeyboardInterrupt /
        # SystemExit are not errors of a rank), nothing from the ranks.
        assert _tracebacks(stderr) <= 1, stderr[-5000:]
        assert "PeerError" not in stderr and "CollectiveTimeout" not in stderr, stderr[-5000:]
        print(f"FAULTS test=signal backend={backend} signal={sig.name} stop_s={elapsed:.3f} "
              f"exit={job.proc.returncode}")
    finally:
        job.kill_all()


def test_ctrl_c_to_the_whole_process_group(tmp_path):
    """A terminal's Ctrl-C reaches the parent and every rank at once: the ranks ignore it
    (the parent stops them), nothing but the parent reports it."""
    n = 2
    out = tmp_path / "ranks"
    out.mkdir()
    job = Job([sys.executable, str(JOB), "--backend", "shm", "--nproc", str(n),
               "--out", str(out)], tmp_path)
    try:
        job.wait_until(lambda: _rank_files(out, n), f"{n} ranks running")
        job.ranks = [r["pid"] for r in _rank_files(out, n)]
        time.sleep(0.3)
        elapsed = job.signal_and_time(signal.SIGINT, whole_group=True)
        stdout, stderr = job.output()
        assert elapsed < STOP_LIMIT, stderr[-3000:]
        assert job.proc.returncode != 0
        assert _tracebacks(stderr) <= 1, stderr[-5000:]
    finally:
        job.kill_all()


def test_a_failing_rank_is_reported_once_with_its_rank(tmp_path):
    n = 3
    out = tmp_path / "ranks"
    out.mkdir()
    before = _segments()
    job = Job([sys.executable, str(JOB), "--backend", "shm", "--nproc", str(n),
               "--out", str(out), "--fail-rank", "1"], tmp_path)
    try:
        job.proc.wait(START_LIMIT)
        stdout, stderr = job.output()
        assert job.proc.returncode != 0, stderr
        assert "rank 1 failed: ValueError: deliberate failure on rank 1" in stderr, stderr
        # The rank's own traceback once (inside the SpawnError), the parent's once; the
        # survivors' PeerErrors at most as a one-line note, never as tracebacks.
        assert _tracebacks(stderr) == 2, stderr
        assert stderr.count('raise ValueError(f"deliberate failure') == 1, stderr
        assert not re.search(r"^\w*(PeerError|CollectiveTimeout):", stderr, re.M), stderr
        assert not (_segments() - before)
    finally:
        job.kill_all()


# -------------------------------------------------------------------- the example
def _example(tmp_path: Path, *extra: str) -> Job:
    # Info logging: each rank says when its world is ready (the progress bar, drawn only
    # on a terminal, is not there to say that training runs).
    return Job([sys.executable, str(ROOT / "examples" / "ddp.py"), "--epochs", "1000",
                *extra], tmp_path, env={"COLLECTIVES_LOG_LEVEL": "info"})


def _ranks_of(pid: int) -> list[int]:
    """The ranks a job ``pid`` started with collectives.spawn: its descendants that have no
    children of their own (forked from its fork server, or with COLLECTIVES_START_METHOD=
    spawn its own children), other than multiprocessing's resource tracker."""
    found, todo = [], _children(pid)
    while todo:
        p = todo.pop()
        below = _children(p)
        todo += below
        if not below and "resource_tracker" not in tmp_read(Path(f"/proc/{p}/cmdline")):
            found.append(p)
    return found


def _training(job: Job, n: int) -> bool:
    """Every rank started and joined its world (so training runs)."""
    job.ranks = _ranks_of(job.proc.pid)
    return len(job.ranks) >= n and job.output()[1].count(" ready on ") >= n


@pytest.mark.parametrize("sig", [
    signal.SIGINT,
    pytest.param(signal.SIGTERM, marks=pytest.mark.slow),  # spawn's path: shm-SIGTERM above
], ids=["SIGINT", "SIGTERM"])
def test_signal_to_the_example_stops_it_cleanly(tmp_path, sig):
    before = _segments()
    job = _example(tmp_path, "--nproc", "2")
    try:
        job.wait_until(lambda: _training(job, 2), "training")
        elapsed = job.signal_and_time(sig)
        stdout, stderr = job.output()
        assert elapsed < STOP_LIMIT, f"{elapsed:.1f} s\n{stderr[-3000:]}"
        assert job.proc.returncode != 0, stderr[-3000:]
        assert not (_segments() - before), _segments() - before
        assert _tracebacks(stderr) == 0, stderr[-5000:]  # a signal is not a crash
        print(f"FAULTS test=signal example=ddp signal={sig.name} stop_s={elapsed:.3f} "
              f"exit={job.proc.returncode}")
    finally:
        job.kill_all()


def test_a_failing_example_rank_is_reported_once(tmp_path):
    """Every rank fails alike (no such data folder): one report, naming a rank, with that
    rank's traceback; no traceback of the parent's own."""
    job = _example(tmp_path, "--nproc", "2", "--data-dir", str(tmp_path / "no-such-dir"))
    try:
        job.proc.wait(START_LIMIT)
        stdout, stderr = job.output()
        assert job.proc.returncode == 1, stderr
        assert re.search(r"^examples/ddp\.py: rank \d failed: \w+", stderr, re.M), stderr
        assert _tracebacks(stderr) == 1, stderr  # the rank's, inside the report
        assert "--- traceback of rank" in stderr, stderr
    finally:
        job.kill_all()
