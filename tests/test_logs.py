"""Logging: the ``collectives`` logger tree, silent by default, ``COLLECTIVES_LOG_LEVEL``
adding a stderr handler that names the rank; rendezvous progress, the path a group
chose, failures; and no ``print`` in library code."""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from collectives import logs

ROOT = Path(__file__).resolve().parent.parent

#: Modules whose job is to print: command lines and their output.
COMMAND_LINES = ("collectives/bench/", "collectives/doctor.py", "collectives/env_report.py",
                 "collectives/cli.py", "collectives/settings.py", "collectives/trace_merge.py",
                 "parallel/ft/__main__.py")

TWO_RANKS = textwrap.dedent("""
    import numpy as np, collectives
    def main():
        pg = collectives.init_process_group(backend=BACKEND)
        a = np.ones(4); pg.all_reduce(a); pg.close()
        return float(a[0])
    if __name__ == "__main__":
        print(collectives.spawn(main, 2))
""")


def _python(code: str, env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "two_ranks.py"
    script.write_text(code)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_LOG")}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=180, cwd=tmp_path,
                          env=dict(clean, PYTHONPATH=str(ROOT), **env))


def test_library_code_never_prints():
    found = []
    for package in ("collectives", "backends", "parallel"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(COMMAND_LINES):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                    found.append(f"{rel}:{node.lineno}")
    assert not found, "print() in library code (log it, or warn):\n" + "\n".join(found)


def test_the_tree_is_silent_unless_configured():
    import collectives  # noqa: F401 - the import configures the tree
    root = logging.getLogger(logs.ROOT)
    assert any(isinstance(h, logging.NullHandler) for h in root.handlers)
    assert logs.configure({}) is None
    assert logs.get_logger("backend.shm").name == "collectives.backend.shm"


def test_a_bad_level_warns_and_leaves_logging_off():
    with pytest.warns(RuntimeWarning, match="COLLECTIVES_LOG_LEVEL='loud' must be one of"):
        assert logs.configure({"COLLECTIVES_LOG_LEVEL": "loud"}) is None


def test_waits_are_logged_at_start_every_few_seconds_and_at_the_end(caplog, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: clock[0])
    log = logs.get_logger("rendezvous")
    with caplog.at_level(logging.DEBUG, logger="collectives"):
        wait = logs.Awaiting(log, "ranks to attach", every=5.0)
        wait.still([1, 2])
        clock[0] = 106.0
        assert wait.due()
        wait.still([2])
        wait.still([2])          # (told once per 5 s)
        clock[0] = 107.5
        assert wait.done() == 7.5
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("DEBUG", "waiting for ranks to attach"),
        ("INFO", "still waiting for ranks to attach after 6 s: ranks [2]"),
        ("DEBUG", "done waiting for ranks to attach after 7.500 s")]


def test_without_configuration_nothing_new_reaches_the_terminal(tmp_path):
    done = _python(TWO_RANKS.replace("BACKEND", "'shm'"), {}, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[2.0, 2.0]"
    assert "collectives." not in done.stderr, done.stderr


@pytest.mark.parametrize("backend", ["shm", "zmq"])
def test_debug_shows_the_rendezvous_and_the_path_each_rank_chose(tmp_path, backend):
    from collectives import available_backends
    if backend not in available_backends():
        pytest.skip(f"{backend} is not available here")
    done = _python(TWO_RANKS.replace("BACKEND", repr(backend)),
                   {"COLLECTIVES_LOG_LEVEL": "debug"}, tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    for rank in (0, 1):
        mine = [line for line in lines if f"[rank {rank}/2]" in line]
        assert any(f"DEBUG collectives.rendezvous: rank {rank} of 2" in l for l in mine), mine
        assert any(f"DEBUG collectives.backend.{backend}: waiting for" in l for l in mine)
        assert any("INFO collectives.rendezvous: world of 2 ranks ready" in l for l in mine)
        assert any(f"DEBUG collectives.group: new group: ProcessGroup 'world' on {backend}, "
                   f"rank {rank} of 2" in l for l in mine), mine


def test_a_timeout_is_logged_as_a_warning(tmp_path):
    code = textwrap.dedent("""
        import time, numpy as np, collectives
        def main():
            pg = collectives.init_process_group(backend="shm", timeout=1.0)
            if pg.rank == 0:
                try:
                    pg.all_reduce(np.ones(4))     # rank 1 is not there for 1 s
                except collectives.CollectiveTimeout:
                    pass
            else:
                time.sleep(3)
            pg.abort("done")
        if __name__ == "__main__":
            collectives.spawn(main, 2)
    """)
    done = _python(code, {"COLLECTIVES_LOG_LEVEL": "warning",
                          "COLLECTIVES_FLIGHT_DIR": str(tmp_path / "flight")}, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "[rank 0/2] WARNING collectives.group: group 'world': CollectiveTimeout:" \
        in done.stderr, done.stderr
    assert "WARNING collectives.group: group 'world': flight record written to" in done.stderr
    assert "WARNING collectives.group: group 'world' (rank 1 of 2) aborted: done" \
        in done.stderr
    assert "DEBUG" not in done.stderr and "INFO" not in done.stderr
