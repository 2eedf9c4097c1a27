"""The scripts of docs/writing-an-algorithm.md, docs/writing-a-backend.md and
docs/testing.md, run as a user runs them: each code block saved under the file name the
page gives it and started with ``python FILE`` in a fresh folder, its exit status and
output checked against what the page says.

The default run checks the algorithms on shm (``COLLECTIVES_CHECK_BACKENDS=shm``; the
scripts are unchanged) and the socket backend at world sizes 1 to 4; ``-m slow`` runs the
correct algorithm on every other available backend, one backend per run, each timed, and
the ``check_backend("shm", ...)`` snippet of docs/testing.md.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from collectives.testing.algorithm_check import BACKENDS_VARIABLE, default_backends
from readme_parse import named_block, page_text

ROOT = Path(__file__).resolve().parents[1]
#: "under a minute per backend", with room for a loaded 2-core machine's start-up.
SECONDS_PER_BACKEND = 60.0


def readme_block(name: str) -> str:
    """The first fenced code block after the first mention of `name` on the first page
    (README.md, then docs/*.md) that mentions it."""
    return named_block(name)[1].text


def run_script(name: str, backends: "str | None" = None,
               timeout: float = 600.0) -> tuple[subprocess.CompletedProcess, float]:
    """Save the pages' block ``name`` as ``name`` in a fresh folder and run it there."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop(BACKENDS_VARIABLE, None)
    if backends is not None:
        env[BACKENDS_VARIABLE] = backends
    with tempfile.TemporaryDirectory(prefix="readme-kit-") as folder:
        Path(folder, name).write_text(readme_block(name))
        start = time.monotonic()
        done = subprocess.run([sys.executable, name], cwd=folder, env=env, text=True,
                              capture_output=True, timeout=timeout)
        return done, time.monotonic() - start


def _backend_params() -> list:
    return [pytest.param(b, id=b, marks=[] if b == "shm" else [pytest.mark.slow])
            for b in default_backends()]


@pytest.mark.parametrize("backend", _backend_params())
def test_the_correct_all_reduce_passes(backend):
    done, seconds = run_script("check_my_all_reduce.py", backends=backend)
    print(f"check_my_all_reduce.py on {backend}: {seconds:.1f} s")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("my_all_reduce: passed")
    assert seconds < SECONDS_PER_BACKEND, f"{backend}: {seconds:.1f} s"


def test_the_broken_all_reduce_is_caught_with_a_shrunk_case():
    done, seconds = run_script("check_broken_all_reduce.py", backends="shm")
    print(f"check_broken_all_reduce.py on shm: {seconds:.1f} s")
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    page = page_text(named_block("check_broken_all_reduce.py")[0])
    shown = page.index("the end of its output reads:")
    documented = re.search(r"```\n(.*?)\n```", page[shown:], re.S).group(1)
    for line in documented.splitlines():  # exactly what the page says, line by line
        assert line in done.stderr, f"{line!r} not in the output:\n{done.stderr[-3000:]}"
    # hypothesis shows the shrunk case ("Falsifying example: ..." in 6.155 and earlier,
    # "Failing test case: ..." in 6.170, the release a fresh install takes today)
    assert "Falsifying example" in done.stderr or "Failing test case" in done.stderr
    assert seconds < SECONDS_PER_BACKEND


def test_the_socket_backend_passes_check_backend_at_world_sizes_1_to_4():
    block = readme_block("sockets_backend.py")
    assert "world_sizes=(1, 2, 3, 4)" in block and "register_backend" in block
    done, seconds = run_script("sockets_backend.py")
    print(f"sockets_backend.py: {seconds:.1f} s")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("sockets: passed check_backend at world sizes 1-4")
    assert seconds < 2 * SECONDS_PER_BACKEND


@pytest.mark.slow
def test_the_check_backend_snippet_runs_as_a_script():
    done, seconds = run_script("check_shm.py")
    print(f"check_shm.py: {seconds:.1f} s")
    assert done.returncode == 0, done.stderr[-3000:]
