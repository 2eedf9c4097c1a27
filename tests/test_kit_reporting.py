"""The testing kit says what it checks and what passed (a ``CheckReport``, the
``collectives.testing`` logger), writes nothing of hypothesis's into the current folder
unless asked, and the examples' progress bar stays off where it would spoil a log."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from collectives.testing import CheckReport
from collectives.testing.check_report import WorldResult
from collectives.testing.hypothesis_storage import example_database, storage_folder

ROOT = Path(__file__).resolve().parent.parent


def test_the_report_is_one_line_of_what_passed():
    report = CheckReport("my_all_reduce as all_reduce",
                         (WorldResult("shm", 1, 50, 1.25), WorldResult("shm", 3, 50, 2.5),
                          WorldResult("zmq", 2, 40, 3.0)))
    assert report.cases == 140 and report.seconds == pytest.approx(6.75)
    assert str(report) == ("my_all_reduce as all_reduce: 140 cases passed on shm at 1, 3 "
                           "ranks; zmq at 2 ranks in 6.8 s")


def test_the_database_argument(tmp_path):
    from hypothesis.database import DirectoryBasedExampleDatabase, InMemoryExampleDatabase
    assert example_database(None, "check_backend") is None
    mine = InMemoryExampleDatabase()
    assert example_database(mine, "check_backend") is mine
    assert isinstance(example_database(tmp_path / "db", "check_backend"),
                      DirectoryBasedExampleDatabase)
    with pytest.raises(TypeError, match="check_algorithm: argument `database` must be"):
        example_database(3, "check_algorithm")


def test_check_algorithm_reports_logs_and_leaves_the_folder_clean(tmp_path):
    # Enough cases for hypothesis to read the constants of the code under test (which it
    # caches in its storage folder, ./.hypothesis by default).
    script = tmp_path / "check_ring.py"
    script.write_text(textwrap.dedent("""
        from collectives.algorithms import ring
        from collectives.testing import check_algorithm
        if __name__ == "__main__":
            report = check_algorithm(ring.all_reduce, "all_reduce", backends=["shm"],
                                     world_sizes=(1, 2), max_examples=30)
            print(report)
    """))
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLLECTIVES_LOG_LEVEL="info")
    env.pop("HYPOTHESIS_STORAGE_DIRECTORY", None)
    done = subprocess.run([sys.executable, script.name], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().startswith("all_reduce as all_reduce: 60 cases passed on "
                                          "shm at 1, 2 ranks in "), done.stdout
    log = [line for line in done.stderr.splitlines() if "collectives.testing" in line]
    assert "checking all_reduce as all_reduce: up to 30 cases on shm at world sizes 1, 2" \
        in log[0], log
    assert any("starting 2 ranks on shm" in line for line in log)
    assert any("30 cases passed on shm at 2 ranks" in line for line in log)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["check_ring.py"]
    assert storage_folder().is_dir()


def _progress(monkeypatch, stream, tqdm_installed=True):
    pytest.importorskip("torch")
    from examples.common import harness
    monkeypatch.setattr(sys, "stderr", stream)
    if not tqdm_installed:
        monkeypatch.setitem(sys.modules, "tqdm", None)   # (import tqdm: ImportError)
    return harness.progress(range(3), 0, desc="epoch 1/1")


def test_the_bar_is_off_when_stderr_is_not_a_terminal(monkeypatch):
    stream = io.StringIO()
    bar = _progress(monkeypatch, stream)
    assert list(bar) == [0, 1, 2] and stream.getvalue() == ""


def test_the_bar_is_on_for_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True
    stream = Terminal()
    assert list(_progress(monkeypatch, stream)) == [0, 1, 2]
    assert "epoch 1/1" in stream.getvalue()


def test_the_examples_run_without_tqdm(monkeypatch):
    bar = _progress(monkeypatch, io.StringIO(), tqdm_installed=False)
    assert isinstance(bar, range)
