"""``collectives doctor`` finds its records by itself (no argument: the latest job of the
flight folder; the folder; a job's folder), prints JSON with ``--json``; old job folders
are pruned to ``COLLECTIVES_FLIGHT_KEEP``; SIGUSR1 writes a live job's records; the note
that points at the doctor is in the message where Python (3.10) prints no notes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from collectives import CollectiveTimeout, errors, flight
from collectives.testing.threads import run_threads

ROOT = Path(__file__).resolve().parents[1]


def _write_job(root: Path, job: str, monkeypatch, *, ranks=(0, 1), age_s: float = 0.0,
               stuck: str = "barrier") -> Path:
    """A job folder as ranks write it: all agree on seq 0, then rank 0 is stuck in
    ``stuck`` while the others are in all_reduce."""
    monkeypatch.setenv("COLLECTIVES_JOB_ID", job)
    for rank in ranks:
        r = flight.Recorder(8)
        r.finish(r.start(0, "all_reduce", (4,), np.dtype(np.float32), -1, "SUM", -1))
        r.start(1, stuck if rank == 0 else "all_reduce", (4,), np.dtype(np.float32), -1,
                None, -1)
        r.dump(rank=rank, size=2, backend="shm", group="world", directory=str(root),
               reason="SIGTERM")
    folder = root / job
    then = time.time() - age_s
    os.utime(folder, (then, then))
    return folder


def _run(*argv, flight_dir: Path, job: str = "") -> subprocess.CompletedProcess:
    """``python *argv`` with this checkout importable and the flight folder set."""
    env = dict(os.environ, COLLECTIVES_FLIGHT_DIR=str(flight_dir),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    env.pop("COLLECTIVES_JOB_ID", None)
    if job:
        env["COLLECTIVES_JOB_ID"] = job
    return subprocess.run([sys.executable, *map(str, argv)], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def _doctor(*args: str, flight_dir: Path) -> subprocess.CompletedProcess:
    return _run("-m", "collectives", "doctor", *args, flight_dir=flight_dir)


def test_no_argument_or_the_folder_reads_the_latest_job_a_subfolder_its_own(tmp_path,
                                                                          monkeypatch):
    old = _write_job(tmp_path, "oldjob", monkeypatch, age_s=60, stuck="broadcast")
    _write_job(tmp_path, "newjob", monkeypatch)
    for args in ((), (str(tmp_path),)):
        report = _doctor(*args, flight_dir=tmp_path)
        assert report.returncode == 0, report.stderr
        assert report.stdout.startswith("job newjob\n"), report.stdout
        assert "oldjob" not in report.stdout
        assert "FIRST DIVERGENCE at seq 1: the ranks made different calls" in report.stdout
        assert "written on a signal: rank 0 (SIGTERM), rank 1 (SIGTERM)" in report.stdout
    report = _doctor(str(old), flight_dir=tmp_path)
    assert report.returncode == 0 and report.stdout.startswith("job oldjob\n")
    assert "broadcast(shape=(4,), dtype=float32)" in report.stdout


def test_json_says_what_the_text_says(tmp_path, monkeypatch):
    folder = _write_job(tmp_path, "j1", monkeypatch)
    report = _doctor("--json", flight_dir=tmp_path)
    assert report.returncode == 0, report.stderr
    document = json.loads(report.stdout)
    assert document["paths"] == [str(folder)]
    (group,) = document["groups"]
    assert group["job"] == "j1" and group["group"] == "world" and group["size"] == 2
    assert group["ranks"] == [0, 1] and group["absent"] == []
    assert group["agreed"] == {"all_reduce": 1} and group["agreed_count"] == 1
    divergence = group["divergence"]
    assert divergence["seq"] == 1 and divergence["why"] == "the ranks made different calls"
    assert divergence["ranks"]["0"]["call"] == "barrier(shape=(4,), dtype=float32)"
    assert divergence["ranks"]["1"]["state"] == "running"


def test_no_records_is_exit_2_with_the_folder_named(tmp_path):
    report = _doctor("--json", flight_dir=tmp_path / "nothing-here")
    assert report.returncode == 2
    assert "nothing-here" in report.stderr and report.stdout == ""


def test_old_job_folders_are_pruned_to_the_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_FLIGHT_KEEP", "3")
    keep_me = tmp_path / "not-records"      # a folder of something else: never removed
    keep_me.mkdir()
    (keep_me / "notes.json").write_text("{}")
    for n in range(5):
        _write_job(tmp_path, f"job{n}", monkeypatch, ranks=(0,), age_s=100 - n)
    # Each dump prunes; the newest job is the one being written, and 3 are kept.
    assert sorted(os.listdir(tmp_path)) == ["job2", "job3", "job4", "not-records"]
    assert flight.prune(str(tmp_path), keep=1) == [str(tmp_path / "job2"),
                                                   str(tmp_path / "job3")]
    monkeypatch.setenv("COLLECTIVES_FLIGHT_KEEP", "0")
    with pytest.raises(ValueError, match="COLLECTIVES_FLIGHT_KEEP"):
        _write_job(tmp_path, "job9", monkeypatch, ranks=(0,))


def _timed_out_error(flight_dir: Path, monkeypatch) -> BaseException:
    monkeypatch.setenv("COLLECTIVES_FLIGHT_DIR", str(flight_dir))
    monkeypatch.setenv("COLLECTIVES_JOB_ID", "notejob")

    def body(pg):
        if pg.rank == 1:
            time.sleep(1.0)   # never joins
            return None
        try:
            pg.barrier()
        except CollectiveTimeout as exc:
            return exc
        return None

    return run_threads(body, 2, timeout=0.3)[0]


def test_the_note_is_in_the_message_where_python_prints_no_notes(tmp_path, monkeypatch):
    """Python 3.10 has no ``add_note`` and its tracebacks ignore ``__notes__``: the note
    (where the record is, and the doctor's command) goes into the message too."""
    monkeypatch.setattr(errors, "NATIVE_NOTES", False)
    exc = _timed_out_error(tmp_path, monkeypatch)
    assert isinstance(exc, CollectiveTimeout)
    text = str(exc)
    assert "flight record: " in text and "python -m collectives.doctor" in text
    assert text.splitlines()[0].startswith("[rank 0/2] barrier")
    assert exc.__notes__ and exc.__notes__[0] in text
    assert exc.op == "barrier"          # the typed fields survive


def test_on_311_the_note_is_a_note_and_the_message_stays_short(tmp_path, monkeypatch):
    if not errors.NATIVE_NOTES:
        pytest.skip("Python < 3.11: no native notes")
    exc = _timed_out_error(tmp_path, monkeypatch)
    assert "flight record" not in str(exc)
    assert any("python -m collectives.doctor" in n for n in exc.__notes__)


def test_sigusr1_writes_the_records_of_open_groups_and_the_process_goes_on(tmp_path):
    """A process with an open group, sent SIGUSR1: its record is written (the call in
    flight included? none here: the last finished one), and it carries on to exit 0."""
    script = tmp_path / "live.py"
    script.write_text(
        "import os, signal, time, numpy as np, collectives\n"
        "pg = collectives.init_process_group()\n"
        "pg.all_reduce(np.ones(2))\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(0.2)\n"
        "pg.all_reduce(np.ones(2))\n"
        "pg.close()\n"
        "print('still alive')\n")
    run = _run(script, flight_dir=tmp_path / "f", job="usr1job")
    assert run.returncode == 0 and run.stdout.strip() == "still alive", run.stderr
    document = json.loads((tmp_path / "f" / "usr1job" / "world.rank0.json").read_text())
    assert document["reason"] == "SIGUSR1"
    assert [r["op"] for r in document["records"]] == ["all_reduce"]


def test_handlers_chain_to_the_previous_one_and_sigterm_still_terminates(tmp_path):
    script = tmp_path / "chain.py"
    script.write_text(
        "import os, signal, sys, time, numpy as np\n"
        "seen = []\n"
        "signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))\n"
        "import collectives\n"
        "pg = collectives.init_process_group()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "time.sleep(0.1)\n"
        "print('usr1 chained', seen == [signal.SIGUSR1], flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(5)\n"
        "print('not reached')\n")
    run = _run(script, flight_dir=tmp_path / "f", job="chainjob")
    assert run.stdout.splitlines() == ["usr1 chained True"], run.stdout + run.stderr
    assert run.returncode == -signal.SIGTERM
    document = json.loads((tmp_path / "f" / "chainjob" / "world.rank0.json").read_text())
    assert document["reason"] == "SIGTERM"
